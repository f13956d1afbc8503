"""The answer and recall metrics of §4, shared by evaluate.py and cuemem.py (docs/design.md,
"Evaluation vocabulary"):

- SQuAD-style token F1 of an answer against the reference (Table 1), a key-F1 against the answer
  keys, and key accuracy (Table 2), all with numbers normalised ("$180.00" = "$180" = "180");
- keys_present(answer, keys): the key matcher itself (word boundaries, numbers normalised), which
  reward.py's answer-key reward uses too;
- the final answer of a completion (the text after 'Final answer:');
- precision, recall and Jaccard of the recalled set H^ against H* (Table 2);
- the error taxonomy of a wrong answer (Table 3), with "Truncated" for a chain cut off by the cap;
- paired comparisons of two variants on the same items: a seeded paired bootstrap interval of the
  mean difference and the exact McNemar test of accuracy.

A library module: it imports no stage. The two small pieces it shares with reward.py (where a
completion's final answer starts, and the Jaccard of two sets) are written out here with the same
rules; tests/test_evaluate.py checks that both agree.
"""

from __future__ import annotations

import math
import re
import string
import unicodedata
from collections import Counter

import numpy as np

SELF_RECALL_METHODS = ("srt", "srt-p")  # the model writes <HIS> tags itself
# Table 3 rows. "Truncated" is this repository's addition: a chain cut off by max_new_tokens has no
# answer at all, which says nothing about recall, so it would distort the paper's four shares.
ERROR_TYPES = ("Missing Recall", "Over Recall", "Wrong Recall", "Failure Answer", "Truncated")

THINK_CLOSE = "</think>"
_ANSWER_ANYCASE = re.compile(re.escape("Final answer:"), re.IGNORECASE)


# --------------------------------------------------------------------------------------------
# Answer metrics (Table 1: F1; Table 2: accuracy)
# --------------------------------------------------------------------------------------------
# One number: optional currency sign, digits with optional thousands commas, an optional fraction,
# an optional percent. "(?<![\w.])" keeps the digits of a label (A5) or a code (NU9MH3) out.
_NUMBER = re.compile(r"(?<![\w.])[$€£¥₹]?\s?(\d{1,3}(?:,\d{3})+|\d+)(?:\.(\d+))?(?!\w)(\s?%|\s?percent\b)?")
_QUOTES = str.maketrans(
    {c: "'" for c in "\u2018\u2019\u201a\u201b\u2032\u2039\u203a`\u00b4"}
    | {c: '"' for c in "\u201c\u201d\u201e\u201f\u2033\u00ab\u00bb"}
)
_POLAR = {"yes": "no", "no": "yes"}
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def _number_form(m: re.Match) -> str:
    """ "$180.00" -> "180", "1,800" -> "1800", "12.50" -> "12.5", "20 %" -> "20%" (20% is not $20)."""
    whole, fraction = m.group(1).replace(",", ""), (m.group(2) or "").rstrip("0")
    return (
        whole.lstrip("0").rjust(1, "0") + (f".{fraction}" if fraction else "") + ("%" if m.group(3) else "")
    )


def normalize_number(text: str) -> str | None:
    """The canonical form of a text that is one number, else None."""
    m = _NUMBER.fullmatch(unicodedata.normalize("NFKC", text).strip())
    return _number_form(m) if m else None


def numbers_in(text: str) -> set[str]:
    """The canonical forms of every number a text states."""
    return {_number_form(m) for m in _NUMBER.finditer(unicodedata.normalize("NFKC", text))}


def normalize_answer(text: str) -> str:
    """SQuAD normalization (lowercase, drop punctuation and the articles a/an/the, squeeze spaces)
    with one change: every number is first put in its canonical form and kept whole, so "$180.00"
    is "180" rather than SQuAD's "18000", and "12.5" keeps its point."""
    text = unicodedata.normalize("NFKC", text).lower()
    pieces, last = [], 0
    for m in _NUMBER.finditer(text):
        pieces += [text[last : m.start()].translate(_PUNCTUATION), f" {_number_form(m)} "]
        last = m.end()
    text = "".join(pieces) + text[last:].translate(_PUNCTUATION)
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


def answer_keys(record: dict) -> list[str]:
    """The record's non-empty answer keys (one string is one key, as in reward.py); a record
    without any is scored against its whole reference."""
    keys = record.get("answer_keys") or []
    keys = [str(k) for k in ([keys] if isinstance(keys, str) else keys) if str(k).strip()]
    return keys or [record["answer"]]


def key_f1(prediction: str, record: dict) -> float:
    """SQuAD F1 against the answer keys joined as the reference: what a terse correct answer earns
    ("$180" for keys ["$180"] gets 1.0, where F1 against the templated reference sentence gives
    0.33); the precision side still charges an answer for words the keys do not hold."""
    return f1_score(prediction, " ".join(answer_keys(record)))


def _key_form(text: str) -> str:
    """Casefolded, quote- and space-folded text with every number replaced by ⟦canonical⟧, so that
    "$20" (⟦20⟧) is not found in "$207" (⟦207⟧) nor in "20%" (⟦20%⟧)."""
    t = unicodedata.normalize("NFKC", text).translate(_QUOTES).casefold()
    return " ".join(_NUMBER.sub(lambda m: f" ⟦{_number_form(m)}⟧ ", t).split())


def _contains(haystack: str, key: str) -> bool:
    return bool(key) and re.search(rf"(?<!\w){re.escape(key)}(?!\w)", haystack) is not None


