"""The composite verifiable reward of SRT (paper §3.4, Eqs. (4)-(7)).

A completion tau = (Z_t, A_t) is scored against the stage-0 annotation (H*_t, A*_t):

    R(Z_t, A_t) = format(Z_t) + recall(H^_t, H*_t) + answer(A_t, A*_t)          Eq. (4)

    format  in {0, 1}          one <think> block, paired <HIS> tags inside it, 'Final answer:'   Eq. (5)
    recall  in [-1.25, 1.25]   2.5 * |H^ n H*| / |H^ u H*| - 1.25                                 Eq. (6)
    answer  in [-1, 1]         cosine of the all-MiniLM-L6-v2 embeddings of A_t and A*_t          Eq. (7)

The file reads in that order: parsing, Eq. (5), the recall set H^ and Eq. (6), Eq. (7), then the
batched entry point GRPO calls (`compute_rewards`) and a command line that explains a score:

    python reward.py --data runs/data/test.jsonl --index 3 --completion completion.txt
    python reward.py --data runs/data/test.jsonl --completions preds.jsonl

Every function is total: any string, however malformed, gets a score in range and never raises.
The parser is lenient (it extracts what it can for Eqs. (6) and (7)); the format check is strict.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import unicodedata
from collections import Counter
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from stage0_build import DataError, embed, format_target, read_jsonl, read_lines, write_json, write_jsonl

# The output format of DESIGN.md ("Output format"): the strings the policy learns to write.
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
HIS_OPEN, HIS_CLOSE = "<HIS>", "</HIS>"
ANSWER_MARK = "Final answer:"

# A tag matches a history utterance only if their overlap (defined below) reaches this value.
# Why 0.6: a verbatim copy scores 1.0 and a copy that drops or alters a third of its words still
# scores about 0.67, so honest recalls pass; but two utterances of similar length pasted into one
# unlabelled piece score at most about 0.5 with either of them, so a paste earns nothing.
DEFAULT_THRESHOLD = 0.6

# Eq. (6) constants: recall = RECALL_SCALE * IoU - RECALL_SHIFT, in [-1.25, 1.25].
RECALL_SCALE, RECALL_SHIFT = 2.5, 1.25


# --------------------------------------------------------------------------------------------
# 1. Parsing a completion into (think, tags, final answer)
# --------------------------------------------------------------------------------------------
@dataclass
class Completion:
    think: str | None            # text inside the first <think>...</think>; None if there is no block
    tags: list[str]              # contents of the well-formed <HIS>...</HIS> pairs, stripped, non-empty
    final_answer: str | None     # text after 'Final answer:', stripped; None if absent or empty


_HIS_MARK = re.compile(r"</?HIS>")
_ANSWER_ANYCASE = re.compile(re.escape(ANSWER_MARK), re.IGNORECASE)


def _his_pairs(text: str):
    """Yield (content_start, content_end) of every <HIS>...</HIS> pair.
    Lenient on purpose: a <HIS> reopened before it closes drops the earlier one (the innermost pair
    wins), a stray </HIS> is ignored. The format check reports all of these; recall still counts
    whatever pairs survive."""
    open_at = None
    for mark in _HIS_MARK.finditer(text):
        if mark.group() == HIS_OPEN:
            open_at = mark
        elif open_at is not None:
            yield open_at.end(), mark.start()
            open_at = None


def parse_completion(text: str) -> Completion:
    """Split a completion into its think block, its recall tags and its final answer.

    think: between the first <think> and the first </think> after it (an unclosed block runs to the
    end); with only a </think> (some chat templates open the block in the prompt) everything before it.
    tags: every <HIS> pair anywhere in the text; tags outside the think block still count as recall
    actions for Eq. (6), and Eq. (5) is what punishes their position.
    final_answer: after the last 'Final answer:' (any case) that follows the last </think>; without a
    </think>, after the last 'Final answer:' anywhere.
    """
    open_at = text.find(THINK_OPEN)
    if open_at >= 0:
        close_at = text.find(THINK_CLOSE, open_at)
        think = text[open_at + len(THINK_OPEN): close_at if close_at >= 0 else len(text)]
    else:
        close_at = text.find(THINK_CLOSE)
        think = text[:close_at] if close_at >= 0 else None

    tags = []
    for content_start, content_end in _his_pairs(text):
        content = text[content_start:content_end].strip()
        if content:  # an empty tag recalls nothing; Eq. (5) reports it
            tags.append(content)

    last_close = text.rfind(THINK_CLOSE)
    tail_start = last_close + len(THINK_CLOSE) if last_close >= 0 else 0
    marks = list(_ANSWER_ANYCASE.finditer(text, tail_start))
    final_answer = text[marks[-1].end():].strip() if marks else None
    return Completion(think=think, tags=tags, final_answer=final_answer or None)


# --------------------------------------------------------------------------------------------
# 2. Eq. (5): the format reward, with the reasons a completion fails it
# --------------------------------------------------------------------------------------------
_MISSPELLED_TAG = re.compile(r"<\s*/?\s*(?:his|think)\s*>", re.IGNORECASE)
_LABEL = re.compile(r"\b([QA]\d+)\s*:")


def _short(s: str, n: int = 40) -> str:
    s = " ".join(s.split())
    return repr(s if len(s) <= n else s[: n - 3] + "...")


def format_problems(text: str) -> list[str]:
    """Every reason `text` fails Eq. (5), in reading order; an empty list means format = 1.

    Valid means: (optional whitespace) <think> non-empty reasoning </think>, then 'Final answer:'
    and a non-empty answer; exactly one think block; every <HIS> inside it, each one closed before
    the next opens (paired, not nested), none empty, and none holding only labels without text.
    """
    problems = []
    body = text.strip()
    if not body:
        return ["the completion is empty"]

    n_open, n_close = body.count(THINK_OPEN), body.count(THINK_CLOSE)
    if n_open != 1 or n_close != 1:
        problems.append(f"expected exactly one {THINK_OPEN} and one {THINK_CLOSE}, found {n_open} and {n_close}")
    open_at, close_at = body.find(THINK_OPEN), body.find(THINK_CLOSE)
    if open_at > 0:
        problems.append(f"text before {THINK_OPEN}: {_short(body[:open_at])}")
    if 0 <= close_at < open_at:
        problems.append(f"{THINK_CLOSE} comes before {THINK_OPEN}")
    think_span = (open_at + len(THINK_OPEN), close_at) if 0 <= open_at < close_at else None
    if think_span and not body[think_span[0]:think_span[1]].strip():
        problems.append("the think block is empty")

    if close_at >= 0:
        tail = body[body.rfind(THINK_CLOSE) + len(THINK_CLOSE):]
        exact = tail.count(ANSWER_MARK)
        anycase = _ANSWER_ANYCASE.search(tail)
        if not tail.lstrip().startswith(ANSWER_MARK):
            if anycase is None:
                problems.append(f"no '{ANSWER_MARK}' after {THINK_CLOSE}")
            elif exact == 0:
                problems.append(f"write '{ANSWER_MARK}' exactly (found '{anycase.group()}')")
            else:
                problems.append(f"text between {THINK_CLOSE} and '{ANSWER_MARK}': "
                                f"{_short(tail[:tail.find(ANSWER_MARK)])}")
        repeats = len(_ANSWER_ANYCASE.findall(tail))
        if repeats > 1:
            problems.append(f"'{ANSWER_MARK}' appears {repeats} times after {THINK_CLOSE}")
        if anycase is not None and not tail[anycase.end():].strip():
            problems.append(f"'{ANSWER_MARK}' is followed by no answer")

    # <HIS> tags: inside the think block, paired, not nested, not empty.
    depth, content_start, k = 0, 0, 0
    for mark in _HIS_MARK.finditer(body):
        inside = think_span is not None and think_span[0] <= mark.start() < think_span[1]
        if not inside:
            problems.append(f"{mark.group()} at character {mark.start()} lies outside the think block")
        if mark.group() == HIS_OPEN:
            if depth:
                problems.append(f"nested {HIS_OPEN} at character {mark.start()}: the previous tag is not closed")
            depth, content_start = 1, mark.end()
        elif not depth:
            problems.append(f"{HIS_CLOSE} at character {mark.start()} has no opening {HIS_OPEN}")
        else:
            depth, k = 0, k + 1
            content = body[content_start:mark.start()]
            if not content.strip():
                problems.append(f"<HIS> tag {k} is empty")
            elif not any(piece.tokens for piece in split_tag(content)):
                problems.append(f"<HIS> tag {k} holds labels but no utterance text: {_short(content)}")
    if depth:
        problems.append(f"{HIS_OPEN} at character {content_start - len(HIS_OPEN)} is never closed")

    for mark in _MISSPELLED_TAG.finditer(body):
        if mark.group() not in (THINK_OPEN, THINK_CLOSE, HIS_OPEN, HIS_CLOSE):
            problems.append(f"{mark.group()!r} is not a tag of the format (case and spacing matter)")
    return problems


def is_valid_format(text: str) -> bool:
    # Eq. (5): R_format = I(is_valid(Z_t))
    return not format_problems(text)


# --------------------------------------------------------------------------------------------
# 3. The recall set H^: align every tag to the history utterance of maximal normalized overlap
# --------------------------------------------------------------------------------------------
# Normalization: Unicode NFKC, case-folded; tokens are runs of letters and digits (punctuation,
# '$', '%' and underscores separate tokens), except that every CJK ideograph or kana character is a
# token of its own, because those scripts write words without spaces.
_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
_TOKEN = re.compile(rf"[{_CJK}]|[^\W_{_CJK}]+")


def tokens(text: str) -> list[str]:
    return _TOKEN.findall(unicodedata.normalize("NFKC", text).casefold())


def overlap(a: Counter, b: Counter) -> float:
    """Normalized token overlap |a n b| / max(|a|, |b|) on token multisets, in [0, 1].

    1 only for the same multiset of tokens. Dividing by the longer side (not the shorter, not the
    tag) is what makes a paste of several utterances score low against each of them, and a scrap
    of an utterance score low against the whole: a recall must be one whole utterance.
    """
    longer = max(sum(a.values()), sum(b.values()))
    return sum((a & b).values()) / longer if longer else 0.0


class Piece(NamedTuple):
    text: str             # as written, label included ("A5: The Chakra Balancing service is $180.")
    hint: str | None      # the label the model wrote, if any ("A5")
    tokens: Counter       # normalized tokens of the utterance text, label excluded


def split_tag(content: str) -> list[Piece]:
    """One tag may hold several labelled utterances (the paper's Fig. 1 form,
    `<HIS>Q1: ... A5: ... A6: ...</HIS>`): split on the label prefixes `Q12:` / `A3:` and align each
    piece on its own. Text before the first label is one unlabelled piece. (A label-like string
    inside an utterance, 'plan A2: ...', also splits; the synthetic data never writes one.)"""
    labels = list(_LABEL.finditer(content))
    bounds = [m.start() for m in labels] + [len(content)]
    pieces = []
    head = content[:bounds[0]]
    if tokens(head):
        pieces.append(Piece(head.strip(), None, Counter(tokens(head))))
    for m, end in zip(labels, bounds[1:]):
        pieces.append(Piece(content[m.start():end].strip(), m.group(1), Counter(tokens(content[m.end():end]))))
    return pieces


class HistoryIndex(NamedTuple):
    labels: list[str]
    counts: list[Counter]
    sizes: list[int]


def index_history(history: list[dict]) -> HistoryIndex:
    """Tokenize C_t once; GRPO scores K completions of the same prompt against it."""
    counts = [Counter(tokens(turn["text"])) for turn in history]
    return HistoryIndex([turn["label"] for turn in history], counts, [sum(c.values()) for c in counts])


def best_match(piece: Piece, index: HistoryIndex) -> tuple[str | None, float]:
    """The history utterance of maximal overlap with a piece, and that overlap.

    The text decides, the label is only a hint: a piece labelled 'A5' whose text is a copy of Q1
    counts as Q1 (the recall action copied Q1; a wrong label does not earn A5). The label only breaks
    exact ties, e.g. between two utterances that both read 'Yes.'; other ties go to the earliest."""
    size = sum(piece.tokens.values())
    best_i, best = None, 0.0
    for i, (counts, n) in enumerate(zip(index.counts, index.sizes)):
        if size == 0 or min(size, n) < best * max(size, n) - 1e-9:  # cannot reach `best`: skip it
            continue
        score = overlap(piece.tokens, counts)
        if score > best + 1e-12 or (best_i is not None and abs(score - best) <= 1e-12
                                    and index.labels[i] == piece.hint != index.labels[best_i]):
            best_i, best = i, score
    return (index.labels[best_i] if best_i is not None else None), best


class TagMatch(NamedTuple):
    text: str             # the piece as written
    label: str | None     # the history label it recalls, None if its best overlap < threshold
    overlap: float        # its best overlap with any history utterance


def match_tags(tags: list[str], history: list[dict] | HistoryIndex,
               threshold: float = DEFAULT_THRESHOLD) -> list[TagMatch]:
    """Align every piece of every tag to the history (one TagMatch per piece, in writing order)."""
    index = history if isinstance(history, HistoryIndex) else index_history(history)
    matches = []
    for tag in tags:
        for piece in split_tag(tag):
            label, score = best_match(piece, index)
            matches.append(TagMatch(piece.text, label if score >= threshold and label else None, score))
    return matches


def unmatched_key(text: str) -> str:
    """H^ element of a tag that matched nothing. It cannot collide with a label, and the same
    hallucination written twice is one element (H^ is a set)."""
    return "?" + " ".join(tokens(text))


def recall_sets(matches: list[TagMatch], history_labels: list[str]) -> tuple[list[str], list[str], set[str]]:
    """(recalled labels in history order, texts of unmatched pieces, H^ as the set Eq. (6) uses).

    A matched utterance enters H^ once however often it is recalled; every distinct unmatched piece
    enters as an element of its own, so a hallucinated recall enlarges the union and lowers the reward."""
    order = {label: i for i, label in enumerate(history_labels)}
    recalled = sorted({m.label for m in matches if m.label is not None}, key=order.__getitem__)
    unmatched = [m.text for m in matches if m.label is None]
    return recalled, unmatched, set(recalled) | {unmatched_key(t) for t in unmatched}


def predicted_recall_set(text: str, history: list[dict], threshold: float = DEFAULT_THRESHOLD) -> set[str]:
    """H^ of a completion: matched labels plus one '?...' element per distinct unmatched piece."""
    matches = match_tags(parse_completion(text).tags, history, threshold)
    return recall_sets(matches, [turn["label"] for turn in history])[2]


def recalled_labels(text: str, history: list[dict], threshold: float = DEFAULT_THRESHOLD) -> list[str]:
    """The history labels a completion recalls, in history order (unmatched tags left out)."""
    matches = match_tags(parse_completion(text).tags, history, threshold)
    return recall_sets(matches, [turn["label"] for turn in history])[0]


def jaccard(a, b) -> float:
    """IoU |a n b| / |a u b| of two sets; two empty sets agree perfectly (1.0)."""
    a, b = set(a), set(b)
    return len(a & b) / len(a | b) if a | b else 1.0


def recall_reward(recalled_set, gold_set) -> float:
    # Eq. (6): R_recall = 2.5 * |H^ n H*| / |H^ u H*| - 1.25
    return RECALL_SCALE * jaccard(recalled_set, gold_set) - RECALL_SHIFT


# --------------------------------------------------------------------------------------------
# 4. Eq. (7): the answer reward, cosine of sentence embeddings
# --------------------------------------------------------------------------------------------
def answer_rewards(answers: list[str | None], references: list[str]) -> list[float]:
    """Eq. (7) for a batch: cos(v_A, v_A*) with all-MiniLM-L6-v2 (stage0_build.embed, loaded once,
    unit-norm rows, so the cosine is a dot product). All answers and references go through one
    embedding call. A missing answer gets the minimum, -1, and is never embedded."""
    rewards = [-1.0] * len(answers)
    present = [i for i, a in enumerate(answers) if a is not None]
    if present:
        vectors = embed([answers[i] for i in present] + [references[i] for i in present])
        cosines = np.sum(vectors[:len(present)] * vectors[len(present):], axis=1)
        for i, c in zip(present, cosines):
            rewards[i] = float(np.clip(c, -1.0, 1.0))
    return rewards


# --------------------------------------------------------------------------------------------
# 5. Eq. (4): the composite reward, batched for GRPO
# --------------------------------------------------------------------------------------------
def compute_rewards(completions: list[str], examples: list[dict],
                    threshold: float = DEFAULT_THRESHOLD) -> list[dict]:
    """Score completion i against stage-0 record examples[i] (uses history, recall, answer).

    Returns one dict per completion: format, recall, answer, total (Eq. (4)), jaccard (the IoU of
    Eq. (6)), recalled (labels of H^ in history order), unmatched (pieces that matched nothing),
    final_answer, matches ([text, label, overlap] per piece) and format_problems."""
    if len(completions) != len(examples):
        raise ValueError(f"{len(completions)} completions but {len(examples)} examples")
    indexes = {}  # id(history) -> HistoryIndex: the K rollouts of one prompt share one tokenization
    results, answers = [], []
    for text, example in zip(completions, examples):
        history = example["history"]
        if id(history) not in indexes:
            indexes[id(history)] = index_history(history)
        index = indexes[id(history)]
        parsed = parse_completion(text)
        problems = format_problems(text)
        matches = match_tags(parsed.tags, index, threshold)
        recalled, unmatched, predicted = recall_sets(matches, index.labels)
        iou = jaccard(predicted, example["recall"])
        results.append({
            "format": 0.0 if problems else 1.0,                       # Eq. (5)
            "recall": RECALL_SCALE * iou - RECALL_SHIFT,              # Eq. (6)
            "jaccard": iou,
            "recalled": recalled,
            "unmatched": unmatched,
            "final_answer": parsed.final_answer,
            "matches": [[m.text, m.label, round(m.overlap, 4)] for m in matches],
            "format_problems": problems,
        })
        answers.append(parsed.final_answer)
    for result, reward in zip(results, answer_rewards(answers, [e["answer"] for e in examples])):
        result["answer"] = reward                                      # Eq. (7)
        result["total"] = result["format"] + result["recall"] + reward  # Eq. (4)
    return results


def compute_reward(completion: str, example: dict, threshold: float = DEFAULT_THRESHOLD) -> dict:
    return compute_rewards([completion], [example], threshold)[0]


# --------------------------------------------------------------------------------------------
# Command line: explain one score, or average a file of them
# --------------------------------------------------------------------------------------------
def explain(completion: str, record: dict, threshold: float) -> str:
    """A report a student can read: each component and where it came from."""
    result = compute_reward(completion, record, threshold)
    index = index_history(record["history"])
    gold = record["recall"]
    lines = [f"record {record.get('id', '?')}: query Q{record.get('query_turn', '?')}: {record.get('query', '')}",
             f"gold H* = {{{', '.join(gold)}}}   reference A* = {record['answer']!r}", ""]

    problems = result["format_problems"]
    if problems:
        lines.append("format  0    (Eq. 5) failed:")
        lines += [f"          - {p}" for p in problems]
    else:
        n = len(parse_completion(completion).tags)
        lines.append(f"format  1    (Eq. 5) one non-empty <think> block holding {n} paired, non-empty "
                     f"<HIS> tag(s), then '{ANSWER_MARK}' and an answer")

    lines.append(f"\nrecall tags (match when overlap >= {threshold:.2f}; overlap = |tag n utterance| / max size)")
    pieces = [p for tag in parse_completion(completion).tags for p in split_tag(tag)]
    if not pieces:
        lines.append("  (no <HIS> tags)")
    for k, piece in enumerate(pieces, 1):
        label, score = best_match(piece, index)
        if score >= threshold and label:
            verdict = f"-> {label}  overlap {score:.2f}  " + ("in H*" if label in gold else "NOT in H*")
            if piece.hint and piece.hint != label:
                verdict += f"  (written label {piece.hint} ignored: the text is {label})"
        else:
            verdict = f"-> nothing  best {label or '-'} overlap {score:.2f} < {threshold:.2f}: unmatched, enters the union"
        lines.append(f"  [{k}] {_short(piece.text, 60)}\n      {verdict}")

    predicted = set(result["recalled"]) | {unmatched_key(t) for t in result["unmatched"]}
    inter, union = len(predicted & set(gold)), len(predicted | set(gold))
    shown = result["recalled"] + [f"unmatched#{i + 1}" for i in range(len(predicted) - len(result["recalled"]))]
    lines += ["", f"H^ = {{{', '.join(shown)}}}   |H^ n H*| = {inter}   |H^ u H*| = {union}   "
                  f"IoU = {result['jaccard']:.4f}" + ("  (both empty: IoU 1)" if union == 0 else ""),
              f"recall  {result['recall']:+.4f} (Eq. 6) = 2.5 * {result['jaccard']:.4f} - 1.25"]
    if result["final_answer"] is None:
        lines.append(f"answer  -1.0000 (Eq. 7) no final answer after '{ANSWER_MARK}': the minimum")
    else:
        lines.append(f"answer  {result['answer']:+.4f} (Eq. 7) cos(emb({_short(result['final_answer'], 50)}), "
                     f"emb({_short(record['answer'], 50)}))")
    lines.append(f"total   {result['total']:+.4f} (Eq. 4) = {result['format']:.0f} "
                 f"{result['recall']:+.4f} {result['answer']:+.4f}   range [-2.25, 3.25]")
    return "\n".join(lines)


def read_completions(path: str, records: list[dict]) -> list[tuple[dict, str]]:
    """Lines {"id": ..., "completion": ...} (matched by id to --data) or {"index": ..., "completion": ...}."""
    by_id = {r["id"]: r for r in records}

    def parse(row, path, line_no):
        if not isinstance(row, dict):
            raise DataError(f"{path}:{line_no}: line is not a JSON object")
        if not isinstance(row.get("completion"), str):
            raise DataError(f"{path}:{line_no}: field 'completion' is missing or not a string")
        if "id" in row:
            if row["id"] not in by_id:
                raise DataError(f"{path}:{line_no}: field 'id' names {row['id']!r}, which is not in the --data file")
            return by_id[row["id"]], row["completion"]
        if "index" in row:
            i = row["index"]
            if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < len(records):
                raise DataError(f"{path}:{line_no}: field 'index' must be an integer in [0, {len(records)})")
            return records[i], row["completion"]
        raise DataError(f"{path}:{line_no}: field 'id' (or 'index') is missing")

    return read_lines(path, parse)


def main(argv=None):
    parser = argparse.ArgumentParser(
        description="SRT composite reward (paper §3.4, Eqs. 4-7): explain the score of one completion, "
                    "or average the scores of a file of completions.")
    parser.add_argument("--data", required=True, help="stage-0 JSONL (e.g. runs/data/test.jsonl)")
    parser.add_argument("--index", type=int, default=0, help="which record of --data to score (0-based)")
    parser.add_argument("--id", default=None, help="pick the record by id instead of --index")
    parser.add_argument("--completion", default=None,
                        help="a file holding the completion, or the completion text itself; "
                             "default: the record's own reference target (the best possible score)")
    parser.add_argument("--completions", default=None,
                        help="JSONL of {'id' or 'index', 'completion'}: score them all and print the means")
    parser.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD,
                        help=f"minimum overlap for a tag to match an utterance (default {DEFAULT_THRESHOLD})")
    parser.add_argument("--out", default=None, help="with --completions: folder for scores.jsonl, summary.json, config.json")
    args = parser.parse_args(argv)
    if not 0.0 < args.threshold <= 1.0:
        sys.exit(f"error: --threshold must lie in (0, 1], got {args.threshold}")

    try:
        records = read_jsonl(args.data)
        if args.completions:
            pairs = read_completions(args.completions, records)
    except (DataError, OSError) as e:
        sys.exit(f"error: {e}")
    if not records:
        sys.exit(f"error: {args.data} holds no records")

    if args.completions:
        results = []
        for start in range(0, len(pairs), 256):
            chunk = pairs[start:start + 256]
            results += compute_rewards([c for _, c in chunk], [r for r, _ in chunk], args.threshold)
        n = max(len(results), 1)
        summary = {"n": len(results), **{k: sum(r[k] for r in results) / n
                                         for k in ("format", "recall", "answer", "total", "jaccard")},
                   "unmatched_tags_per_completion": sum(len(r["unmatched"]) for r in results) / n,
                   "no_final_answer": sum(r["final_answer"] is None for r in results) / n}
        print(f"{summary['n']} completions from {args.completions}, threshold {args.threshold}")
        for k in ("format", "recall", "answer", "total", "jaccard"):
            print(f"  mean {k:<8} {summary[k]:+.4f}")
        print(f"  unmatched tags per completion {summary['unmatched_tags_per_completion']:.2f}, "
              f"no final answer {100 * summary['no_final_answer']:.1f}%")
        if args.out:
            write_jsonl(os.path.join(args.out, "scores.jsonl"),
                        [{"id": r["id"], **s} for (r, _), s in zip(pairs, results)])
            write_json(os.path.join(args.out, "summary.json"), summary)
            write_json(os.path.join(args.out, "config.json"), vars(args))
        return summary

    if args.id is not None:
        matching = [r for r in records if r["id"] == args.id]
        if not matching:
            sys.exit(f"error: {args.data}: no record has id {args.id!r}")
        record = matching[0]
    elif not 0 <= args.index < len(records):
        sys.exit(f"error: --index {args.index} is out of range: {args.data} holds {len(records)} records")
    else:
        record = records[args.index]
    if args.completion is None:
        completion = format_target(record)
    elif os.path.isfile(args.completion):
        with open(args.completion, encoding="utf-8") as f:
            completion = f.read()
    else:
        completion = args.completion
    print(explain(completion, record, args.threshold))


if __name__ == "__main__":
    main()
