"""The answer and recall metrics of §4, shared by evaluate.py and cuemem.py (docs/design.md,
"Evaluation vocabulary"):

- SQuAD-style token F1 of an answer against the reference (Table 1), a key-F1 against the answer
  keys, and key accuracy (Table 2), all with numbers normalised ("$180.00" = "$180" = "180");
- the answer matcher of accuracy, which reward.py's keys answer reward uses too:
  answer_is_right(answer, keys, reference) holds when the answer states every key (keys_present:
  word boundaries, numbers normalised, a yes/no key for one polarity and no hedge), none of them
  only to deny it (keys_affirmed: "The backpack was not $106."), and no other value
  (stated_values: a money amount, number, date or time, code or capitalised name) that neither
  the reference nor a key holds (extra_values), so a list of candidates fails, and so does a
  negation; and
  states_several_candidates, the report's share of answers that list more than one;
- the final answer of a completion (the text after 'Final answer:');
- precision, recall and Jaccard of the recalled set H^ against H* (Table 2);
- the error taxonomy of a wrong answer (Table 3), with "Truncated" for a chain cut off by the cap;
- paired comparisons of two variants on the same items: a seeded paired bootstrap interval of the
  mean difference and the exact McNemar test of accuracy.

A library module: it imports no stage. Where a completion's final answer starts is written out here
with the rules of srt/completion.py, which the reward reads it with (tests/test_evaluate.py checks
that both agree); `jaccard`, Eq. (6)'s IoU, is the one definition that reward.py's recall reward
scales and the recall metrics report, so the two cannot disagree.
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
ERROR_TYPES = ("Missing Recall", "Over Recall", "Wrong Recall", "Garbled Copy", "Failure Answer", "Truncated")

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


_HEDGE = re.compile(
    r"(?<!\w)(?:possibly|perhaps|maybe|probably|might|unsure|uncertain|unclear|depends|depending"
    r"|either way|or not|not sure|not certain|may or may not|can'?t say|cannot say|can'?t tell"
    r"|cannot tell|hard to say)(?!\w)"
)


def keys_present(answer: str | None, keys) -> list[bool]:
    """For each answer key: does the answer state it? Word boundaries, numbers normalised ("$180.00",
    "$180" and "180" agree; "$20" is not in "$207"), case and quotes folded, with two refinements
    from the values of stated_values: a key that is one date or time matches it in any form ("1 pm"
    = "1pm" = "13:00", "Friday" = "friday"), and a name or an all-capitals code in a key must be
    written as one (a capital first letter, the code in capitals), since a lowercased name is no
    value that extra_values could count ("mateo, lena, dmitri" would state Mateo and hide the rest).
    A 'yes' or 'no' key counts only for one polarity without a hedge: the opposite word absent
    ("yes or no" states neither) and no hedge word ("possibly yes, possibly not", "maybe")."""
    text = _key_form(answer or "")
    raw = unicodedata.normalize("NFKC", answer or "").translate(_QUOTES)
    present = []
    for key in map(str, keys):
        form, date = _key_form(key).strip(" .!"), _one_date(key)
        found = ("date", date) in _values(raw) if date else _contains(text, form)
        if form in _POLAR:
            found = found and not _contains(text, _POLAR[form]) and _HEDGE.search(text) is None
        present.append(found and all(_written_as_value(raw, v, code) for v, code in _case_marked(key)))
    return present


# A negation cue, and where a clause ends: "The backpack was not $106." denies the key $106, "It is
# $106, not $100." and "No, it is $106." do not (the cue comes after it, or in a clause of its own).
_NEGATION = re.compile(r"(?<!\w)(?:not|never|no|none|neither|nor|cannot|\w+n't)(?!\w)", re.IGNORECASE)
_CLAUSE_END = re.compile(
    r"[.;:!?,\n]|(?<!\w)(?:but|however|instead|rather|though|although)(?!\w)", re.IGNORECASE
)


def _denied(text: str, key: str) -> bool:
    """Does `text` state the key only to deny it: a negation cue earlier in the clause of every
    place it states it? (A text that does not state the key at all denies nothing.)"""
    date = _one_date(key)
    if date:  # a date or time in any of its forms ("1 pm" = "13:00"), found in the raw text
        text = unicodedata.normalize("NFKC", text).translate(_QUOTES)
        places = [m.start() for m in _DATE_TIME.finditer(text) if _date_value(m) == date]
    else:
        text, form = _key_form(text), _key_form(key).strip(" .!")
        places = [m.start() for m in re.finditer(rf"(?<!\w){re.escape(form)}(?!\w)", text)] if form else []
    clauses = [_CLAUSE_END.split(text[:at])[-1] for at in places]  # each from its start to the key
    return bool(places) and all(_NEGATION.search(clause) for clause in clauses)


def keys_affirmed(answer: str | None, keys, reference: str) -> list[bool]:
    """keys_present, less the keys the answer states only to deny them ("The hiking backpack was not
    $106."): such an answer is wrong, as a list of candidates is. A yes/no key keeps its own rule
    (keys_present), and a key the reference itself denies may be denied too."""
    affirmed = []
    for key, found in zip(map(str, keys), keys_present(answer, keys)):
        polar = _key_form(key).strip(" .!") in _POLAR
        affirmed.append(found and (polar or not _denied(answer or "", key) or _denied(reference or "", key)))
    return affirmed


def _one_date(key: str) -> str | None:
    """The canonical date or time of a key that is nothing else ("1 pm" -> "13:00"), else None."""
    m = _DATE_TIME.fullmatch(unicodedata.normalize("NFKC", key).strip(" .!"))
    return _date_value(m) if m else None


def _case_marked(key: str) -> list[tuple[str, bool]]:
    """The values of a key that only their case marks: (name, False) and (all-capitals code, True)."""
    return [
        (v, kind == "code")
        for kind, v in _values(key)
        if kind == "name" or (kind, v.isalpha()) == ("code", True)
    ]


def _written_as_value(text: str, value: str, code: bool) -> bool:
    """Does the text hold the value with a capital first letter (in capitals, for a code)?"""
    for m in re.finditer(rf"(?<!\w){re.escape(value)}(?!\w)", text, re.IGNORECASE):
        if m.group(0).isupper() if code else m.group(0)[0].isupper():
            return True
    return False


# --------------------------------------------------------------------------------------------
# The values an answer states, and the one matcher of accuracy and the keys answer reward
# --------------------------------------------------------------------------------------------
# A value's kind: "money" ($180, 180 dollars), "number" (180, 20%, 21st), "date" (a weekday, a month
# with or without its day, a clock time: 3pm, 3:30 pm, 15:30, noon), "code" (a token that mixes
# letters and digits, BA9742, 37C, or an all-capitals word of 4+ letters, BCERKM) and "name" (a
# capitalised word that is not a common word and not the first word of a sentence, unless that
# sentence has no lowercase word at all: "Osaka, Lena." lists two names, "Lena does it." none).
# Known gap of that rule, kept so that free prose ("Regarding the fee, ...") is not charged for its
# first words: one name per sentence ("Lena is one. Mateo is one.") states names no rule counts.
VALUE_KINDS = ("money", "number", "date", "code", "name")
_MONTHS = "january february march april may june july august september october november december".split()
_MONTH_RE = (  # capitalised even where the rest of a pattern ignores case: "you may 3 times" is no date
    r"(?-i:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?"
    r"|Sep(?:t(?:ember)?)?|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)"
)
_ORDINAL = r"(?:st|nd|rd|th)?"
_DATE_TIME = re.compile(
    rf"(?P<md>\b{_MONTH_RE}\.?\s+(?P<md_day>\d{{1,2}}){_ORDINAL}(?!\w))"
    rf"|(?P<dm>\b(?P<dm_day>\d{{1,2}}){_ORDINAL}\s+(?:of\s+)?(?P<dm_month>{_MONTH_RE})\b)"
    r"|(?P<clock>(?<![\w.:])(?P<h>\d{1,2})(?::(?P<m>\d{2}))?\s?(?P<ampm>[ap]\.?m)\b)"
    r"|(?P<hhmm>(?<![\w.:])(?P<h24>\d{1,2}):(?P<m24>\d{2})(?![\w:]))"
    r"|(?P<noon>\b(?:noon|midday|midnight)\b)"
    r"|(?P<weekday>\b(?:mon|tues|wednes|thurs|fri|satur|sun)days?\b)",
    re.IGNORECASE,
)
_ORDINAL_NUMBER = re.compile(r"(?<![\w.])(\d+)(?:st|nd|rd|th)(?!\w)", re.IGNORECASE)
_MONEY_WORD = re.compile(r"\s*(?:dollars?|usd|euros?|eur|pounds?|gbp)\b", re.IGNORECASE)
_TOKEN = re.compile(r"[^\W_](?:[\w'-]*[^\W_])?")
_CONTRACTION = re.compile(r"'(?:s|m|re|ve|ll|d|t)$", re.IGNORECASE)
_SENTENCE = re.compile(r"(?<=[.!?:;])[\"')\]]*\s+|\n")  # where a sentence (or a list item) ends
# Capitalised words that name nothing: pronouns, greetings, answer words and the openers that a
# one-word sentence ("Sure.", "Thanks!") is made of. Weekdays and months are dates, not names.
_COMMON = frozenset(
    """i me my you your yours we our us they their he she his her it its this that these those there
    here the a an and or but so yes no not ok okay yeah yep nope sure thanks thank please hi hello hey
    dear welcome great good fine right correct exactly absolutely certainly indeed sorry unfortunately
    alas well also however note done noted oh ah am pm id tv gb mb kb tb mr mrs ms dr sir madam""".split()
)


def _date_value(m: re.Match) -> str:
    """Canonical form of a date or time match: 'march 3', 'friday', '15:30' (24-hour clock)."""
    if m.group("md") or m.group("dm"):
        month = (m.group("md") or m.group("dm_month")).split()[0].rstrip(".").lower()[:3]
        full = next(name for name in _MONTHS if name.startswith(month))
        return f"{full} {int(m.group('md_day') or m.group('dm_day'))}"
    if m.group("clock"):
        hour, minute = int(m.group("h")) % 12, int(m.group("m") or 0)
        return f"{hour + 12 * (m.group('ampm')[0].lower() == 'p')}:{minute:02d}"
    if m.group("hhmm"):
        return f"{int(m.group('h24'))}:{int(m.group('m24')):02d}"
    if m.group("noon"):
        return "0:00" if m.group("noon").lower() == "midnight" else "12:00"
    return m.group("weekday").lower().rstrip("s")


def _values(text: str, initial_names: bool = False) -> set[tuple[str, str]]:
    """(kind, value) pairs of a text; with initial_names a sentence's first capitalised word counts
    as a name too (an answer key or a reference: "Mateo does it" holds the name Mateo)."""
    text = unicodedata.normalize("NFKC", text or "").translate(_QUOTES)
    found, masked = set(), list(text)

    def take(kind: str, value: str, m: re.Match) -> None:  # a value is read once: blank it out
        found.add((kind, value))
        masked[m.start() : m.end()] = " " * (m.end() - m.start())

    for m in _DATE_TIME.finditer(text):
        take("date", _date_value(m), m)
    for m in _NUMBER.finditer("".join(masked)):
        money = m.group(0).lstrip()[0] in "$€£¥₹" or _MONEY_WORD.match(text, m.end())
        take("money" if money else "number", _number_form(m), m)
    for m in _ORDINAL_NUMBER.finditer("".join(masked)):
        take("number", str(int(m.group(1))), m)
    for sentence in _SENTENCE.split("".join(masked)):
        tokens = _TOKEN.findall(sentence)
        listing = not any(t[0].islower() for t in tokens)  # no lowercase word: "Osaka, Lena." lists values
        for i, token in enumerate(tokens):
            if any(c.isdigit() for c in token) and any(c.isalpha() for c in token):
                found.add(("code", token.casefold()))
            elif token.isalpha() and token.isupper() and len(token) >= 4:
                found.add(("code", token.casefold()))
            elif token[0].isupper() and (i > 0 or listing or initial_names):
                word = _CONTRACTION.sub("", token).casefold()
                if word not in _COMMON:
                    found.add(("date" if word in _MONTHS else "name", word))
    return found


def stated_values(text: str) -> set[tuple[str, str]]:
    """The (kind, normalised value) pairs a text states, kind one of VALUE_KINDS: money and numbers
    in the canonical form of normalize_number ("$180.00" -> ("money", "180")), dates as 'march 3',
    weekdays as 'friday', clock times on the 24-hour clock ('3 pm' -> '15:00'), codes and names
    casefolded. A date or time is not also a number, nor a code's digits."""
    return _values(text)


def _allowed(value: tuple[str, str], pool: set[tuple[str, str]], words: str) -> bool:
    """Does the pool (the values of the reference and the keys) hold the value? Money and numbers
    by value ("$180" = "180"); a name, a code, a weekday or a month also by any mention of the word
    in the reference or a key ("Lena does it" holds Lena; "on May 11" holds May)."""
    kind, v = value
    if kind in ("money", "number"):
        return ("money", v) in pool or ("number", v) in pool
    return value in pool or ((kind != "date" or v.isalpha()) and _contains(words, v))


def extra_values(answer: str | None, reference: str, keys) -> list[str]:
    """The values the answer states (stated_values) that neither the reference answer nor a key
    holds: the candidates it lists beyond the answer. Sorted normalised values ("95", "osaka")."""
    if not answer:
        return []
    sources = [reference or "", *(str(k) for k in keys or [])]
    pool = set().union(*(_values(t, initial_names=True) for t in sources))
    words = " ".join(unicodedata.normalize("NFKC", t).translate(_QUOTES).casefold() for t in sources)
    return sorted({v for kind, v in stated_values(answer) if not _allowed((kind, v), pool, words)})


def answer_is_right(answer: str | None, keys, reference: str) -> bool:
    """The matcher of accuracy and of the keys answer reward: the answer states every key, and not
    to deny it (keys_affirmed), and no other value of any kind that the reference and the keys do not hold
    (extra_values). An honest answer may restate what its reference says ("$180 is over $150");
    a list of the history's candidates fails. No keys: the whole reference is the key."""
    keys = [str(k) for k in (keys or []) if str(k).strip()] or [reference]
    return (
        bool(answer)
        and all(keys_affirmed(answer, keys, reference))
        and not extra_values(answer, reference, keys)
    )


def states_several_candidates(answer: str | None, record: dict) -> bool:
    """Whether the answer states more than one candidate for one of the record's keys: a key's
    candidates are the answer's values of that key's kind (two amounts where the key is an amount,
    two names where it is a name; both 'yes' and 'no' for a yes/no key) that the reference does not
    hold, plus the key itself when stated. A value the reference gives (a threshold) is no candidate."""
    if not answer:
        return False
    keys = answer_keys(record)
    extras = set(extra_values(answer, record["answer"], keys))
    stated = stated_values(answer)
    present = keys_present(answer, keys)
    text = _key_form(answer)
    for key, found in zip(keys, present):
        form = _key_form(key).strip(" .!")
        if form in _POLAR:
            if _contains(text, "yes") and _contains(text, "no"):
                return True
            continue
        kinds = {kind for kind, _ in _values(key, initial_names=True)}
        kinds |= {"money", "number"} if kinds & {"money", "number"} else set()
        wrong = {v for kind, v in stated if kind in kinds and v in extras}
        if len(wrong) + bool(found) > 1:
            return True
    return False


def accuracy(prediction: str, record: dict) -> float:
    """1 if the prediction states every answer key and no other value that the reference does not
    hold (answer_is_right); a record without keys needs its whole reference answer present instead."""
    return float(answer_is_right(prediction, answer_keys(record), record["answer"]))


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
TAG_LABEL = re.compile(r"<HIS>\s*(?:Turn\s+)?([QA]\d+)\s*:")
# How far back a recalled turn lies, in rounds before the query (stage 0's stats, evaluate's breakdown)
DISTANCE_BINS = ("1-4", "5-9", "10-19", "20+")


def distance_bin(distance) -> str:
    """The DISTANCE_BINS bin of a recall distance in rounds; "none" where nothing is recalled."""
    if distance is None:
        return "none"
    return "1-4" if distance < 5 else "5-9" if distance < 10 else "10-19" if distance < 20 else "20+"


def tag_labels(completion: str) -> list[str]:
    """The labels a completion's <HIS> tags open with, whatever text follows them: the turns it
    chose, apart from how well it copied them (--recall copy writes the copy for it)."""
    return list(dict.fromkeys(TAG_LABEL.findall(completion)))


def jaccard(a, b) -> float:
    """Eq. (6)'s IoU |a n b| / |a u b| of two collections of labels, each read as a set (a repeat is
    one element), in [0, 1]; two empty sets agree perfectly (1.0). reward.recall_reward scales it
    to Eq. (6)'s reward; recall_metrics, evaluate.py and stage 0's near-duplicate test use it as is."""
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


def error_type(recalled, gold, truncated: bool = False, labels=None) -> str:
    """Table 3 taxonomy of a wrong answer, tested in this order (docs/design.md): a completion cut off
    by the token cap -> Truncated; H^ = H* -> Failure Answer; H* a proper subset of H^ -> Over
    Recall; H^ \\ H* non-empty -> Wrong Recall, or Garbled Copy where the tags' `labels` (when
    given) name only turns of H*: the choice of turn was right, the copy matched no turn (what
    --recall copy rules out); otherwise (H^ a proper subset of H*) -> Missing Recall."""
    if truncated:
        return "Truncated"
    recalled, gold = set(recalled), set(gold)
    if recalled == gold:
        return "Failure Answer"
    if gold < recalled:
        return "Over Recall"
    if recalled - gold:
        if labels is not None and set(labels) <= gold and all(r.startswith("?") for r in recalled - gold):
            return "Garbled Copy"
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
