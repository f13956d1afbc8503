"""Benchmark: one optimizer step of stage 1 on a preset's own batches, split into its parts, with
torch's default AdamW (on a CPU a Python loop of small ops over every tensor) against the fused
kernel srt/training.adamw uses, SDPA's attention against eager's and stage 1's --attention
bf16_eager, and the loss's log-probabilities as stage 1 computes them (a gather minus a logsumexp,
logprobs.token_logprobs) against cross_entropy over each chunk (cross_entropy_logprobs below).

Each side runs the same global batches (stage1_sft.PhaseData, the preset's micro-batches) through
stage1_sft's own collate and sft_loss_sums: forward and backward of every micro-batch, the
gradient clip, then the optimizer step at learning rate 0, so that the weights never move and
every side sees the same ones (AdamW does all its work at lr 0). Sides alternate step by step,
so that a slow spell of a shared machine falls on all; one untimed warm-up step each (the first
AdamW step allocates its moments). Reported: median seconds (min-max) of the whole step, of
forward + backward, and of the optimizer step; each side's step against the first side's on the
same batch, as the median (min-max) of the steps' ratios; and the largest relative difference of
a step's loss from the first side's. In an fp32 run (--dtype float32, or auto on a CPU without bf16
units) nothing is bf16: the bf16_eager side is eager attention in fp32, and is named so.

    python bench/sft_step.py --preset cpu-lesson --data runs/demo/data/train.jsonl
    python bench/sft_step.py --preset cpu-lesson --data runs/demo/data/train.jsonl --optimizers fused \
        --attention sdpa eager bf16_eager --loss logsumexp cross-entropy
    python bench/sft_step.py --preset cpu-lesson --data runs/demo/data/train.jsonl --profile --steps 3

--profile instead runs the steps once, with stage 1's own fused AdamW and the first --attention and
--loss, under torch.profiler and says where a step's time goes: each op's self time, grouped by
what it does (OP_KINDS), as seconds a step and a share of the step's wall time, and the GFLOP/s
the weight products reach (the profiler's FLOP count of aten::mm / addmm / bmm over their time).
What no op holds (Python, the data path, waiting) is the rest of the wall time. The profiler adds
its own overhead to small ops.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from measure import check_out, describe, fmt_stat, machine, machine_line, markdown_table, write_results  # noqa: E402

import stage1_sft  # noqa: E402
from srt import logprobs  # noqa: E402
from srt.attention_kernel import bf16_eager_in_fp32, bf16_eager_note, register_bf16_eager  # noqa: E402
from srt.config import up_to  # noqa: E402
from srt.data_io import DataError, read_mixture  # noqa: E402
from srt.distributed import clip_grad_norm  # noqa: E402
from srt.loading import load_model_and_tokenizer  # noqa: E402
from srt.precision import resolve_dtype  # noqa: E402

OPTIMIZERS = ("loop", "fused")  # torch.optim.AdamW's default on a CPU, and fused=True
# a step of the lesson preset takes seconds a side: a thousand is hours, more is a typo
MAX_STEPS = 1_000


def cross_entropy_logprobs(logits, targets, chunk_size=256):
    """logprobs.token_logprobs as SFT calls it (T = 1, nothing suppressed, no entropy), written
    with cross_entropy over each chunk's rows (one fused log-softmax pass forward, one backward)
    instead of a gather minus a logsumexp; the same checkpointed chunks."""
    import torch
    from torch.utils.checkpoint import checkpoint

    def chosen_logprobs(x, t):
        rows, positions, vocab = x.shape
        nll = torch.nn.functional.cross_entropy(x.float().reshape(-1, vocab), t.reshape(-1), reduction="none")
        return -nll.view(rows, positions)

    chunks = zip(logits.split(chunk_size, dim=1), targets.split(chunk_size, dim=1))
    per_chunk = [checkpoint(chosen_logprobs, x, t, use_reentrant=False) for x, t in chunks]
    return torch.cat(per_chunk, dim=1), None


LOSSES = {"logsumexp": logprobs.token_logprobs, "cross-entropy": cross_entropy_logprobs}

# --profile: an op's kind, by its exact name or, failing that, a part of it; first match wins.
WEIGHT_PRODUCTS = "weight products (mm, addmm, bmm)"
OP_KINDS = (
    (WEIGHT_PRODUCTS, {"aten::mm", "aten::addmm", "aten::bmm"}, ()),
    (
        "casts and copies",
        {"aten::to", "aten::_to_copy", "aten::copy_", "aten::clone", "aten::contiguous"},
        (),
    ),
    ("attention (sdpa, softmax)", set(), ("scaled_dot_product", "flash_attention", "aten::_softmax")),
    ("the loss (log-softmax, gather)", set(), ("log_softmax", "logsumexp", "gather", "nll_loss")),
    ("optimizer (AdamW)", set(), ("adam", "foreach")),
    ("embedding", set(), ("embedding",)),
)
OTHER_OPS = "other ops (norms, SiLU, residuals, masks, ...)"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--preset", default="cpu-lesson", choices=sorted(stage1_sft.PRESETS))
    p.add_argument("--data", required=True, help="stage 0's train.jsonl")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--target", default="full", choices=sorted(stage1_sft.TARGETS))
    p.add_argument("--phase", type=int, default=2, choices=[1, 2])
    p.add_argument("--steps", type=up_to(MAX_STEPS), default=10, help="timed steps a side")
    p.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=OPTIMIZERS)
    p.add_argument("--attention", nargs="+", default=["sdpa"], choices=["sdpa", "eager", "bf16_eager"])
    p.add_argument("--loss", nargs="+", default=["logsumexp"], choices=sorted(LOSSES))
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--profile", action="store_true", help="where a step's time goes, by kind of op (above)")
    p.add_argument("--out", default="runs/bench/sft_step")
    return p


def phase_data(cfg, tokenizer, phase: int):
    """Stage 1's global batches of `phase` (stage1_sft.PhaseData over cfg's data)."""
    records = read_mixture(cfg.data, cfg.seed)
    return stage1_sft.PhaseData(
        tokenizer, records, phase, cfg.max_length, cfg.target, cfg.seed, cfg.batch_size * cfg.grad_accum
    )


def step_batches(data, cfg, tokenizer, k: int) -> tuple[list[dict], int, int]:
    """Global batch k as stage 1 runs it -> (its collated micro-batches, the target tokens the loss
    is normalised by, the tokens of its records)."""
    examples = [data.example(i) for i in data.batch_indices(k)]
    micro = [examples[a : a + cfg.batch_size] for a in range(0, len(examples), cfg.batch_size)]
    batches = [stage1_sft.collate(m, tokenizer.pad_token_id) for m in micro]
    global_tokens = sum(int(b["labels"].ne(stage1_sft.IGNORE_INDEX).sum()) for b in batches)
    return batches, global_tokens, sum(len(e["input_ids"]) for e in examples)


def timed_step(model, batches, global_tokens, optimizer, autocast_dtype, max_grad_norm) -> tuple:
    """One optimizer step of stage 1 (forward and backward of every micro-batch under
    `autocast_dtype`, the clip, the optimizer step) -> (seconds of forward + backward and clip,
    seconds of the optimizer step, the step's loss: Eq. (3) over the global batch's target tokens)."""
    start, loss = time.perf_counter(), 0.0
    for batch in batches:
        sums = stage1_sft.sft_loss_sums(model, batch, autocast_dtype)
        (sums["nll"] / global_tokens).backward()
        loss += sums["nll"].item() / global_tokens
    clip_grad_norm(model.parameters(), max_grad_norm)
    middle = time.perf_counter()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return middle - start, time.perf_counter() - middle, loss


def op_kind(name: str) -> str:
    for kind, names, parts in OP_KINDS:
        if name in names or any(part in name for part in parts):
            return kind
    return OTHER_OPS


def profile_steps(model, data, cfg, tokenizer, autocast_dtype, steps: int) -> dict:
    """--profile: one warm-up step, then `steps` steps under torch.profiler -> seconds a step by
    kind of op (self time), the step's wall time, the weight products' GFLOP/s."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0, fused=True)
    timed_step(
        model, step_batches(data, cfg, tokenizer, 0)[0], 1, optimizer, autocast_dtype, cfg.max_grad_norm
    )
    wall = 0.0
    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as profiler:
        for k in range(1, steps + 1):
            batches, global_tokens, _ = step_batches(data, cfg, tokenizer, k)
            wall += sum(
                timed_step(model, batches, global_tokens, optimizer, autocast_dtype, cfg.max_grad_norm)[:2]
            )
    seconds, flops = dict.fromkeys([kind for kind, _, _ in OP_KINDS] + [OTHER_OPS], 0.0), 0
    for event in profiler.key_averages():
        kind = op_kind(event.key)
        seconds[kind] += event.self_cpu_time_total / 1e6 / steps
        flops += event.flops if kind == WEIGHT_PRODUCTS else 0
    step_s = wall / steps
    seconds["no op (Python, data, waiting)"] = max(step_s - sum(seconds.values()), 0.0)
    products = seconds[WEIGHT_PRODUCTS]
    return {
        "step_s": step_s,
        "seconds": seconds,
        "weight_product_gflops": flops / steps / products / 1e9 if products else None,
    }


