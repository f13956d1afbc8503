"""Pool GRPO replicates: the gain over the SFT start, per replicate and over all of them.

Reads any number of result.json files of bench/grpo_replicate.py. Per replicate, its paired
differences as the replicate computed them (GRPO - start, placebo - start, GRPO - placebo). Pooled,
the mean of the replicates' gains, each replicate weighing the same whatever its number of queries,
with two 95% intervals side by side:

- a two-level bootstrap: each resample draws the replicates with replacement and one draw of the
  queries. Replicates that answered the same queries (the same ids, as the recipe's do) share that
  draw: a hard query is hard for every replicate, and drawing it for one replicate and not for
  another would count the same query noise once per replicate and widen nothing real. Replicates
  on other queries get a draw each.
- a t(R-1) interval over the R replicates' means: the runs are the units, the queries' noise is
  inside each mean.

20,000 resamples by default. A bound whose sign changes with the bootstrap's seed (checked over
--sign-seeds seeds) is printed "borderline": it is not a result either way. A comparison that only
one replicate holds is labelled "one run, queries only" and gets no verdict.

    python bench/pool_replicates.py runs/replicate-1/result.json runs/replicate-2/result.json \\
        runs/replicate-3/result.json

Writes <out>/pooled.json, <out>/pooled.md and <out>/pooled.png (default runs/bench/pool_replicates):
each replicate's gain with its interval, the pooled one, and the placebo.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
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

RESAMPLES = 20_000  # at 2,000 a pooled bound near 0 changed its sign with the bootstrap's seed
SIGN_SEEDS = 5  # bootstrap seeds over which a bound's sign is checked
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
    p.add_argument("--resamples", type=at_least(1000), default=RESAMPLES, help="bootstrap resamples")
    p.add_argument("--seed", type=at_least(0), default=0, help="the bootstrap's seed")
    p.add_argument(
        "--sign-seeds",
        type=at_least(1),
        default=SIGN_SEEDS,
        help="bootstrap seeds over which each pooled bound's sign is checked (1: not checked)",
    )
    p.add_argument("--out", default="runs/bench/pool_replicates")
    return p


def query_differences(per_query: dict, measure: str, base: str, other: str) -> np.ndarray | None:
    """other - base per query, in the order of per_query["ids"], NaN where either lacks the measure
    (as compare_variants pairs them); None when the replicate has no such model."""
    if base not in per_query or other not in per_query:
        return None
    return np.array(
        [
            np.nan if a is None or b is None else b - a
            for a, b in zip(per_query[base][measure], per_query[other][measure])
        ],
        dtype=float,
    )


def t_interval(means, confidence: float = 0.95) -> dict:
    """mean +- t(R-1) * SD / sqrt(R) over the replicates' means; none from one replicate."""
    from scipy.stats import t as student_t

    means = np.asarray(means, dtype=float)
    if means.size < 2:
        return {"low": None, "high": None, "sd": None}
    sd = float(means.std(ddof=1))
    half = float(student_t.ppf((1 + confidence) / 2, means.size - 1)) * sd / np.sqrt(means.size)
    return {"low": float(means.mean() - half), "high": float(means.mean() + half), "sd": sd}


def pooled_gain(
    diffs: list[np.ndarray],
    resamples: int = RESAMPLES,
    seed: int = 0,
    confidence: float = 0.95,
    ids: list[list[str]] | None = None,
) -> dict:
    """The mean over replicates of each replicate's mean per-query difference (NaN: no value), the
    percentile interval of a two-level bootstrap (per resample, R replicates drawn with replacement,
    then the queries: one draw shared by all when `ids` says the replicates answered the same queries,
    otherwise one per drawn slot), and the t(R-1) interval over the replicates' means."""
    keep = [i for i, d in enumerate(diffs) if d is not None and np.isfinite(d).any()]
    diffs = [np.asarray(diffs[i], dtype=float) for i in keep]
    if not diffs:
        return {"diff": None, "low": None, "high": None, "replicates": 0, "resamples": resamples}
    shared = ids is not None and all(list(ids[i]) == list(ids[keep[0]]) for i in keep)
    rng = np.random.default_rng(seed)
    R = len(diffs)
    drawn = rng.integers(0, R, size=(resamples, R))  # which replicate fills each slot of a resample
    if shared:
        table = np.vstack(diffs)  # R x n, the same queries in the same order
        pooled = np.empty(resamples)
        for start in range(0, resamples, 1000):  # chunks: 1000 x R x n values at a time
            stop = min(start + 1000, resamples)
            queries = rng.integers(0, table.shape[1], size=(stop - start, table.shape[1]))
            picked = table[drawn[start:stop, :, None], queries[:, None, :]]
            with np.errstate(invalid="ignore"), warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # a draw of only missing values
                pooled[start:stop] = np.nanmean(np.nanmean(picked, axis=2), axis=1)
    else:
        values = [d[np.isfinite(d)] for d in diffs]
        means = np.empty((resamples, R))
        for i, d in enumerate(values):  # every slot that drew replicate i gets its own query resample
            slots = drawn == i
            means[slots] = d[rng.integers(0, d.size, size=(int(slots.sum()), d.size))].mean(axis=1)
        pooled = means.mean(axis=1)
    tail = 100 * (1 - confidence) / 2
    low, high = np.nanpercentile(pooled, [tail, 100 - tail])
    replicate_means = [float(np.nanmean(d)) for d in diffs]
    return {
        "diff": float(np.mean(replicate_means)),
        "low": float(low),
        "high": float(high),
        "replicates": R,
        "resamples": resamples,
        "shared_queries": bool(shared),
        "t": t_interval(replicate_means, confidence),
    }


