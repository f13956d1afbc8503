"""Benchmark: rollouts through our decode loop (srt/decode.py) against Hugging Face `generate`, in
generated tokens per second, on the same prompts, the same K and the same lengths.

Both sides call generation.generate on the same rendered stage-2 prompts (srt.rollouts.PromptStream
over --data, as stage2_grpo draws them) and differ only in `engine`: "ours" or "hf". Each runs as
stage 2 runs it at --precision auto: where the hardware has bf16 units (a GPU, a CPU with AMX or
AVX512-BF16) ours on its bf16 copy of the policy and generate under bf16 autocast; elsewhere both
in fp32 (--precision fp32 forces fp32 on both, --precision bf16 forces the bf16 copy and
autocast). Equal work: the stop tokens are suppressed (the model's generation_config.suppress_tokens,
which both engines honour), so every row is exactly
--max-new-tokens long on both sides, which the outputs are checked for. Sides alternate within
each repeat, after one warm-up each, so a slow spell of a shared machine falls on both. Reported
per K (--ks, default batch 1, K = 4 and K = 8 samples of --prompts prompts): the median seconds of
one rollout (prefill included, the same on both sides), generated tokens per second, the
ratio ours / hf, the paired ratio and the ratio of CPU seconds (steal time, what a virtual
machine's neighbours take, counts in wall time only). The precision is read from the computation:
the dtype of the last matmul of the last decoder layer during one untimed call per side (forward
hooks, removed before timing). On a GPU it also reports whether our rollouts replayed their decode
step as a CUDA graph (decode.capture_step warns when the capture fails and the loop decodes eagerly).

--recall copy: ours decodes by pointer (srt/recall.py: the program writes each recalled turn in one
forward) and, in the same repeats, free on the same prompts; generate cannot copy, so it is not
timed. Reported: the copies' gain, ours free's seconds over ours by pointer, repeat by repeat.

--check: greedy equality instead of speed. The first --check-prompts dev prompts, in fp32 on both
sides, batches of --batch-size prompts, stop tokens allowed: ours must give generate's tokens, row
for row; the first row that differs is printed.

    python bench/rollout_speed.py --model smollm2-135m --data runs/data/train.jsonl
    python bench/rollout_speed.py --check --model smollm2-135m --data runs/data/dev.jsonl
    python bench/rollout_speed.py --model tiny-random --synthetic 6 --ks 1,4 --max-new-tokens 8 --repeats 1

Writes <out>/results.json and <out>/results.md (or check.json / check.md; default
runs/bench/rollout_speed).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
for _path in (str(ROOT), str(BENCH)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from measure import bench_records, check_out, describe, machine, machine_line, markdown_table, write_results  # noqa: E402

from srt.config import at_least, positive  # noqa: E402

ENGINES = ("ours", "hf")
FREE = "ours, free"  # --recall copy: ours with recall "free" on the same prompts, what the copies gain
GRAPH_FAILED = "decode: CUDA graph capture failed"  # decode.capture_step's warning when it falls back


def k_list(text: str) -> list[int]:
    try:
        ks = [int(k) for k in text.split(",") if k.strip()]
    except ValueError:
        ks = []
    if not ks or min(ks) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of K >= 1, e.g. 1,4,8")
    return ks


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--model", default="smollm2-135m", help="a folder, an HF id, smollm2-135m, tiny-random")
    p.add_argument(
        "--data",
        help="stage-0 JSONL the prompts come from (default runs/data/train.jsonl; --check: dev.jsonl)",
    )
    p.add_argument("--synthetic", type=at_least(0), default=0, help="build N synthetic dialogues instead")
    p.add_argument("--prompts", type=at_least(1), default=1, help="distinct prompts per rollout")
    p.add_argument("--ks", type=k_list, default=[1, 4, 8], help="samples per prompt to measure")
    p.add_argument("--max-new-tokens", type=at_least(1), default=128, help="every row's length")
    p.add_argument("--max-prompt-length", type=at_least(1), default=1536, help="as stage 2's cpu-table2")
    p.add_argument("--temperature", type=positive(float), default=1.0)
    p.add_argument(
        "--precision",
        choices=["auto", "fp32", "bf16"],
        default="auto",
        help="auto: as stage 2 resolves it; bf16: fp32 weights with ours on a bf16 copy and hf under bf16 "
        "autocast, whatever the hardware (e.g. a CPU with neither AMX nor avx512_bf16)",
    )
    p.add_argument(
        "--recall",
        choices=["free", "copy"],
        default="free",
        help="copy: ours decodes by pointer (srt/recall.py) and free, paired; generate cannot copy, so "
        "it is not run (a model that writes <HIS> tags: an SFT checkpoint)",
    )
    p.add_argument("--repeats", type=at_least(1), default=3, help="timed rollouts per side and K")
    p.add_argument("--check", action="store_true", help="greedy equality on dev prompts instead of speed")
    p.add_argument("--check-prompts", type=at_least(1), default=32, help="--check: how many prompts")
    p.add_argument("--batch-size", type=at_least(1), default=8, help="--check: prompts per call")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/bench/rollout_speed")
    return p


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def load_prompts(args, tokenizer, n: int) -> list[str]:
    from srt.data_io import DataError
    from srt.rollouts import PromptStream

    split = "dev" if args.check else "train"
    records = bench_records(args.data or f"runs/data/{split}.jsonl", args.synthetic, split)
    try:
        stream = PromptStream(records, tokenizer, args.max_prompt_length, args.seed)
        return [prompt for _, prompt in stream.next_batch(min(n, len(records)))]
    except DataError as e:
        sys.exit(f"error: {e}")


def graph_record(device: str, failed: list[bool]) -> str:
    """What our rollouts did with the CUDA graph: on a GPU the loop replays its decode step as one,
    or warns (GRAPH_FAILED) and decodes eagerly; `failed` says for each timed rollout if it warned."""
    if device != "cuda":
        return "n/a"
    return f"failed in {sum(failed)} of {len(failed)} rollouts" if any(failed) else "replayed"


def observed_precision(model, run) -> dict:
    """engine -> dtype of the last decoder layer's last matmul during one call of `run(engine)`.
    Hooks go on the model and on its sampling copy (srt/decode.py), and come off before timing."""
    import torch

    from srt.distributed import decoder_layers

    seen = {}
    for engine in ENGINES:
        dtypes, handles = set(), []
        for module in {id(m): m for m in run.models()}.values():
            last = [m for m in decoder_layers(module)[-1].modules() if isinstance(m, torch.nn.Linear)][-1]
            handles.append(last.register_forward_hook(lambda m, i, o: dtypes.add(str(o.dtype))))
        run(engine)
        for handle in handles:
            handle.remove()
        seen[engine] = sorted(dtypes)
    return seen


def speed(args) -> None:
    import torch

    from srt import decode, generation, loading, precision

    dtype, device = {"auto": "auto", "fp32": "float32", "bf16": "float32"}[args.precision], default_device()
    model, tokenizer = loading.load_model_and_tokenizer(args.model, dtype=dtype, device=device)
    _, autocast_dtype = precision.resolve_dtype(dtype, device)
    if args.precision == "bf16":
        autocast_dtype = torch.bfloat16
    stops = generation.stop_token_ids(model, tokenizer)
    model.generation_config.suppress_tokens = stops  # equal work: every row runs to the cap
    prompts = load_prompts(args, tokenizer, args.prompts)

    class Rollout:
        def __init__(self, K):
            self.K = K

        def models(self):
            return [model, decode.sampling_model(model, autocast_dtype)]

        def __call__(self, side):
            engine, recall = ("ours", "free") if side == FREE else (side, args.recall)
            torch.manual_seed(args.seed)
            start, cpu_start = time.perf_counter(), time.process_time()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = generation.generate(
                    model,
                    tokenizer,
                    prompts,
                    max_new_tokens=args.max_new_tokens,
                    num_generations=self.K,
                    temperature=args.temperature,
                    autocast_dtype=autocast_dtype,
                    engine=engine,
                    **({"recall": recall} if engine == "ours" else {}),
                )
            seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
            for warning in caught:  # shown as usual, and read for the CUDA graph's fallback
                warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)
            if min(out["generated_tokens"]) != args.max_new_tokens:
                sys.exit(f"error: {side}: a row ended before --max-new-tokens; the lengths are not equal")
            generated = sum(out["generated_tokens"])
            return {
                "copied": sum(out.get("copied_tokens", [0])),
                "seconds": seconds,
                "cpu_seconds": cpu_seconds,
                "generated": generated,
                "rows": len(out["texts"]),
                "graph_failed": any(str(w.message).startswith(GRAPH_FAILED) for w in caught),
            }

    results = {"machine": machine(), "config": vars(args), "runs": []}
    # Each paired ratio compares rollouts run back to back: ours and generate, or (--recall copy,
    # where generate cannot copy) ours free and ours by pointer.
    sides = ENGINES if args.recall == "free" else (FREE, "ours")
    for K in args.ks:
        rollout = Rollout(K)
        precision = observed_precision(model, rollout)  # also the warm-up of each side
        times = {side: [] for side in sides}
        if FREE in sides:
            rollout(FREE)  # its warm-up
        for _ in range(args.repeats):
            for side in sides:
                times[side].append(rollout(side))
        row = {"K": K, "prompts": len(prompts), "precision": precision, "recall": args.recall}
        row["copied_tokens"] = {side: describe([r["copied"] for r in times[side]]) for side in sides}
        row["cuda_graph"] = graph_record(device, [r["graph_failed"] for r in times["ours"]])
        for side in sides:
            seconds = describe([r["seconds"] for r in times[side]])
            generated = times[side][0]["generated"]
            row[side] = {
                "seconds": seconds,
                "generated_tokens": generated,
                "tokens_per_s": generated / seconds["median"],
            }
        if args.recall == "copy":  # nothing to compare with generate: the copies' gain instead
            row["speedup"] = row["paired"] = row["cpu_ratio"] = None
            # ours free's seconds over ours by pointer in each repeat, the two run back to back
            row["copies_paired"] = describe(
                [free["seconds"] / ours["seconds"] for ours, free in zip(times["ours"], times[FREE])]
            )
        else:
            row["speedup"] = row["ours"]["tokens_per_s"] / row["hf"]["tokens_per_s"]
            # hf's seconds over ours in each repeat, the two rollouts run back to back: a slow spell of a
            # shared machine moves both, so the paired ratios spread less than the medians' ratio.
            row["paired"] = describe(
                [h["seconds"] / o["seconds"] for o, h in zip(times["ours"], times["hf"])]
            )
            # CPU seconds of the process (every thread): the time a virtual machine's neighbours take from
            # a run (steal time) is wall time, not CPU time of the process.
            row["cpu"] = {engine: describe([r["cpu_seconds"] for r in times[engine]]) for engine in ENGINES}
            row["cpu_ratio"] = row["cpu"]["hf"]["median"] / row["cpu"]["ours"]["median"]
        results["runs"].append(row)
        if args.recall == "copy":
            pointer, free = row["ours"]["tokens_per_s"], row[FREE]["tokens_per_s"]
            gain = row["copies_paired"]["median"]
            print(
                f"K = {K}: ours by pointer {pointer:.1f} tok/s, free {free:.1f} tok/s, x{gain:.2f} paired",
                flush=True,
            )
            continue
        ours, hf = row["ours"]["tokens_per_s"], row["hf"]["tokens_per_s"]
        print(
            f"K = {K}: ours {ours:.1f} tok/s, hf {hf:.1f} tok/s, x{ours / hf:.2f} {precision}, "
            f"CUDA graph: {row['cuda_graph']}",
            flush=True,
        )
    widths = [len(tokenizer(p, add_special_tokens=False).input_ids) for p in prompts]

    def with_hf(r, cell):
        return "-" if r["speedup"] is None else cell(r)

    table = markdown_table(
        [
            "prompts x K",
            "precision (ours / hf)",
            "ours s",
            "hf s",
            "ours tok/s",
            "hf tok/s",
            "ours / hf",
            "paired, median (min-max)",
            "CPU s ours / hf",
            "hf / ours by CPU s",
            "ours free s",
            "free / by pointer, paired",
            "copied tokens (ours)",
        ],
        [
            [
                f"{r['prompts']} x {r['K']}",
                f"{'/'.join(r['precision']['ours'])} / {'/'.join(r['precision']['hf'])}",
                r["ours"]["seconds"]["median"],
                with_hf(r, lambda r: r["hf"]["seconds"]["median"]),
                r["ours"]["tokens_per_s"],
                with_hf(r, lambda r: r["hf"]["tokens_per_s"]),
                with_hf(r, lambda r: f"{r['speedup']:.2f}x"),
                with_hf(
                    r,
                    lambda r: (
                        f"{r['paired']['median']:.2f}x ({r['paired']['min']:.2f}-{r['paired']['max']:.2f})"
                    ),
                ),
                with_hf(r, lambda r: f"{r['cpu']['ours']['median']:.1f} / {r['cpu']['hf']['median']:.1f}"),
                with_hf(r, lambda r: f"{r['cpu_ratio']:.2f}x"),
                r[FREE]["seconds"]["median"] if FREE in r else "-",
                f"{r['copies_paired']['median']:.2f}x" if FREE in r else "-",
                r["copied_tokens"]["ours"]["median"],
            ]
            for r in results["runs"]
        ],
    )
    copy_note = (
        " (ours by pointer, also timed free on the same prompts: free / by pointer is its seconds over "
        "ours, paired)"
        if args.recall == "copy"
        else ""
    )
    lines = [
        "# Rollouts: our decode loop vs Hugging Face generate\n",
        machine_line(results["machine"]) + "\n",
        f"{args.model}, --precision {args.precision}, --recall {args.recall}{copy_note}; "
        f"prompts of {widths} tokens; every row exactly "
        f"{args.max_new_tokens} new tokens (stop tokens suppressed); T = {args.temperature}; median of "
        f"{args.repeats} timed rollouts per side (prefill included, the same on both sides)"
        + (
            "; paired: hf's seconds over ours in each repeat, the two run back to back; CPU s: the "
            "process's CPU seconds (all threads, medians), which a shared machine's steal time does "
            "not inflate"
            if args.recall == "free"
            else ""
        )
        + ".\n",
        table,
    ]
    if device == "cuda":
        graphs = "; ".join(f"K = {r['K']}: {r['cuda_graph']}" for r in results["runs"])
        lines.append(f"\nOur decode step as a CUDA graph (else eager, with a warning): {graphs}.")
    write_results(Path(args.out), "results", results, "\n".join(lines) + "\n")
    print("\n".join(lines))


def check(args) -> None:
    import torch

    from srt import generation, loading

    model, tokenizer = loading.load_model_and_tokenizer(args.model, dtype="float32", device=default_device())
    prompts = load_prompts(args, tokenizer, args.check_prompts)
    first_difference, rows, tokens, equal_rows = None, 0, 0, 0
    for start in range(0, len(prompts), args.batch_size):
        batch = prompts[start : start + args.batch_size]
        outs = {
            engine: generation.generate(
                model, tokenizer, batch, args.max_new_tokens, greedy=True, engine=engine
            )
            for engine in ENGINES
        }
        for i in range(len(batch)):
            ours, hf = (outs[e]["completion_ids"][i][outs[e]["completion_mask"][i].bool()] for e in ENGINES)
            rows, tokens, equal_rows = rows + 1, tokens + len(hf), equal_rows + torch.equal(ours, hf)
            if first_difference is None and not torch.equal(ours, hf):
                at = next((t for t, (a, b) in enumerate(zip(ours.tolist(), hf.tolist())) if a != b), None)
                first_difference = {
                    "prompt": start + i,
                    "token": at,
                    "ours_len": len(ours),
                    "hf_len": len(hf),
                }
        print(f"{rows}/{len(prompts)} prompts compared, equal so far: {first_difference is None}", flush=True)
    equal = first_difference is None
    results = {"machine": machine(), "config": vars(args), "prompts": rows, "tokens": tokens}
    results.update(equal=equal, equal_prompts=equal_rows, first_difference=first_difference)
    line = (
        f"Greedy, fp32, {args.model}: {rows} prompts, {tokens} tokens of generate; ours equal token for "
        f"token: {equal}"
        + ("" if equal else f" ({equal_rows} prompts equal; first difference: {first_difference})")
    )
    write_results(Path(args.out), "check", results, f"{machine_line(results['machine'])}\n\n{line}\n")
    print(line)
    if not equal:
        sys.exit(1)


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    check_out(args.out)
    import torch

    torch.manual_seed(args.seed)
    (check if args.check else speed)(args)


if __name__ == "__main__":
    main()
