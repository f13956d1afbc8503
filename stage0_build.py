"""Stage 0 of SRT: dialogue dependency structure construction (paper §3.2).

    dialogues -> dedup -> 8..32 rounds -> Eq. (2) dependency scoring -> teacher (H*, Z, A*)
              -> verification filter -> train/dev/test JSONL + stats.json + config.json
                 (split by dialogue, seeded; --split test puts every record in one split)
                 + LoCoMo: conversations.jsonl, every conversation whole, for retrievers

stats.json's "lookup_checks" says whether a test answer can be read off train or off the number
in a yes/no query alone (srt/data/leakage.py; docs/synthetic-corpus.md).

Paper vs this implementation, the one list (docs/pipeline.md links here):

  1. The teacher: the paper's is Claude 3.7 Sonnet. The default here, --teacher oracle, writes the
     corpus's own gold (the synthetic generator's planted H*, LoCoMo's evidence) in the paper's
     `Turn X: 'content'` form; --teacher api:MODEL or hf:MODEL asks an LLM, as the paper does.
  2. The corpus: the paper's SRQA (5,000 dialogues curated from MG-ShopDial, MultiWOZ, DailyDialog,
     ReDial and LoCoMo) is not released. The default source is the embedded synthetic corpus
     (docs/synthetic-corpus.md); each of those corpora has a reader (--source).
  3. Eq. (2): Sim_sem is the cosine of all-MiniLM-L6-v2 embeddings (the paper names no encoder). A
     round whose H* the corpus itself gives (LoCoMo's evidence, JSONL gold) is kept even in a
     dialogue Eq. (2) does not select (corpus_gives_recall).
  4. The verification filter's "string matching between A*_t and H*_t" looks for each answer key in
     the recalled turns; an answer without keys must have its numbers and content words there, on
     word boundaries (srt/data/teacher.py grounded); a yes/no answer derived from them is exempt.
  5. Train, dev and test are split by dialogue (a LoCoMo conversation is one group), seeded; the
     paper gives no split. A LoCoMo conversation, far longer than 32 rounds, gives each question a
     window of --max-rounds - 1 of its rounds (--locomo-window; docs/pipeline.md).

The records it writes feed every later stage; their format is in docs/design.md ("Data"), their
reader and checks in srt/data_io.py. The sources live in srt/data/: synthetic.py (the embedded
generator, one module per domain beside it) and corpora.py (LoCoMo, CoQA, MultiWOZ, DailyDialog,
ReDial, MG-ShopDial, chit-chat, our JSONL); the LLM teachers of §3.2 (hf:MODEL, api:MODEL) and the
answer-key-free grounding check in srt/data/teacher.py; the sentence embedder of Eq. (2) in
srt/embedder.py. The prompt and the SFT target that later stages render from a record live in
srt/prompt.py.

Run `python stage0_build.py --help`.
"""

from __future__ import annotations

import srt.startup  # noqa: F401  # isort: skip  (first: Ctrl-C while torch loads is one line)

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
from tqdm import tqdm

from srt.completion import is_valid_format
from srt.config import (
    MAX_DIALOGUES,
    add_api_flags,
    add_limit,
    add_out,
    add_overwrite,
    add_quiet,
    add_resume,
    add_seed,
    add_trust_remote_code,
    at_least,
    changed_settings,
    claim_out,
    in_range,
    interruptible,
    parse_config,
    positive,
    require,
    up_to,
    write_config,
)
from srt.data.corpora import LOADERS, LOCOMO_WINDOWS, load_corpus, locomo_conversations, window_summary
from srt.data.leakage import lookup_checks, lookup_summary, normalize
from srt.data.synthetic import generate_synthetic
from srt.data.synthetic_common import keys_outside_recall
from srt.data.teacher import gold_is_complete, grounded, make_teacher
from srt.data_io import BUCKETS, bucket_of, files_sha256, write_json, write_jsonl
from srt.embedder import embed
from srt.metrics import DISTANCE_BINS, distance_bin, jaccard
from srt.precision import add_device
from srt.prompt import format_target, his_tag


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
# --dedup-jaccard (srt.metrics.jaccard, the IoU of Eq. (6)) are near-identical: the later one is
# merged into the earlier (dropped).
# Dialogues that share meta.split_group (LoCoMo's windows of one conversation) overlap by
# construction and are never compared with each other.
# --------------------------------------------------------------------------------------------
def _hash(text: str, dim: int | None = None) -> int:
    h = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")
    return h % dim if dim else h