def bound_signs(diffs, ids, resamples: int, seeds: int) -> dict:
    """The bootstrap's bounds under `seeds` seeds of the bootstrap: "borderline" where a bound's sign
    (above 0 or not, below 0 or not) changes from seed to seed."""
    runs = [pooled_gain(diffs, resamples, seed, ids=ids) for seed in range(seeds)]
    lows, highs = [r["low"] for r in runs], [r["high"] for r in runs]
    flips = len({low > 0 for low in lows}) > 1 or len({high < 0 for high in highs}) > 1
    return {"low_range": [min(lows), max(lows)], "high_range": [min(highs), max(highs)], "borderline": flips}


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


def pool(results: list[dict], resamples: int, seed: int, sign_seeds: int = SIGN_SEEDS) -> dict:
    """comparison -> measure -> pooled_gain over the replicates that hold that comparison, with the
    bootstrap bounds' stability over `sign_seeds` bootstrap seeds."""
    pooled = {}
    for name, (base, other) in COMPARISONS.items():
        per_measure = {}
        for measure in MEASURES:
            holding = [r for r in results if base in r["per_query"] and other in r["per_query"]]
            diffs = [query_differences(r["per_query"], measure, base, other) for r in holding]
            ids = [r["per_query"].get("ids") for r in holding]
            ids = ids if all(i is not None for i in ids) else None
            gain = pooled_gain(diffs, resamples, seed, ids=ids)
            if gain["replicates"] > 1 and sign_seeds > 1:
                gain["signs"] = bound_signs(diffs, ids, resamples, sign_seeds)
            per_measure[measure] = gain
        if per_measure["jaccard"]["replicates"]:
            pooled[name] = per_measure
    return pooled


def borderline(gain: dict) -> bool:
    return bool(gain.get("signs", {}).get("borderline"))


def verdict(pooled: dict) -> dict:
    """The decision rule on the pooled gain: the Jaccard interval above 0 and above the placebo
    (GRPO - placebo above 0, where at least two replicates ran a placebo: one is one run, and a
    verdict over runs needs runs), F1 not lower by more than 2 points. A bound whose sign depends
    on the bootstrap's seed gives no verdict: "borderline"."""
    gain = pooled["grpo-start"]
    above_zero = gain["jaccard"]["low"] is not None and gain["jaccard"]["low"] > 0
    versus = pooled.get("grpo-placebo", {}).get("jaccard")
    above_placebo = None if versus is None or versus["replicates"] < 2 else bool(versus["low"] > 0)
    f1_kept = gain["f1"]["diff"] is not None and gain["f1"]["diff"] >= -MAX_F1_DROP
    return {
        "jaccard_above_zero": bool(above_zero),
        "jaccard_above_zero_borderline": borderline(gain["jaccard"]),
        "jaccard_above_placebo": above_placebo,
        "placebo_replicates": 0 if versus is None else versus["replicates"],
        "f1_within_2_points": bool(f1_kept),
        "passes": bool(
            above_zero and f1_kept and above_placebo is not False and not borderline(gain["jaccard"])
        ),
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
    text = f"{100 * d['diff']:+.1f} [{100 * d['low']:+.1f}, {100 * d['high']:+.1f}]"
    if d.get("t", {}).get("low") is not None:
        text += f"; t [{100 * d['t']['low']:+.1f}, {100 * d['t']['high']:+.1f}]"
    return text + (" **borderline**" if borderline(d) else "")


def pooled_label(per_measure: dict) -> str:
    count = per_measure["jaccard"]["replicates"]
    if count == 1:
        return "**one run, queries only**"
    shared = "one query draw shared" if per_measure["jaccard"].get("shared_queries") else "query draws apart"
    return f"**pooled, {plural(count, 'replicate')}** ({shared})"


def table(results: list[dict], paths: list[str], pooled: dict, decision: dict) -> str:
    lines = [
        "| replicate | comparison | queries | "
        + " | ".join(f"{LABELS[m]} [95% over queries]" for m in MEASURES)
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
            f"| {pooled_label(per_measure)} | {name} | - | "
            + " | ".join(_ci(per_measure[m]) for m in MEASURES)
            + " |"
        )
    resamples = next(iter(pooled.values()))["jaccard"]["resamples"]
    above, placebos = decision["jaccard_above_placebo"], decision["placebo_replicates"]
    zero = (
        "borderline"
        if decision["jaccard_above_zero_borderline"]
        else "yes"
        if decision["jaccard_above_zero"]
        else "no"
    )
    placebo = (
        "-"
        if placebos == 0
        else "no verdict (one replicate ran a placebo: one run, queries only)"
        if above is None
        else "yes"
        if above
        else "no"
    )
    lines += [
        "",
        "A replicate's row: its paired bootstrap over its queries (one run). A pooled row: the mean of "
        f"the replicates' means; in brackets the two-level bootstrap ({resamples} resamples: replicates, "
        "then queries), after 't' the t(R-1) interval over the replicates' means; **borderline**: a bound "
        "whose sign changes with the bootstrap's seed.",
        "",
        f"Pooled Jaccard gain above 0: {zero}; above the placebo: {placebo}; F1 not lower by more than 2 "
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
    rows += [
        (
            "pooled" if pooled[name]["jaccard"]["replicates"] > 1 else "one run, queries only",
            name,
            pooled[name],
        )
        for name in ("grpo-start", "placebo-start")
        if name in pooled
    ]
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
    pooled = pool(results, args.resamples, args.seed, args.sign_seeds)
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
