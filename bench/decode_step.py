"""Benchmark: where one grouped decode step goes on this machine (srt/decode.GroupedStep).

One step of K rows of one prompt, `--at` tokens into the completion, timed three ways, interleaved
so that a slow spell of a shared machine moves all three alike: as it is; with every weight
product replaced by its cached output (left: the attention, norms, RoPE, copies and Python); and
with the attention's output cached too (left: norms, RoPE, copies and Python). The differences are
the products' and the attention's shares of a step. Also timed: one product through a packed
32 x 32 weight, whose time is almost all the product op's fixed cost, paid by each of the step's
products however small its weight.

    python bench/decode_step.py --model smollm2-135m --dtype bfloat16   # the bf16 copy rollouts read
    python bench/decode_step.py --model tiny-random --repeats 3

Writes <out>/decode_step.json and .md (default runs/bench/decode_step).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
for _path in (str(ROOT), str(BENCH)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from measure import describe, machine, machine_line, markdown_table, write_results  # noqa: E402

from srt.config import at_least  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--model", default="smollm2-135m", help="a folder, an HF id, smollm2-135m, tiny-random")
    p.add_argument("-K", type=at_least(1), default=4, help="rows of the step: samples of the one prompt")
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="bfloat16",
        help="the sampling copy's precision (bfloat16: what rollouts read on bf16 units)",
    )
    p.add_argument("--prompt-length", type=at_least(1), default=943, help="prompt tokens (random ids)")
    p.add_argument("--at", type=at_least(0), default=60, help="completion tokens already in the cache")
    p.add_argument("--repeats", type=at_least(1), default=100, help="timed steps of each kind, interleaved")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/bench/decode_step")
    return p


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    import torch

    from srt import decode
    from srt.modeling import load_model_and_tokenizer

    torch.manual_seed(args.seed)
    model, _ = load_model_and_tokenizer(args.model, dtype="float32")
    sampler = decode.sampling_model(model, torch.bfloat16 if args.dtype == "bfloat16" else None)
    if not decode.grouped_step_supported(sampler):
        sys.exit(f"error: {args.model}: decode.GroupedStep does not write out this architecture")
    K, width = args.K, args.prompt_length
    length = width + args.at + 1
    ids = torch.randint(0, model.config.vocab_size, (1, width))
    cache = decode.GroupKVCache(K, width, length, K)
    with torch.no_grad():
        sampler(
            input_ids=ids,
            position_ids=torch.arange(width)[None],
            cache=cache,
            use_cache=True,
            logits_to_keep=decode.last_column(width, "cpu"),
        )
    # The step after `at` completion tokens: it writes column width + at and attends to all before it.
    cache.column, cache.visible = torch.tensor([width + args.at]), width + args.at + 1
    key_mask = torch.zeros(K, length, dtype=torch.bool)
    key_mask[:, : cache.visible] = True
    tokens = torch.randint(0, model.config.vocab_size, (K, 1))
    positions = torch.full((K, 1), width + args.at)
    step = decode.GroupedStep(sampler, cache)

    products, attention = {}, {}
    run_product, run_attention = step.linear, torch.nn.functional.scaled_dot_product_attention

    def cached_product(group, x):
        if group not in products:
            products[group] = run_product(group, x)
        return products[group]

    def cached_attention(q, *rest, **kwargs):
        if "out" not in attention:
            attention["out"] = run_attention(q, *rest, **kwargs)
        return attention["out"]

    def as_it_is():
        return step(tokens, positions, key_mask)

    def without_products():
        step.linear = cached_product
        try:
            return step(tokens, positions, key_mask)
        finally:
            del step.linear  # the instance attribute goes; the class's method is back

    def without_products_or_attention():
        torch.nn.functional.scaled_dot_product_attention = cached_attention
        try:
            return without_products()
        finally:
            torch.nn.functional.scaled_dot_product_attention = run_attention

    kinds = {
        "as it is": as_it_is,
        "products cached": without_products,
        "and attention": without_products_or_attention,
    }
    times = {name: [] for name in kinds}
    with torch.no_grad():
        for fn in kinds.values():  # warm-up, and the caches filled
            fn()
        for _ in range(args.repeats):
            for name, fn in kinds.items():
                start = time.perf_counter()
                fn()
                times[name].append(1000 * (time.perf_counter() - start))

        # The product op's fixed cost: a packed 32 x 32 weight, where there is nothing to read.
        kind = decode.packing_kind(sampler.lm_head.weight)
        fixed_ms = None
        if kind is not None:
            weight = torch.randn(32, 32, dtype=sampler.lm_head.weight.dtype)
            small, x = decode.pack(kind, weight, None, K), torch.randn(K, 1, 32, dtype=weight.dtype)
            calls = []
            for _ in range(args.repeats + 1):
                start = time.perf_counter()
                for _ in range(10):
                    decode.packed_linear(small, x, K)
                calls.append(1000 * (time.perf_counter() - start) / 10)  # ms a call
            fixed_ms = describe(calls[1:])["median"]

        # What reading the weights costs the ops after it: a 4-element add, warm (right after another)
        # and right after a read of as many bytes as the step's weights, which pushes the add's code
        # and data out of the caches. In a step the ops between products pay some of this, so the
        # products' share below is the bytes they read and what that reading costs the ops after them.
        weight_bytes = sum(p.numel() * p.element_size() for p in sampler.parameters())
        sweep, tiny = torch.ones(weight_bytes // 4), torch.ones(4)
        after = {"warm": [], "after_weights": []}
        for _ in range(args.repeats):
            for name, before in (("warm", lambda: tiny + 1), ("after_weights", sweep.sum)):
                before()
                start = time.perf_counter()
                tiny + 1
                after[name].append(1000 * (time.perf_counter() - start))
        small_op_ms = {name: describe(values)["median"] for name, values in after.items()}

    stats = {name: describe(values) for name, values in times.items()}
    shares = {
        stat: {
            "step": stats["as it is"][stat],
            "products": stats["as it is"][stat] - stats["products cached"][stat],
            "attention": stats["products cached"][stat] - stats["and attention"][stat],
            "rest": stats["and attention"][stat],
        }
        for stat in ("median", "min")
    }
    calls_per_step = len(decode.fused_linears(sampler))
    info = machine()
    payload = {
        "machine": info,
        "config": vars(args),
        "packing": kind,
        "times_ms": stats,
        "shares_ms": shares,
        "products_per_step": calls_per_step,
        "product_fixed_ms": fixed_ms,
        "weight_mb": weight_bytes / 1e6,
        "small_op_ms": small_op_ms,
    }
    table = markdown_table(
        ["", "step (ms)", "weight products", "attention", "norms, RoPE, copies, Python"],
        [
            [stat, f"{s['step']:.1f}", f"{s['products']:.1f}", f"{s['attention']:.1f}", f"{s['rest']:.1f}"]
            for stat, s in shares.items()
        ],
    )
    fixed = (
        f"One product through a packed 32 x 32 weight ({kind}): {1000 * fixed_ms:.1f} us; the step makes "
        f"{calls_per_step} products, {calls_per_step * fixed_ms:.1f} ms at that cost."
        if fixed_ms is not None
        else "No weight is packed here (the modules run as they are)."
    )
    markdown = (
        f"# Where one grouped decode step goes\n\n{machine_line(info)}\n\n{args.model}, {args.dtype}, "
        f"K = {K}, a prompt of {width} tokens, {args.at} completion tokens in the cache; "
        f"{args.repeats} steps of each kind, interleaved. Shares are differences of the medians (or "
        f"of the minima): the step as it is, with the products' outputs cached, and with the "
        f"attention's too.\n\n{table}\n\n{fixed}\n\nA 4-element add: {1000 * small_op_ms['warm']:.1f} us "
        f"right after another, {1000 * small_op_ms['after_weights']:.1f} us right after reading "
        f"{weight_bytes / 1e6:.0f} MB (the step's weights): the products' share includes what their bytes "
        "cost the ops after them.\n"
    )
    print(markdown)
    write_results(Path(args.out), "decode_step", payload, markdown)
    return payload


if __name__ == "__main__":
    main()
