"""summary.json, report.md and the plots of an evaluation run (paper §4): the means per variant
and per length bucket, Tables 1-3 as Markdown, F1 against dialogue length (Fig. 4), the error
types per bucket (Table 3) and the attention heat maps of §4.6 (Fig. 3).

Also the summary of cuemem.py's own runs (§5.4 of the CueMem paper: evidence recall, and input
tokens and latency as a fraction of the full-history setting's).

A library module: it reads the rows evaluate.py and cuemem.py write (one dict per answer, with the
metrics of metrics.py) and imports no stage.
"""
from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import numpy as np

from data_io import BUCKETS, atomic_write_text, bucket_of, write_json
from metrics import ERROR_TYPES

TABLE2_ROWS = ("SRT", "w/o RL", "w/o CoT", "w/o SFT")

# --------------------------------------------------------------------------------------------
# Aggregation: summary.json
# --------------------------------------------------------------------------------------------
METRICS = ("f1", "accuracy", "precision", "recall", "jaccard", "format_valid",
           "reward_format", "reward_recall", "reward_answer", "reward_total")


def describe(values) -> dict | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"mean": float(np.mean(values)), "p50": float(np.percentile(values, 50)),
            "p90": float(np.percentile(values, 90)), "n": len(values)}


def mean_metrics(rows) -> dict:
    out = {"n": len(rows)}
    for metric in METRICS:
        values = [r[metric] for r in rows if r.get(metric) is not None]
        out[metric] = float(np.mean(values)) if values else None
    return out


def error_counts(rows) -> dict:
    counts = Counter(r["error_type"] for r in rows if r.get("error_type"))
    return {kind: counts.get(kind, 0) for kind in ERROR_TYPES}


def summarize_variant(variant, rows, fine_buckets) -> dict:
    summary = {"method": variant["method"], "model": variant["model"], **mean_metrics(rows),
               "latency_s": describe(r["latency_s"] for r in rows),
               "input_tokens": describe(r["input_tokens"] for r in rows),
               "generated_tokens": describe(r["generated_tokens"] for r in rows),
               "by_bucket": {}, "errors_by_bucket": {}}
    for b in fine_buckets:
        members = [r for r in rows if bucket_of(r["num_turns"], fine_buckets) == b]
        summary["by_bucket"][str(b)] = mean_metrics(members)
    # Fig. 4's "multi-turn buckets (k >= 24)", read off the same bucketing as the columns.
    long_rows = [r for r in rows if bucket_of(r["num_turns"], fine_buckets) >= 24]
    summary["by_bucket"][">=24"] = mean_metrics(long_rows)
    for b in BUCKETS:
        summary["errors_by_bucket"][str(b)] = error_counts([r for r in rows if r["bucket"] == b])
    return summary



def summarize_cuemem(rows, counter_name="") -> dict:
    """cuemem.py's summary.json. Means over queries; token and latency fractions are totals over totals (§5.4: CueMem's
    input tokens and latency as a fraction of the full-history setting's)."""
    mean = lambda key, sub=rows: float(np.mean([r[key] for r in sub])) if sub else 0.0
    total = lambda key, sub=rows: float(sum(r[key] for r in sub))
    ratio = lambda a, b, sub=rows: total(a, sub) / total(b, sub) if total(b, sub) else 0.0
    with_gold = [r for r in rows if r["gold_evidence"]]
    summary = {"n": len(rows), "n_with_evidence": len(with_gold),
               "recall": mean("recall"), "precision": mean("precision"), "jaccard": mean("jaccard"),
               "recall_nonempty": mean("recall", with_gold),  # queries whose H* is not empty
               "evidence_size": mean("evidence_size"),
               "input_tokens": mean("input_tokens"), "full_input_tokens": mean("full_input_tokens"),
               "token_fraction": ratio("input_tokens", "full_input_tokens"),
               "history_token_fraction": ratio("history_tokens", "full_history_tokens"),
               "token_counter": counter_name}
    if rows and "f1" in rows[0]:
        summary.update(f1=mean("f1"), latency_s=mean("latency_s"), build_s=mean("build_s"))
    if rows and "full_latency_s" in rows[0]:
        summary.update(full_f1=mean("full_f1"), full_latency_s=mean("full_latency_s"),
                       latency_fraction=ratio("latency_s", "full_latency_s"))
    summary["by_bucket"] = {
        str(b): {"n": len(sub), "recall": mean("recall", sub),
                 "token_fraction": ratio("input_tokens", "full_input_tokens", sub)}
        for b in sorted({r["bucket"] for r in rows}) for sub in [[r for r in rows if r["bucket"] == b]]}
    return summary


# --------------------------------------------------------------------------------------------
# Report: Tables 1-3, per-bucket tables, plots
# --------------------------------------------------------------------------------------------
def _pct(x):
    return "-" if x is None else f"{100 * x:.1f}"


