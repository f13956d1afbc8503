"""Benchmark: GRPO rollouts with each prompt prefilled once for its K samples (its KV cache copied
to the K rows) against K identical prefills (the prompt repeated K times before `generate`).

Both sides call modeling.generate on the same rendered stage-2 prompts (srt.rollouts.PromptStream
over --data, as stage2_grpo draws them) with the same seed, K, temperature and token cap; the only
difference is prefill_once. Sides alternate within each repeat, so a slow spell of a shared
machine falls on both. Reported per side: the median wall seconds of one rollout, the generated
tokens per second, and the prompt and generated tokens actually processed (from the outputs, not
from the flags), so both sides are seen to do the same work.

    python bench/rollout_prefill.py --model runs/demo/sft/final --data runs/data/train.jsonl
    python bench/rollout_prefill.py --model tiny-random --synthetic 20 --repeats 1 --max-new-tokens 8

Writes <out>/results.json and <out>/results.md (default runs/bench/rollout_prefill).
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

from measure import bench_records, describe, machine, machine_line, write_results  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument(
        "--model", default="runs/demo/sft/final", help="policy: a folder, an HF id, smollm2-135m, tiny-random"
    )
    p.add_argument("--data", default="runs/data/train.jsonl", help="stage-0 JSONL the prompts come from")
    p.add_argument(
        "--synthetic", type=int, default=0, help="build this many synthetic dialogues instead of --data"
    )
    p.add_argument("--prompts", type=int, default=2, help="prompts per rollout (stage 2's prompts per step)")
    p.add_argument("-K", "--num-generations", type=int, default=4, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=64, help="token cap per sample")
    p.add_argument("--max-prompt-length", type=int, default=1536, help="as stage 2's cpu-demo preset")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=3, help="timed rollouts per side (after one warm-up each)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/bench/rollout_prefill")
    return p


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    import torch

    from srt import modeling
    from srt.data_io import DataError
    from srt.rollouts import PromptStream

    model, tokenizer = modeling.load_model_and_tokenizer(args.model, dtype="float32")
    records = bench_records(args.data, args.synthetic, "train")
    try:
        stream = PromptStream(records, tokenizer, args.max_prompt_length, args.seed)
        prompts = [prompt for _, prompt in stream.next_batch(args.prompts)]
    except DataError as e:
        sys.exit(f"error: {e}")

    def rollout(prefill_once: bool) -> dict:
        torch.manual_seed(args.seed)
        start = time.perf_counter()
        out = modeling.generate(
            model,
            tokenizer,
            prompts,
            max_new_tokens=args.max_new_tokens,
            num_generations=args.num_generations,
            temperature=args.temperature,
            prefill_once=prefill_once,
        )
        seconds = time.perf_counter() - start
        return {
            "seconds": seconds,
            "generated": int(out["completion_mask"].sum()),
            "prompt_tokens": int(out["prompt_mask"].sum()),
            "rows": out["completion_ids"].shape[0],
            "ids": out["completion_ids"],
        }

    sides = {"prefill once": True, "K prefills": False}
    for flag in sides.values():
        rollout(flag)  # warm-up
    runs = {name: [] for name in sides}
    for _ in range(args.repeats):
        for name, flag in sides.items():
            runs[name].append(rollout(flag))
    # The same work on both sides: the same rows, prompt tokens, and (same seed) sampled tokens.
    first = {name: rows[0] for name, rows in runs.items()}
    same_samples = torch.equal(first["prefill once"]["ids"], first["K prefills"]["ids"])
    results = {"machine": machine(), "config": vars(args), "same_samples": same_samples, "sides": {}}
    for name, rows in runs.items():
        seconds = describe([r["seconds"] for r in rows])
        generated = rows[0]["generated"]
        results["sides"][name] = {
            "seconds": seconds,
            "generated_tokens": generated,
            "prompt_tokens_per_row": rows[0]["prompt_tokens"] / rows[0]["rows"],
            "rows": rows[0]["rows"],
            "tokens_per_s": generated / seconds["median"],
        }
    ratio = (
        results["sides"]["prefill once"]["seconds"]["median"]
        / results["sides"]["K prefills"]["seconds"]["median"]
    )
    results["time_ratio_once_over_k"] = ratio
    lines = [
        "# Rollouts: prefill once vs K prefills\n",
        machine_line(results["machine"]) + "\n",
        f"{args.prompts} prompts x K = {args.num_generations}, up to {args.max_new_tokens} new tokens, "
        f"T = {args.temperature}, {args.repeats} timed repeats per side (median).\n",
        "| Side | rows | prompt tokens per row | generated tokens | rollout s (median) "
        "| generated tokens/s |",
        "|---|---|---|---|---|---|",
    ]
    for name, side in results["sides"].items():
        lines.append(
            f"| {name} | {side['rows']} | {side['prompt_tokens_per_row']:.0f} | {side['generated_tokens']} | "
            f"{side['seconds']['median']:.2f} | {side['tokens_per_s']:.1f} |"
        )
    lines.append(
        f"\nTime ratio prefill once / K prefills: {ratio:.2f}. Same sampled tokens under one seed: "
        f"{same_samples} (fp32 kernels may differ in the last bit between the two shapes, so False "
        "with equal lengths is possible; see tests/test_stage2.py for the exactness check)."
    )
    write_results(Path(args.out), "results", results, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