def split_group(dialogue):
    """What must stay together: a split never divides it, dedup never compares within it."""
    return (dialogue.get("meta") or {}).get("split_group")


def turn_fingerprints(dialogue) -> set[int]:
    return {_hash(normalize(u["text"])) for u in utterances(dialogue)}


def intent_vector(dialogue, dim=256) -> np.ndarray:
    v = np.zeros(dim, dtype=np.float32)
    for r in dialogue["rounds"]:
        v[_hash(" ".join(normalize(r["user"]).split()[:2]), dim)] += 1.0
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
        if any((group is None or g != group) and jaccard(prints, p) >= jaccard_threshold for g, p in cluster):
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
    """Eq. (2)'s Score(u_i, Q_t) of history utterance i (similarity Sim_sem(u_i, Q_t)) for the query
    of round t, i and t in rounds; numbers or numpy arrays, broadcast elementwise."""
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


def llm_teacher(args):
    """hf:MODEL or api:MODEL (srt/data/teacher.py), its replies cached in OUT/teacher_cache."""
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


# --teacher, up to its ":" -> the teacher it builds (parse_args admits only these)
TEACHERS = {"oracle": lambda args: OracleTeacher(), "hf": llm_teacher, "api": llm_teacher}


def build_teacher(args):
    return TEACHERS[args.teacher.partition(":")[0]](args)


def round_teacher(gold, teacher, oracle):
    """Who annotates a query round: the oracle where the round's gold serves it (beside an LLM
    teacher only complete gold, teacher.gold_is_complete), the LLM teacher the rest. None: the
    oracle alone, and a round without gold."""
    if gold is not None and (teacher is oracle or gold_is_complete(gold)):
        return oracle
    return None if teacher is oracle else teacher


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
    if not is_valid_format(format_target(record)):
        # A turn of H* (copied verbatim into a <HIS> tag) or the answer holds a marker of the format:
        # '</think>', '<HIS>', 'Final answer:'. Its own reference would fail Eq. (5): SFT would learn
        # a malformed target and GRPO punish an honest copy. Dropped, and counted in stats.json.
        return "markup_in_target"
    return None


# --------------------------------------------------------------------------------------------
# The whole §3.2 pipeline after the length filter, for each query round Q_t (a round with gold or a
# query mark): Eq. (2) scores every utterance of C_t; a dialogue is selected for annotation if one
# pair passes; the teacher writes (H*_t, Z_t, A*_t); the record keeps C~_t (H*_t and the utterances
# above the threshold, for SFT phase 1, §3.3); the verification filter keeps the record or drops it.
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


def utterance_vectors(dialogues) -> list[np.ndarray]:
    """Unit-norm embeddings of every dialogue's utterances, one row per utterance in the order of
    utterances(). Templates and small talk repeat across dialogues: each text is embedded once."""
    texts = sorted({u["text"] for d in dialogues for u in utterances(d)})
    vectors, row = embed(texts), {text: k for k, text in enumerate(texts)}
    return [vectors[[row[u["text"]] for u in utterances(d)]] for d in dialogues]


def score_queries(dialogue, vectors, args) -> list[dict]:
    """Eq. (2) for each query round Q_t of a dialogue (a round with gold or a query mark): the score
    of every utterance u_i of its history C_t, and the labels of those above the threshold."""
    utts, queries = utterances(dialogue), []
    for t, rnd in enumerate(dialogue["rounds"], 1):
        if "gold" not in rnd and not rnd.get("query"):
            continue
        history = utts[: 2 * (t - 1)]  # C_t = Q1, A1, ..., Q_{t-1}, A_{t-1}
        similarity = vectors[: 2 * (t - 1)] @ vectors[2 * (t - 1)]  # Sim_sem(u_i, Q_t): unit vectors
        rounds = [u["round"] for u in history]
        scores = dependency_score(similarity, t, rounds, args.w_sem, args.w_dist, args.decay)
        above = {u["label"] for u, s in zip(history, scores) if passes_threshold(s, args.threshold)}
        queries.append(
            {
                "dialogue": dialogue,
                "t": t,
                "round": rnd,
                "history": history,
                "scores": scores,
                "above_threshold": above,
            }
        )
    return queries


