"""summary.json, report.md and the plots of an evaluation run (paper §4): the means per variant,
per length bucket, per query type, |H*| and recall distance; every variant paired against SRT
(bootstrap intervals, McNemar); Tables 1-3 as Markdown; F1 and batch-1 latency against dialogue
length (Fig. 4), the error types per bucket (Table 3) and the attention heat maps of §4.6 (Fig. 3).

Where the records carry a LoCoMo question category, LoCoMo's own per-category scoring beside ours
(srt/locomo_eval.py): the score and evidence recall per category, paired against SRT.

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

from srt import locomo_eval
from srt.data.corpora import LOCOMO_CATEGORIES
from srt.data_io import BUCKETS, atomic_write_text, bucket_of, write_json
from srt.metrics import DISTANCE_BINS, ERROR_TYPES, mcnemar_exact, paired_bootstrap

# Table 2's rows: the paper's ablations, then ours: "recall-only" (the think block holds the <HIS>
# tags alone), "No history" (the w/o-CoT model with an empty history: the floor every accuracy is
# read against), and the memory baselines on the same queries.
TABLE2_ROWS = (
    "SRT", "Recall by pointer", "w/o RL", "w/o CoT", "Recall only", "No history", "w/o SFT", "Full history",
    "RAG", "CueMem",
)  # fmt: skip

# --------------------------------------------------------------------------------------------
# Aggregation: summary.json
# --------------------------------------------------------------------------------------------
# Means over the rows where the metric exists: precision / recall / jaccard on queries with a
# non-empty H*, silent on queries with an empty H* (self-recall methods), truncated where known.
METRICS = (
    "f1",
    "key_f1",
    "accuracy",
    "precision",
    "recall",
    "jaccard",
    "label_jaccard",
    "silent",
    "truncated",
    "format_valid",
    "reward_format",
    "reward_recall",
    "reward_answer",
    "reward_total",
    "several_candidates",
)
# Paired against SRT, item by item (Table 2's intervals).
COMPARED = ("accuracy", "f1", "key_f1", "recall", "jaccard", "label_jaccard")
BREAKDOWNS = {"query_type": "query type", "h_size": "|H*|", "distance_bin": "recall distance (rounds)"}
DISTANCE_ORDER = ("none", *DISTANCE_BINS)
CUTOFF_LIMIT = 0.05  # a token budget that cuts off more answers than this is too tight
OPTIONS_SHOWN = {"full": ("memory",), "recency": ("recency_k", "memory"), "rag": ("rag_k", "memory"),
                 "cuemem": ("cuemem", "memory"), "srt": ("recall",), "srt-p": ("recall",)}  # fmt: skip
# Table 2's variants need >= 96 queries, >= 24 per 8/16/24/32-round bucket, to be read.
MIN_QUERIES, MIN_PER_BUCKET = 96, 24


def describe(values) -> dict | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {
        "mean": float(np.mean(values)),
        "p50": float(np.percentile(values, 50)),
        "p90": float(np.percentile(values, 90)),
        "min": float(np.min(values)),
        "max": float(np.max(values)),
        "n": len(values),
    }


def mean_metrics(rows) -> dict:
    out = {"n": len(rows)}
    for metric in METRICS:
        values = [float(r[metric]) for r in rows if r.get(metric) is not None]
        out[metric] = float(np.mean(values)) if values else None
        if metric in ("recall", "silent"):
            out[f"n_{metric}"] = len(values)
    return out


def error_counts(rows) -> dict:
    counts = Counter(r["error_type"] for r in rows if r.get("error_type"))
    return {kind: counts.get(kind, 0) for kind in ERROR_TYPES}


def throughput(rows) -> dict | None:
    """Answers and generated tokens per second of generation wall time in the batched pass."""
    wall = sum(r["generate_share_s"] for r in rows if r.get("generate_share_s") is not None)
    if not rows or wall <= 0:
        return None
    tokens = [r["generated_tokens"] for r in rows if r.get("generated_tokens") is not None]
    return {
        "requests_per_s": len(rows) / wall,
        "tokens_per_s": sum(tokens) / wall if tokens else None,
        "batch_size": max(r.get("batch_size", 1) for r in rows),
    }


def _group_key(value):
    return (DISTANCE_ORDER.index(value) if value in DISTANCE_ORDER else len(DISTANCE_ORDER), str(value))


def summarize_variant(variant, rows, latency_rows, fine_buckets) -> dict:
    """One variant's summary: means, the batch-1 latency sample (overall and per Fig. 4 bucket),
    throughput at the batched pass's batch size, offline seconds per query, and the breakdowns."""
    summary = {
        "method": variant["method"],
        "model": variant["model"],
        **mean_metrics(rows),
        "options": {
            k: v
            for k, v in variant.get("options", {}).items()
            if k in OPTIONS_SHOWN.get(variant["method"], ()) + ("limit", "max_new_tokens")
            and (k, v) != ("memory", "window")  # the record's own window: what every method read before
        },
        "latency_s": describe(r["latency_s"] for r in latency_rows),
        "latency_input_tokens": describe(r["input_tokens"] for r in latency_rows),
        "latency_generated_tokens": describe(r["generated_tokens"] for r in latency_rows),
        # per generated token, so that requests of different lengths compare: on an idle machine the
        # figure is steady; a neighbour's load shows as a spread (max / min) far above 1
        "latency_ms_per_token": describe(
            1000 * r["latency_s"] / max(r["generated_tokens"], 1) for r in latency_rows
        ),
        "offline_s": describe(r.get("offline_s") for r in rows if variant["method"] in ("rag", "cuemem")),
        "throughput": throughput(rows),
        "input_tokens": describe(r["input_tokens"] for r in rows),
        "generated_tokens": describe(r["generated_tokens"] for r in rows),
        # of those, the model's own and those recall "copy" wrote (srt/recall.py)
        "decoded_tokens": describe(r.get("decoded_tokens") for r in rows),
        "copied_tokens": describe(r.get("copied_tokens") for r in rows),
        "latency_decoded_tokens": describe(r.get("decoded_tokens") for r in latency_rows),
        "history_tokens": describe(r.get("history_tokens") for r in rows),
        # how long the final answers are: a list of candidates is long, and states several
        "answer_tokens": describe(r.get("answer_tokens") for r in rows),
        # Table 2's headline reads the queries that need recall; the others ("none") apart
        "needs_recall": mean_metrics([r for r in rows if r.get("needs_recall", True)]),
        "no_recall": mean_metrics([r for r in rows if not r.get("needs_recall", True)]),
        "by_bucket": {},
        "latency_by_bucket": {},
        "errors_by_bucket": {},
        "locomo": locomo_eval.summarize(rows),  # None unless the records carry a LoCoMo category
    }
    for b in fine_buckets:
        members = [r for r in rows if bucket_of(r["num_turns"], fine_buckets) == b]
        summary["by_bucket"][str(b)] = mean_metrics(members)
        timed = [r for r in latency_rows if bucket_of(r["num_turns"], fine_buckets) == b]
        summary["latency_by_bucket"][str(b)] = {
            "latency_s": describe(r["latency_s"] for r in timed),
            "input_tokens": describe(r["input_tokens"] for r in timed),
            "generated_tokens": describe(r["generated_tokens"] for r in timed),
        }
    # Fig. 4's "multi-turn buckets (k >= 24)", read off the same bucketing as the columns.
    long_rows = [r for r in rows if bucket_of(r["num_turns"], fine_buckets) >= 24]
    summary["by_bucket"][">=24"] = mean_metrics(long_rows)
    for b in BUCKETS:
        summary["errors_by_bucket"][str(b)] = error_counts([r for r in rows if r["bucket"] == b])
    summary["n_by_coarse_bucket"] = {str(b): sum(1 for r in rows if r["bucket"] == b) for b in BUCKETS}
    for field in BREAKDOWNS:
        values = sorted({r.get(field) for r in rows}, key=_group_key)
        summary[f"by_{field}"] = {
            str(v): mean_metrics([r for r in rows if r.get(field) == v]) for v in values
        }
    return summary


