"""The answer and recall metrics of §4, shared by evaluate.py and cuemem.py (../shared/DESIGN.md,
"Evaluation vocabulary"):

- SQuAD-style token F1 of an answer against the reference (Table 1) and key accuracy (Table 2);
- the final answer of a completion (the text after 'Final answer:');
- precision, recall and Jaccard of the recalled set H^ against H* (Table 2);
- the error taxonomy of a wrong answer (Table 3).

A library module: it imports no stage. The two small pieces it shares with reward.py (where a
completion's final answer starts, and the Jaccard of two sets) are written out here with the same
rules; tests/test_evaluate.py checks that both agree.
"""
from __future__ import annotations

import re
import string
from collections import Counter

SELF_RECALL_METHODS = ("srt", "srt-p")  # the model writes <HIS> tags itself
ERROR_TYPES = ("Missing Recall", "Over Recall", "Wrong Recall", "Failure Answer")  # Table 3 rows

THINK_CLOSE = "</think>"
_ANSWER_ANYCASE = re.compile(re.escape("Final answer:"), re.IGNORECASE)


# --------------------------------------------------------------------------------------------
# Answer metrics (Table 1: F1; Table 2: accuracy)
# --------------------------------------------------------------------------------------------
def normalize_answer(text: str) -> str:
    """SQuAD normalization: lowercase, drop punctuation and the articles a/an/the, squeeze spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def f1_score(prediction: str, reference: str) -> float:
    """SQuAD token F1: harmonic mean of token precision and recall over the bag of normalized tokens.
    When either side normalizes to nothing, F1 is 1 if both do and 0 otherwise."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(reference).split()
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def _contains(haystack: str, needle: str) -> bool:
    """Whole-token containment of normalized text: 'yes' is in 'yes it is', not in 'yesterday'."""
    return f" {needle} " in f" {haystack} "


def accuracy(prediction: str, record: dict) -> float:
    """1 if every answer key is present in the normalized prediction; a record without keys needs
    the normalized reference answer contained instead."""
    pred = normalize_answer(prediction)
    keys = [k for k in (normalize_answer(k) for k in record.get("answer_keys") or []) if k]
    if not keys:
        keys = [normalize_answer(record["answer"])]
    return float(all(_contains(pred, k) for k in keys))


def answer_text(completion: str) -> str | None:
    """The text after the last 'Final answer:' (any case) that follows the last </think> (anywhere
    without one), stripped; None when absent or empty. The rule of reward.parse_completion, whose
    Eq. (7) scores the same span."""
    last_close = completion.rfind(THINK_CLOSE)
    tail_start = last_close + len(THINK_CLOSE) if last_close >= 0 else 0
    marks = list(_ANSWER_ANYCASE.finditer(completion, tail_start))
    answer = completion[marks[-1].end():].strip() if marks else None
    return answer or None


def final_answer(method: str, completion: str) -> str:
    """The answer a method gave. Direct methods that omit the 'Final answer:' prefix answer with
    their whole output; a self-recall chain without it has no answer."""
    answer = answer_text(completion)
    if answer is not None:
        return answer
    return "" if method in SELF_RECALL_METHODS else completion.strip()


# --------------------------------------------------------------------------------------------
# Recall metrics and the error taxonomy (Table 2, Table 3)
# --------------------------------------------------------------------------------------------
def jaccard(a, b) -> float:
    """IoU |a n b| / |a u b| of two sets; two empty sets agree perfectly (1.0), as in Eq. (6)."""
    a, b = set(a), set(b)
    return len(a & b) / len(a | b) if a | b else 1.0


def recall_metrics(recalled, gold) -> dict:
    """Precision, recall and Jaccard of H^ against H*, with the conventions of the recall reward:
    an empty H^ is fully precise (it claims nothing false), an empty H* is fully recalled (nothing
    could be missed), and both empty is Jaccard 1."""
    recalled, gold = set(recalled), set(gold)
    hit = len(recalled & gold)
    return {"precision": hit / len(recalled) if recalled else 1.0,
            "recall": hit / len(gold) if gold else 1.0,
            "jaccard": jaccard(recalled, gold)}


def error_type(recalled, gold) -> str:
    """Table 3 taxonomy of a wrong answer, tested in this order (DESIGN.md):
    H^ = H* -> Failure Answer; H* a proper subset of H^ -> Over Recall;
    H^ \\ H* non-empty -> Wrong Recall; otherwise (H^ a proper subset of H*) -> Missing Recall."""
    recalled, gold = set(recalled), set(gold)
    if recalled == gold:
        return "Failure Answer"
    if gold < recalled:
        return "Over Recall"
    if recalled - gold:
        return "Wrong Recall"
    return "Missing Recall"
