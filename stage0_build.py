"""Stage 0 of SRT: dialogue dependency structure construction (paper §3.2).

    dialogues -> dedup -> 8..32 rounds -> Eq. (2) dependency scoring -> teacher (H*, Z, A*)
              -> verification filter -> train/dev/test JSONL + stats.json + config.json
                 (split by dialogue, seeded; --split test puts every record in one split)
                 + LoCoMo: conversations.jsonl, every conversation whole, for retrievers

stats.json's "lookup_checks" says whether a test answer can be read off train or off the number
in a yes/no query alone (lookup_checks below; docs/synthetic-corpus.md).

The records it writes feed every later stage; their format is in docs/design.md ("Data"), their
reader and checks in srt/data_io.py. The sources live in srt/data/: synthetic.py (the embedded
generator, one module per domain beside it) and corpora.py (LoCoMo, CoQA, MultiWOZ, DailyDialog,
ReDial, MG-ShopDial, chit-chat, our JSONL); the LLM teachers of §3.2 (hf:MODEL, api:MODEL) and the
answer-key-free grounding check in srt/data/teacher.py; the sentence embedder of Eq. (2) in
srt/modeling.py. The prompt and the SFT target that later stages render from a record live in
srt/prompt.py.

Run `python stage0_build.py --help`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

from srt.config import (
    at_least,
    claim_out,
    env_var_name,
    in_range,
    parse_config,
    positive,
    require,
    write_config,
)
from srt.data.corpora import LOADERS, LOCOMO_WINDOWS, load_corpus, locomo_conversations
from srt.data.synthetic import generate_synthetic
from srt.data.synthetic_common import keys_outside_recall
from srt.data.teacher import gold_is_complete, grounded, make_teacher
from srt.data_io import BUCKETS, bucket_of, write_json, write_jsonl
from srt.modeling import embed
from srt.prompt import his_tag


# --------------------------------------------------------------------------------------------
# Raw dialogues: the form every source is converted to before §3.2 runs (corpora.py's docstring)
#   {"id", "source", "domain", "meta"?, "rounds": [{"user", "assistant", "gold"?, "query"?}, ...]}
# A round with "gold" or "query" is a query to annotate; its assistant text is the reference answer.
# --------------------------------------------------------------------------------------------
def read_dialogues(path, on_error="raise", errors=None) -> list[dict]:
    """Raw dialogues from our JSONL (corpora.parse_jsonl_dialogue); skipped lines go to `errors`."""
    dialogues, report = load_corpus("jsonl", path, on_error=on_error)
    if errors is not None:
        errors.extend(report.get("errors", []))
    return dialogues


def utterances(dialogue) -> list[dict]:
    """The labelled utterances of a dialogue, Q1, A1, Q2, A2, ... with their round index."""
    out = []
    for i, r in enumerate(dialogue["rounds"], 1):
        out.append({"label": f"Q{i}", "speaker": "user", "text": r["user"], "round": i})
        out.append({"label": f"A{i}", "speaker": "assistant", "text": r["assistant"], "round": i})
    return out


# --------------------------------------------------------------------------------------------
# §3.2 step 1: deduplication. Turn-level feature hashing gives each dialogue a set of turn
# fingerprints; dialogues are first clustered on hashed intent features (the opening words of
# every user turn), and inside a cluster two dialogues whose fingerprint sets overlap by at least
# --dedup-jaccard are near-identical: the later one is merged into the earlier (dropped).
# Dialogues that share meta.split_group (LoCoMo's windows of one conversation) overlap by
# construction and are never compared with each other.
# --------------------------------------------------------------------------------------------
def _normalize(text: str) -> str:
    return " ".join(re.findall(r"[a-z0-9$]+", text.lower()))


def _hash(text: str, dim: int | None = None) -> int:
    h = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")
    return h % dim if dim else h


def split_group(dialogue):
    """What must stay together: a split never divides it, dedup never compares within it."""
    return (dialogue.get("meta") or {}).get("split_group")


def turn_fingerprints(dialogue) -> set[int]:
    return {_hash(_normalize(u["text"])) for u in utterances(dialogue)}


def intent_vector(dialogue, dim=256) -> np.ndarray:
    v = np.zeros(dim, dtype=np.float32)
    for r in dialogue["rounds"]:
        v[_hash(" ".join(_normalize(r["user"]).split()[:2]), dim)] += 1.0
    return v / (np.linalg.norm(v) or 1.0)


def deduplicate(dialogues, intent_threshold=0.9, jaccard_threshold=0.8):
    """Returns (kept dialogues, number merged away). Leader clustering on intent vectors, then
    exact Jaccard of turn fingerprints inside each cluster."""
    leaders, clusters, kept, merged = [], [], [], 0
    for d in dialogues:
        vec, prints, group = intent_vector(d), turn_fingerprints(d), split_group(d)
        sims = np.array([vec @ leader for leader in leaders]) if leaders else np.zeros(0)
        if len(sims) and sims.max() >= intent_threshold:
            cluster = clusters[int(sims.argmax())]
        else:
            leaders.append(vec)
            clusters.append([])
            cluster = clusters[-1]
        if any(
            (group is None or g != group) and len(prints & p) / len(prints | p) >= jaccard_threshold
            for g, p in cluster
        ):
            merged += 1
            continue
        cluster.append((group, prints))
        kept.append(d)
    return kept, merged


# --------------------------------------------------------------------------------------------
# Eq. (2): Score(u_i, Q_t) = 0.6 * Sim_sem(u_i, Q_t) + 0.4 * exp(-0.15 * |t - i|) > 0.6
# Distances are in rounds. 10 rounds back the decay term is exp(-1.5) = 0.22 (§3.2).
# --------------------------------------------------------------------------------------------
def dependency_score(similarity, t, i, w_sem=0.6, w_dist=0.4, decay=0.15):
    return w_sem * np.asarray(similarity) + w_dist * np.exp(-decay * np.abs(np.asarray(t) - np.asarray(i)))


def passes_threshold(score, threshold=0.6):
    return np.asarray(score) > threshold  # strict, as written in Eq. (2)


# --------------------------------------------------------------------------------------------
# The teacher (§3.2): given (Q_t, C_t) it returns the minimal recall set H*_t in the paper's
# "Turn X: 'content'" form, the reasoning chain Z_t and the answer A*_t. The oracle serves the
# synthetic source from its ground truth; LLM teachers plug in behind the same `annotate`.
# --------------------------------------------------------------------------------------------
class OracleTeacher:
    name = "oracle"

    def annotate(self, query: str, history: list[dict], gold: dict, answer: str) -> dict:
        by_label = {u["label"]: u for u in history}
        return {
            "recall_turns": [
                f"Turn {label}: '{by_label[label]['text']}'" for label in gold["recall"] if label in by_label
            ],
            "analysis": gold.get("analysis", "what the user needs"),
            "reasoning": gold.get("reasoning", ""),
            "answer": answer,
            "answer_keys": list(gold.get("answer_keys", [])),
            "derived_yes_no": bool(gold.get("derived_yes_no")),
            "query_type": gold.get("query_type", "unknown"),
        }

    def annotate_many(self, items) -> list[tuple[dict, None]]:
        return [(self.annotate(*item), None) for item in items]


TURN_REF = re.compile(r"Turn\s+([QA]\d+)\s*:")


def parse_turn_refs(recall_turns) -> list[str]:
    """ "Turn A5: 'The Chakra Balancing service is $180.'" -> "A5"."""
    return [m.group(1) for ref in recall_turns for m in [TURN_REF.match(ref.strip())] if m]


def build_reasoning(analysis: str, recalled: list[dict], reasoning: str) -> str:
    """Z_t in the output format of docs/design.md: analyze -> recall (one <HIS> per utterance) -> reason."""
    recall = "\n".join(his_tag(u) for u in recalled) if recalled else "No earlier turn is needed."
    return (
        f"1. Analyze Query: The user asks {analysis}.\n2. Recall History: {recall}\n3. Reasoning: {reasoning}"
    )


# --------------------------------------------------------------------------------------------
# The verification filter at the end of §3.2
# --------------------------------------------------------------------------------------------
HIS_TAG = re.compile(r"<HIS>(.*?)</HIS>", re.S)


def verify_record(record) -> str | None:
    """None if the triple (H*, Z, A*) passes; else the name of the check it fails."""
    by_label = {u["label"]: u["text"] for u in record["history"]}
    if any(label not in by_label for label in record["recall"]):
        return "recall_outside_history"  # H* must lie inside C_t
    cited = []
    for tag in HIS_TAG.findall(record["reasoning"]):
        label, _, text = tag.partition(":")
        label = label.strip()
        if label not in record["recall"] or by_label.get(label) != text.strip():
            return "inconsistent_reasoning"  # a tag that is not a verbatim element of H*
        cited.append(label)
    if set(cited) != set(record["recall"]):
        return "inconsistent_reasoning"  # an element of H* the reasoning never cites
    if record["recall"]:
        evidence = " ".join(by_label[label] for label in record["recall"]).lower()
        derived = record["meta"].get("derived_yes_no", False)
        for key in record.get("answer_keys", []):
            if derived and key.lower() in ("yes", "no"):
                continue  # a derived yes/no is reasoned, not copied
            if key.lower() not in evidence or key.lower() not in record["answer"].lower():
                return "ungrounded_answer"  # string matching between A* and H*
        if not record.get("answer_keys"):  # no keys: A*'s numbers and content words, found in H*
            check = record["meta"].get("grounding") or grounded(
                record["answer"], [by_label[label] for label in record["recall"]]
            )
            if not check["grounded"] and not record["meta"].get("derived_answer"):
                return "ungrounded_answer_words"  # a derived answer (LoCoMo's dates) is only reported
    return None


# --------------------------------------------------------------------------------------------
# The whole §3.2 pipeline
# --------------------------------------------------------------------------------------------
# The keys of a round's gold the record holds in its own fields; any other key goes to meta.
GOLD_FIELDS = {"recall", "answer_keys", "answer", "analysis", "reasoning", "query_type", "derived_yes_no"}


def corpus_gives_recall(dialogue, rnd) -> bool:
    """A corpus's own H* (LoCoMo's evidence, JSONL gold) already justifies its round: Eq. (2)'s
    selection, which finds the dialogues worth annotating, does not judge it (its scores and C~_t
    are still computed). The synthetic generator's planted H* stays under the filter."""
    gold = rnd.get("gold")
    return (
        isinstance(gold, dict)
        and isinstance(gold.get("recall"), list)
        and dialogue.get("source") != "synthetic"
    )