def dependency_selection(dialogue, queries) -> list[dict]:
    """§3.2: a dialogue is selected for annotation only if one of its (Q_t, u_i) pairs passes Eq. (2).
    Of a dialogue not selected, the rounds whose H* the corpus gives stay (corpus_gives_recall)."""
    if any(q["above_threshold"] for q in queries) or all(
        corpus_gives_recall(dialogue, q["round"]) for q in queries
    ):
        return queries
    return [q for q in queries if corpus_gives_recall(dialogue, q["round"])]


def ask_teachers(queries, teachers, progress) -> None:
    """Each teacher's note on its rounds (q["note"]: H*_t as "Turn X: 'content'", the analysis and
    reasoning of Z_t, A*_t; None with q["reason"] where the reply is unusable). An LLM teacher's
    prompts go out in chunks that cross dialogues: a chat corpus has one query per dialogue."""
    for who in teachers:
        oracle = isinstance(who, OracleTeacher)
        mine = [q for q in queries if q["teacher"] is who]
        chunk = len(mine) if oracle else max(64, 4 * getattr(who, "max_concurrency", 1))
        for start in tqdm(
            range(0, len(mine), chunk or 1), desc=f"teacher {who.name}", disable=not progress or oracle
        ):
            part = mine[start : start + chunk]
            notes = who.annotate_many(
                [
                    (q["round"]["user"], q["history"], q["round"].get("gold"), q["round"]["assistant"])
                    for q in part
                ]
            )
            for q, (note, reason) in zip(part, notes):
                q["note"], q["reason"] = note, reason


def record_meta(q, recall, recalled) -> dict:
    """The source's meta and gold's other keys; where the query sits; its Eq. (2) scores; who wrote
    Z_t; §3.2's string matching of A*_t against H*_t where A*_t has no answer keys."""
    dialogue, rnd, note = q["dialogue"], q["round"], q["note"]
    meta = {
        **(dialogue.get("meta") or {}),
        **(rnd.get("meta") or {}),
        **{k: v for k, v in (rnd.get("gold") or {}).items() if k not in GOLD_FIELDS},
    }
    meta.update(
        {
            "num_turns": q["t"],
            "bucket": bucket_of(q["t"]),
            "dialogue_id": dialogue["id"],
            "dialogue_rounds": len(dialogue["rounds"]),
            "domain": dialogue.get("domain", "unknown"),
            "query_type": note["query_type"],
            "derived_yes_no": note["derived_yes_no"],
            "scores": {u["label"]: round(float(s), 4) for u, s in zip(q["history"], q["scores"])},
        }
    )
    if not isinstance(q["teacher"], OracleTeacher):
        meta.update(teacher=q["teacher"].name, reasoning_source="teacher", reference_answer=rnd["assistant"])
    if recall and not note["answer_keys"]:
        meta["grounding"] = grounded(note["answer"], [u["text"] for u in recalled])
    return meta


def make_record(q) -> dict:
    """A query round and its teacher's note -> the record of docs/design.md ("Data")."""
    history, note = q["history"], q["note"]
    recall = parse_turn_refs(note["recall_turns"])  # H*_t
    by_label = {u["label"]: u for u in history}
    recalled = [by_label[label] for label in recall if label in by_label]
    return {
        "id": f"{q['dialogue']['id']}-t{q['t']:02d}",
        "source": q["dialogue"].get("source", "jsonl"),
        "history": [{k: u[k] for k in ("label", "speaker", "text")} for u in history],
        "query": q["round"]["user"],
        "query_turn": q["t"],
        "recall": recall,
        "reasoning": build_reasoning(note["analysis"], recalled, note["reasoning"]),  # Z_t
        "answer": note["answer"],
        "answer_keys": note["answer_keys"],
        # C~_t: the utterances above Eq. (2)'s threshold, and H*_t whatever its scores
        "pruned": [u["label"] for u in history if u["label"] in q["above_threshold"] or u["label"] in recall],
        "meta": record_meta(q, recall, recalled),
    }


