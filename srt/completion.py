"""The output format (docs/design.md, "Output format"): what the policy learns to write, read back.

    <think>
    1. Analyze Query: ...
    2. Recall History: <HIS>Q1: ...</HIS> <HIS>A5: ...</HIS>
    3. Reasoning: ...
    </think>
    Final answer: ...

`parse_completion` splits any string into its think block, its <HIS> tags and its final answer;
`format_problems` lists why a completion breaks the format, and `is_valid_format` is the test behind
the format reward of Eq. (5) (reward.py). Stage 1's held-out check and evaluate.py read completions
with the same functions, so the reward and the reports can never disagree on what was written.
"""

from __future__ import annotations

import re
import unicodedata
from typing import NamedTuple

# The output format of docs/design.md ("Output format"): the strings the policy learns to write.
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
HIS_OPEN, HIS_CLOSE = "<HIS>", "</HIS>"
ANSWER_MARK = "Final answer:"
MARKERS = (THINK_OPEN, THINK_CLOSE, HIS_OPEN, HIS_CLOSE, ANSWER_MARK)


# ==== Normalisation and parsing a completion into (think, tags, final answer) ====
_QUOTES = str.maketrans(
    {c: "'" for c in "\u2018\u2019\u201a\u201b\u2032\u2039\u203a`\u00b4"}
    | {c: '"' for c in "\u201c\u201d\u201e\u201f\u2033\u00ab\u00bb"}
)
_TRAILING = ".,;:!? 。、"  # NFKC leaves the CJK full stop and comma as they are


def normalize(text: str) -> str:
    """NFKC: the form every parser below reads, so that a full-width ＜HIS＞ is seen as <HIS>."""
    return unicodedata.normalize("NFKC", text)


def canonical(text: str) -> str:
    """The form in which a copy must equal its utterance (tolerances: see the module docstring)."""
    t = " ".join(normalize(text).translate(_QUOTES).casefold().split())
    previous = None
    while t != previous:  # "'...$180.'," -> "...$180"
        previous = t
        t = t.rstrip(_TRAILING)
        if len(t) >= 2 and t[0] == t[-1] and t[0] in "'\"":
            t = t[1:-1].strip()
    return t


class Completion(NamedTuple):
    think: str | None  # text inside the first <think>...</think>; None if there is no block
    tags: list[str]  # contents of the <HIS>...</HIS> pairs, stripped, non-empty
    final_answer: str | None  # text after 'Final answer:', stripped; None if absent or empty


_HIS_MARK = re.compile(r"</?HIS>")
_ANSWER_ANYCASE = re.compile(re.escape(ANSWER_MARK), re.IGNORECASE)


def _his_pairs(text: str):
    """(start, end) of every <HIS>...</HIS> content; lenient (Eq. (5) reports what it forgives)."""
    open_at = None
    for mark in _HIS_MARK.finditer(text):
        if mark.group() == HIS_OPEN:
            open_at = mark
        elif open_at is not None:
            yield open_at.end(), mark.start()
            open_at = None


def parse_completion(text: str) -> Completion:
    """Split the NFKC form of a completion into its think block, its tags and its final answer.

    think: between the first <think> and the first </think> after it (an unclosed block runs to the
    end); with only a </think> (a chat template may open the block in the prompt) everything before.
    tags: every <HIS> pair anywhere; tags outside the think block still count for Eq. (6), and
    Eq. (5) punishes their position. final_answer: after the last 'Final answer:' (any case) that
    follows the last </think>; without a </think>, after the last one anywhere.
    """
    text = normalize(text)
    open_at = text.find(THINK_OPEN)
    if open_at >= 0:
        close_at = text.find(THINK_CLOSE, open_at)
        think = text[open_at + len(THINK_OPEN) : close_at if close_at >= 0 else len(text)]
    else:
        close_at = text.find(THINK_CLOSE)
        think = text[:close_at] if close_at >= 0 else None
    tags = [text[a:b].strip() for a, b in _his_pairs(text) if text[a:b].strip()]
    last_close = text.rfind(THINK_CLOSE)
    tail_start = last_close + len(THINK_CLOSE) if last_close >= 0 else 0
    marks = list(_ANSWER_ANYCASE.finditer(text, tail_start))
    final_answer = text[marks[-1].end() :].strip() if marks else None
    return Completion(think=think, tags=tags, final_answer=final_answer or None)