def compare_variants(rows_by_name, reference, resamples=2000, seed=0) -> dict:
    """Every variant against `reference` (Table 2's SRT) on the queries both answered that need
    recall (H* not empty; the others are reported apart): the paired bootstrap interval of the mean
    difference (variant - reference) for each metric of COMPARED, on the items where both have it,
    and the exact McNemar test of accuracy."""
    if reference is None or reference not in rows_by_name:
        return {}
    base = {r["id"]: r for r in rows_by_name[reference] if r.get("needs_recall", True)}
    out = {}
    for name, rows in rows_by_name.items():
        if name == reference:
            continue
        pairs = [(base[r["id"]], r) for r in rows if r["id"] in base]
        entry = {"n": len(pairs), "against": reference}
        for metric in COMPARED:
            both = [
                (a[metric], b[metric])
                for a, b in pairs
                if a.get(metric) is not None and b.get(metric) is not None
            ]
            entry[metric] = paired_bootstrap([a for a, _ in both], [b for _, b in both], resamples, seed)
        scored = [
            (a["accuracy"], b["accuracy"]) for a, b in pairs if None not in (a["accuracy"], b["accuracy"])
        ]
        entry["mcnemar"] = mcnemar_exact([a for a, _ in scored], [b for _, b in scored])
        out[name] = entry
    return out


