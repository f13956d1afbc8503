"""Pool GRPO replicates: the gain over the SFT start, per replicate and over all of them.

Reads any number of result.json files of bench/grpo_replicate.py. Per replicate, its paired
differences as the replicate computed them (GRPO - start, placebo - start, GRPO - placebo). Pooled,
the mean of the replicates' gains, each replicate weighing the same whatever its number of queries,
with a two-level bootstrap 95% interval: each resample draws the replicates with replacement and,
within each drawn replicate, its queries with replacement, so the interval holds both the spread
between replicates (SFT seed and GRPO seed) and the noise of a finite dev set. A replicate drawn twice
gets two independent query draws.

    python bench/pool_replicates.py runs/replicate-1/result.json runs/replicate-2/result.json \\
        runs/replicate-3/result.json

Writes <out>/pooled.json, <out>/pooled.md and <out>/pooled.png (default runs/bench/pool_replicates):
each replicate's gain with its interval, the pooled one, and the placebo.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
for _path in (str(ROOT), str(BENCH)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from grpo_seeds import MAX_F1_DROP  # noqa: E402
from measure import check_out, write_results  # noqa: E402

from srt.config import at_least  # noqa: E402

MEASURES = ("jaccard", "f1", "accuracy", "right_without_recall")
LABELS = {
    "jaccard": "Δ recall Jaccard",
    "f1": "Δ F1",
    "accuracy": "Δ accuracy",
    "right_without_recall": "Δ right answer, recall missed H*",
}
# comparison -> (the model whose values are subtracted, the other)
COMPARISONS = {
    "grpo-start": ("start", "grpo"),
    "placebo-start": ("start", "placebo"),
    "grpo-placebo": ("placebo", "grpo"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("results", nargs="+", help="result.json files of bench/grpo_replicate.py")
    p.add_argument("--resamples", type=at_least(1000), default=2000, help="bootstrap resamples")
    p.add_argument("--seed", type=at_least(0), default=0, help="the bootstrap's seed")
    p.add_argument("--out", default="runs/bench/pool_replicates")
    return p


def query_differences(per_query: dict, measure: str, base: str, other: str) -> np.ndarray | None:
    """other - base per query, the queries where both have the measure (as compare_variants pairs
    them); None when the replicate has no such model."""
    if base not in per_query or other not in per_query:
        return None
    pairs = [
        (a, b)
        for a, b in zip(per_query[base][measure], per_query[other][measure])
        if a is not None and b is not None
    ]
    return np.array([b - a for a, b in pairs], dtype=float)


def pooled_gain(
    diffs: list[np.ndarray], resamples: int = 2000, seed: int = 0, confidence: float = 0.95
) -> dict:
    """The mean over replicates of each replicate's mean per-query difference, and the percentile
    interval of a two-level bootstrap: per resample, R replicates drawn with replacement, then each
    drawn replicate's n_i queries drawn with replacement (independently for every draw)."""
    diffs = [np.asarray(d, dtype=float) for d in diffs if d is not None and len(d)]
    if not diffs:
        return {"diff": None, "low": None, "high": None, "replicates": 0, "resamples": resamples}
    rng = np.random.default_rng(seed)
    R = len(diffs)
    drawn = rng.integers(0, R, size=(resamples, R))  # which replicate fills each slot of a resample
    means = np.empty((resamples, R))
    for i, d in enumerate(diffs):  # every slot that drew replicate i gets its own query resample
        slots = drawn == i
        means[slots] = d[rng.integers(0, d.size, size=(int(slots.sum()), d.size))].mean(axis=1)
    pooled = means.mean(axis=1)
    tail = 100 * (1 - confidence) / 2
    low, high = np.percentile(pooled, [tail, 100 - tail])
    return {
        "diff": float(np.mean([d.mean() for d in diffs])),
        "low": float(low),
        "high": float(high),
        "replicates": R,
        "resamples": resamples,
    }


def read_result(path: str) -> dict:
    try:
        result = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        sys.exit(f"error: {path}: {e}")
    for field in ("seed", "differences", "per_query"):
        if field not in result:
            sys.exit(f"error: {path}: no field {field!r}; is it a result.json of bench/grpo_replicate.py?")
    return result


def check_distinct(paths: list[str], results: list[dict]) -> None:
    """Each replicate pooled once: one file named twice, or two copies of one result, would count
    one replicate as two and narrow the interval for nothing."""
    seen = {}
    for path, result in zip(paths, results):
        for key in (f"path {Path(path).resolve()}", "result " + json.dumps(result, sort_keys=True)):
            if key in seen:
                sys.exit(f"error: {seen[key]} and {path} are one replicate; give each replicate once")
            seen[key] = path


def pool(results: list[dict], resamples: int, seed: int) -> dict:
    """comparison -> measure -> pooled_gain over the replicates that hold that comparison."""
    pooled = {}
    for name, (base, other) in COMPARISONS.items():
        per_measure = {}
        for measure in MEASURES:
            diffs = [query_differences(r["per_query"], measure, base, other) for r in results]
            per_measure[measure] = pooled_gain([d for d in diffs if d is not None], resamples, seed)
        if per_measure["jaccard"]["replicates"]:
            pooled[name] = per_measure
    return pooled


