"""LoCoMo's own scoring, beside ours: per question category, as the release scores it.

LoCoMo (Maharana et al., 2024, "Evaluating Very Long-Term Conversational Memory of LLM Agents")
scores an answer by the category of its question, in `eval_question_answering` of
snap-research/locomo, task_eval/evaluation.py; this module follows it line for line:

    1 multi-hop    the answer and the reference split on ',': for each reference part the best
                   token F1 over the answer's parts, averaged over the reference parts
    2 temporal     token F1
    3 open-domain  token F1 against the reference up to its first ';' (the rest is a rationale)
    4 single-hop   token F1
    5 adversarial  1 when the answer says 'not mentioned' or 'no information available', else 0:
                   the question's premise is not in the conversation, and the planted
                   adversarial_answer is the wrong answer it baits

Token F1 is LoCoMo's, not SQuAD's (srt/metrics.py): commas deleted first, then lower case,
punctuation deleted, the words a/an/the/and dropped, and every token Porter-stemmed (NLTK's
PorterStemmer, as the release uses).

Evidence recall is LoCoMo's recall accuracy: the share of a question's evidence dia_ids that the
method put before the answer (recalled in <HIS> tags, or retrieved), with each dia_id mapped to
the label of the utterance that holds it (stage 0 keeps that map in meta.evidence_labels). The
release gives a question without evidence a recall of 1; here it has none, so that a question
nothing could be recalled for does not raise every method alike.

Records carry their category in meta.category (srt/data/corpora.py's LoCoMo loader; our JSONL may carry
it too). A library module: evaluate.py scores rows with it, report.py tabulates them.
"""

from __future__ import annotations

import re
import string
from collections import Counter

import numpy as np
from nltk.stem import PorterStemmer

from srt.data.corpora import LOCOMO_CATEGORIES
from srt.metrics import paired_bootstrap

_STEMMER = PorterStemmer()
_PUNCTUATION = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the|and)\b")
ABSTAIN_PHRASES = ("no information available", "not mentioned")  # category 5, lower case


# --------------------------------------------------------------------------------------------
# evaluation.py's normalisation and F1
# --------------------------------------------------------------------------------------------
def normalize_answer(text: str) -> str:
    """evaluation.py's normalize_answer: commas out, lower case, punctuation out, a/an/the/and out,
    whitespace squeezed. The order matters: "don't" -> "dont", "rock-and-roll" -> "rockandroll"."""
    text = str(text).replace(",", "").lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def stemmed_tokens(text: str) -> list[str]:
    return [_STEMMER.stem(word) for word in normalize_answer(text).split()]