def annotate_dialogues(dialogues, teacher, args, progress=True):
    """The steps above on the dialogues that passed deduplication and the length filter.
    Returns (records, drop counts)."""
    drops, records, queries = Counter(), [], []
    oracle = teacher if isinstance(teacher, OracleTeacher) else OracleTeacher()
    vectors = utterance_vectors(dialogues)
    for dialogue, vecs in zip(tqdm(dialogues, desc="Eq. (2)", disable=not progress), vectors):
        scored = score_queries(dialogue, vecs, args)  # Eq. (2)
        selected = dependency_selection(dialogue, scored)
        if len(selected) < len(scored):
            drops["dependency_selection"] += 1  # no (Q_t, u_i) pair passes Eq. (2)
        for q in selected:
            q["teacher"] = round_teacher(q["round"].get("gold"), teacher, oracle)
        if unserved := sum(q["teacher"] is None for q in selected):  # no gold: needs an LLM teacher
            drops["teacher:no_gold_for_oracle"] += unserved
        queries += selected
    ask_teachers(queries, [oracle] if teacher is oracle else [oracle, teacher], progress)  # H*_t, Z_t, A*_t
    for q in queries:
        if q.get("note") is None:
            if q["teacher"] is not None:
                drops[f"teacher:{q['reason']}"] += 1
            continue
        record = make_record(q)  # with C~_t
        if failed := verify_record(record):
            drops[f"verification:{failed}"] += 1
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
            distances[distance_bin(d)] += 1
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
        "recall_distance_hist": {k: distances.get(k, 0) for k in DISTANCE_BINS},
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
    "cpu-table2": {"num_dialogues": 600},
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
    add_limit(p, "read at most this many dialogues from --path")
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
    p.add_argument(
        "--num-dialogues",
        type=up_to(MAX_DIALOGUES, low=0),
        default=2000,
        help="synthetic dialogues to generate",
    )
    add_out(p, "runs/data")
    add_seed(p, "random seed (generator, split, teacher)")
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
    add_api_flags(
        p, base_default="https://api.openai.com/v1", base_help="api teacher: the endpoint", model=False
    )
    p.add_argument("--max-concurrency", type=at_least(1), default=4, help="API requests in flight")
    p.add_argument("--api-timeout", type=positive(float), default=120.0, help="seconds per API request")
    p.add_argument(
        "--api-retries",
        type=at_least(0),
        default=4,
        help="retries of a 429, 5xx or timeout (back-off with jitter)",
    )
    add_device(p, "hf teacher: default cuda when available, else cpu")
    add_trust_remote_code(p, "hf teacher: run the model repository's code")
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
    add_resume(
        p,
        "do nothing if --out already holds a build of the same config, refuse one of another config "
        "(--overwrite replaces it); else build",
    )
    add_overwrite(p, "replace the build --out holds (without: refused)")
    add_quiet(p)
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
    """Does `out` hold a finished build of `config`? A finished build of another config is refused
    (one line naming what differs): --resume continues a build, it never replaces one."""
    if not (out / "config.json").exists():
        return False
    saved = json.loads((out / "config.json").read_text(encoding="utf-8"))
    recorded = saved.pop(FILES_KEY, {})
    saved = {k: v for k, v in saved.items() if k not in ("script", *WHERE)}
    config = {k: v for k, v in config.items() if k not in WHERE}
    if saved != config:
        sys.exit(
            f"error: --resume with another config than the build in {out}: "
            f"{', '.join(changed_settings(saved, config))}; --overwrite replaces that build"
        )
    if not all((out / name).exists() for name in outputs):
        return False
    check_built_files(out, recorded)
    return True