def annotate_dialogues(dialogues, teacher, args, progress=True):
    """Eq. (2) scoring, dependency-aware selection, teacher annotation and verification of every
    round with gold or a query mark. The oracle serves gold (beside an LLM teacher only complete
    gold, teacher.gold_is_complete); the LLM teacher the rest, in batches across dialogues.
    Returns (records, drop counts)."""
    from tqdm import tqdm

    drops, oracle = Counter(), OracleTeacher()
    llm = not isinstance(teacher, OracleTeacher)
    all_utts = [utterances(d) for d in dialogues]
    texts = [u["text"] for utts in all_utts for u in utts]
    unique = sorted(set(texts))  # templates and small talk repeat across dialogues: embed each text once
    unique_vectors = embed(unique)
    row = {text: k for k, text in enumerate(unique)}
    rows = [row[text] for text in texts]
    pending, offset = [], 0
    for d, utts in zip(tqdm(dialogues, desc="Eq. (2)", disable=not progress), all_utts):
        vecs = unique_vectors[rows[offset : offset + len(utts)]]
        offset += len(utts)
        queries, selected = [], False
        for t, rnd in enumerate(d["rounds"], 1):
            if "gold" not in rnd and not rnd.get("query"):
                continue
            history, query_vec = utts[: 2 * (t - 1)], vecs[2 * (t - 1)]
            sims = vecs[: 2 * (t - 1)] @ query_vec
            scores = dependency_score(
                sims, t, [u["round"] for u in history], args.w_sem, args.w_dist, args.decay
            )
            kept = {u["label"] for u, s in zip(history, scores) if passes_threshold(s, args.threshold)}
            selected |= bool(kept)
            gold = rnd.get("gold")
            who = (
                oracle
                if gold is not None and (not llm or gold_is_complete(gold))
                else teacher
                if llm
                else None
            )
            queries.append(
                {"t": t, "rnd": rnd, "history": history, "scores": scores, "kept": kept, "who": who}
            )
        if not selected and not all(corpus_gives_recall(d, q["rnd"]) for q in queries):
            drops["dependency_selection"] += 1  # no (Q_t, u_i) pair passes Eq. (2)
            queries = [q for q in queries if corpus_gives_recall(d, q["rnd"])]
        if any(q["who"] is None for q in queries):  # no ground truth for the oracle: needs an LLM teacher
            drops["teacher:no_gold_for_oracle"] += sum(q["who"] is None for q in queries)
        pending.append((d, queries))
    for who in (oracle, teacher) if llm else (oracle,):
        mine = [q for _, queries in pending for q in queries if q["who"] is who]
        # prompts of many dialogues go out together: a chat corpus has one query per dialogue
        chunk = len(mine) if who is oracle else max(64, 4 * getattr(who, "max_concurrency", 1))
        bar = tqdm(
            range(0, len(mine), chunk or 1), desc=f"teacher {who.name}", disable=not progress or who is oracle
        )
        for start in bar:
            part = mine[start : start + chunk]
            notes = who.annotate_many(
                [(q["rnd"]["user"], q["history"], q["rnd"].get("gold"), q["rnd"]["assistant"]) for q in part]
            )
            for q, (note, reason) in zip(part, notes):
                q["note"], q["reason"] = note, reason
    records = []
    for d, queries in pending:
        for q in queries:
            t, rnd, history, note = q["t"], q["rnd"], q["history"], q.get("note")
            if note is None:
                if q["who"] is not None:
                    drops[f"teacher:{q['reason']}"] += 1
                continue
            recall = parse_turn_refs(note["recall_turns"])
            by_label = {u["label"]: u for u in history}
            recalled = [by_label[label] for label in recall if label in by_label]
            hist = [{k: u[k] for k in ("label", "speaker", "text")} for u in history]
            meta = {
                **(d.get("meta") or {}),
                **(rnd.get("meta") or {}),
                **{k: v for k, v in (rnd.get("gold") or {}).items() if k not in GOLD_FIELDS},
            }
            meta.update(
                {
                    "num_turns": t,
                    "bucket": bucket_of(t),
                    "dialogue_id": d["id"],
                    "dialogue_rounds": len(d["rounds"]),
                    "domain": d.get("domain", "unknown"),
                    "query_type": note["query_type"],
                    "derived_yes_no": note["derived_yes_no"],
                    "scores": {u["label"]: round(float(s), 4) for u, s in zip(history, q["scores"])},
                }
            )
            if q["who"] is not oracle:
                meta.update(
                    teacher=teacher.name, reasoning_source="teacher", reference_answer=rnd["assistant"]
                )
            if recall and not note["answer_keys"]:
                meta["grounding"] = grounded(note["answer"], [u["text"] for u in recalled])
            record = {
                "id": f"{d['id']}-t{t:02d}",
                "source": d.get("source", "jsonl"),
                "history": hist,
                "query": rnd["user"],
                "query_turn": t,
                "recall": recall,
                "reasoning": build_reasoning(note["analysis"], recalled, note["reasoning"]),
                "answer": note["answer"],
                "answer_keys": note["answer_keys"],
                "pruned": [u["label"] for u in history if u["label"] in q["kept"] or u["label"] in recall],
                "meta": meta,
            }
            reason = verify_record(record)
            if reason:
                drops[f"verification:{reason}"] += 1
            else:
                records.append(record)
    return records, drops