def token_f1(prediction: str, reference: str) -> float:
    """evaluation.py's f1_score: F1 of the bags of stemmed tokens; 0 when they share none."""
    predicted, gold = stemmed_tokens(prediction), stemmed_tokens(reference)
    same = sum((Counter(predicted) & Counter(gold)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(predicted), same / len(gold)
    return 2 * precision * recall / (precision + recall)


def multi_answer_f1(prediction: str, reference: str) -> float:
    """evaluation.py's f1 (category 1): both split on ','; each reference part takes its best F1
    over the prediction's parts; the mean over the reference parts."""
    predictions = [p.strip() for p in str(prediction).split(",")]
    references = [g.strip() for g in str(reference).split(",")]
    return float(np.mean([max(token_f1(p, g) for p in predictions) for g in references]))


def says_not_mentioned(prediction: str) -> bool:
    """Category 5: right only when the answer declines in one of the release's two phrasings."""
    return any(phrase in str(prediction).lower() for phrase in ABSTAIN_PHRASES)


def locomo_score(prediction, reference, category: int) -> float:
    """The score of one answer in [0, 1], by its question's category (the module docstring).
    A missing answer (no 'Final answer:') scores as the empty string does: 0."""
    prediction, reference = "" if prediction is None else str(prediction), str(reference)
    if category == 3:
        reference = reference.split(";")[0].strip()
    if category in (2, 3, 4):
        return token_f1(prediction, reference)
    if category == 1:
        return multi_answer_f1(prediction, reference)
    if category == 5:
        return float(says_not_mentioned(prediction))
    raise ValueError(f"LoCoMo has no question category {category!r} (1-5)")


# --------------------------------------------------------------------------------------------
# One record, one answer
# --------------------------------------------------------------------------------------------
def category_of(record) -> int | None:
    """The LoCoMo category (1-5) a record carries in meta.category, else None."""
    category = (record.get("meta") or {}).get("category")
    return category if isinstance(category, int) and category in LOCOMO_CATEGORIES else None


def evidence_recall(recalled, record) -> float | None:
    """Share of the record's evidence that `recalled` (labels; None: the method recalls nothing
    by design, as the full history) holds: per dia_id of meta.evidence through
    meta.evidence_labels (an id the history does not hold is missed), else per turn of H*. None
    without evidence or without a recalled set."""
    if recalled is None:
        return None
    meta, chosen = record.get("meta") or {}, set(recalled)
    ids = meta.get("evidence") or []
    if ids and "evidence_labels" in meta:
        # An id without a label lies outside what the method was shown (a window chosen without
        # the evidence): it counts, as not recalled, so windows of every kind share one denominator.
        return sum(meta["evidence_labels"].get(i) in chosen for i in ids) / len(ids)
    evidence = list(record["recall"])
    if not evidence:
        return None
    return sum(label in chosen for label in evidence) / len(evidence)


def score_row(answer, record, recalled) -> dict:
    """The LoCoMo columns of one evaluated answer (all None for a record without a category)."""
    category = category_of(record)
    if category is None:
        return {"locomo_category": None, "locomo_score": None, "evidence_recall": None}
    return {
        "locomo_category": category,
        "locomo_score": locomo_score(answer, record["answer"], category),
        "evidence_recall": evidence_recall(recalled, record),
    }


# --------------------------------------------------------------------------------------------
# Per-category summaries and paired comparisons
# --------------------------------------------------------------------------------------------
CATEGORY_ORDER = tuple(LOCOMO_CATEGORIES)  # 1..5, the release's numbering
ANSWERABLE = (1, 2, 3, 4)  # the premise is in the conversation; 5 is adversarial
COMPARED = ("locomo_score", "evidence_recall", "jaccard", "f1")


def _mean(rows, key):
    values = [float(r[key]) for r in rows if r.get(key) is not None]
    return (float(np.mean(values)) if values else None), len(values)


def _groups(items, category=lambda row: row["locomo_category"]):
    """("all", items), ("answerable", categories 1-4), then ("1", ..) .. ("5", ..). "answerable" holds
    the questions whose premise is in the conversation: an answer that always declines scores
    the share of category 5 over "all" and nothing here."""
    return [("all", items), ("answerable", [i for i in items if category(i) in ANSWERABLE])] + [
        (str(c), [i for i in items if category(i) == c]) for c in CATEGORY_ORDER
    ]


def declined(row) -> float | None:
    """1.0 when the row's final answer declines in the release's phrasings, 0.0 when it answers,
    None without a final answer. Read from the stored answer, so rows written before this column
    existed are counted too."""
    answer = row.get("final_answer")
    return None if answer is None else float(says_not_mentioned(answer))


def summarize(rows) -> dict | None:
    """{"all": .., "answerable": .., "1": .., ..., "5": ..}, each {n, score, evidence_recall,
    n_evidence, jaccard, n_jaccard, f1, declined, input_tokens}, over the rows with a LoCoMo
    category; None when no row has one. `declined` is the share of answers that say "not
    mentioned": right on category 5, a wrong answer on the others."""
    scored = [dict(r, declined=declined(r)) for r in rows if r.get("locomo_category") is not None]
    if not scored:
        return None
    out = {}
    for key, members in _groups(scored):
        score, n = _mean(members, "locomo_score")
        recall, n_evidence = _mean(members, "evidence_recall")
        jaccard, n_jaccard = _mean(members, "jaccard")
        out[key] = {
            "n": n,
            "score": score,
            "evidence_recall": recall,
            "n_evidence": n_evidence,
            "jaccard": jaccard,
            "n_jaccard": n_jaccard,
            "f1": _mean(members, "f1")[0],
            "declined": _mean(members, "declined")[0],
            "input_tokens": _mean(members, "input_tokens")[0],
        }
    return out


def compare(rows_by_name, reference, resamples=2000, seed=0, metrics=COMPARED) -> dict:
    """Every variant against `reference` on the LoCoMo questions both answered: the paired
    bootstrap interval (variant - reference) of each of `metrics`, on the items where both have
    it, over all questions ("all"), the answerable ones (categories 1-4) and per category, with
    each side's mean over those items ("a": the reference's, "b": the variant's)."""
    if reference is None or reference not in rows_by_name:
        return {}
    base = {r["id"]: r for r in rows_by_name[reference] if r.get("locomo_category") is not None}
    out = {}
    for name, rows in rows_by_name.items():
        pairs = [(base[r["id"]], r) for r in rows if r["id"] in base]
        if name == reference or not pairs:
            continue
        entry = {"against": reference}
        for key, members in _groups(pairs, category=lambda pair: pair[0]["locomo_category"]):
            cell = {"n": len(members)}
            for metric in metrics:
                both = [
                    (a[metric], b[metric])
                    for a, b in members
                    if a.get(metric) is not None and b.get(metric) is not None
                ]
                a_values, b_values = [x for x, _ in both], [y for _, y in both]
                cell[metric] = {
                    **paired_bootstrap(a_values, b_values, resamples, seed),
                    "a": float(np.mean(a_values)) if both else None,
                    "b": float(np.mean(b_values)) if both else None,
                }
            entry[key] = cell
        out[name] = entry
    return out