# ==== Eq. (5): the format reward, with the reasons a completion fails it ====
# Look-alikes that NFKC leaves alone (a small table, not all of Unicode's confusables): angle
# brackets, slashes, and Cyrillic, Greek and small-capital letters of "his"/"think"/"final answer".
_CONFUSABLE = str.maketrans(
    "‹〈《⟨❮˂ᐸ⋖›〉》⟩❯˃ᐳ⋗∕⁄⧸НнҺһΗʜІіΙιıɪЅѕꜱТтΤᴛКкΚκᴋΝɴаАеЕоОрРсСѡᴡԝг",
    "<<<<<<<<>>>>>>>>///hhhhhhiiiiiisssttttkkkkknnaaeeooppccwwwr",
)
_TAG_LIKE = re.compile(r"<\s*/?\s*(?:his|think)\s*>|final\s*answer\s*:")


def lookalike_markers(text: str) -> list[str]:
    """Strings that read as a tag of the format but are not one written exactly: <his>, ＜HIS＞,
    <НIS> (Cyrillic Н), <H\\u200bIS>, <HÍS> (accents go). An answer mark counts only when NFKC makes
    it exactly 'Final answer:' (prose like 'my final answer:' inside the think block is left alone)."""
    skeleton, where = [], []
    for i, ch in enumerate(text):
        s = "".join(
            c for c in unicodedata.normalize("NFKD", ch) if unicodedata.category(c) not in ("Mn", "Cf")
        )
        s = s.translate(_CONFUSABLE).casefold()
        skeleton.append(s)
        where += [i] * len(s)
    spans = [
        (m.group(), text[where[m.start()] : where[m.end() - 1] + 1])
        for m in _TAG_LIKE.finditer("".join(skeleton))
    ]
    return [
        raw for like, raw in spans if raw not in MARKERS and (like[0] == "<" or normalize(raw) == ANSWER_MARK)
    ]


# A new turn after the answer: a history label, a role name, or a chat-template token.
_NEW_TURN = re.compile(
    r"^\s*(?:(?:turn\s+)?[QA]\d+\s*:|(?:user|assistant|system|human|customer|agent|bot)\s*:"
    r"|#+\s*(?:user|assistant|human)\b)",
    re.IGNORECASE | re.MULTILINE,
)
_CHAT_TOKEN = re.compile(r"<\|[^|<>\n]{1,40}\|>|\[/?INST\]")


def short(s: str, n: int = 40) -> str:
    s = " ".join(s.split())
    return repr(s if len(s) <= n else s[: n - 3] + "...")


def format_problems(text: str) -> list[str]:
    """Every reason `text` fails Eq. (5) ([] means format = 1): the rules are numbered in reward.py's
    format_reward, and each check below carries its rule's number."""
    problems = [  # rule 1: every marker written exactly
        f"{raw!r} looks like a marker of the format but is not one: write {', '.join(MARKERS)} exactly"
        for raw in lookalike_markers(text)
    ]
    body = normalize(text).strip()
    if not body:
        return ["the completion is empty"]

    # rule 2: one think block, first, not empty
    n_open, n_close = body.count(THINK_OPEN), body.count(THINK_CLOSE)
    if n_open != 1 or n_close != 1:
        problems.append(
            f"expected exactly one {THINK_OPEN} and one {THINK_CLOSE}, found {n_open} and {n_close}"
        )
    open_at, close_at = body.find(THINK_OPEN), body.find(THINK_CLOSE)
    if open_at > 0:
        problems.append(f"text before {THINK_OPEN}: {short(body[:open_at])}")
    if 0 <= close_at < open_at:
        problems.append(f"{THINK_CLOSE} comes before {THINK_OPEN}")
    think_span = (open_at + len(THINK_OPEN), close_at) if 0 <= open_at < close_at else None
    if think_span and not body[think_span[0] : think_span[1]].strip():
        problems.append("the think block is empty")

    if close_at >= 0:  # rule 3: after </think>, 'Final answer:' once, then an answer
        tail = body[body.rfind(THINK_CLOSE) + len(THINK_CLOSE) :]
        anycase = _ANSWER_ANYCASE.search(tail)
        if not tail.lstrip().startswith(ANSWER_MARK):
            if anycase is None:
                problems.append(f"no '{ANSWER_MARK}' after {THINK_CLOSE}")
            elif ANSWER_MARK not in tail:
                problems.append(f"write '{ANSWER_MARK}' exactly (found '{anycase.group()}')")
            else:
                problems.append(
                    f"text between {THINK_CLOSE} and '{ANSWER_MARK}': {short(tail[: tail.find(ANSWER_MARK)])}"
                )
        if (repeats := len(_ANSWER_ANYCASE.findall(tail))) > 1:
            problems.append(f"'{ANSWER_MARK}' appears {repeats} times after {THINK_CLOSE}")
        if anycase is not None:
            answer = tail[anycase.end() :]
            if not answer.strip():
                problems.append(f"'{ANSWER_MARK}' is followed by no answer")
            later_lines = answer.partition("\n")[2]  # rule 4: the answer starts no new turn
            for m in list(_NEW_TURN.finditer(later_lines)) + list(_CHAT_TOKEN.finditer(answer)):
                problems.append(f"the answer goes on to start a new turn: {short(m.group())}")

    # <HIS> tags: inside the think block, paired, not nested (rule 5); not empty, every label with
    # its utterance (rule 6).
    depth, content_start, k = 0, 0, 0
    for mark in _HIS_MARK.finditer(body):
        inside = think_span is not None and think_span[0] <= mark.start() < think_span[1]
        if not inside:
            problems.append(f"{mark.group()} at character {mark.start()} lies outside the think block")
        if mark.group() == HIS_OPEN:
            if depth:
                problems.append(
                    f"nested {HIS_OPEN} at character {mark.start()}: the previous tag is not closed"
                )
            depth, content_start = 1, mark.end()
        elif not depth:
            problems.append(f"{HIS_CLOSE} at character {mark.start()} has no opening {HIS_OPEN}")
        else:
            depth, k = 0, k + 1
            content = body[content_start : mark.start()]
            if not content.strip():
                problems.append(f"<HIS> tag {k} is empty")
            for piece in split_tag(content):
                if not piece.body:
                    problems.append(f"<HIS> tag {k}: label {piece.hint} has no utterance text")
    if depth:
        problems.append(f"{HIS_OPEN} at character {content_start - len(HIS_OPEN)} is never closed")
    return problems


