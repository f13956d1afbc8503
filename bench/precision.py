"""Benchmark: bf16 autocast against plain fp32 on this machine, for what `--dtype auto` decides.

`--dtype auto` keeps fp32 master weights and adds bf16 autocast where precision.cpu_has_fast_bf16
(or a GPU) says bf16 is faster; this script measures whether it is, on the work the lesson does,
with the same model object on both sides (fp32 weights; the bf16 side under bf16 autocast, and its
rollouts and answers on decode's bf16 sampling copy, as stage 2 and evaluate.py run them):

    sft        one stage-1 optimizer step on the preset's own global batch (bench/sft_step.py's
               batches and step: every micro-batch forward and backward, the clip, fused AdamW at
               learning rate 0, so the weights never move)
    rollout    stage 2's sampling of K completions of one prompt (stage2_grpo.sample_groups at
               the preset's temperature; the reward is left out: it is the same work on both sides)
    eval-b8    evaluate.py's greedy decoding (generate_batch) of --eval-batch srt prompts at once
    eval-b1    the same for one prompt (a request's latency)

Equal work: the stop tokens are suppressed (the model's generation_config.suppress_tokens), so every
row of a rollout or an answer runs to its token cap on both sides. Sides alternate within each part
(fp32, bf16, fp32, bf16, ...), after one untimed warm-up each, so that a slow spell of a shared
machine falls on both; each repetition gives both sides the same batch or prompts. Reported per
part: the median seconds (min-max) of each side, the ratio of the medians bf16 / fp32, and the
median (min-max) of the paired ratios (each repetition's bf16 over its fp32).

    python bench/precision.py --data runs/demo/data/train.jsonl
    python bench/precision.py --model tiny-random --synthetic 20 --repeats 1 --sft-steps 1 --out /tmp/p

Writes <out>/results.json and <out>/results.md (default runs/bench/precision).
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

from measure import check_out, describe, fmt_stat, machine, machine_line, markdown_table, write_results  # noqa: E402

from srt.config import at_least  # noqa: E402

PARTS = ("sft", "rollout", "eval-b8", "eval-b1")
SIDES = ("fp32", "bf16")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--data", default="runs/demo/data/train.jsonl", help="stage 0's train.jsonl")
    p.add_argument(
        "--eval-data",
        default=None,
        help="the records evaluation answers (default: test.jsonl beside --data, else --data)",
    )
    p.add_argument(
        "--synthetic", type=at_least(0), default=0, help="a fresh stage-0 corpus of N dialogues instead"
    )
    p.add_argument("--preset", default="cpu-lesson", help="stage 1's and stage 2's preset")
    p.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    p.add_argument("--sft-steps", type=at_least(1), default=3, help="timed SFT steps a side")
    p.add_argument("--phase", type=int, default=2, choices=[1, 2], help="stage 1's phase")
    p.add_argument("--repeats", type=at_least(1), default=3, help="timed rollouts and answers a side")
    p.add_argument("-K", "--num-generations", type=at_least(1), default=None, help="default: the preset's")
    p.add_argument("--max-new-tokens", type=at_least(1), default=128, help="every rollout row's length")
    p.add_argument("--eval-batch", type=at_least(1), default=8, help="the batched evaluation's prompts")
    p.add_argument("--eval-new-tokens", type=at_least(1), default=32, help="every answer's length")
    p.add_argument("--seed", type=at_least(0), default=0)
    p.add_argument("--out", default="runs/bench/precision", help="writes results.json and results.md here")
    return p


def autocast_of(side):
    import torch

    return torch.bfloat16 if side == "bf16" else None


def alternate(reps: int, run) -> dict:
    """run(side, rep) -> (seconds, tokens) for rep 0..reps (0 warms up, untimed), the sides
    alternating within each rep -> {side: {"seconds": [...], "tokens": [...]}}."""
    timed = {side: {"seconds": [], "tokens": []} for side in SIDES}
    for rep in range(reps + 1):
        for side in SIDES:
            seconds, tokens = run(side, rep)
            if rep:
                timed[side]["seconds"].append(seconds)
                timed[side]["tokens"].append(tokens)
    return timed


def sft_part(args, model, tokenizer, data_path):
    import sft_step
    import torch

    import stage1_sft

    cfg = stage1_sft.parse_args(["--preset", args.preset, "--data", data_path])
    data = sft_step.phase_data(cfg, tokenizer, args.phase)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0, fused=True)
    model.train()

    def run(side, rep):
        batches, global_tokens, record_tokens = sft_step.step_batches(data, cfg, tokenizer, rep)
        forward_backward, step, _ = sft_step.timed_step(
            model, batches, global_tokens, optimizer, autocast_of(side), cfg.max_grad_norm
        )
        return forward_backward + step, record_tokens

    timed = alternate(args.sft_steps, run)
    optimizer.zero_grad(set_to_none=True)
    model.eval()
    return timed, f"{cfg.batch_size * cfg.grad_accum} records a step, micro-batches of {cfg.batch_size}"


def rollout_part(args, model, tokenizer, records):
    import torch

    import stage2_grpo
    from srt.rollouts import PromptStream

    argv = ["--preset", args.preset, "--model", args.model, "--dtype", "float32"]
    argv += ["--max-new-tokens", str(args.max_new_tokens), "--seed", str(args.seed)]
    if args.num_generations:
        argv += ["-K", str(args.num_generations)]
    cfg = stage2_grpo.parse_args(argv)
    stream = PromptStream(records, tokenizer, cfg.max_prompt_length, args.seed)
    pairs = [stream.next_batch(1) for _ in range(args.repeats + 1)]  # one prompt a rep, both sides

    def no_reward(completions, examples):
        return [{"total": 0.0} for _ in completions]

    def run(side, rep):
        (record, prompt), *_ = pairs[rep]
        torch.manual_seed(args.seed + rep)
        start = time.perf_counter()
        models = stage2_grpo.Models(model, tokenizer, optimizer=None)
        settings = stage2_grpo.StepSettings.of(cfg, autocast_of(side))
        rollout = stage2_grpo.sample_groups(models, [record], [prompt], settings, no_reward)
        return time.perf_counter() - start, int(rollout.completion_mask.sum())

    return alternate(args.repeats, run), f"K = {cfg.num_generations}, 1 prompt, T = {cfg.temperature}"


def eval_part(args, model, tokenizer, records, batch: int):
    import eval_latency

    import evaluate

    need = batch * (args.repeats + 1)
    chosen = evaluate.select_examples(records, min(need, len(records)), args.seed)
    options = {"recency_k": 4, "rag_k": 8, "cuemem": {}}
    prompts = [eval_latency.build_prompt("srt", r, options, tokenizer)[0] for r in chosen]

    def run(side, rep):
        start = (rep * batch) % len(prompts)
        group = (prompts * (batch // len(prompts) + 2))[start : start + batch]
        outputs, seconds = eval_latency.answer(
            model, tokenizer, "srt", group, args.eval_new_tokens, autocast_of(side)
        )
        return seconds, sum(o["generated_tokens"] for o in outputs)

    return alternate(args.repeats, run), f"greedy, batch {batch}, srt prompts"


def summarize(timed: dict) -> dict:
    fp32, bf16 = (timed[side]["seconds"] for side in SIDES)
    result = {
        side: {"seconds": describe(timed[side]["seconds"]), "samples": timed[side]["seconds"],
               "tokens": timed[side]["tokens"]}
        for side in SIDES
    }  # fmt: skip
    result["ratio_of_medians"] = result["bf16"]["seconds"]["median"] / result["fp32"]["seconds"]["median"]
    result["paired_ratio"] = describe([b / a for a, b in zip(fp32, bf16)])
    return result


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    check_out(args.out)
    import torch
    from measure import bench_records

    import stage1_sft
    import stage2_grpo
    from srt.generation import stop_token_ids
    from srt.loading import load_model_and_tokenizer
    from srt.precision import resolve_dtype

    for stage in (stage1_sft, stage2_grpo):
        if args.preset not in stage.PRESETS:
            sys.exit(f"error: --preset {args.preset}: not a preset of {stage.__name__}.py")
    with tempfile.TemporaryDirectory(prefix="precision-") as tmp:
        if args.synthetic:
            import stage0_build

            stage0_build.main(
                ["--source", "synthetic", "--num-dialogues", str(args.synthetic), "--out", tmp, "--quiet",
                 "--seed", str(args.seed)]
            )  # fmt: skip
            data_path = str(Path(tmp) / "train.jsonl")
        else:
            data_path = args.data
            if not Path(data_path).is_file():
                sys.exit(
                    f"error: --data {data_path} not found; build it with `python stage0_build.py "
                    f"--preset cpu-lesson --out {Path(data_path).parent}`, or pass --synthetic N"
                )
        eval_path = args.eval_data or str(Path(data_path).with_name("test.jsonl"))
        if args.eval_data is None and not Path(eval_path).is_file():
            eval_path = data_path
        records = bench_records(data_path)
        eval_records = bench_records(eval_path) if any(p.startswith("eval") for p in args.parts) else []
        if not records or (eval_records == [] and any(p.startswith("eval") for p in args.parts)):
            sys.exit(f"error: {data_path if not records else eval_path} holds no records")

        model, tokenizer = load_model_and_tokenizer(args.model, dtype="float32")
        model.generation_config.suppress_tokens = stop_token_ids(model, tokenizer)  # equal work
        results, notes = {}, {}
        for part in args.parts:
            if part == "sft":
                timed, notes[part] = sft_part(args, model, tokenizer, data_path)
            elif part == "rollout":
                with torch.no_grad():
                    timed, notes[part] = rollout_part(args, model, tokenizer, records)
            else:
                batch = args.eval_batch if part == "eval-b8" else 1
                timed, notes[part] = eval_part(args, model, tokenizer, eval_records, batch)
            results[part] = summarize(timed)
            print(f"{part}: bf16 / fp32 {results[part]['ratio_of_medians']:.2f}x", flush=True)

    info = machine()
    auto = resolve_dtype("auto", "cuda" if torch.cuda.is_available() else "cpu")[1]
    flags = [f for f in ("amx_bf16", "avx512_bf16", "avx512f") if info.get(f)]
    names = {"sft": "SFT step", "rollout": "rollout", "eval-b8": f"eval, batch {args.eval_batch}",
             "eval-b1": "eval, batch 1"}  # fmt: skip
    rows = []
    for part, r in results.items():
        tokens = sum(r["fp32"]["tokens"]) / len(r["fp32"]["tokens"])
        rows.append(
            [f"{names[part]} ({notes[part]})", f"{tokens:.0f}", fmt_stat(r["fp32"]["seconds"]),
             fmt_stat(r["bf16"]["seconds"]), f"{r['ratio_of_medians']:.2f}x", fmt_stat(r["paired_ratio"], 2)]
        )  # fmt: skip
    command = "python bench/precision.py " + " ".join(argv if argv is not None else sys.argv[1:])
    header = ["part", "tokens a rep", "fp32 s, median (min-max)", "bf16 s", "bf16 / fp32"]
    header.append("paired bf16 / fp32")
    markdown = "\n".join(
        [
            f"# bf16 autocast against fp32: {args.model}, preset {args.preset}",
            "",
            f"`{command}`",
            "",
            f"Machine: {machine_line(info)}; CPU flags {', '.join(flags) or 'none of amx / avx512'}; "
            f"`--dtype auto` here: {'bf16 autocast' if auto else 'plain fp32'}.",
            "",
            f"Sides alternated, one warm-up each; {args.sft_steps} SFT steps and {args.repeats} rollouts and "
            "answers a side; tokens: a step's record tokens, a rollout's or answer's generated tokens.",
            "",
            markdown_table(header, rows),
            "",
        ]
    )
    payload = {
        "command": command,
        "args": vars(args),
        "machine": info,
        "auto_autocast": str(auto).replace("torch.", "") if auto else None,
        "notes": notes,
        "results": results,
    }
    json_path, md_path = write_results(Path(args.out), "results", payload, markdown)
    print(markdown + f"\nwritten: {md_path}, {json_path}", flush=True)
    return payload


if __name__ == "__main__":
    main()