def split_by_dialogue(records, seed, dev_fraction, test_fraction):
    """Train, dev and test never share a dialogue, nor a split group (LoCoMo: one conversation)."""

    def group(r):
        return r["meta"].get("split_group", r["meta"]["dialogue_id"])

    ids = sorted({group(r) for r in records})
    random.Random(seed).shuffle(ids)
    n_test, n_dev = round(len(ids) * test_fraction), round(len(ids) * dev_fraction)
    test_ids, dev_ids = set(ids[:n_test]), set(ids[n_test : n_test + n_dev])
    splits = {"train": [], "dev": [], "test": []}
    for r in records:
        d = group(r)
        splits["test" if d in test_ids else "dev" if d in dev_ids else "train"].append(r)
    return splits


def corpus_stats(num_input, dialogues, splits, drops):
    records = [r for part in splits.values() for r in part]
    n = max(1, len(records))
    buckets = Counter(r["meta"]["bucket"] for r in records)
    sizes = Counter(len(r["recall"]) for r in records)
    distances = Counter()
    for r in records:
        for label in r["recall"]:
            d = r["query_turn"] - int(label[1:])
            distances["1-4" if d < 5 else "5-9" if d < 10 else "10-19" if d < 20 else "20+"] += 1
    return {
        "dialogues_in": num_input,
        "dialogues_kept": len(dialogues),
        "queries": len(records),
        "queries_per_split": {k: len(v) for k, v in splits.items()},
        "dialogues_per_split": {k: len({r["meta"]["dialogue_id"] for r in v}) for k, v in splits.items()},
        "bucket_counts": {str(b): buckets.get(b, 0) for b in BUCKETS},
        "bucket_share": {str(b): round(buckets.get(b, 0) / n, 3) for b in BUCKETS},
        "recall_size_hist": {str(k): sizes[k] for k in sorted(sizes)},
        "share_recall_ge_2": round(sum(v for k, v in sizes.items() if k >= 2) / n, 3),
        "recall_distance_hist": {k: distances.get(k, 0) for k in ("1-4", "5-9", "10-19", "20+")},
        # Eq. (2) keeps distractors: C~_t should be a real superset of H*, not H* alone (§3.3)
        "share_pruned_equals_recall": round(
            sum(set(r["pruned"]) == set(r["recall"]) for r in records) / n, 3
        ),
        "mean_pruned_over_history": round(
            sum(len(r["pruned"]) / max(1, len(r["history"])) for r in records) / n, 3
        ),
        # unique gold: an utterance outside H* that holds a distinctive answer key is an equally valid recall
        "share_key_outside_recall": round(
            sum(bool(keys_outside_recall(r["history"], r["recall"], r["answer_keys"])) for r in records) / n,
            4,
        ),
        # §3.2's string matching without answer keys; a derived answer that fails is kept, and counted here
        "grounding_checked": sum("grounding" in r["meta"] for r in records),
        "ungrounded_kept_as_derived": sum(
            not r["meta"].get("grounding", {"grounded": True})["grounded"] for r in records
        ),
        "query_types": dict(Counter(r["meta"]["query_type"] for r in records)),
        "domains": dict(Counter(r["meta"]["domain"] for r in records)),
        "dropped": dict(drops),
    }


