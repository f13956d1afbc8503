"""Benchmark: the floor of one decode step on this machine, against which a decode loop's speed reads.

Decoding one token for K rows must at least multiply the K rows by every weight matrix of the model
once (every nn.Linear, the tied lm_head included). This times exactly that, `x @ w.T` for each
weight, with no attention, norms, sampling or Python around it, at K = 1, 4 and 8; a plain read
(a sum) and a plain copy of the same bytes, for what the memory gives; and the same products
through the weights packed as the decode step packs them on a CPU (srt/decode.packed_weights: MKL
in fp32, oneDNN in bf16; q, k, v stacked into one product, and gate with up); and the prefill's
last-column logits, sliced as Hugging Face's logits_to_keep=1 slices them against gathered by an
index (decode.last_column). A decode step that costs little more than the weight products has
nothing left to take out at this precision but a faster product (bench/README.md,
`rollout_speed.py`); products much slower than the plain read are the kernel's, not the memory's.

    python bench/decode_floor.py --model smollm2-135m
    python bench/decode_floor.py --model smollm2-135m --dtype bfloat16   # the bf16 copy rollouts read
    python bench/decode_floor.py --model tiny-random --ks 1,4 --repeats 3

Writes <out>/decode_floor.json and .md (default runs/bench/decode_floor).
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
from rollout_speed import k_list  # noqa: E402

from srt.config import at_least  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--model", default="smollm2-135m", help="a folder, an HF id, smollm2-135m, tiny-random")
    p.add_argument("--ks", type=k_list, default=[1, 4, 8], help="rows per decode step")
    p.add_argument("--repeats", type=at_least(1), default=7, help="timed passes (median), after one warm-up")
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="the weights' and rows' precision (bfloat16: the copy rollouts sample from on bf16 units)",
    )
    p.add_argument(
        "--prompt-length", type=at_least(1), default=943, help="the prefill's logits: prompt tokens"
    )
    p.add_argument("--out", default="runs/bench/decode_floor")
    return p


def median_seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return describe(times)["median"]


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    import torch

    from srt.decode import packed_linear, packed_weights
    from srt.modeling import load_model_and_tokenizer

    model, _ = load_model_and_tokenizer(args.model, dtype="float32")
    dtype = getattr(torch, args.dtype)
    model = model.to(dtype).requires_grad_(False)  # as the sampling copy: matmul's paths depend on it
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    weights = [m.weight.detach() for m in linears]
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    rows = []
    with torch.no_grad():
        for k in args.ks:
            inputs = {w.shape[1]: torch.randn(k, w.shape[1], dtype=dtype) for w in weights}
            seconds = median_seconds(lambda: [inputs[w.shape[1]] @ w.T for w in weights], args.repeats)
            # The same products through the weights packed as the decode step packs them (if it does here).
            packed = packed_weights(model, k)
            packed_s = (
                median_seconds(
                    lambda: [packed_linear(packed[g], inputs[g[0].in_features], k) for g in packed],
                    args.repeats,
                )
                if packed
                else None
            )
            rows.append(
                {
                    "k": k,
                    "ms": 1000 * seconds,
                    "tokens_per_s": k / seconds,
                    "gb_per_s": weight_bytes / seconds / 1e9,
                    "packed": next(iter(packed.values()))[0] if packed else None,
                    "packed_ms": 1000 * packed_s if packed else None,
                    "packed_gb_per_s": weight_bytes / packed_s / 1e9 if packed else None,
                }
            )
        # What the memory gives: the same bytes read once (a sum: fp32, which the CPU sums at full
        # vector width with nothing to convert), and read and written once (a copy).
        source = torch.ones(weight_bytes // 4)
        target = torch.empty_like(source)
        read_s = median_seconds(source.sum, args.repeats)
        copy_s = median_seconds(lambda: target.copy_(source), args.repeats)
        # The prefill's one row of logits per prompt, from hidden states [B, P, d]: the lm_head on
        # hidden[:, -1:] (Hugging Face's logits_to_keep=1) against hidden gathered by an index
        # (srt/decode.last_column). The slice's batch stride is P * d: torch's matmul cannot fold it
        # into one product and, for a weight that takes no gradient, copies it for each prompt.
        head, prefill = model.lm_head, []
        for prompts in (1, 8):
            hidden = torch.randn(prompts, args.prompt_length, head.in_features, dtype=dtype)
            index = torch.tensor([args.prompt_length - 1])
            sliced = median_seconds(lambda: head(hidden[:, -1:]), args.repeats)
            gathered = median_seconds(lambda: head(hidden[:, index]), args.repeats)
            prefill.append({"prompts": prompts, "slice_ms": 1000 * sliced, "index_ms": 1000 * gathered})
        # A prefill of one prompt without padding, the model's own forward: a causal boolean mask
        # handed in (what decode passes for padded prompts) against none (plainly causal: SDPA skips
        # the scores above the diagonal instead of computing and masking them).
        ids = torch.randint(0, model.config.vocab_size, (1, args.prompt_length))
        causal = torch.ones(args.prompt_length, args.prompt_length, dtype=torch.bool).tril()[None, None]
        last = torch.tensor([args.prompt_length - 1])
        masked = median_seconds(
            lambda: model(input_ids=ids, attention_mask=causal, logits_to_keep=last), args.repeats
        )
        unmasked = median_seconds(lambda: model(input_ids=ids, logits_to_keep=last), args.repeats)
    info = machine()
    payload = {
        "machine": info,
        "model": args.model,
        "dtype": args.dtype,
        "matrices": len(weights),
        "weight_mb": weight_bytes / 1e6,
        "threads": torch.get_num_threads(),
        "rows": rows,
        "read": {"ms": 1000 * read_s, "gb_per_s": weight_bytes / read_s / 1e9},
        "copy": {"ms": 1000 * copy_s, "gb_per_s_read_write": 2 * weight_bytes / copy_s / 1e9},
        "prefill_logits": prefill,
        "prefill_mask": {"masked_ms": 1000 * masked, "causal_ms": 1000 * unmasked},
    }
    table = markdown_table(
        [
            "K rows",
            "every weight once (ms)",
            "at most tokens/s",
            "weights read (GB/s)",
            "packed (ms)",
            "packed (GB/s)",
        ],
        [
            [
                r["k"],
                f"{r['ms']:.0f}",
                f"{r['tokens_per_s']:.1f}",
                f"{r['gb_per_s']:.1f}",
                f"{r['packed_ms']:.0f} ({r['packed']})" if r["packed"] else "not packed here",
                f"{r['packed_gb_per_s']:.1f}" if r["packed"] else "",
            ]
            for r in rows
        ],
    )
    markdown = (
        f"# The floor of a decode step\n\n{machine_line(info)}\n\n{args.model}: {len(weights)} weight "
        f"matrices, {weight_bytes / 1e6:.0f} MB {args.dtype}, {torch.get_num_threads()} threads; median of "
        f"{args.repeats}.\n\n{table}\n\nThe same bytes read once (a sum): {1000 * read_s:.0f} ms, "
        f"{payload['read']['gb_per_s']:.1f} GB/s; copied: {1000 * copy_s:.0f} ms, "
        f"{payload['copy']['gb_per_s_read_write']:.1f} GB/s read + write.\n\nThe prefill's last-column "
        f"logits of prompts of {args.prompt_length} tokens, the lm_head on hidden[:, -1:] against hidden "
        "gathered by an index: "
        + ", ".join(
            f"{r['prompts']} prompt(s) {r['slice_ms']:.1f} ms against {r['index_ms']:.1f} ms" for r in prefill
        )
        + f".\n\nThe prefill of one prompt of {args.prompt_length} tokens, a causal mask handed in against "
        f"none: {1000 * masked:.0f} ms against {1000 * unmasked:.0f} ms.\n"
    )
    print(markdown)
    write_results(Path(args.out), "decode_floor", payload, markdown)
    return payload


if __name__ == "__main__":
    main()