def profile_markdown(profiled: dict, title: str) -> str:
    step_s = profiled["step_s"]
    rows = [
        [kind, f"{s:.3f}", f"{s / step_s:.1%}"]
        for kind, s in sorted(profiled["seconds"].items(), key=lambda item: -item[1])
    ]
    gflops = profiled["weight_product_gflops"]
    return "\n\n".join(
        [
            title,
            markdown_table(["kind of op", "seconds a step (self time)", "share of the step"], rows),
            f"step {step_s:.2f} s (under the profiler); weight products at "
            + (f"{gflops:.0f} GFLOP/s" if gflops is not None else "n/a"),
        ]
    )


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    check_out(args.out)
    try:
        read_mixture(args.data)  # a bad --data is one line, before the model loads
    except DataError as e:
        sys.exit(f"error: {e}")
    import torch

    cfg = stage1_sft.parse_args(["--preset", args.preset, "--data", args.data, "--target", args.target])
    model, tokenizer = load_model_and_tokenizer(args.model, dtype=args.dtype)
    weight_dtype, autocast_dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    fp32 = bf16_eager_in_fp32(weight_dtype, autocast_dtype)
    if fp32 and "bf16_eager" in args.attention:
        print(bf16_eager_note(args.dtype), file=sys.stderr, flush=True)

    def named(attention: str) -> str:  # the side's name in the tables says what ran
        return f"{attention} in fp32 (no bf16)" if fp32 and attention == "bf16_eager" else attention

    model.train()
    data = phase_data(cfg, tokenizer, args.phase)
    register_bf16_eager()
    attentions = args.attention
    title = (
        f"# Stage 1 step, {args.preset}, phase {args.phase}, --target {args.target}: "
        f"{cfg.batch_size * cfg.grad_accum} records a step, micro-batches of {cfg.batch_size}"
    )
    if args.profile:
        model.set_attn_implementation(attentions[0])
        logprobs.token_logprobs = LOSSES[args.loss[0]]
        profiled = profile_steps(model, data, cfg, tokenizer, autocast_dtype, args.steps)
        info = machine()
        markdown = profile_markdown(
            profiled,
            f"{title}, {named(attentions[0])} attention, {args.loss[0]} loss, {args.steps} steps profiled\n\n"
            f"{machine_line(info)}",
        )
        report(args, "profile-", {"machine": info, "profile": profiled}, markdown)
        return
    sides = {}
    for attention in attentions:
        for loss in args.loss:
            for kind in args.optimizers:
                fused = True if kind == "fused" else None
                optimizer = torch.optim.AdamW(model.parameters(), lr=0.0, fused=fused)
                sides[f"AdamW {kind}, {named(attention)}, {loss}"] = (attention, LOSSES[loss], optimizer)
    parts = {name: {"step": [], "forward + backward": [], "optimizer": []} for name in sides}
    losses = {name: [] for name in sides}
    tokens = []
    for k in range(args.steps + 1):
        batches, global_tokens, record_tokens = step_batches(data, cfg, tokenizer, k)
        tokens.append(record_tokens)
        for name, (attention, loss_logprobs, optimizer) in sides.items():
            model.set_attn_implementation(attention)
            logprobs.token_logprobs = loss_logprobs  # what stage1_sft.sft_loss_sums calls
            forward_backward, step, loss = timed_step(
                model, batches, global_tokens, optimizer, autocast_dtype, cfg.max_grad_norm
            )
            losses[name].append(loss)
            if k:  # step 0 warms up
                parts[name]["step"].append(forward_backward + step)
                parts[name]["forward + backward"].append(forward_backward)
                parts[name]["optimizer"].append(step)
    logprobs.token_logprobs = LOSSES["logsumexp"]
    first = next(iter(sides))
    results = {name: {part: describe(v) for part, v in timing.items()} for name, timing in parts.items()}
    for name in results:
        results[name]["loss vs first side"] = max(abs(a / b - 1) for a, b in zip(losses[name], losses[first]))
        # the same batch on both sides: the median of the steps' ratios, robust to a step's length
        ratios = [a / b for a, b in zip(parts[name]["step"], parts[first]["step"])]
        results[name]["step vs first side"] = describe(ratios)
    columns = ("step", "forward + backward", "optimizer", "step vs first side")
    rows = [
        [name, *(fmt_stat(r[column]) for column in columns), f"{r['loss vs first side']:.1e}"]
        for name, r in results.items()
    ]
    info = machine()
    markdown = "\n\n".join(
        [
            f"# Stage 1 step, {args.preset}, phase {args.phase}, --target {args.target}: "
            f"{args.steps} steps a side of {cfg.batch_size * cfg.grad_accum} records "
            f"({sum(tokens[1:]) / args.steps:.0f} tokens a step), micro-batches of {cfg.batch_size}\n\n"
            f"{machine_line(info)}",
            markdown_table(
                [
                    "side",
                    "step (s), median (min-max)",
                    "forward + backward (s)",
                    "optimizer step (s)",
                    "step vs first side, median (min-max) of the steps' ratios",
                    "loss vs first side (largest relative difference)",
                ],
                rows,
            ),
        ]
    )
    report(args, "", {"machine": info, "results": results}, markdown)


def report(args, prefix: str, payload: dict, markdown: str) -> None:
    """Print the table and write it, with `payload` and the arguments, under --out."""
    name = f"{prefix}{args.preset}-phase{args.phase}-{args.target}"
    json_path, md_path = write_results(Path(args.out), name, {"args": vars(args), **payload}, markdown)
    print(markdown)
    print(f"\nwrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()
