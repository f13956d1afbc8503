"""What stage 0 checks a corpus against (§3.2): that a model could answer test queries by lookup
from train, without reading the history. SRT is scored on whether a model recalls the right turns
and answers from them; a test answer that train holds word for word, or that the number in a
yes/no query decides on its own, rewards memorising train instead.

    checks = lookup_checks({"train": [...], "dev": [...], "test": [...]})   # stats.json "lookup_checks"
    print(lookup_summary(checks))                                            # the line a build prints

The checks read only the records' own fields (query, answer, answer_keys, meta.domain,
meta.query_type); docs/synthetic-corpus.md ("Lookup checks") describes them and what they measured.
"""

from __future__ import annotations

import re
from collections import Counter

import numpy as np


def normalize(text: str) -> str:
    """The text two records are compared by, here and in stage 0's deduplication: lower case, the
    runs of [a-z0-9$] joined by one space."""
    return " ".join(re.findall(r"[a-z0-9$]+", text.lower()))


# --------------------------------------------------------------------------------------------
# Lookup checks: can a test answer be read off train, or off the query's number alone?
# (a) a query/answer pair of dev or test that train holds word for word (after normalize), and
#     the test queries a train lookup answers: train holds the same normalised query, and the
#     answer it most often gives there is the test's answer;
# (b) on yes/no queries (one answer key "yes" or "no"), the majority answer per query type
#     (meta.domain/meta.query_type) and per bucket of the first number in the query: the
#     quartiles of that type's numbers over all splits, "none" for a query without a number.
#     A rule that reads only the type and the number gets the majority rate of each bucket.
# Bounds: no test pair in train; no majority more than 10 points above chance (50%)
# in any query type or bucket of LOOKUP_MIN_BUCKET queries or more.
# --------------------------------------------------------------------------------------------
LOOKUP_BOUNDS = {"test_pairs_in_train": 0, "max_majority_excess": 0.10}
LOOKUP_MIN_BUCKET = 10  # smaller buckets are listed, not ranked: one query is always a 100% majority
FIRST_NUMBER = re.compile(r"\d+(?:,\d{3})*(?:\.\d+)?")


def first_number(text: str) -> float | None:
    m = FIRST_NUMBER.search(text)
    return float(m.group().replace(",", "")) if m else None


def yes_no_answer(record) -> str | None:
    """The answer of a yes/no query (exactly one of "yes" and "no" among its answer keys), else None."""
    found = {k.strip().lower() for k in record.get("answer_keys") or []} & {"yes", "no"}
    return found.pop() if len(found) == 1 else None


def lookup_type(record) -> str:
    meta = record.get("meta") or {}
    return f"{meta.get('domain', 'unknown')}/{meta.get('query_type', 'unknown')}"


def number_buckets(numbers) -> tuple[list[float], dict[int, str]]:
    """Quartile edges of a query type's numbers and a name per bucket: bucket k holds the numbers x
    with k edges below x (x <= first edge, ..., x > last edge), named by its smallest and largest."""
    edges = sorted(set(np.quantile(numbers, [0.25, 0.5, 0.75]).tolist())) if numbers else []
    inside = {}
    for x in numbers:
        inside.setdefault(int(np.searchsorted(edges, x, side="left")), []).append(x)
    return edges, {k: f"{min(xs):g}-{max(xs):g}" for k, xs in inside.items()}


def _majority(counts: Counter) -> str:
    return min(counts.items(), key=lambda kv: (-kv[1], kv[0]))[0]  # ties: the first in sort order