# config.json's record of the build's files, by name: their sha256 when the build published them.
FILES_KEY = "files_sha256"
# Where the build lies is not what it is: ./out, out/ and a folder moved since hold the same build,
# and its files are checked by their sha256 (check_built_files), not by the path they were written to.
WHERE = ("out",)


def built_files(folder: Path, outputs) -> dict:
    return {name: files_sha256([folder / name]) for name in outputs if (folder / name).exists()}


def check_built_files(out: Path, recorded: dict) -> None:
    """A finished build's files must be the ones it wrote: a split cut or edited by hand would be
    called built and trained on. (A build that predates the record is not checked.)"""
    for name, digest in recorded.items():
        if (out / name).exists() and files_sha256([out / name]) != digest:
            sys.exit(
                f"error: --resume: {out / name} is not the file this build wrote (its sha256 differs from "
                f"the one in {out / 'config.json'}); --overwrite rebuilds it"
            )


def read_inputs(args, out):
    """-> (dialogues, source report, LoCoMo's whole conversations, teacher). Stops with one line,
    before the teacher runs and before any output, where there is nothing the teacher could annotate."""
    try:
        dialogues, report = read_source(args)
        # LoCoMo's questions are asked after the whole conversation: retrievers read all of it
        conversations = locomo_conversations(args.path) if args.source == "locomo" else []
    except (ValueError, OSError) as e:  # DataError is a ValueError
        sys.exit(f"error: {e}")
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
    return dialogues, report, conversations, teacher


def annotate_and_split(args, dialogues, malformed, teacher, out):
    """Deduplicate, keep the dialogues within the round limits, annotate them (Eq. (2), the teacher)
    and split by dialogue. -> (splits, drops: what was dropped at each step, dialogues read, the ids of
    the dialogues kept)."""
    num_input = len(dialogues) + malformed
    drops = Counter({"malformed": malformed} if malformed else {})
    dialogues, merged = deduplicate(dialogues, args.dedup_intent, args.dedup_jaccard)
    drops["deduplication"] = merged
    # a LoCoMo window of every round is asked for whole: --max-rounds does not bound it
    longest = float("inf") if args.source == "locomo" and args.locomo_window == "all" else args.max_rounds
    within_rounds = [d for d in dialogues if args.min_rounds <= len(d["rounds"]) <= longest]
    drops["length"] = len(dialogues) - len(within_rounds)
    records, annotate_drops = annotate_dialogues(within_rounds, teacher, args, progress=not args.quiet)
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
    return splits, drops, num_input, kept_dialogues


def print_build_summary(args, stats, num_input, out, report, windows, teacher, drops) -> None:
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


def build(args) -> None:
    """§3.2 from the source to the published build in --out (commit_build)."""
    out = claim_out(args.out, "stage0_build.py", args.resume, args.overwrite)
    config = {k: v for k, v in vars(args).items() if k not in RUN_ONLY}
    outputs = ["train.jsonl", "dev.jsonl", "test.jsonl", "stats.json"]
    if args.source == "locomo":
        outputs.append("conversations.jsonl")
    if args.resume and built_with(out, config, outputs):
        print(f"{out}: already built with this config (--resume), nothing to do")
        return
    start = time.time()
    dialogues, report, conversations, teacher = read_inputs(args, out)
    windows = report.pop("locomo_windows", None)
    splits, drops, num_input, kept_dialogues = annotate_and_split(
        args, dialogues, report.get("malformed", 0), teacher, out
    )
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
        files = built_files(folder, OUTPUT_FILES[:-1])  # what --resume checks the build by
        write_config(folder, {**config, FILES_KEY: files}, "stage0_build.py")  # last: the mark of a build

    commit_build(out, write)
    print_build_summary(args, stats, num_input, out, report, windows, teacher, drops)


def main(argv=None) -> None:
    args = parse_args(argv)
    with interruptible(
        lambda: (
            f"a build is published whole (config.json last) or not at all, so {args.out} holds no "
            "half build; run the same command again (--resume skips a build already there)"
        ),
        args.out,
    ):
        build(args)


if __name__ == "__main__":
    main()
