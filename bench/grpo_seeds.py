"""Does GRPO improve recall over its SFT start? The paired test, read from an evaluate.py run.

For each GRPO model evaluated beside its SFT start (evaluate.py with `--table2 "SRT=<sft>"`, so every
comparison is paired against the SFT model on the same dev queries), the recall Jaccard on the
queries whose H* is non-empty and the answer F1 on all of them, each difference with its 2000-resample
paired bootstrap 95% interval. A run passes when the interval of its Jaccard gain lies above 0 and
its F1 is not lower by more than 2 points. Beside them, the answer accuracy (every answer key
present) and the share of queries answered right with a recall that missed H* entirely (Jaccard 0):
a rise of the latter is a policy that learned to answer without going through the recall. The
learning curves of the runs (the greedy probe of stage 2 and the recall reward of the sampled
groups) are drawn side by side in one figure, e.g. the cosine answer reward of Eq. (7) against the
key-based one on the same probe.

    python bench/grpo_seeds.py --eval runs/recall/eval-dev --sft sft-long \\
        --curves "cosine, seed 0=runs/recall/grpo-s0" "cosine, seed 1=runs/recall/grpo-s1" \\
        "keys, seed 0=runs/recall/grpo-keys-s0"

Writes <out>/results.json, <out>/results.md and <out>/curves.png (default runs/bench/grpo_seeds).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
for _path in (str(ROOT), str(BENCH)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from measure import check_out, machine, machine_line, write_results  # noqa: E402

from srt.data_io import read_jsonl  # noqa: E402
from srt.metrics import paired_bootstrap  # noqa: E402

MAX_F1_DROP = 0.02  # a gain in recall may not cost more than 2 points of F1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument(
        "--eval", default="runs/recall/eval-dev", help="an evaluate.py output folder (its summary.json)"
    )
    p.add_argument("--sft", default="sft-long", help="the variant name of the SFT start (Table 2's SRT row)")
    p.add_argument(
        "--curves",
        nargs="*",
        default=[],
        metavar="LABEL=RUN",
        help="stage 2 run folders (probe.jsonl, metrics.jsonl) to draw side by side",
    )
    p.add_argument("--out", default="runs/bench/grpo_seeds")
    return p


def right_without_recall(rows: list[dict]) -> dict[str, float]:
    """Per query that needs recall: 1.0 when every answer key is present while the recall shares no
    turn with H* (an answer that did not come through the recall), else 0.0."""
    return {
        r["id"]: float(r["accuracy"] == 1.0 and r["jaccard"] == 0.0) for r in rows if r.get("gold_recall")
    }


def bypass_comparison(eval_dir: Path, sft: str, name: str) -> dict | None:
    """right_without_recall of `name` against `sft`, paired on the same queries; None without the
    per-query files evaluate.py writes (<eval>/<variant>.jsonl)."""
    paths = [eval_dir / f"{variant}.jsonl" for variant in (sft, name)]
    if not all(path.exists() for path in paths):
        return None
    base, grpo = (right_without_recall(read_jsonl(path, validate=False)) for path in paths)
    if set(base) != set(grpo):
        raise SystemExit(
            f"error: {paths[0]} and {paths[1]} hold different queries: evaluate both on the same data"
        )
    ids = sorted(base)
    return dict(
        paired_bootstrap([base[i] for i in ids], [grpo[i] for i in ids]),
        sft=sum(base.values()) / len(ids) if ids else None,
        grpo=sum(grpo.values()) / len(ids) if ids else None,
    )


def verdicts(summary: dict, sft: str, eval_dir: Path | None = None) -> list[dict]:
    """One row per variant compared against `sft`: Jaccard and F1 of both, the paired differences
    with their intervals, and whether the run passes (Jaccard interval above 0, F1 drop <= 2 points)."""
    if sft not in summary["variants"]:
        raise SystemExit(
            f"error: {sft!r} is not a variant of this evaluation ({sorted(summary['variants'])})"
        )
    base, rows = summary["variants"][sft], []
    for name, c in summary.get("comparisons", {}).items():
        if c.get("against") != sft:
            raise SystemExit(
                f"error: {name} is compared against {c.get('against')!r}, not {sft!r}: "
                f'evaluate with --table2 "SRT={sft}"'
            )
        jac, f1 = c["jaccard"], c["f1"]
        passed = (
            jac["low"] is not None
            and jac["low"] > 0
            and f1["diff"] is not None
            and f1["diff"] >= -MAX_F1_DROP
        )
        rows.append(
            {
                "variant": name,
                "n": c["n"],
                "n_needed": jac["n"],
                "jaccard_sft": base["jaccard"],
                "jaccard": summary["variants"][name]["jaccard"],
                "jaccard_diff": jac,
                "f1_sft": base["f1"],
                "f1": summary["variants"][name]["f1"],
                "f1_diff": f1,
                "silent": summary["variants"][name].get("silent"),
                "silent_sft": base.get("silent"),
                "accuracy_sft": base.get("accuracy"),
                "accuracy": summary["variants"][name].get("accuracy"),
                "accuracy_diff": c.get("accuracy"),
                "right_without_recall": bypass_comparison(eval_dir, sft, name) if eval_dir else None,
                "passes": bool(passed),
            }
        )
    return rows


def _ci(d: dict | None) -> str:
    if d is None or d["diff"] is None:
        return "-"
    return f"{100 * d['diff']:+.1f} [{100 * d['low']:+.1f}, {100 * d['high']:+.1f}]"


def table(rows: list[dict], sft: str) -> str:
    lines = [
        f"| GRPO run | queries (need recall) | Jaccard {sft} -> GRPO (%) | Δ Jaccard [95% CI] | "
        f"F1 {sft} -> GRPO | Δ F1 [95% CI] | silence on H* empty (%) | passes | "
        f"accuracy {sft} -> GRPO (%) | Δ accuracy [95% CI] | right answer, recall missed H* (%) | "
        "Δ [95% CI] |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def pct(v):
        return "-" if v is None else f"{100 * v:.1f}"

    for r in rows:
        bypass = r.get("right_without_recall") or {}
        lines.append(
            f"| {r['variant']} | {r['n']} ({r['n_needed']}) | "
            f"{pct(r['jaccard_sft'])} -> {pct(r['jaccard'])} | "
            f"{_ci(r['jaccard_diff'])} | {pct(r['f1_sft'])} -> {pct(r['f1'])} | {_ci(r['f1_diff'])} | "
            f"{pct(r['silent_sft'])} -> {pct(r['silent'])} | {'yes' if r['passes'] else 'no'} | "
            f"{pct(r.get('accuracy_sft'))} -> {pct(r.get('accuracy'))} | {_ci(r.get('accuracy_diff'))} | "
            f"{pct(bypass.get('sft'))} -> {pct(bypass.get('grpo'))} | {_ci(bypass or None)} |"
        )
    return "\n".join(lines)


def plot_curves(curves: dict[str, Path], path: Path) -> None:
    """Probe recall Jaccard and F1 against the step, and the recall reward of the sampled groups."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    for label, run in curves.items():
        probes = read_jsonl(run / "probe.jsonl", validate=False)
        metrics = (
            read_jsonl(run / "metrics.jsonl", validate=False) if (run / "metrics.jsonl").exists() else []
        )
        steps = [p["step"] for p in probes]
        axes[0].plot(steps, [p.get("jaccard_needed") for p in probes], marker="o", label=label)
        axes[1].plot(steps, [p.get("f1") for p in probes], marker="o", label=label)
        axes[2].plot(
            [m["step"] for m in metrics], [m.get("reward_recall_mean") for m in metrics], label=label
        )
    for ax, title in zip(
        axes,
        (
            "probe: recall Jaccard (H* non-empty)",
            "probe: answer F1",
            "recall reward of the sampled groups (Eq. (6))",
        ),
    ):
        ax.set_title(title)
        ax.set_xlabel("GRPO step")
        ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    check_out(args.out)
    summary_path = Path(args.eval) / "summary.json"
    if not summary_path.exists():
        raise SystemExit(f"error: {summary_path} not found: run evaluate.py first")
    rows = verdicts(json.loads(summary_path.read_text()), args.sft, Path(args.eval))
    curves = {}
    for spec in args.curves:
        label, sep, run = spec.partition("=")
        if not sep or not (Path(run) / "probe.jsonl").exists():
            raise SystemExit(f"error: --curves {spec!r}: expected LABEL=RUN with RUN/probe.jsonl")
        curves[label] = Path(run)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if curves:
        plot_curves(curves, out / "curves.png")
    info = machine()  # of this reading: the evaluation's own machine is in its report.md
    markdown = f"{machine_line(info)}\n\n{table(rows, args.sft)}\n"
    results = {
        "machine": info,
        "eval": str(args.eval),
        "sft": args.sft,
        "rows": rows,
        "curves": {k: str(v) for k, v in curves.items()},
    }
    write_results(out, "results", results, markdown)
    print(markdown)
    return results


if __name__ == "__main__":
    main()