def is_valid_format(text: str) -> bool:
    # Eq. (5): R_format = I(is_valid(Z_t))
    return not format_problems(text)


# ==== The pieces of a <HIS> tag: one utterance each (several in Fig. 1's form) ====
# Tokens only explain a miss (the nearest utterance, reward.py); they never decide a match.
_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
_TOKEN = re.compile(rf"[{_CJK}]|[^\W_{_CJK}]+")
LABEL = re.compile(r"(?:\b[Tt]urn\s+)?\b([QA]\d+)\s*:")
MAX_SPLIT_LABELS = 40  # beyond this many labels in one tag, split on every label (no re-joining)


def tokens(text: str) -> list[str]:
    return _TOKEN.findall(normalize(text).casefold())


class Piece(NamedTuple):
    text: str  # as written, label included ("A5: The Chakra Balancing service is $180.")
    hint: str | None  # the label the model wrote, if any ("A5")
    body: str  # canonical text of the utterance part, label excluded ("" = none)


class HistoryIndex(NamedTuple):
    labels: list[str]
    texts: list[str]
    by_text: dict  # canonical utterance -> its labels in history order


def index_history(history: list[dict]) -> HistoryIndex:
    """Canonicalise C_t once; GRPO scores K completions of the same prompt against it."""
    by_text = {}
    for turn in history:
        key = canonical(turn["text"])
        if key:
            by_text.setdefault(key, []).append(turn["label"])
    return HistoryIndex([t["label"] for t in history], [t["text"] for t in history], by_text)


def _segment(content: str, start: int, end: int, label: re.Match | None) -> Piece:
    body = content[start if label is None else label.end() : end]
    return Piece(content[start:end].strip(), label and label.group(1), canonical(body))


def split_tag(content: str, index: HistoryIndex | None = None) -> list[Piece]:
    """The pieces of one tag: Fig. 1's `<HIS>Q1: ... A5: ... A6: ...</HIS>` splits on its labels
    (`Q12:`, `Turn A3:`); text before the first label is an unlabelled piece. With `index`, a label
    that is part of an utterance ("Take plan A2: it is cheaper.") does not cut it: among the ways to
    cut at labels, the one with the most verbatim matches wins (ties: the most pieces)."""
    labels = list(LABEL.finditer(content))
    head = content[: labels[0].start()] if labels else content
    starts = ([0] if tokens(head) else []) + [m.start() for m in labels]  # "- Q1: ..." has no head
    at = {m.start(): m for m in labels}
    n, bounds = len(starts), starts + [len(content)]
    if index is None or n > MAX_SPLIT_LABELS:
        return [_segment(content, bounds[i], bounds[i + 1], at.get(bounds[i])) for i in range(n)]
    best = [(0, 0, None)] + [(-1, 0, None)] * n  # (matched, pieces, previous cut) per cut point
    for j in range(1, n + 1):
        for i in range(j):
            piece = _segment(content, bounds[i], bounds[j], at.get(bounds[i]))
            score = (best[i][0] + (piece.body in index.by_text), best[i][1] + 1)
            if score > best[j][:2]:
                best[j] = (*score, i)
    cuts = [n]
    while cuts[0]:
        cuts.insert(0, best[cuts[0]][2])
    return [_segment(content, bounds[a], bounds[b], at.get(bounds[a])) for a, b in zip(cuts, cuts[1:])]
