"""Benchmark: stage 1 (SFT) training throughput, with and without length grouping, per precision.

stage1_sft.PhaseData shuffles the records of an epoch, sorts each group of 32 global batches by
length and shuffles the batches, so that a batch holds examples of similar length and little
padding. This script measures what that buys: it runs stage 1's own training step (collate,
sft_loss_sums = Eq. (3), backward, clipping, AdamW) on PhaseData's grouped batches and, alternately,
on the same epoch permutation cut into batches without the sort (PhaseData's shuffle without its
grouping, built here from its public pieces), and reports:

- training tokens per second (real, unpadded tokens of the batch) and padded tokens per second;
- the padding share of the measured batches, and of a larger sample of batches (--padding-batches,
  tokenized only: it costs no model time);
- seconds per optimizer step (median and min-max, the first --warmup steps of each order left out);

for fp32, and bf16 autocast where the hardware has bf16 units (a GPU, an AMX CPU), for each phase
asked for (1: pruned histories, 2: full histories). The model is stage 1's start
(`--model`, default the embedded SmolLM2-135M); its weights change as it trains, which does not
change the cost of a step.

    python bench/sft_throughput.py --model smollm2-135m --data runs/data/train.jsonl
    python bench/sft_throughput.py --model tiny-random --synthetic 30 --steps 2 --out runs/bench/tiny-sft

Writes <out>/results.json and <out>/results.md (default runs/bench/sft_throughput).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
for _path in (str(ROOT), str(BENCH)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from measure import (  # noqa: E402
    describe,
    fmt_stat,
    machine,
    machine_line,
    markdown_table,
    resolve_precisions,
    write_results,
)

ORDERS = ("grouped", "ungrouped")


def build_parser() -> argparse.ArgumentParser:
    from stage1_sft import build_parser as stage1_parser

    D = vars(stage1_parser().parse_args([]))  # stage 1's own defaults
    p = argparse.ArgumentParser(
        description="Stage 1 training tokens/s and padding share, with and without "
        "length grouping, fp32 and bf16 where available.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = p.add_argument
    add("--model", default=D["model"], help="a local folder, a Hugging Face id, smollm2-135m or tiny-random")
    add("--data", default=D["data"], help="stage-0 training records (JSONL)")
    add(
        "--synthetic",
        type=int,
        metavar="N",
        help="instead of --data, build N synthetic dialogues in a temporary folder",
    )
    add("--out", default="runs/bench/sft_throughput", help="writes results.json and results.md here")
    add("--phases", default="1,2", help="stage 1 phases to measure: 1 (pruned histories), 2 (full), or 1,2")
    add("--steps", type=int, default=4, help="optimizer steps per phase, precision and order")
    add("--warmup", type=int, default=1, help="steps of each order left out of the medians")
    add("--batch-size", type=int, default=D["batch_size"], help="examples per step (one micro-batch)")
    add("--max-length", type=int, default=D["max_length"], help="tokens per example, as stage 1")
    add("--lr", type=float, default=D["lr"], help="AdamW learning rate (does not change the cost)")
    add(
        "--gradient-checkpointing",
        action=argparse.BooleanOptionalAction,
        default=D["gradient_checkpointing"],
        help="as stage 1's flag",
    )
    add(
        "--precisions",
        default="auto",
        help="auto (fp32, plus bf16 on a GPU or an AMX CPU), fp32, bf16 or fp32,bf16",
    )
    add(
        "--padding-batches",
        type=int,
        default=64,
        help="batches of each order tokenized (not trained) for the padding share of a larger sample",
    )
    add("--seed", type=int, default=0, help="data order")
    return p


def check_arguments(args) -> list[int]:
    try:
        phases = sorted({int(p) for p in args.phases.split(",")})
    except ValueError:
        phases = []
    if not phases or any(p not in (1, 2) for p in phases):
        sys.exit(f"error: --phases {args.phases!r}: use 1, 2 or 1,2")
    if args.warmup < 0 or args.steps <= args.warmup:
        sys.exit(f"error: --steps must be more than --warmup ({args.warmup})")
    if args.batch_size < 1 or args.max_length < 16:
        sys.exit("error: --batch-size must be at least 1 and --max-length at least 16")
    if args.padding_batches < 0:
        sys.exit("error: --padding-batches must be 0 or more")
    if not args.synthetic and not Path(args.data).exists():
        sys.exit(
            f"error: {args.data} not found; build it with `python stage0_build.py --source synthetic "
            f"--out {Path(args.data).parent}`, or pass --synthetic N"
        )
    return phases


# --------------------------------------------------------------------------------------------
# The two orders: PhaseData's grouped batches, and the same shuffle without the length sort
# --------------------------------------------------------------------------------------------
def ungrouped_batches(data, epoch: int = 0) -> list[list[int]]:
    """PhaseData.epoch_batches without its length sort: the same seeded permutation (wrapped to fill
    the last batch), cut into consecutive batches."""
    import numpy as np

    rng = np.random.default_rng([data.seed, data.phase, epoch])
    order = np.resize(rng.permutation(len(data.records)), data.batches_per_epoch * data.global_batch)
    return [
        [int(i) for i in order[k : k + data.global_batch]] for k in range(0, len(order), data.global_batch)
    ]


def batch_indices(data, order: str, k: int) -> list[int]:
    if order == "grouped":
        return data.batch_indices(k)
    batches = ungrouped_batches(data, k // data.batches_per_epoch)
    return batches[k % data.batches_per_epoch]


def padding(examples) -> dict:
    """Tokens of a right-padded batch: real, padded (rows x width), and the padding share."""
    width = max(len(e["input_ids"]) for e in examples)
    real = sum(len(e["input_ids"]) for e in examples)
    padded = width * len(examples)
    return {
        "rows": len(examples),
        "width": width,
        "real_tokens": real,
        "padded_tokens": padded,
        "padding_share": 1 - real / padded,
    }


def sample_padding(data, order: str, batches: int) -> float | None:
    """Padding share over the first `batches` batches of the order, tokenized only."""
    real = padded = 0
    for k in range(batches):
        p = padding([data.example(i) for i in batch_indices(data, order, k)])
        real, padded = real + p["real_tokens"], padded + p["padded_tokens"]
    return 1 - real / padded if padded else None


# --------------------------------------------------------------------------------------------
# One training step, as stage 1 takes it (single process, one micro-batch)
# --------------------------------------------------------------------------------------------
def train_step(model, optimizer, examples, pad_id, autocast_dtype, max_grad_norm=1.0) -> dict:
    import torch

    from stage1_sft import collate, sft_loss_sums

    device = next(model.parameters()).device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    batch = {k: v.to(device) for k, v in collate(examples, pad_id).items()}
    sync()
    start = time.perf_counter()
    sums = sft_loss_sums(model, batch, autocast_dtype)
    (sums["nll"] / sums["tokens"].clamp(min=1)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    sync()
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "target_tokens": int(sums["tokens"].item()), **padding(examples)}


def measure_precision(args, precision: str, phases: list[int], records) -> dict:
    import torch

    from srt.modeling import load_model_and_tokenizer, resolve_dtype
    from srt.training import seed_everything
    from stage1_sft import PhaseData

    seed_everything(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = "float32" if precision == "fp32" else "auto"  # auto = fp32 weights + bf16 autocast (GPU / AMX)
    _, autocast_dtype = resolve_dtype(dtype, device)
    model, tokenizer = load_model_and_tokenizer(args.model, dtype=dtype, device=device)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    result = {"autocast": str(autocast_dtype).replace("torch.", "") if autocast_dtype else None, "phases": {}}
    for phase in phases:
        data = PhaseData(tokenizer, records, phase, args.max_length, "full", args.seed, args.batch_size)
        steps = {order: [] for order in ORDERS}
        for k in range(args.steps):  # alternate the orders step by step: a slow spell hits both
            for order in ORDERS:
                examples = [data.example(i) for i in batch_indices(data, order, k)]
                steps[order].append(
                    dict(
                        train_step(model, optimizer, examples, tokenizer.pad_token_id, autocast_dtype),
                        step=k + 1,
                    )
                )
        result["phases"][phase] = {
            order: {
                "steps": steps[order],
                "sample_padding_share": sample_padding(data, order, args.padding_batches)
                if args.padding_batches
                else None,
            }
            for order in ORDERS
        }
    return result


def summarize(steps: list[dict], warmup: int) -> dict:
    measured = steps[warmup:]
    real = sum(s["real_tokens"] for s in measured)
    padded = sum(s["padded_tokens"] for s in measured)
    return {
        "steps": len(measured),
        "seconds": describe([s["seconds"] for s in measured]),
        "tokens_per_s": describe([s["real_tokens"] / s["seconds"] for s in measured]),
        "padded_tokens_per_s": describe([s["padded_tokens"] / s["seconds"] for s in measured]),
        "target_tokens_per_s": describe([s["target_tokens"] / s["seconds"] for s in measured]),
        "padding_share": 1 - real / padded if padded else None,
        "mean_real_tokens": real / len(measured) if measured else None,
    }


def table_rows(results: dict, warmup: int) -> list[list]:
    rows = []
    for precision, result in results.items():
        for phase, orders in result["phases"].items():
            for order, data in orders.items():
                s = summarize(data["steps"], warmup)
                share = data["sample_padding_share"]
                rows.append(
                    [
                        precision,
                        str(phase),
                        order,
                        s["steps"],
                        fmt_stat(s["seconds"]),
                        fmt_stat(s["tokens_per_s"]),
                        fmt_stat(s["padded_tokens_per_s"]),
                        f"{s['padding_share']:.1%}" if s["padding_share"] is not None else "n/a",
                        f"{share:.1%}" if share is not None else "n/a",
                    ]
                )
    return rows


HEADER = [
    "precision",
    "phase",
    "order",
    "steps",
    "s / step",
    "training tokens / s",
    "padded tokens / s",
    "padding (measured)",
    "padding (sample)",
]


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    phases = check_arguments(args)
    precisions = resolve_precisions(args.precisions)
    from srt.data_io import DataError, read_jsonl

    with tempfile.TemporaryDirectory(prefix="sft_throughput-") as tmp:
        data = args.data
        if args.synthetic:
            import stage0_build

            stage0_build.main(
                [
                    "--source",
                    "synthetic",
                    "--num-dialogues",
                    str(args.synthetic),
                    "--out",
                    tmp,
                    "--seed",
                    str(args.seed),
                    "--quiet",
                    "--dev-fraction",
                    "0",
                    "--test-fraction",
                    "0",
                ]
            )
            data = str(Path(tmp) / "train.jsonl")
        try:
            records = read_jsonl(data)
        except DataError as e:
            sys.exit(f"error: {e}")
        if not records:
            sys.exit(f"error: {data} holds no records")
        results = {}
        for precision in precisions:
            try:
                results[precision] = measure_precision(args, precision, phases, records)
            except DataError as e:  # no record of a phase fits --max-length
                sys.exit(f"error: {e}")
    host = machine()
    command = "python bench/sft_throughput.py " + " ".join(argv if argv is not None else sys.argv[1:])
    table = markdown_table(HEADER, table_rows(results, args.warmup), "lllrrrrrr")
    text = "\n".join(
        [
            "# Stage 1 (SFT) throughput: length grouping on and off",
            "",
            f"`{command}`",
            "",
            f"Machine: {machine_line(host)}.",
            "",
            f"model `{args.model}`, batch {args.batch_size} x up to {args.max_length} tokens, "
            f"one micro-batch a step, gradient checkpointing {args.gradient_checkpointing}; "
            f"{args.steps} steps per order "
            f"({args.steps - args.warmup} measured), orders alternated step by step; medians (min-max). "
            f"Training tokens are the real, unpadded tokens; padding (sample) is over {args.padding_batches} "
            f"batches of each order, tokenized only.",
            "",
            table,
            "",
        ]
    )
    payload = {
        "command": command,
        "config": vars(args),
        "machine": host,
        "results": results,
        "summary": {
            p: {
                ph: {o: summarize(d["steps"], args.warmup) for o, d in orders.items()}
                for ph, orders in r["phases"].items()
            }
            for p, r in results.items()
        },
    }
    json_path, md_path = write_results(Path(args.out), "results", payload, text)
    print(text + f"\nwritten: {md_path}, {json_path}", flush=True)


if __name__ == "__main__":
    main()