def _num(x, digits=2):
    return "-" if x is None else f"{x:.{digits}f}"


def _stat(d, key="mean", digits=2):
    return "-" if d is None else f"{d[key]:.{digits}f}"


def table1(summary) -> str:
    lines = ["| Method | Variant | F1 | Acc. (%) | Latency mean (s) | p50 | p90 | Input tokens | Generated tokens |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, s in summary["variants"].items():
        lines.append(f"| {s['method']} | {name} | {_pct(s['f1'])} | {_pct(s['accuracy'])} | "
                     f"{_stat(s['latency_s'])} | {_stat(s['latency_s'], 'p50')} | {_stat(s['latency_s'], 'p90')} | "
                     f"{_stat(s['input_tokens'], digits=0)} | {_stat(s['generated_tokens'], digits=0)} |")
    return "\n".join(lines)


def table2(summary) -> str:
    lines = ["| Variant | Name | Recall (%) | Acc. (%) | Jaccard (%) |", "|---|---|---|---|---|"]
    for row in TABLE2_ROWS:
        name = summary["table2"].get(row)
        if name in summary["variants"]:
            s = summary["variants"][name]
            lines.append(f"| {row} | {name} | {_pct(s['recall'])} | {_pct(s['accuracy'])} | {_pct(s['jaccard'])} |")
    return "\n".join(lines)


def table3(summary) -> str:
    name = summary["srt_variant"]
    header = "| Error type | " + " | ".join(str(b) for b in BUCKETS) + " |"
    lines = [header, "|---|" + "---|" * len(BUCKETS)]
    if name is None:
        return "(no srt or srt-p variant was evaluated)"
    errors = summary["variants"][name]["errors_by_bucket"]
    totals = {b: sum(errors[str(b)].values()) for b in BUCKETS}
    for kind in ERROR_TYPES:
        cells = [f"{100 * errors[str(b)][kind] / totals[b]:.1f}%" if totals[b] else "-" for b in BUCKETS]
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    lines.append("| wrong answers (n) | " + " | ".join(str(totals[b]) for b in BUCKETS) + " |")
    return "\n".join(lines)


def bucket_table(summary, metric) -> str:
    keys = [str(b) for b in summary["fine_buckets"]] + [">=24"]
    lines = ["| Variant | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
    for name, s in summary["variants"].items():
        cells = [_pct(s["by_bucket"][k][metric]) for k in keys]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    counts = [str(next(iter(summary["variants"].values()))["by_bucket"][k]["n"]) for k in keys]
    lines.append("| examples (n) | " + " | ".join(counts) + " |")
    return "\n".join(lines)


def recall_table(summary) -> str:
    lines = ["| Variant | Precision (%) | Recall (%) | Jaccard (%) | Format valid (%) | R_format | R_recall | R_answer | R total |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, s in summary["variants"].items():
        lines.append(f"| {name} | {_pct(s['precision'])} | {_pct(s['recall'])} | {_pct(s['jaccard'])} | "
                     f"{_pct(s['format_valid'])} | {_num(s['reward_format'])} | {_num(s['reward_recall'])} | "
                     f"{_num(s['reward_answer'])} | {_num(s['reward_total'])} |")
    return "\n".join(lines)


def attention_table(summary) -> str:
    lines = ["| Example | Turns | Chain | Share on H* without recall (%) | Share on H* with self-recall (%) |",
             "|---|---|---|---|---|"]
    for e in summary["attention"]:
        lines.append(f"| {e['id']} | {e['num_turns']} | {e['chain']} | {_pct(e['no_recall_on_gold'])} | "
                     f"{_pct(e['self_recall_on_gold'])} |")
    return "\n".join(lines)


def write_report(summary, out_dir, plots) -> Path:
    batched = any(v["batch_size"] > 1 for v in summary["config"]["variants"] if v["model"] != "api")
    parts = [
        "# SRT evaluation report",
        f"Data: `{summary['config']['data']}`, {summary['num_examples']} examples "
        f"(stratified over the 8/16/24/32-round buckets when limited; seed {summary['config']['seed']}).",
        "## Table 1: F1 and end-to-end latency",
        table1(summary),
        "Latency is wall seconds per answer end to end: prompt build (retrieval included) + generation + parsing."
        + (" Generation is batched: each answer is charged the batch's wall time divided by the batch size."
           if batched else ""),
        "## Table 2: ablations (Recall = |H^ ∩ H*| / |H*|; Acc. = all answer keys present)",
        table2(summary) if summary["table2"] else "(no Table 2 variants; name them with --table2)",
        f"## Table 3: error types of wrong answers per dialogue length ({summary['srt_variant'] or 'n/a'})",
        table3(summary),
        "## F1 by dialogue length (rounds; Fig. 4 buckets)",
        bucket_table(summary, "f1"),
        "## Accuracy by dialogue length",
        bucket_table(summary, "accuracy"),
        "## Recall Jaccard by dialogue length",
        bucket_table(summary, "jaccard"),
        "## Recall, format validity and reward components (Eqs. (4)-(7))",
        recall_table(summary),
    ]
    if summary["attention"]:
        parts += [f"## Attention analysis (§4.6, {summary['srt_variant']})", attention_table(summary),
                  "Share of the answer tokens' attention (averaged over layers and heads) on the turns of H*, "
                  "normalized over all history turns."]
    parts += ["## Plots"] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    path = Path(out_dir) / "report.md"
    atomic_write_text(path, "\n\n".join(parts) + "\n")
    return path


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend (plots are files; no display needed),
    imported on first use so that the summaries need no plotting library."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save_figure(fig, path) -> Path:
    tmp = Path(path).with_name(f".{Path(path).name}.tmp.png")
    fig.savefig(tmp, dpi=110, bbox_inches="tight")
    os.replace(tmp, path)
    return Path(path)


def plot_f1_by_length(summary, path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, s in summary["variants"].items():
        xs = [b for b in summary["fine_buckets"] if s["by_bucket"][str(b)]["f1"] is not None]
        ax.plot(xs, [100 * s["by_bucket"][str(b)]["f1"] for b in xs], marker="o", label=name)
    ax.set(xlabel="dialogue length (rounds)", ylabel="F1", xticks=list(summary["fine_buckets"]), ylim=(0, 100),
           title="F1 against dialogue length")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    path = _save_figure(fig, path)
    plt.close(fig)
    return path


def plot_error_types(summary, path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    name = summary["srt_variant"]
    errors = summary["variants"][name]["errors_by_bucket"] if name else {}
    bottom = np.zeros(len(BUCKETS))
    for kind in ERROR_TYPES:
        totals = [sum(errors.get(str(b), {}).values()) for b in BUCKETS]
        shares = np.array([100 * errors[str(b)][kind] / t if t else 0.0 for b, t in zip(BUCKETS, totals)])
        ax.bar([str(b) for b in BUCKETS], shares, bottom=bottom, label=kind)
        bottom += shares
    for x, b in enumerate(BUCKETS):
        ax.text(x, 101, f"n={sum(errors.get(str(b), {}).values())}", ha="center", va="bottom", fontsize=8)
    ax.set(xlabel="dialogue length (rounds)", ylabel="share of wrong answers (%)", ylim=(0, 100),
           title=f"Error types per length bucket ({name or 'n/a'})\n")
    ax.legend(fontsize=8, loc="upper right")
    path = _save_figure(fig, path)
    plt.close(fig)
    return path


def plot_attention(attention, path) -> Path:
    """Fig. 3 as heat maps: one panel per example, rows = without recall / with self-recall, columns =
    history turns, values = attention share normalized per row; the turns of H* are marked in red."""
    plt = pyplot()
    fig, axes = plt.subplots(len(attention), 1, figsize=(max(6, 0.22 * max(len(e["turns"]) for e in attention)),
                                                         1.6 * len(attention) + 0.6), squeeze=False)
    for ax, e in zip(axes[:, 0], attention):
        grid = np.array([e["no_recall"], e["self_recall"]], dtype=float)
        grid = grid / np.maximum(grid.sum(axis=1, keepdims=True), 1e-12)
        image = ax.imshow(grid, aspect="auto", cmap="viridis", vmin=0)
        ax.set_yticks([0, 1], ["no recall", "self-recall"])
        ax.set_xticks(range(len(e["turns"])), e["turns"], rotation=90, fontsize=6)
        for tick, label in zip(ax.get_xticklabels(), e["turns"]):
            if label in e["gold"]:
                tick.set_color("red")
        ax.set_title(f"{e['id']} ({e['num_turns']} rounds, {e['chain']} chain)", fontsize=8)
        fig.colorbar(image, ax=ax, fraction=0.02)
    path = _save_figure(fig, path)
    plt.close(fig)
    return path




def write_outputs(summary, out_dir) -> Path:
    """The plots, <out>/summary.json and <out>/report.md of one run; returns the report's path."""
    out_dir = Path(out_dir)
    plots = [plot_f1_by_length(summary, out_dir / "f1_by_length.png"),
             plot_error_types(summary, out_dir / "error_types.png")]
    if summary["attention"]:
        plots.append(plot_attention(summary["attention"], out_dir / "attention.png"))
    summary["plots"] = [p.name for p in plots]
    write_json(out_dir / "summary.json", summary)
    return write_report(summary, out_dir, plots)
