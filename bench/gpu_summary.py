"""The summary bench/gpu_check.sh prints after its parts, from what they left under its WORK folder,
each figure beside the target it is checked against (docs/gpu.md):

- per training run: steps and tokens per second (the first step, a warm-up, not counted), the peak
  GPU memory of rank 0, the memory planner's peak (the plan each stage prints at its start) and
  planned / measured - 1, which should lie in [-5%, +15%]: a plan may promise a little more memory
  than a run takes, hardly less;
- GRPO's rollouts: the median seconds of a step's `generate` with --fsdp over without, at most 1.3x
  on one GPU (the gathered weights decode as a plain module, srt/distributed.plain_module);
- our decode loop at K = 8 (bench/gpu_rollouts.sh): a rollout's seconds per new token, prefill
  included, at most 2 ms;
- the test suite's last line.

    python bench/gpu_summary.py runs/gpu_check 1
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

RUNS = ("sft_plain", "sft_fsdp", "grpo_plain", "grpo_fsdp")
PLAN_RANGE = (-0.05, 0.15)
FSDP_ROLLOUTS = 1.3
DECODE_STEP_MS = 2.0
PEAK_LINE = re.compile(r"peak = .*?(\d+\.\d+)\s*$")  # the last line of a stage's memory plan


def read_metrics(folder: Path) -> list[dict]:
    path = folder / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def planned_peak(log: Path) -> float | None:
    if not log.exists():
        return None
    peaks = [float(m.group(1)) for m in map(PEAK_LINE.search, log.read_text().splitlines()) if m]
    return peaks[0] if peaks else None


def check(ok: bool) -> str:
    return "ok" if ok else "OUT OF RANGE"


def run_lines(work: Path, ranks: str) -> list[str]:
    header = f"{'run':<12}{'ranks':>6}{'steps/s':>9}{'tokens/s':>10}{'peak GB':>9}{'planned GB':>12}"
    lines = [header + "  planned/measured"]
    for name in RUNS:
        rows = read_metrics(work / name)
        if not rows:
            lines.append(f"{name:<12} no metrics (failed? see logs/{name}.log)")
            continue
        timed = rows[1:] or rows
        seconds = sum(r["step_s"] for r in timed)
        tokens = sum(r["tokens_per_s"] * r["step_s"] for r in timed)
        measured = max((r.get("peak_gpu_gb") or 0.0) for r in rows) or None
        planned = planned_peak(work / "logs" / f"{name}.log")
        line = f"{name:<12}{ranks:>6}{len(timed) / seconds:>9.2f}{tokens / seconds:>10.0f}"
        line += f"{measured:>9.2f}" if measured else f"{'n/a':>9}"
        line += f"{planned:>12.2f}" if planned is not None else f"{'n/a':>12}"
        if measured and planned is not None:
            gap = planned / measured - 1
            line += f"  {gap:+.1%} ({check(PLAN_RANGE[0] <= gap <= PLAN_RANGE[1])}: [-5%, +15%])"
        lines.append(line)
    return lines


def rollout_line(work: Path) -> str:
    medians = {}
    for mode in ("plain", "fsdp"):
        rows = read_metrics(work / f"grpo_{mode}")
        if rows:
            medians[mode] = statistics.median(r["generate_s"] for r in rows)
    if len(medians) < 2:
        return "GRPO rollouts: no pair of runs to compare"
    ratio = medians["fsdp"] / medians["plain"]
    return (
        f"GRPO rollouts, median seconds a step: {medians['plain']:.3f} plain, {medians['fsdp']:.3f} --fsdp: "
        f"{ratio:.2f}x ({check(ratio <= FSDP_ROLLOUTS)}: at most {FSDP_ROLLOUTS}x on one GPU)"
    )


def decode_line(work: Path) -> str:
    path = work / "rollouts" / "speed" / "results.json"
    if not path.exists():
        return "decode loop: no rollout results"
    results = json.loads(path.read_text())
    tokens = results["config"]["max_new_tokens"]
    for run in results["runs"]:
        if run["K"] == 8:
            ms = 1000 * run["ours"]["seconds"]["median"] / tokens
            return (
                f"decode loop at K = 8: {ms:.2f} ms a new token, prefill included "
                f"({check(ms <= DECODE_STEP_MS)}: at most {DECODE_STEP_MS:g} ms); "
                f"CUDA graph: {run['cuda_graph']}"
            )
    return "decode loop: no run at K = 8"


def tests_line(work: Path) -> str:
    log = work / "logs" / "tests.log"
    if not log.exists():
        return "tests: not run"
    said = [line for line in log.read_text().splitlines() if re.search(r"passed|failed|error", line)]
    return f"tests: {said[-1].split(None, 1)[-1] if said else 'no pytest summary (see logs/tests.log)'}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="bench/gpu_summary.py")
    parser.add_argument("work", type=Path, help="gpu_check.sh's WORK folder: one subfolder a run, and logs/")
    parser.add_argument("ranks", help="the GPUs the runs used (NGPU), as gpu_check.sh passes it")
    args = parser.parse_args(argv)
    lines = [
        *run_lines(args.work, args.ranks),
        rollout_line(args.work),
        decode_line(args.work),
        tests_line(args.work),
    ]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