# --------------------------------------------------------------------------------------------
# Lookup checks: can a test answer be read off train, or off the query's number alone?
# (a) a query/answer pair of dev or test that train holds word for word (after _normalize), and
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
    pairs = {(_normalize(r["query"]), _normalize(r["answer"])) for r in train}
    answers_of = {}
    for r in train:
        answers_of.setdefault(_normalize(r["query"]), Counter())[_normalize(r["answer"])] += 1
    shared = {
        name: [r for r in splits.get(name, []) if (_normalize(r["query"]), _normalize(r["answer"])) in pairs]
        for name in ("dev", "test")
    }
    answerable = sum(
        _normalize(r["query"]) in answers_of
        and _majority(answers_of[_normalize(r["query"])]) == _normalize(r["answer"])
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


def window_summary(windows) -> str:
    """stats.json's locomo_windows in one line: each kind's evidence ceiling, all and answerable."""
    kinds = windows["kinds"]
    parts = [
        f"{kind}{'*' if kind == windows['used'] else ''} "
        + " / ".join(f"{kinds[kind][g]['ids_inside']:.1%}" for g in ("all", "answerable") if g in kinds[kind])
        for kind in kinds
    ]
    return (
        f"  LoCoMo evidence ids inside a window of {windows['budget_rounds']} rounds (all / answerable; "
        f"* the records'): " + ", ".join(parts)
    )


def drop_unsupported(records) -> tuple[list[dict], int]:
    """Train only: a LoCoMo question of categories 1-4 whose window (chosen without the evidence)
    holds none of its evidence would teach SFT to state an answer no shown turn supports. Dev and
    test keep every question: a user's window misses evidence too, and the scores must show it.
    -> (the records kept, how many were dropped)."""
    kept = [
        r
        for r in records
        if not (
            r["meta"].get("category") in (1, 2, 3, 4)
            and r["meta"].get("window", {}).get("evidence_in_window", [1, 1])[0] == 0
            and r["meta"].get("evidence")
        )
    ]
    return kept, len(records) - len(kept)


PRESETS = {
    # `make table2`: Table 2 on every Fig. 4 length bucket (8-32 rounds)
    "cpu-demo": {"num_dialogues": 600},
    # `make demo`: dialogues of 8-11 rounds only (of 2,000 drawn, about a third are that short), so a
    # full-history record is about 550 tokens instead of about 980 (docs/experiments/presets.md)
    "cpu-lesson": {"num_dialogues": 2000, "max_rounds": 12},
    "paper": {"num_dialogues": 5000},
}
# flags that change how a run goes, not what it builds
RUN_ONLY = (
    "resume",
    "overwrite",
    "quiet",
    "teacher_cache",
    "max_concurrency",
    "api_timeout",
    "api_retries",
    "device",
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Stage 0 of SRT (§3.2): build the dependency-annotated dialogue corpus.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--source",
        choices=["synthetic", *LOADERS],
        default="synthetic",
        help="synthetic: the embedded generator (srt/data/synthetic.py); the others read --path "
        "(srt/data/corpora.py)",
    )
    p.add_argument(
        "--path",
        "--input",
        dest="path",
        help="the corpus file or folder (chitchat: default the installed chitchat-dataset)",
    )
    p.add_argument("--limit", type=at_least(1), help="read at most this many dialogues from --path")
    p.add_argument(
        "--queries",
        choices=["last", "all", "none", "qa"],
        help="the rounds of a corpus without gold the teacher annotates; default the corpus's own "
        "(CoQA every question, the others the last round); qa: MG-ShopDial's product questions",
    )
    p.add_argument(
        "--locomo-adversarial",
        choices=["keep", "abstain", "skip"],
        default="abstain",
        help="LoCoMo category 5 (the premise is not in the conversation): answered 'Not mentioned in "
        "the conversation.' (what LoCoMo's own scoring counts right), its planted adversarial_answer, "
        "or dropped",
    )
    p.add_argument(
        "--locomo-window",
        choices=LOCOMO_WINDOWS,
        default="retrieved",
        help="LoCoMo: the --max-rounds - 1 rounds a question's history keeps, chosen without its "
        "evidence: the rounds closest to the question by all-MiniLM-L6-v2 (retrieved), the last ones "
        "(recent), or every round whatever --max-rounds (all); evidence: an oracle window built around "
        "the evidence (and dropping questions whose evidence rounds outnumber it). H* is the evidence "
        "inside the window; stats.json's locomo_windows gives every kind's evidence ceiling",
    )
    p.add_argument(
        "--locomo-train-unsupported",
        choices=("drop", "keep"),
        default="drop",
        help="LoCoMo train split: drop (default) or keep the questions of categories 1-4 whose window "
        "holds none of their evidence (their chain could cite no turn); dev and test keep every question",
    )
    p.add_argument("--num-dialogues", type=at_least(0), default=2000, help="synthetic dialogues to generate")
    p.add_argument("--out", default="runs/data", help="output folder")
    p.add_argument("--seed", type=at_least(0), default=0, help="random seed (generator, split, teacher)")
    p.add_argument(
        "--teacher",
        default="oracle",
        help="who annotates (H*, Z, A*): oracle (the ground truth a source carries), hf:MODEL "
        "(a local folder or model id) or api:MODEL (an OpenAI-compatible endpoint)",
    )
    p.add_argument("--teacher-cache", help="the LLM teacher's reply cache (default OUT/teacher_cache)")
    p.add_argument(
        "--teacher-max-new-tokens",
        type=at_least(1),
        help="longest teacher reply (default: hf 384, api 1024)",
    )
    p.add_argument("--api-base", default="https://api.openai.com/v1", help="api teacher: the endpoint")
    p.add_argument(
        "--api-key-env",
        type=env_var_name,
        default="OPENAI_API_KEY",
        help="the name of the environment variable that holds the API key (never the key itself)",
    )
    p.add_argument("--max-concurrency", type=at_least(1), default=4, help="API requests in flight")
    p.add_argument("--api-timeout", type=positive(float), default=120.0, help="seconds per API request")
    p.add_argument(
        "--api-retries",
        type=at_least(0),
        default=4,
        help="retries of a 429, 5xx or timeout (back-off with jitter)",
    )
    p.add_argument("--device", help="hf teacher: default cuda when available, else cpu")
    p.add_argument(
        "--trust-remote-code", action="store_true", help="hf teacher: run the model repository's code"
    )
    p.add_argument("--min-rounds", type=at_least(1), default=8, help="§3.2 length filter: fewest rounds")
    p.add_argument(
        "--max-rounds",
        type=at_least(1),
        default=32,
        help="§3.2 length filter: most rounds (LoCoMo: the window's rounds)",
    )
    p.add_argument(
        "--w-sem", type=in_range(0.0, 1.0), default=0.6, help="Eq. (2) weight of semantic similarity"
    )
    p.add_argument(
        "--w-dist", type=in_range(0.0, 1.0), default=0.4, help="Eq. (2) weight of the distance decay"
    )
    # a negative decay would weigh a turn more the further back it lies: every turn passes
    p.add_argument("--decay", type=at_least(0.0, float), default=0.15, help="Eq. (2) decay per round")
    p.add_argument(
        "--threshold", type=in_range(0.0, 1.0), default=0.6, help="Eq. (2) selection threshold (strict >)"
    )
    p.add_argument(
        "--dedup-intent",
        type=in_range(0.0, 1.0),
        default=0.9,
        help="cosine of intent vectors that puts dialogues in one cluster",
    )
    p.add_argument(
        "--dedup-jaccard",
        type=in_range(0.0, 1.0),
        default=0.8,
        help="turn-fingerprint Jaccard that marks near-identical dialogues",
    )
    p.add_argument(
        "--dev-fraction",
        type=in_range(0.0, 1.0),
        default=0.1,
        help="share of dialogues (LoCoMo: of conversations) in dev, seeded by --seed",
    )
    p.add_argument(
        "--test-fraction",
        type=in_range(0.0, 1.0),
        default=0.1,
        help="share of dialogues (LoCoMo: of conversations) in test; with --dev-fraction below 1",
    )
    p.add_argument(
        "--split",
        choices=["train", "dev", "test"],
        help="write every record to this split (the others empty): a new file scored whole, with no "
        "retraining; default: split by dialogue with --dev-fraction and --test-fraction",
    )
    p.add_argument(
        "--on-error",
        choices=["raise", "skip"],
        default="raise",
        help="a malformed source record stops the run (raise) or is skipped and counted (skip)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="do nothing if --out already holds a build of the same config; else build, replacing it",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="replace the build --out holds (without: refused)"
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = parse_config(p, PRESETS, argv)
    if args.source not in ("synthetic", "chitchat") and not args.path:
        p.error(f"--source {args.source} needs --path FILE_OR_DIR")
    if args.queries == "qa" and args.source != "mgshopdial":
        p.error("--queries qa is MG-ShopDial's (its utterances carry a goal)")
    if args.teacher != "oracle" and not re.fullmatch(r"(hf|api):.+", args.teacher):
        p.error(f"--teacher {args.teacher!r}: use oracle, hf:MODEL or api:MODEL")
    require(
        args.min_rounds <= args.max_rounds,
        f"--min-rounds {args.min_rounds} is above --max-rounds {args.max_rounds}: no dialogue would pass",
    )
    require(
        args.split is not None or args.dev_fraction + args.test_fraction < 1,
        f"--dev-fraction {args.dev_fraction} and --test-fraction {args.test_fraction} leave no dialogue "
        "for train: their sum must be below 1 (or --split names the one split to write)",
    )
    return args


def read_source(args) -> tuple[list[dict], dict]:
    """-> (raw dialogues, the loader's report). JSONL is not cut: the §3.2 length filter decides."""
    if args.source == "synthetic":
        return generate_synthetic(args.num_dialogues, args.seed), {}
    options = {
        "max_rounds": None if args.source == "jsonl" else args.max_rounds,
        "limit": args.limit,
        "on_error": args.on_error,
        **({"queries": args.queries} if args.queries else {}),
    }
    if args.source == "locomo":
        # stage 0's embedder for the retrieved windows, the one Eq. (2) uses
        options.update(
            seed=args.seed, adversarial=args.locomo_adversarial, window=args.locomo_window, embed=embed
        )
    return load_corpus(args.source, args.path, **options)


def source_name(args) -> str:
    """The input a message should name: the file or folder, else the generator or package."""
    if args.source == "synthetic":
        return f"the synthetic corpus (--num-dialogues {args.num_dialogues})"
    return args.path or f"--source {args.source} (the installed package)"


def build_teacher(args):
    if args.teacher == "oracle":
        return OracleTeacher()
    return make_teacher(
        args.teacher,
        cache_dir=args.teacher_cache or f"{args.out}/teacher_cache",
        api_base=args.api_base,
        key_env=args.api_key_env,
        max_concurrency=args.max_concurrency,
        timeout=args.api_timeout,
        retries=args.api_retries,
        seed=args.seed,
        max_new_tokens=args.teacher_max_new_tokens,
        device=args.device,
        trust_remote_code=args.trust_remote_code,
    )


# The files of one build, replaced together (commit_build): a train split beside the dev and test
# splits of another build could share a dialogue with them.
OUTPUT_FILES = ("train.jsonl", "dev.jsonl", "test.jsonl", "conversations.jsonl", "stats.json", "config.json")


def commit_build(out: Path, write) -> None:
    """write(tmp) puts every output of this build in a fresh folder inside `out`; then they replace
    the earlier build's, by renames. config.json, the mark of a finished build, goes first and comes
    back last: a build cut off before the renames leaves the earlier build whole, and one cut off
    among them (a few renames) leaves no config.json, so --resume rebuilds instead of taking the
    mix for a finished build. An output the new build lacks (an earlier LoCoMo build's
    conversations.jsonl) goes too."""
    for stale in out.glob(".build.*"):  # the temporary folder of a build that was killed
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(dir=out, prefix=".build."))
    try:
        write(tmp)
        (out / "config.json").unlink(missing_ok=True)
        for name in OUTPUT_FILES[:-1]:
            if (tmp / name).exists():
                os.replace(tmp / name, out / name)
            else:
                (out / name).unlink(missing_ok=True)
        os.replace(tmp / "config.json", out / "config.json")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def built_with(out: Path, config: dict, outputs) -> bool:
    """Does `out` hold a finished build of `config`?"""
    if not (out / "config.json").exists() or not all((out / name).exists() for name in outputs):
        return False
    saved = json.loads((out / "config.json").read_text(encoding="utf-8"))
    return {k: v for k, v in saved.items() if k != "script"} == config


def main(argv=None) -> None:
    args = parse_args(argv)
    out = claim_out(args.out, "stage0_build.py", args.resume, args.overwrite)
    config = {k: v for k, v in vars(args).items() if k not in RUN_ONLY}
    outputs = ["train.jsonl", "dev.jsonl", "test.jsonl", "stats.json"]
    if args.source == "locomo":
        outputs.append("conversations.jsonl")
    if args.resume and built_with(out, config, outputs):
        print(f"{out}: already built with this config (--resume), nothing to do")
        return
    start = time.time()
    try:
        dialogues, report = read_source(args)
        # LoCoMo's questions are asked after the whole conversation: retrievers read all of it
        conversations = locomo_conversations(args.path) if args.source == "locomo" else []
    except (ValueError, OSError) as e:  # DataError is a ValueError
        sys.exit(f"error: {e}")
    windows = report.pop("locomo_windows", None)
    malformed = report.get("malformed", 0)
    if not dialogues:  # before the teacher and before any output: nothing already written is lost
        skipped = f" ({malformed} malformed, skipped)" if malformed else ""
        sys.exit(f"error: {source_name(args)} holds no dialogues{skipped}; nothing written to {out}")
    try:
        teacher = build_teacher(args)
    except (ValueError, OSError) as e:
        sys.exit(f"error: {e}")
    if (
        args.teacher == "oracle"
        and dialogues
        and not any("gold" in r for d in dialogues for r in d["rounds"])
    ):
        sys.exit(
            f"error: --source {args.source} carries no gold answers, so --teacher oracle can annotate "
            "nothing; use an LLM teacher: --teacher api:MODEL or hf:MODEL"
        )
    num_input = len(dialogues) + malformed
    drops = Counter({"malformed": malformed} if malformed else {})
    dialogues, merged = deduplicate(dialogues, args.dedup_intent, args.dedup_jaccard)
    drops["deduplication"] = merged
    # a LoCoMo window of every round is asked for whole: --max-rounds does not bound it
    longest = float("inf") if args.source == "locomo" and args.locomo_window == "all" else args.max_rounds
    in_range = [d for d in dialogues if args.min_rounds <= len(d["rounds"]) <= longest]
    drops["length"] = len(dialogues) - len(in_range)
    records, annotate_drops = annotate_dialogues(in_range, teacher, args, progress=not args.quiet)
    drops.update(annotate_drops)
    if not records:  # empty splits would only fail later stages: stop here, before any output
        dropped = ", ".join(f"{k} {v}" for k, v in drops.items() if v) or "none"
        sys.exit(
            f"error: no records survived the build of {source_name(args)} ({num_input} dialogues in; "
            f"dropped: {dropped}); nothing written to {out}"
        )
    kept_dialogues = sorted({r["meta"]["dialogue_id"] for r in records})
    if args.split:  # the whole file in one split, e.g. a new conversation file as a test set
        splits = {name: records if name == args.split else [] for name in ("train", "dev", "test")}
    else:
        splits = split_by_dialogue(records, args.seed, args.dev_fraction, args.test_fraction)
    # (the oracle window holds all of every question's evidence: nothing to drop there)
    if (
        args.source == "locomo"
        and args.locomo_window != "evidence"
        and args.locomo_train_unsupported == "drop"
    ):
        splits["train"], unsupported = drop_unsupported(splits["train"])
        drops["train_evidence_outside_window"] = unsupported
    stats = corpus_stats(num_input, kept_dialogues, splits, drops)
    stats.update(
        lookup_checks=lookup_checks(splits),
        source=args.source,
        source_report=report,
        **({"locomo_windows": windows} if windows else {}),
        teacher={"name": args.teacher, **getattr(teacher, "stats", {})},
        seconds=round(time.time() - start, 1),
    )

    def write(folder):
        for name, part in splits.items():
            write_jsonl(folder / f"{name}.jsonl", part)
        if args.source == "locomo":
            write_jsonl(folder / "conversations.jsonl", conversations)
        write_json(folder / "stats.json", stats)
        write_config(folder, config, "stage0_build.py")  # last: the mark of a finished build

    commit_build(out, write)
    print(
        f"stage0: {stats['dialogues_kept']}/{num_input} dialogues, {stats['queries']} queries "
        f"{stats['queries_per_split']} in {stats['seconds']} s -> {out}"
    )
    print(
        f"  buckets {stats['bucket_share']}  |H*|>=2: {stats['share_recall_ge_2']}  "
        f"|H*| hist {stats['recall_size_hist']}"
    )
    print(f"  recall distance {stats['recall_distance_hist']}  dropped {stats['dropped']}")
    print(lookup_summary(stats["lookup_checks"]))
    print(
        f"  pruned == H* in {stats['share_pruned_equals_recall']:.1%} of queries, "
        f"|C~_t| / |C_t| = {stats['mean_pruned_over_history']:.2f}"
    )
    if report:
        print(f"  {args.source}: " + ", ".join(f"{k} {v}" for k, v in report.items() if k != "errors"))
    if windows:
        print(window_summary(windows))
    if args.teacher != "oracle":
        print(f"  teacher {args.teacher}: {dict(teacher.stats)}")
    if drops.get("teacher:no_gold_for_oracle"):
        print("  rounds without gold need an LLM teacher: --teacher api:MODEL or hf:MODEL")
    for message in report.get("errors", [])[:5]:
        print(f"  skipped: {message}")


if __name__ == "__main__":
    main()
