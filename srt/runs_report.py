"""The runs report: one comparison over several training runs, each run shown, then what they share.

One evaluation (evaluate.py) answers the test queries with one trained checkpoint per side, so its
intervals resample those queries and nothing else: they say how sure we are about *that* pair of
checkpoints. Train again with another seed and, at 135M parameters, the control-minus-SRT accuracy
moves by as much as its query interval is wide. A claim about the methods needs the spread between
training runs, so this report reads K paired runs (each a seed: SRT and its control trained on the
seed's batches, both answering the same test queries) and gives

- per run: SRT's recall Jaccard with its query interval, SRT's and the control's accuracy, and
  their difference with the paired bootstrap interval over the queries (as report.md has it);
- across runs: the mean of the K per-run values, their SD, a t(K-1) 95% interval for the mean over
  runs (runs are the units: the interval is mean +- t * SD / sqrt(K)), min-max, and how many runs
  each side won (by point estimate, and with its query interval excluding 0);
- a picture: one point per run with its query interval, for the accuracy difference and for the
  Jaccard, the mean over runs with its t interval beneath (Agarwal et al. 2021: with few runs, show
  every run).

    python -m srt.runs_report --out runs/demo/runs --base runs/demo/eval-base \\
        "seed 1=runs/demo/seed-1/eval" "seed 2=runs/demo/seed-2/eval" docs/experiments/demo-runs/runs.json

A run is an evaluate.py folder (LABEL=FOLDER, its SRT and control named by --srt and --control) or
the runs.json of an earlier report (all its runs), so that runs measured on different days pool.
All runs must have answered the same queries of the same test file. Writes runs.json (every run,
with its per-query values), runs.md, runs.png and spread.json (what evaluate.py --runs-spread
prints beside a single run's difference).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

from srt.config import add_out
from srt.data_io import DataError, atomic_write_text, read_jsonl, write_json
from srt.metrics import mcnemar_exact, paired_bootstrap

RESAMPLES = 2000  # the same query bootstrap as report.md's Table 2, so a run's row reads as it does there


# --------------------------------------------------------------------------------------------
# One run: its per-query values and its own (query) intervals
# --------------------------------------------------------------------------------------------
class RunsError(ValueError):
    """Bad input, said in one line naming the file and what is wrong."""


def mean_interval(values, resamples: int = RESAMPLES, seed: int = 0) -> dict:
    """A mean over queries with its percentile bootstrap 95% interval (queries resampled)."""
    values = np.asarray(values, dtype=float)
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, values.size, size=(resamples, values.size))].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return {"mean": float(values.mean()), "low": float(low), "high": float(high), "n": int(values.size)}


def read_eval(label: str, folder: str, srt: str, control: str) -> dict:
    """One run from an evaluate.py folder: the queries that need recall (Table 2's headline), SRT's and
    the control's correctness on each, SRT's Jaccard on each."""
    folder = Path(folder)
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise RunsError(f"{folder / 'config.json'}: {e}; is {folder} an evaluate.py output folder?") from e
    rows = {}
    for side in (srt, control):
        path = folder / f"{side}.jsonl"
        if not path.exists():
            raise RunsError(f"{path}: missing; the run has no variant {side!r} (--srt / --control)")
        try:
            rows[side] = {r["id"]: r for r in read_jsonl(path, validate=False) if r.get("needs_recall", True)}
        except (DataError, OSError, KeyError) as e:
            raise RunsError(f"{path}: {e}") from e
    ids = sorted(set(rows[srt]) & set(rows[control]))
    if not ids:
        raise RunsError(f"{folder}: {srt} and {control} share no query that needs recall")
    for side in (srt, control):
        unscored = [i for i in ids if rows[side][i].get("accuracy") is None]
        if unscored:
            raise RunsError(f"{folder / (side + '.jsonl')}: query {unscored[0]}: no field 'accuracy'")
    return {
        "label": label,
        "source": str(folder),
        "data_sha256": config.get("data_sha256"),
        "ids": ids,
        "srt_correct": [int(bool(rows[srt][i]["accuracy"])) for i in ids],
        "control_correct": [int(bool(rows[control][i]["accuracy"])) for i in ids],
        "srt_jaccard": [rows[srt][i].get("jaccard") for i in ids],
        # the cost of a query in tokens the model generates: machine-independent, unlike seconds
        "srt_tokens": [rows[srt][i].get("generated_tokens") for i in ids],
        "control_tokens": [rows[control][i].get("generated_tokens") for i in ids],
    }


def run_statistics(run: dict, resamples: int = RESAMPLES) -> dict:
    """A run's row: accuracies, Δ accuracy (control - SRT, report.md's sign) with its paired query
    interval and McNemar's test, and SRT's Jaccard with its query interval."""
    jaccard = [j for j in run["srt_jaccard"] if j is not None]

    def mean_tokens(side):
        tokens = [t for t in run.get(f"{side}_tokens", []) if t is not None]
        return float(np.mean(tokens)) if tokens else None

    return {
        "n": len(run["ids"]),
        "srt_accuracy": float(np.mean(run["srt_correct"])),
        "control_accuracy": float(np.mean(run["control_correct"])),
        "delta": paired_bootstrap(run["srt_correct"], run["control_correct"], resamples, seed=0),
        "mcnemar": mcnemar_exact(run["srt_correct"], run["control_correct"]),
        "jaccard": mean_interval(jaccard, resamples) if jaccard else None,
        "srt_tokens": mean_tokens("srt"),
        "control_tokens": mean_tokens("control"),
    }


# --------------------------------------------------------------------------------------------
# Across runs: the runs are the units
# --------------------------------------------------------------------------------------------
def across_runs(values) -> dict:
    """Mean, SD (n - 1), the t(n-1) 95% interval of the mean over runs, min and max. With one run
    there is no spread to measure: SD and the interval are None."""
    from scipy.stats import t as student_t

    values = np.asarray(values, dtype=float)
    k = values.size
    out = {"mean": float(values.mean()), "min": float(values.min()), "max": float(values.max()), "runs": k}
    if k < 2:
        return {**out, "sd": None, "low": None, "high": None}
    sd = float(values.std(ddof=1))
    half = float(student_t.ppf(0.975, k - 1)) * sd / math.sqrt(k)
    return {**out, "sd": sd, "low": out["mean"] - half, "high": out["mean"] + half}


def mean_of(values) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.mean(values)) if values else None


def wins(deltas: list[dict]) -> dict:
    """How many runs each side won: by the point estimate, and with the run's query interval
    excluding 0. Δ is control - SRT, so a positive Δ is a run the control won."""
    return {
        "control": sum(d["diff"] > 0 for d in deltas),
        "srt": sum(d["diff"] < 0 for d in deltas),
        "even": sum(d["diff"] == 0 for d in deltas),
        "control_interval_above_0": sum(d["low"] > 0 for d in deltas),
        "srt_interval_below_0": sum(d["high"] < 0 for d in deltas),
    }


def summarize(runs: list[dict], resamples: int = RESAMPLES) -> dict:
    rows = [{"label": r["label"], "source": r["source"], **run_statistics(r, resamples)} for r in runs]
    jaccards = [row["jaccard"]["mean"] for row in rows if row["jaccard"]]
    return {
        "runs": rows,
        "across": {
            "delta_accuracy": across_runs([row["delta"]["diff"] for row in rows]),
            "jaccard": across_runs(jaccards) if jaccards else None,
            "srt_accuracy": across_runs([row["srt_accuracy"] for row in rows]),
            "control_accuracy": across_runs([row["control_accuracy"] for row in rows]),
            "srt_tokens": mean_of([row["srt_tokens"] for row in rows]),
            "control_tokens": mean_of([row["control_tokens"] for row in rows]),
            # the typical width of one run's query interval, to set beside the SD between runs
            "query_se_delta": float(np.mean([(r["delta"]["high"] - r["delta"]["low"]) / 3.92 for r in rows])),
        },
        "wins": wins([row["delta"] for row in rows]),
    }


# --------------------------------------------------------------------------------------------
# A speed lever against the lesson's runs: the rule of demo.md, written before any lever ran
# --------------------------------------------------------------------------------------------
MIN_RUNS = 3  # fewer runs have no spread of their own worth reading
MIN_JACCARD = 0.40  # every run must still learn to recall


def judge_lever(report: dict, runs: list[dict], reference: dict, source: str = "spread.json") -> dict:
    """demo.md, "When a speed lever may become the lesson's default": over at least 3 paired seeds
    of the reference runs, the lever's mean Jaccard and its mean Δ (control - SRT) each lie within
    one SD (between the reference runs) of the reference's mean, and every lever run recalls with
    Jaccard >= 40%. Wall time is the rule's last condition; it is measured side by side, outside
    these folders, and left to the caller."""
    if reference.get("data_sha256") != runs[0]["data_sha256"]:
        raise RunsError(
            f"{source}: measured on another test file (data_sha256 differs); the runs do not pair"
        )
    unknown = [r["label"] for r in runs if r["label"] not in reference.get("runs", [])]
    if unknown:
        raise RunsError(
            f"{source}: holds no run labelled {unknown[0]!r}; judge a lever on the reference's seeds"
        )
    checks = []
    for name, key in (("mean recall Jaccard", "jaccard"), ("mean Δ accuracy", "delta_accuracy")):
        ref, got = reference[key], report["across"][key]
        if ref is None or ref.get("sd") is None or got is None:
            raise RunsError(f"{source}: no spread for {key}; the reference needs at least 2 runs")
        low, high = ref["mean"] - ref["sd"], ref["mean"] + ref["sd"]
        checks.append({"check": f"{name} within one SD of the reference's", "value": got["mean"],
                       "low": low, "high": high, "passed": low <= got["mean"] <= high})  # fmt: skip
    lowest = min(r["jaccard"]["mean"] for r in report["runs"])
    checks.append({"check": f"every run's Jaccard at least {MIN_JACCARD:.0%}", "value": lowest,
                   "low": MIN_JACCARD, "high": None, "passed": lowest >= MIN_JACCARD})  # fmt: skip
    checks.append({"check": f"at least {MIN_RUNS} paired seeds", "value": len(runs),
                   "low": MIN_RUNS, "high": None, "passed": len(runs) >= MIN_RUNS})  # fmt: skip
    return {"reference": source, "checks": checks, "passed": all(c["passed"] for c in checks)}


def judge_markdown(verdict: dict) -> str:
    lines = [
        f"Against the lesson's rule (demo.md), reference {verdict['reference']}:",
        "",
        "| check | this lever | bound | passed |",
        "|---|---|---|---|",
    ]
    for c in verdict["checks"]:
        if c["check"].startswith("at least"):
            value, bound = str(c["value"]), f">= {c['low']}"
        elif c["high"] is None:
            value, bound = _pts(c["value"]), f">= {_pts(c['low'])}"
        else:
            signed = "Δ" in c["check"]
            value, bound = _pts(c["value"], signed), f"[{_pts(c['low'], signed)}, {_pts(c['high'], signed)}]"
        lines.append(f"| {c['check']} | {value} | {bound} | {'yes' if c['passed'] else '**no**'} |")
    outcome = "passes" if verdict["passed"] else "**fails**"
    lines += ["", f"Verdict on recall and answers: {outcome}; the rule's last condition, a lower wall time "
              "side by side, is measured apart."]  # fmt: skip
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Input: evaluate folders and earlier reports, checked to pair
# --------------------------------------------------------------------------------------------
def load_runs(specs: list[str], srt: str, control: str) -> list[dict]:
    runs = []
    for spec in specs:
        if "=" in spec:
            label, folder = spec.split("=", 1)
            if not label.strip():
                raise RunsError(
                    f"{spec!r}: an empty label; write LABEL=FOLDER, e.g. 'seed 1=runs/demo/seed-1/eval'"
                )
            runs.append(read_eval(label.strip(), folder, srt, control))
            continue
        try:
            earlier = json.loads(Path(spec).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise RunsError(f"{spec}: {e}; give LABEL=FOLDER or the runs.json of an earlier report") from e
        if not isinstance(earlier, dict) or not isinstance(earlier.get("per_query"), list):
            raise RunsError(f"{spec}: no field 'per_query'; is it the runs.json of srt.runs_report?")
        runs += earlier["per_query"]
    check_paired(runs)
    return runs


def check_paired(runs: list[dict]) -> None:
    """The runs pair only if they answered the same queries of the same test file, each once."""
    if not runs:
        raise RunsError("no runs given")
    first = runs[0]
    labels = set()
    for run in runs:
        if run["label"] in labels:
            raise RunsError(
                f"{run['source']}: the label {run['label']!r} is given twice; label each run once"
            )
        labels.add(run["label"])
        if run["data_sha256"] != first["data_sha256"]:
            raise RunsError(
                f"{run['source']}: answered another test file than {first['source']} (data_sha256 differs)"
            )
        if run["ids"] != first["ids"]:
            raise RunsError(
                f"{run['source']}: answered other queries than {first['source']}; the runs do not pair"
            )


def read_reference(path: str) -> dict:
    try:
        reference = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise RunsError(f"{path}: {e}") from e
    if not isinstance(reference, dict) or not {"data_sha256", "runs", "jaccard", "delta_accuracy"} <= set(
        reference
    ):
        raise RunsError(
            f"{path}: not the spread.json of srt.runs_report (data_sha256, runs, jaccard, delta_accuracy)"
        )
    return reference


def read_base(folder: str | None) -> dict:
    """The base model's rows (RAG and the like), evaluated once: they do not depend on a training seed."""
    if not folder:
        return {}
    path = Path(folder) / "summary.json"
    try:
        summary = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise RunsError(f"{path}: {e}") from e
    return {name: s.get("needs_recall", s).get("accuracy") for name, s in summary["variants"].items()}