def summarize_cuemem(rows, counter_name="") -> dict:
    """cuemem.py's summary.json. Means over queries; token and latency fractions are totals over totals
    (§5.4: CueMem's input tokens and latency as a fraction of the full-history setting's)."""

    def mean(key, sub=rows):
        return float(np.mean([r[key] for r in sub])) if sub else 0.0

    def total(key, sub=rows):
        return float(sum(r[key] for r in sub))

    def ratio_of_totals(a, b, sub=rows):
        return total(a, sub) / total(b, sub) if total(b, sub) else 0.0

    with_gold = [r for r in rows if r["gold_evidence"]]
    summary = {
        "n": len(rows),
        "n_with_evidence": len(with_gold),
        "recall": mean("recall"),
        "precision": mean("precision"),
        "jaccard": mean("jaccard"),
        "recall_nonempty": mean("recall", with_gold),  # queries whose H* is not empty
        "evidence_size": mean("evidence_size"),
        "input_tokens": mean("input_tokens"),
        "full_input_tokens": mean("full_input_tokens"),
        "token_fraction": ratio_of_totals("input_tokens", "full_input_tokens"),
        "history_token_fraction": ratio_of_totals("history_tokens", "full_history_tokens"),
        "token_counter": counter_name,
    }
    if rows and "f1" in rows[0]:
        summary.update(f1=mean("f1"), latency_s=mean("latency_s"), build_s=mean("build_s"))
    if rows and "full_latency_s" in rows[0]:
        summary.update(
            full_f1=mean("full_f1"),
            full_latency_s=mean("full_latency_s"),
            latency_fraction=ratio_of_totals("latency_s", "full_latency_s"),
        )
    summary["by_bucket"] = {
        str(b): {
            "n": len(sub),
            "recall": mean("recall", sub),
            "token_fraction": ratio_of_totals("input_tokens", "full_input_tokens", sub),
        }
        for b in sorted({r["bucket"] for r in rows})
        for sub in [[r for r in rows if r["bucket"] == b]]
    }
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


def _ci(c, digits=1):
    """'+2.1 [-3.1, +7.3]' in percentage points, from a paired_bootstrap result."""
    if not c or c["diff"] is None:
        return "-"
    return f"{100 * c['diff']:+.{digits}f} [{100 * c['low']:+.{digits}f}, {100 * c['high']:+.{digits}f}]"


def _p(m):
    return "-" if not m else f"{m['p']:.3f} ({m['b_only']}/{m['a_only']})"