def verdict(pooled: dict) -> dict:
    """The decision rule on the pooled gain: the Jaccard interval above 0 and above the placebo
    (GRPO - placebo above 0, where a placebo ran), F1 not lower by more than 2 points."""
    gain = pooled["grpo-start"]
    above_zero = gain["jaccard"]["low"] is not None and gain["jaccard"]["low"] > 0
    versus = pooled.get("grpo-placebo", {}).get("jaccard")
    above_placebo = None if versus is None else bool(versus["low"] > 0)
    f1_kept = gain["f1"]["diff"] is not None and gain["f1"]["diff"] >= -MAX_F1_DROP
    return {
        "jaccard_above_zero": bool(above_zero),
        "jaccard_above_placebo": above_placebo,
        "f1_within_2_points": bool(f1_kept),
        "passes": bool(above_zero and f1_kept and above_placebo is not False),
    }


def replicate_name(path: str) -> str:
    """runs/replicate-k8-2/result.json -> replicate-k8-2; a kept copy, k8-seed-2.json -> k8-seed-2."""
    path = Path(path)
    return path.parent.name if path.name == "result.json" else path.stem


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def _ci(d: dict | None) -> str:
    if d is None or d.get("diff") is None:
        return "-"
    return f"{100 * d['diff']:+.1f} [{100 * d['low']:+.1f}, {100 * d['high']:+.1f}]"


def table(results: list[dict], paths: list[str], pooled: dict, decision: dict) -> str:
    lines = [
        "| replicate | comparison | queries | "
        + " | ".join(f"{LABELS[m]} [95% CI]" for m in MEASURES)
        + " |",
        "|---|---|---|" + "---|" * len(MEASURES),
    ]
    for path, r in zip(paths, results):
        for name, d in r["differences"].items():
            lines.append(
                f"| seed {r['seed']} ({replicate_name(path)}) | {name} | {d.get('n', '-')} | "
                + " | ".join(_ci(d.get(m)) for m in MEASURES)
                + " |"
            )
    for name, per_measure in pooled.items():
        lines.append(
            f"| **pooled, {plural(per_measure['jaccard']['replicates'], 'replicate')}** | {name} | - | "
            + " | ".join(_ci(per_measure[m]) for m in MEASURES)
            + " |"
        )
    above = decision["jaccard_above_placebo"]
    lines += [
        "",
        f"Pooled Jaccard gain above 0: {'yes' if decision['jaccard_above_zero'] else 'no'}; above the "
        f"placebo: {'-' if above is None else 'yes' if above else 'no'}; F1 not lower by more than 2 "
        f"points: {'yes' if decision['f1_within_2_points'] else 'no'}. Passes: "
        f"{'yes' if decision['passes'] else 'no'}.",
    ]
    return "\n".join(lines)


def plot(results: list[dict], pooled: dict, path: Path) -> None:
    """Δ recall Jaccard and Δ F1 (points), one row per replicate and comparison, then the pooled rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [
        (f"seed {r['seed']}", name, d)
        for r in results
        for name, d in r["differences"].items()
        if name != "grpo-placebo"
    ]
    rows += [("pooled", name, pooled[name]) for name in ("grpo-start", "placebo-start") if name in pooled]
    colors = {"grpo-start": "tab:blue", "placebo-start": "tab:gray"}
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.45 * len(rows) + 1.6), sharey=True)
    for ax, measure in zip(axes, ("jaccard", "f1")):
        for y, (who, name, d) in enumerate(reversed(rows)):
            m = d[measure]
            if m is None or m.get("diff") is None:
                continue
            bold = who == "pooled"
            ax.errorbar(
                100 * m["diff"],
                y,
                xerr=[[100 * (m["diff"] - m["low"])], [100 * (m["high"] - m["diff"])]],
                fmt="D" if bold else "o",
                color=colors[name],
                markersize=8 if bold else 5,
                capsize=3,
                linewidth=2.5 if bold else 1.2,
            )
        ax.axvline(0, color="black", linewidth=0.8)
        ax.set_title(f"{LABELS[measure]} (points, 95% CI)")
        ax.set_yticks(range(len(rows)), [f"{who}: {name}" for who, name, _ in reversed(rows)])
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    check_out(args.out)
    results = [read_result(p) for p in args.results]
    check_distinct(args.results, results)
    pooled = pool(results, args.resamples, args.seed)
    if "grpo-start" not in pooled:
        sys.exit("error: no replicate holds a GRPO - start comparison with per-query values")
    decision = verdict(pooled)
    markdown = table(results, args.results, pooled, decision)
    out = Path(args.out)
    payload = {
        "results": args.results,
        "replicates": [
            {"seed": r["seed"], "differences": r["differences"], "passes": r.get("passes")} for r in results
        ],
        "pooled": pooled,
        "verdict": decision,
    }
    write_results(out, "pooled", payload, markdown)
    plot(results, pooled, out / "pooled.png")
    print(markdown)
    print(f"\nwritten: {out / 'pooled.json'}, {out / 'pooled.md'}, {out / 'pooled.png'}")
    return payload


if __name__ == "__main__":
    main()