def lookup_checks(splits) -> dict:
    """The checks above, on the records' own fields (query, answer, answer_keys, meta.domain,
    meta.query_type); written to stats.json as "lookup_checks"."""
    train, test = splits.get("train", []), splits.get("test", [])
    pairs = {(normalize(r["query"]), normalize(r["answer"])) for r in train}
    answers_of = {}
    for r in train:
        answers_of.setdefault(normalize(r["query"]), Counter())[normalize(r["answer"])] += 1
    shared = {
        name: [r for r in splits.get(name, []) if (normalize(r["query"]), normalize(r["answer"])) in pairs]
        for name in ("dev", "test")
    }
    answerable = sum(
        normalize(r["query"]) in answers_of
        and _majority(answers_of[normalize(r["query"])]) == normalize(r["answer"])
        for r in test
    )

    # (b) yes/no: the majority answer per query type and per number bucket, over all splits
    rows = [
        (name, lookup_type(r), first_number(r["query"]), yes_no_answer(r))
        for name, part in splits.items()
        for r in part
        if yes_no_answer(r)
    ]
    numbers = {}
    for _, kind, x, _ in rows:
        if x is not None:
            numbers.setdefault(kind, []).append(x)
    buckets = {kind: number_buckets(xs) for kind, xs in numbers.items()}

    def bucket(kind, x):
        if x is None:
            return "none"
        edges, names = buckets[kind]
        return names[int(np.searchsorted(edges, x, side="left"))]

    cells, fitted = {}, {}
    for name, kind, x, answer in rows:
        for key in ((kind, "all"), (kind, bucket(kind, x))):
            cells.setdefault(key, Counter())[answer] += 1
        if name == "train":  # the same rule fitted on train and scored on test: what an attack gets
            for key in ((kind, "all"), (kind, bucket(kind, x))):
                fitted.setdefault(key, Counter())[answer] += 1

    def order(item):  # a type's row first, then its buckets from the lowest number up
        (kind, where), _ = item
        return kind, where != "all", where == "none", float(first_number(where) or 0)

    by_type, worst = {}, (-1.0, None)
    for (kind, where), counts in sorted(cells.items(), key=order):
        n, rate = sum(counts.values()), max(counts.values()) / sum(counts.values())
        row = {"n": n, "yes": counts["yes"], "majority_rate": round(rate, 4)}
        entry = by_type.setdefault(kind, {"buckets": {}})
        if where == "all":
            entry.update(row)
        else:
            entry["buckets"][where] = row
        if n >= LOOKUP_MIN_BUCKET and rate - 0.5 > worst[0]:  # the first of equal excesses
            worst = (rate - 0.5, f"{kind} {where}")
    scored = [  # a bucket train lacks falls back to the type's majority in train
        (answer, fitted.get((kind, bucket(kind, x))) or fitted.get((kind, "all")))
        for name, kind, x, answer in rows
        if name == "test"
    ]
    right = sum(bool(counts) and answer == _majority(counts) for answer, counts in scored)
    result = {
        "normalisation": "lower case, the runs of [a-z0-9$] joined by one space",
        "pairs_in_train": {name: len(part) for name, part in shared.items()},
        "pairs_in_train_examples": [{"query": r["query"], "answer": r["answer"]} for r in shared["test"][:3]],
        "test_answerable_by_lookup": {
            "count": answerable,
            "share": round(answerable / len(test), 4) if test else 0.0,
        },
        "yes_no": {
            "queries": len(rows),
            "grouping": "query type = meta.domain/meta.query_type",
            "buckets": "quartiles of the first number in the query, per query type, over all splits "
            "(none: no number)",
            "min_bucket": LOOKUP_MIN_BUCKET,
            "by_type": by_type,
            "max_majority_excess": round(max(worst[0], 0.0), 4),
            "max_excess_at": worst[1],
            "train_rule_on_test": {
                "n": len(scored),
                "accuracy": round(right / len(scored), 4) if scored else None,
            },
        },
        "bounds": dict(LOOKUP_BOUNDS),
    }
    result["within_bounds"] = (
        result["pairs_in_train"]["test"] <= LOOKUP_BOUNDS["test_pairs_in_train"]
        and max(worst[0], 0.0) <= LOOKUP_BOUNDS["max_majority_excess"]
    )
    return result


def lookup_summary(checks) -> str:
    yes_no = checks["yes_no"]
    rule = yes_no["train_rule_on_test"]["accuracy"]
    return (
        f"  lookup: test pairs in train {checks['pairs_in_train']['test']} (dev "
        f"{checks['pairs_in_train']['dev']}), test answerable by a train lookup "
        f"{checks['test_answerable_by_lookup']['share']:.1%}; yes/no majority per (type, number bucket) "
        f"at most {0.5 + yes_no['max_majority_excess']:.1%}"
        + (f" ({yes_no['max_excess_at']})" if yes_no["max_excess_at"] else "")
        + (f", train's rule on test {rule:.1%}" if rule is not None else "")
        + f": {'within' if checks['within_bounds'] else 'OUTSIDE'} bounds"
    )