# --------------------------------------------------------------------------------------------
# Output: runs.md, runs.png, spread.json
# --------------------------------------------------------------------------------------------
def _pts(x, signed=False) -> str:
    return "-" if x is None else (f"{100 * x:+.1f}" if signed else f"{100 * x:.1f}")


def _p(p: float) -> str:
    return "<0.001" if p < 0.001 else f"{p:.3f}"


def _tokens(x) -> str:
    return "-" if x is None else f"{x:.0f}"


def _interval(d, signed=False) -> str:
    if d is None or d.get("low") is None:
        return "-"
    return f"[{_pts(d['low'], signed)}, {_pts(d['high'], signed)}]"


def markdown(report: dict, base: dict) -> str:
    runs, across, won = report["runs"], report["across"], report["wins"]
    n = runs[0]["n"]
    lines = [
        f"| run | SRT Jaccard (%) [95% over {n} queries] | SRT acc. (%) | control acc. (%) | "
        f"Δ acc., control - SRT [95% over {n} queries] | McNemar p | tokens a query, SRT / control |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        j = r["jaccard"]
        lines.append(
            f"| {r['label']} | {_pts(j and j['mean'])} {_interval(j)} | {_pts(r['srt_accuracy'])} | "
            f"{_pts(r['control_accuracy'])} | "
            f"{_pts(r['delta']['diff'], True)} {_interval(r['delta'], True)} | "
            f"{_p(r['mcnemar']['p'])} | {_tokens(r['srt_tokens'])} / {_tokens(r['control_tokens'])} |"
        )
    d, j = across["delta_accuracy"], across["jaccard"]
    k = d["runs"]
    sd = "-" if d["sd"] is None else f"SD {100 * d['sd']:.1f}"
    jsd = "-" if not j or j["sd"] is None else f"SD {100 * j['sd']:.1f}"
    label = (
        "**one run** (no spread between runs)"
        if k == 1
        else f"**mean of {k} runs** [95% t({k - 1}) over runs]"
    )
    lines.append(
        f"| {label} | "
        f"{_pts(j and j['mean'])} {_interval(j)}, {jsd} | "
        f"{_pts(across['srt_accuracy']['mean'])} | {_pts(across['control_accuracy']['mean'])} | "
        f"**{_pts(d['mean'], True)}** {_interval(d, True)}, {sd} | - | "
        f"{_tokens(across['srt_tokens'])} / {_tokens(across['control_tokens'])} |"
    )
    query_interval = (
        f"A run's Δ interval (paired bootstrap, {RESAMPLES} resamples) resamples the {n} test queries of "
        "that run's two checkpoints: it does not hold another training seed."
    )
    if k == 1:  # nothing to say across runs: one run is one run, neither a tie nor a win for a method
        summary = (
            f"One run: a claim about the methods needs paired runs (seeds). {query_interval} Its query "
            f"standard error is about {100 * across['query_se_delta']:.1f} points."
        )
    else:
        summary = (
            f"Across the {k} runs: Δ accuracy ranges {_pts(d['min'], True)} to {_pts(d['max'], True)} "
            f"points; the control was ahead in {won['control']}, SRT in {won['srt']}, even in {won['even']}; "
            f"the control's query interval lay above 0 in {won['control_interval_above_0']}, SRT's below 0 "
            f"in {won['srt_interval_below_0']}. "
            + (f"SRT's Jaccard ranges {_pts(j['min'])} to {_pts(j['max'])}. " if j else "")
            + f"{query_interval} The mean's interval is t({k - 1}) over the runs (mean ± t·SD/√{k}), the "
            f"runs being the units; one run's query standard error is about "
            f"{100 * across['query_se_delta']:.1f} points beside the runs' SD."
        )
    text = ["\n".join(lines), summary]
    if base:
        text.append(
            "Base model, evaluated once (no training seed): "
            + ", ".join(f"{name} {_pts(acc)}%" for name, acc in base.items())
            + " accuracy on the same queries."
        )
    return "\n\n".join(text) + "\n"


def plot(report: dict, path: Path) -> Path:
    """One point per run with its query interval, then the mean over runs with its t interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, across = report["runs"], report["across"]
    labels = [r["label"] for r in runs] + [f"mean of {len(runs)} (t interval)"]
    panels = [
        (
            "Δ accuracy, control - SRT (points)",
            [r["delta"] for r in runs],
            across["delta_accuracy"],
            "diff",
            True,
        ),
        ("SRT recall Jaccard (%)", [r["jaccard"] for r in runs], across["jaccard"], "mean", False),
    ]
    fig, axes = plt.subplots(1, 2, figsize=(10, 0.45 * len(labels) + 1.6), sharey=True)
    for ax, (title, per_run, mean, key, at_zero) in zip(axes, panels):
        for y, d in enumerate(per_run):
            if d:
                xerr = [[100 * (d[key] - d["low"])], [100 * (d["high"] - d[key])]]
                ax.errorbar(100 * d[key], -y, xerr=xerr, fmt="o", color="tab:blue", capsize=3)
        if mean and mean["low"] is not None:
            ax.errorbar(100 * mean["mean"], -len(per_run),
                        xerr=[[100 * (mean["mean"] - mean["low"])], [100 * (mean["high"] - mean["mean"])]],
                        fmt="D", color="black", capsize=4, markersize=8, linewidth=2)  # fmt: skip
        if at_zero:
            ax.axvline(0, color="gray", linewidth=0.8)
        ax.set_title(title)
        ax.set_yticks([-y for y in range(len(labels))], labels)
    axes[0].set_xlabel("runs: 95% over test queries; mean: 95% t over runs")
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
    return path


def spread(report: dict, runs: list[dict]) -> dict:
    """What a single run's report prints beside its own difference (evaluate.py --runs-spread)."""
    return {
        "data_sha256": runs[0]["data_sha256"],
        "queries": len(runs[0]["ids"]),
        "runs": [r["label"] for r in runs],
        "delta_accuracy": report["across"]["delta_accuracy"],
        "jaccard": report["across"]["jaccard"],
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m srt.runs_report",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("runs", nargs="+", help="LABEL=FOLDER (an evaluate.py run) or an earlier runs.json")
    p.add_argument("--srt", default="srt", help="SRT's variant name in each run")
    p.add_argument("--control", default="nocot", help="the control's variant name in each run")
    p.add_argument("--base", default=None, help="an evaluate.py folder of the base model's rows (once)")
    add_out(p, "runs/demo/runs")
    p.add_argument(
        "--judge-against",
        default=None,
        metavar="SPREAD",
        help="the spread.json of the lesson's runs: judge these runs as a speed lever by demo.md's rule",
    )
    return p


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    try:
        runs = load_runs(args.runs, args.srt, args.control)
        base = read_base(args.base)
        report = summarize(runs)
        verdict = None
        if args.judge_against:
            verdict = judge_lever(report, runs, read_reference(args.judge_against), args.judge_against)
    except RunsError as e:
        sys.exit(f"error: {e}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "runs.json", {**report, "base": base, "per_query": runs})
    write_json(out / "spread.json", spread(report, runs))
    text = markdown(report, base)
    if verdict:
        write_json(out / "verdict.json", verdict)
        text += "\n" + judge_markdown(verdict) + "\n"
    atomic_write_text(out / "runs.md", text)
    plot(report, out / "runs.png")
    print(
        text + f"\nwritten: {out / 'runs.md'}, {out / 'runs.png'}, {out / 'runs.json'}, {out / 'spread.json'}"
    )
    return report


if __name__ == "__main__":
    main()