def table1(summary) -> str:
    lines = [
        "| Method | Variant | n | F1 | key-F1 | Acc. (%) | Latency b=1 mean (s) | p50 | p90 | Input tokens | "
        "Generated tokens | of which decoded | Throughput (req/s) | Offline per query (s) | Cut off (%) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in summary["variants"].items():
        t = s.get("throughput")
        rate = "-" if not t else f"{t['requests_per_s']:.2f}"
        lines.append(
            f"| {s['method']} | {name} | {s['n']} | {_pct(s['f1'])} | {_pct(s['key_f1'])} | "
            f"{_pct(s['accuracy'])} | {_stat(s['latency_s'])} | {_stat(s['latency_s'], 'p50')} | "
            f"{_stat(s['latency_s'], 'p90')} | {_stat(s['latency_input_tokens'], digits=0)} | "
            f"{_stat(s['latency_generated_tokens'], digits=0)} | "
            f"{_stat(s.get('latency_decoded_tokens'), digits=0)} | "
            f"{rate} | {_stat(s['offline_s'], digits=3)} | "
            f"{_pct(s['truncated'])} |"
        )
    return "\n".join(lines)


def table2(summary) -> str:
    """Accuracy, F1 and their paired intervals on the queries that need recall; the queries that
    need none apart; how long the answers are and how often they state several candidates."""
    comparisons = summary.get("comparisons", {})
    lines = [
        "| Variant | Name | n (needs recall) | Acc. (%) | Δ Acc. vs SRT [95% over queries] | "
        "McNemar p (variant only / SRT only) | F1 | Δ F1 [95% over queries] | key-F1 | Jaccard (%) | "
        "Δ Recall [95% over queries] | Acc. on 'none' (%, n) | answer tokens (median) | "
        "several candidates (%) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in TABLE2_ROWS:
        name = summary["table2"].get(row)
        if name not in summary["variants"]:
            continue
        s, c = summary["variants"][name], comparisons.get(name, {})
        needs, none = s.get("needs_recall", s), s.get("no_recall", {})
        lines.append(
            f"| {row} | {name} | {needs.get('n', s['n'])} | {_pct(needs['accuracy'])} | "
            f"{_ci(c.get('accuracy'))} | {_p(c.get('mcnemar'))} | {_pct(needs['f1'])} | {_ci(c.get('f1'))} | "
            f"{_pct(needs['key_f1'])} | {_pct(needs['jaccard'])} | {_ci(c.get('recall'))} | "
            f"{_pct(none.get('accuracy'))} ({none.get('n', 0)}) | "
            f"{_stat(s.get('answer_tokens'), 'p50', 0)} | {_pct(s.get('several_candidates'))} |"
        )
    return "\n".join(lines)


def comparison_table(summary) -> str:
    lines = [
        "| Variant | Paired n | Δ Acc. [95% over queries] | McNemar p | Δ F1 [95% over queries] | "
        "Δ key-F1 [95% over queries] | Δ Recall [95% over queries] | Δ Jaccard [95% over queries] | "
        "Δ label Jaccard [95% over queries] |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, c in summary.get("comparisons", {}).items():
        lines.append(
            f"| {name} | {c['n']} | {_ci(c['accuracy'])} | {_p(c['mcnemar'])} | {_ci(c['f1'])} | "
            f"{_ci(c['key_f1'])} | {_ci(c['recall'])} | {_ci(c['jaccard'])} | {_ci(c.get('label_jaccard'))} |"
        )
    return "\n".join(lines)


def compare_pairs(rows_by_name, pairs, resamples=2000, seed=0) -> dict:
    """--pairs A:B: B against A, as compare_variants compares a variant with SRT, plus the paired
    difference in decoded tokens (the model's own, all queries both answered: what recall "copy"
    saves) and both sides' batch-1 latency medians."""
    out = {}
    for a, b in pairs:
        entry = compare_variants({a: rows_by_name[a], b: rows_by_name[b]}, a, resamples, seed)[b]
        by_id = {r["id"]: r for r in rows_by_name[a]}
        both = [(by_id[r["id"]], r) for r in rows_by_name[b] if r["id"] in by_id]
        tokens = [(x["decoded_tokens"], y["decoded_tokens"]) for x, y in both
                  if None not in (x.get("decoded_tokens"), y.get("decoded_tokens"))]  # fmt: skip
        entry["decoded_tokens"] = paired_bootstrap(
            [x for x, _ in tokens], [y for _, y in tokens], resamples, seed
        )
        entry["decoded_tokens"]["a_mean"] = float(np.mean([x for x, _ in tokens])) if tokens else None
        out[f"{b} vs {a}"] = entry
    return out


def pairs_table(summary) -> str:
    lines = [
        "| B vs A | Paired n | Δ Acc. [95% over queries] | McNemar p | Δ F1 [95% over queries] | "
        "Δ Jaccard [95% over queries] | Δ label Jaccard [95% over queries] | "
        "decoded tokens A, Δ [95% over queries] | latency b=1 A / B (s, mean) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, c in summary.get("pairs", {}).items():
        b, a = name.split(" vs ")
        t = c["decoded_tokens"]
        tokens = (
            "-"
            if t["diff"] is None
            else f"{t['a_mean']:.0f}, {t['diff']:+.1f} [{t['low']:+.1f}, {t['high']:+.1f}]"
        )
        latency = (
            f"{_stat(summary['variants'][a]['latency_s'])} / {_stat(summary['variants'][b]['latency_s'])}"
        )
        lines.append(
            f"| {name} | {c['n']} | {_ci(c['accuracy'])} | {_p(c['mcnemar'])} | {_ci(c['f1'])} | "
            f"{_ci(c['jaccard'])} | {_ci(c.get('label_jaccard'))} | {tokens} | {latency} |"
        )
    return "\n".join(lines)


def locomo_table(summary, metric="score") -> str:
    """LoCoMo's per-category table: `metric` (score or evidence_recall) per category, over the
    answerable questions (1-4) and over all, then our F1, Jaccard, the share of answerable
    questions declined, input tokens and batch-1 latency, one row per variant."""
    names = [n for n, s in summary["variants"].items() if s.get("locomo")]
    keys = [str(c) for c in locomo_eval.CATEGORY_ORDER] + ["answerable", "all"]
    titles = [f"{LOCOMO_CATEGORIES[int(k)]} ({k})" for k in keys[:-2]] + ["answerable (1-4)", "all"]
    lines = [
        "| Variant | Method | "
        + " | ".join(titles)
        + " | F1 (ours) | Jaccard (%) | declined on 1-4 (%) | Input tokens | Latency b=1 (s) |",
        "|---|---|" + "---|" * (len(keys) + 5),
    ]
    for name in names:
        s, cells = summary["variants"][name], summary["variants"][name]["locomo"]
        lines.append(
            f"| {name} | {s['method']} | "
            + " | ".join(_pct(cells[k][metric]) for k in keys)
            + f" | {_pct(cells['all']['f1'])} | {_pct(cells['all']['jaccard'])} | "
            f"{_pct(cells['answerable']['declined'])} | "
            f"{_num(cells['all']['input_tokens'], 0)} | {_stat(s['latency_s'])} |"
        )
    count = "n" if metric == "score" else "n_evidence"
    first = summary["variants"][names[0]]["locomo"]
    lines.append(
        f"| questions (n, {names[0]}) | | " + " | ".join(str(first[k][count]) for k in keys) + " | | | | | |"
    )
    return "\n".join(lines)


def locomo_comparison_table(summary) -> str:
    """Each variant minus SRT on the same LoCoMo questions: score and our F1 over all questions and
    over the answerable ones (1-4), evidence recall and Jaccard, then the score per category,
    with paired bootstrap intervals."""
    categories = [str(c) for c in locomo_eval.CATEGORY_ORDER]
    lines = [
        "| Variant | Paired n | Δ score [95% over queries] | Δ score on 1-4 | Δ F1 (ours) | Δ F1 on 1-4 | "
        "Δ evidence recall | Δ Jaccard | "
        + " | ".join(f"Δ score {LOCOMO_CATEGORIES[int(k)]} ({k})" for k in categories)
        + " |",
        "|---|---|---|---|---|---|---|---|" + "---|" * len(categories),
    ]
    for name, c in summary.get("locomo_comparisons", {}).items():
        every, answerable = c["all"], c["answerable"]
        lines.append(
            f"| {name} | {every['n']} | {_ci(every['locomo_score'])} | {_ci(answerable['locomo_score'])} | "
            f"{_ci(every['f1'])} | {_ci(answerable['f1'])} | {_ci(every['evidence_recall'])} | "
            f"{_ci(every['jaccard'])} | "
            + " | ".join(f"{_ci(c[k]['locomo_score'])} (n={c[k]['n']})" for k in categories)
            + " |"
        )
    return "\n".join(lines)


LOCOMO_NOTE = (
    "LoCoMo's own scoring (task_eval/evaluation.py of the release; srt/locomo_eval.py): multi-hop "
    "(1) is the partial F1 over the comma-separated parts of the reference, temporal (2) and "
    "single-hop (4) token F1, open-domain (3) token F1 against the reference up to its first ';', "
    "adversarial (5) is right only when the answer says 'not mentioned' or 'no information "
    "available'. Its token F1 drops commas, punctuation and a/an/the/and and Porter-stems every "
    "word, so it differs from our F1. Evidence recall: the share of a question's evidence turns the "
    "method recalled (<HIS> tags) or retrieved (RAG, CueMem), over questions with evidence; the full "
    "history recalls nothing by design ('-'). Accuracy and key-F1 need answer keys, which LoCoMo "
    "records do not have: they are not computed for them. Answerable (1-4): the questions whose "
    "premise is in the conversation; an answer that always declines scores category 5's share over "
    "all questions and 0 there. Declined on 1-4: the share of those answered 'not mentioned' (wrong "
    "there). Our F1 of a declining answer to category 5 is its overlap with the reference 'Not "
    "mentioned in the conversation.'"
)


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


def bucket_table(summary, metric, key="by_bucket", extra=(">=24",)) -> str:
    first = next(iter(summary["variants"].values()))
    keys = (
        [str(b) for b in summary["fine_buckets"]] + list(extra)
        if key == "by_bucket"
        else sorted({k for s in summary["variants"].values() for k in s[key]}, key=_group_key)
    )
    lines = ["| Variant | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
    for name, s in summary["variants"].items():
        cells = [_pct(s[key][k][metric]) if k in s[key] else "-" for k in keys]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    counts = [str(first[key][k]["n"]) if k in first[key] else "-" for k in keys]
    lines.append(f"| queries (n, {next(iter(summary['variants']))}) | " + " | ".join(counts) + " |")
    return "\n".join(lines)


def latency_spread(summary) -> str:
    """Whether the batch-1 sample can be read: each variant's ms per generated token, its median and
    its spread (slowest / fastest request). A spread near 1 is a steady machine; far above it, the
    requests met other load, and the latencies say little about the method."""
    parts = []
    for name, s in summary["variants"].items():
        d = s.get("latency_ms_per_token")
        if not d:
            continue
        spread = d["max"] / d["min"] if d["min"] > 0 else float("inf")
        parts.append(f"{name} {d['p50']:.0f} ms (x{spread:.2f}, n {d['n']})")
    if not parts:
        return ""
    few = min(d["n"] for s in summary["variants"].values() if (d := s.get("latency_ms_per_token")))
    caveat = (
        " Fewer than 8 requests a variant cannot tell a slow path from a busy machine."
        if few < 8
        else " A spread above x1.5 means the machine was busy during those requests."
    )
    return "Per generated token at batch 1, median (slowest / fastest): " + ", ".join(parts) + "." + caveat


def latency_table(summary) -> str:
    """Fig. 4's latency panel: mean batch-1 latency (s) per bucket, with mean input / generated tokens."""
    keys = [str(b) for b in summary["fine_buckets"]]
    lines = ["| Variant | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
    for name, s in summary["variants"].items():
        cells = []
        for k in keys:
            d = s["latency_by_bucket"][k]
            cells.append(
                "-"
                if d["latency_s"] is None
                else f"{d['latency_s']['mean']:.2f} ({_stat(d['input_tokens'], digits=0)}/"
                f"{_stat(d['generated_tokens'], digits=0)})"
            )
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def recall_table(summary) -> str:
    lines = [
        "| Variant | H* non-empty (n) | Precision (%) | Recall / coverage (%) | Jaccard (%) | H* empty (n) | "
        "Silence (%) | History tokens passed | Format valid (%) | R_format | R_recall | R_answer | R total |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in summary["variants"].items():
        lines.append(
            f"| {name} | {s['n_recall']} | {_pct(s['precision'])} | {_pct(s['recall'])} | "
            f"{_pct(s['jaccard'])} | {s['n_silent']} | {_pct(s['silent'])} | "
            f"{_stat(s['history_tokens'], digits=0)} | {_pct(s['format_valid'])} | "
            f"{_num(s['reward_format'])} | {_num(s['reward_recall'])} | {_num(s['reward_answer'])} | "
            f"{_num(s['reward_total'])} |"
        )
    return "\n".join(lines)


def attention_table(summary) -> str:
    lines = [
        "| Example | Turns | Chain | Share on H* without recall (%) | Share on H* with self-recall (%) |",
        "|---|---|---|---|---|",
    ]
    for e in summary["attention"]:
        lines.append(
            f"| {e['id']} | {e['num_turns']} | {e['chain']} | {_pct(e['no_recall_on_gold'])} | "
            f"{_pct(e['self_recall_on_gold'])} |"
        )
    return "\n".join(lines)


SCORING_NOTE = (
    "How answers are scored. **Acc.**: every answer key of the record is stated in the final answer "
    '(word boundaries, case folded, numbers normalised so "$180.00" = "$180" = "180" while "$20" is not '
    'in "$207"; a yes/no key counts only without the opposite word or a hedge), and every other value '
    "it states (an amount, a number, a date or time, a code, a name) is in the reference answer "
    "(metrics.answer_is_right): a list of candidates is not an answer. Table 2 reads accuracy and F1 "
    "on the queries that need recall; those that need none are reported apart. "
    "**F1**: the paper's SQuAD-style token F1 against the reference "
    "sentence (numbers kept whole), which a terse correct answer scores low against a templated reference. "
    "**key-F1**: the same F1 against the answer keys joined, which credits a terse correct answer and "
    "still charges extra words. Recall, precision and Jaccard count only queries whose H* is non-empty; "
    "on queries with an empty H*, **Silence** is the share of self-recall answers that recalled nothing. "
    "For the retrievers (recency, rag, cuemem) recall is the coverage of H* by what they passed on."
)


def _options_note(summary) -> str:
    notes = [f"`{n}`: {s['options']}" for n, s in summary["variants"].items() if s.get("options")]
    return "Settings per variant: " + "; ".join(notes) if notes else ""


def interval_note(summary) -> str:
    """What Table 2's intervals resample: the test queries, with one trained checkpoint per variant."""
    config, srt = summary["config"], summary["srt_variant"]
    n = summary["variants"][srt].get("needs_recall", {}).get("n") if srt in summary["variants"] else None
    return (
        f"Δ: variant minus SRT in points, mean over the paired test queries, with a {config.get('bootstrap')}"
        f"-resample seeded paired bootstrap 95% interval **over the {n or 'paired'} test queries of one "
        "training run per variant**: it holds the noise of a finite test set, not the spread between "
        "training runs; another training seed can move Δ by as much as the interval is wide "
        "(`python -m srt.runs_report` reads paired runs; `make demo SEEDS=...`)."
    )


def runs_spread_note(spread) -> str:
    """--runs-spread: the spread over training runs of this configuration, beside this one run's Δ."""
    d, j = spread["delta_accuracy"], spread.get("jaccard")
    k = d["runs"]
    interval = (
        ""
        if d.get("low") is None
        else f", t({k - 1}) 95% over runs [{100 * d['low']:+.1f}, {100 * d['high']:+.1f}]"
    )
    sd = "" if d.get("sd") is None else f", SD {100 * d['sd']:.1f}"
    jaccard = (
        ""
        if not j
        else f" SRT's recall Jaccard over the same runs: mean {100 * j['mean']:.1f}%"
        + ("" if j.get("sd") is None else f", SD {100 * j['sd']:.1f}")
        + f", range {100 * j['min']:.1f} to {100 * j['max']:.1f}."
    )
    return (
        f"**Across {k} training runs of this configuration** (`{spread['path']}`, the same "
        f"{spread['queries']} test queries): the control minus SRT in accuracy had mean "
        f"{100 * d['mean']:+.1f} points{sd}{interval}, range {100 * d['min']:+.1f} to {100 * d['max']:+.1f}. "
        "This report's Δ is one draw from that spread." + jaccard
    )


def write_report(summary, out_dir, plots) -> Path:
    config = summary["config"]
    counts = {s["n"] for s in summary["variants"].values()}
    cut = [
        f"{n} ({_pct(s['truncated'])}%)"
        for n, s in summary["variants"].items()
        if s["truncated"] is not None and s["truncated"] >= CUTOFF_LIMIT
    ]
    srt = summary["srt_variant"]
    size_note = ""
    if srt:
        by_coarse = summary["variants"][srt].get("n_by_coarse_bucket", {})
        small = [b for b, n in by_coarse.items() if n < MIN_PER_BUCKET]
        size_note = (
            f"SRT ({srt}) answered {summary['variants'][srt]['n']} queries, per 8/16/24/32-round bucket "
            + ", ".join(f"{b}: {n}" for b, n in by_coarse.items())
            + ". "
            + (
                ""
                if summary["variants"][srt]["n"] >= MIN_QUERIES and not small
                else f"**Fewer than {MIN_QUERIES} queries or {MIN_PER_BUCKET} per bucket: read the "
                "intervals, not the point estimates.**"
            )
        )
    parts = [
        "# SRT evaluation report",
        f"Data: `{config['data']}`, {summary['num_examples']} queries selected (stratified over the "
        f"8/16/24/32-round buckets when limited; seed {config['seed']})"
        + ("" if len(counts) <= 1 else f"; variants run on {sorted(counts)} of them (see n)")
        + ". "
        + size_note,
        SCORING_NOTE,
        "## Table 1: answers, latency and throughput",
        table1(summary),
        f"Latency: seconds per request at batch size 1 after one warm-up request, end to end from the query "
        f"to the parsed answer (retrieval query included), on {config.get('latency_per_bucket')} request(s) "
        f"per length bucket; its token columns are that sample's. "
        + latency_spread(summary)
        + " Throughput: answers per second of "
        f"generation wall time in the batched pass (batch {config['batch_size']}). Offline: RAG's embedding "
        f"of the history and CueMem's memory build per query, never inside the latency. Cut off: answers "
        f"that reached the token cap ({config['max_new_tokens']} for srt / srt-p, "
        f"{config['max_new_tokens_direct']} otherwise) without a stop token.",
        (
            "**Cut-off rate at or above 5%:** "
            + ", ".join(cut)
            + "; raise the token cap before reading their "
            "scores."
        )
        if cut
        else "Every variant stops before the token cap on more than 95% of its answers.",
        f"## Table 2: ablations, each against SRT ({srt or 'n/a'}) on the same queries",
        table2(summary) if summary["table2"] else "(no Table 2 variants; name them with --table2)",
        interval_note(summary) + " McNemar: exact two-sided test of paired accuracy "
        "(queries only the variant / only SRT got right). Recall is that of the <HIS> tags: a w/o CoT "
        "model writes none, so its recall is 0 by construction here (the paper does not say how it "
        "measured recall for that variant).",
        *([runs_spread_note(summary["runs_spread"])] if summary.get("runs_spread") else []),
        "## Every variant against SRT (paired; 95% over the test queries, one training run each)",
        comparison_table(summary) or "-",
    ]
    if summary.get("pairs"):
        parts += [
            "## Pairs (--pairs A:B): B minus A, paired, on the queries that need recall (tokens: all)",
            pairs_table(summary),
        ]
    if any(s.get("locomo") for s in summary["variants"].values()):
        parts += [
            "## LoCoMo score per question category (%)",
            locomo_table(summary, "score"),
            "## LoCoMo evidence recall per question category (%)",
            locomo_table(summary, "evidence_recall"),
            f"## LoCoMo, every variant against SRT ({srt or 'n/a'}; paired, points)",
            locomo_comparison_table(summary) if summary.get("locomo_comparisons") else "-",
            LOCOMO_NOTE,
        ]
    parts += [
        f"## Table 3: error types of wrong answers per dialogue length ({srt or 'n/a'})",
        table3(summary),
        "Truncated: a chain cut off by the token cap (no answer), kept apart from the paper's four types.",
        "## Recall, silence, coverage and reward components (Eqs. (4)-(7))",
        recall_table(summary),
        "## Latency by dialogue length (Fig. 4 latency panel; s at batch 1, (input/generated tokens))",
        latency_table(summary),
        "## F1 by dialogue length (rounds; Fig. 4 buckets)",
        bucket_table(summary, "f1"),
        "## Accuracy by dialogue length",
        bucket_table(summary, "accuracy"),
        "## key-F1 by dialogue length",
        bucket_table(summary, "key_f1"),
    ]
    for field, title in BREAKDOWNS.items():
        parts += [f"## Accuracy by {title}", bucket_table(summary, "accuracy", f"by_{field}")]
    parts += [
        "## Recall (non-empty H*) by recall distance",
        bucket_table(summary, "recall", "by_distance_bin"),
    ]
    if _options_note(summary):
        parts.append(_options_note(summary))
    if summary["attention"]:
        parts += [
            f"## Attention analysis (§4.6, {srt})",
            attention_table(summary),
            "Share of the answer tokens' attention (averaged over layers and heads) on the prompt lines of "
            "the turns of H*, normalized over all history turns' prompt lines, in both settings: the "
            "<HIS> copies in the chain are not counted, so the comparison is not won by construction.",
        ]
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
    ax.set(
        xlabel="dialogue length (rounds)",
        ylabel="F1",
        xticks=list(summary["fine_buckets"]),
        ylim=(0, 100),
        title="F1 against dialogue length",
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    path = _save_figure(fig, path)
    plt.close(fig)
    return path


def plot_latency_by_length(summary, path) -> Path:
    """Fig. 4's latency panel: batch-1 seconds per request against dialogue length."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, s in summary["variants"].items():
        xs = [b for b in summary["fine_buckets"] if s["latency_by_bucket"][str(b)]["latency_s"] is not None]
        ax.plot(xs, [s["latency_by_bucket"][str(b)]["latency_s"]["mean"] for b in xs], marker="o", label=name)
    ax.set(
        xlabel="dialogue length (rounds)",
        ylabel="latency per request, batch 1 (s)",
        xticks=list(summary["fine_buckets"]),
        title="Latency against dialogue length",
    )
    ax.set_ylim(bottom=0)
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
    ax.set(
        xlabel="dialogue length (rounds)",
        ylabel="share of wrong answers (%)",
        ylim=(0, 100),
        title=f"Error types per length bucket ({name or 'n/a'})\n",
    )
    ax.legend(fontsize=8, loc="upper right")
    path = _save_figure(fig, path)
    plt.close(fig)
    return path


def plot_attention(attention, path) -> Path:
    """Fig. 3 as heat maps: one panel per example, rows = without recall / with self-recall, columns =
    history turns, values = attention share normalized per row; the turns of H* are marked in red."""
    plt = pyplot()
    fig, axes = plt.subplots(
        len(attention),
        1,
        figsize=(max(6, 0.22 * max(len(e["turns"]) for e in attention)), 1.6 * len(attention) + 0.6),
        squeeze=False,
    )
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
    plots = [
        plot_f1_by_length(summary, out_dir / "f1_by_length.png"),
        plot_error_types(summary, out_dir / "error_types.png"),
    ]
    if any(s["latency_s"] for s in summary["variants"].values()):
        plots.append(plot_latency_by_length(summary, out_dir / "latency_by_length.png"))
    if summary["attention"]:
        plots.append(plot_attention(summary["attention"], out_dir / "attention.png"))
    summary["plots"] = [p.name for p in plots]
    write_json(out_dir / "summary.json", summary)
    return write_report(summary, out_dir, plots)