def keys_present(answer: str | None, keys) -> list[bool]:
    """For each answer key: does the answer state it? Word boundaries, numbers normalised ("$180.00",
    "$180" and "180" agree; "$20" is not in "$207"), case and quotes folded. A 'yes' or 'no' key
    counts only if the opposite word is absent, so a hedge "yes or no" states neither."""
    text = _key_form(answer or "")
    forms = [_key_form(str(key)).strip(" .!") for key in keys]
    return [_contains(text, k) and not (k in _POLAR and _contains(text, _POLAR[k])) for k in forms]


def accuracy(prediction: str, record: dict) -> float:
    """1 if every answer key is present in the prediction (keys_present), whatever else it says; a
    record without keys needs its whole reference answer present instead."""
    return float(all(keys_present(prediction, answer_keys(record))))


def answer_text(completion: str) -> str | None:
    """The text after the last 'Final answer:' (any case) that follows the last </think> (anywhere
    without one), stripped; None when absent or empty. The rule of reward.parse_completion, whose
    Eq. (7) scores the same span."""
    last_close = completion.rfind(THINK_CLOSE)
    tail_start = last_close + len(THINK_CLOSE) if last_close >= 0 else 0
    marks = list(_ANSWER_ANYCASE.finditer(completion, tail_start))
    answer = completion[marks[-1].end() :].strip() if marks else None
    return answer or None


_TURN_LABEL = re.compile(r"^\s*(?:A\d+\s*:\s*)?(?:final answer\s*:\s*)?", re.IGNORECASE)
_NEXT_TURN = re.compile(r"^\s*(?:Q\d+\s*:|current query\b)", re.IGNORECASE)


def answer_line(text: str) -> tuple[str, bool]:
    """A direct method's answer: the first line with content once an echoed turn label ("A7: ",
    which a base model continuing the transcript writes) and a 'Final answer:' prefix are dropped.
    -> (that line, whether it is complete: a newline follows it). Used both to stop generation
    (evaluate asks direct methods for one line) and to read the answer. A line that opens the
    user's next turn ("Q8: ...", "Current query ...") before any answer means no answer."""
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if _NEXT_TURN.match(line):
            return "", True
        content = _TURN_LABEL.sub("", line, count=1).strip()
        if content:
            return content, i < len(lines) - 1
    return "", False


def final_answer(method: str, completion: str) -> str:
    """The answer a method gave. A self-recall chain answers after 'Final answer:' (none without
    it); a direct method answers with its first line of content (metrics.answer_line), with or
    without the prefix."""
    if method in SELF_RECALL_METHODS:
        return answer_text(completion) or ""
    return answer_line(completion)[0]


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
    return {
        "precision": hit / len(recalled) if recalled else 1.0,
        "recall": hit / len(gold) if gold else 1.0,
        "jaccard": jaccard(recalled, gold),
    }


def error_type(recalled, gold, truncated: bool = False) -> str:
    """Table 3 taxonomy of a wrong answer, tested in this order (docs/design.md): a completion cut off
    by the token cap -> Truncated; H^ = H* -> Failure Answer; H* a proper subset of H^ -> Over
    Recall; H^ \\ H* non-empty -> Wrong Recall; otherwise (H^ a proper subset of H*) -> Missing Recall."""
    if truncated:
        return "Truncated"
    recalled, gold = set(recalled), set(gold)
    if recalled == gold:
        return "Failure Answer"
    if gold < recalled:
        return "Over Recall"
    if recalled - gold:
        return "Wrong Recall"
    return "Missing Recall"


# --------------------------------------------------------------------------------------------
# Paired comparisons of two variants on the same items (Table 2's intervals)
# --------------------------------------------------------------------------------------------
def paired_bootstrap(a, b, resamples: int = 2000, seed: int = 0, confidence: float = 0.95) -> dict:
    """Mean of b - a over paired items and its percentile bootstrap interval: items are resampled
    with replacement `resamples` times (seeded), each resample's mean difference is kept, and the
    interval is the (1 - confidence) / 2 and (1 + confidence) / 2 percentiles of those means.
    Resampling pairs, not each side alone, keeps the per-item correlation of two variants that
    answer the same queries, which is what makes a small difference readable."""
    diff = np.asarray(b, dtype=float) - np.asarray(a, dtype=float)
    if diff.size == 0:
        return {"diff": None, "low": None, "high": None, "n": 0, "resamples": resamples}
    rng = np.random.default_rng(seed)
    means = diff[rng.integers(0, diff.size, size=(resamples, diff.size))].mean(axis=1)
    tail = 100 * (1 - confidence) / 2
    low, high = np.percentile(means, [tail, 100 - tail])
    return {
        "diff": float(diff.mean()),
        "low": float(low),
        "high": float(high),
        "n": int(diff.size),
        "resamples": resamples,
    }


def mcnemar_exact(a_correct, b_correct) -> dict:
    """Exact (binomial) McNemar test of paired accuracy: of the discordant items, `a_only` were
    right under a alone and `b_only` under b alone; under H0 each discordant item is a fair coin,
    so p = min(1, 2 * P(Binomial(a_only + b_only, 1/2) <= min(a_only, b_only)))."""
    pairs = list(zip(a_correct, b_correct))
    a_only = sum(1 for x, y in pairs if x and not y)
    b_only = sum(1 for x, y in pairs if y and not x)
    n = a_only + b_only
    tail = sum(math.comb(n, i) for i in range(min(a_only, b_only) + 1)) / 2**n if n else 1.0
    return {"a_only": a_only, "b_only": b_only, "p": min(1.0, 2 * tail)}
