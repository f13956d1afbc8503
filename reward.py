"""The composite verifiable reward of SRT (paper §3.4, Eqs. (4)-(7)).

A completion tau = (Z_t, A_t) is scored against the stage-0 annotation (H*_t, A*_t):

    R(Z_t, A_t) = format(Z_t) + recall(H^_t, H*_t) + answer(A_t, A*_t)          Eq. (4)

    format  in {0, 1}          one <think> block, paired <HIS> tags inside it, 'Final answer:'   Eq. (5)
    recall  in [-1.25, 1.25]   2.5 * |H^ n H*| / |H^ u H*| - 1.25                                 Eq. (6)
    answer  in [-1, 1]         --answer-reward cosine | keys | both                               Eq. (7)

Eq. (6) alignment. §3.1: a recall action "verbatim-copies a selected historical utterance", so a
tag matches an utterance only if it reproduces it. Both are compared in `canonical` form: NFKC,
case folded, whitespace runs folded to one space, and three tolerances, each a change that states
no fact: curly and angled quotes fold to straight ones (‘’“”«»: templates and tokenizers swap
them); one pair of quotes around the whole copy goes (the teacher form `Turn A5: '...'` of §3.2);
a run of final punctuation (. , ; : ! ? 。 、) goes (quoting moves or drops the final period; a comma
separates the pieces of a Fig. 1 tag). Nothing else: a changed number, code or name, a dropped
half, reordered or added words, changed inner punctuation ("$1,800" vs "$1800") match nothing.
The text decides, the label is a hint: a tag labelled A5 that copies Q1 verbatim recalls Q1 (the
action o_k of Eq. (1) is the copy), so it earns Q1's credit and never A5's; a wrong label costs what
a wrong choice costs. The label only breaks ties between identical utterances ("Yes." as A1 and
A4; without it, the earliest). A tag that copies nothing still enters H^ as an element of its own,
so a hallucinated or altered recall enlarges the union. Several utterances in one tag (Fig. 1)
split on their labels (`Q1:`, `Turn A5:`); a label with no text is a format error, not a recall.

Eq. (7) choices (`answer_reward`, `--answer-reward`), each in [-1, 1]:
  cosine  (default, the paper) cos of the all-MiniLM-L6-v2 embeddings of A_t and A*_t: pays for
          wording; it barely tells a right answer from a wrong one that shares its words.
  keys    pays for the facts: 2 * share - 1, share = |keys present| / (|keys| + |extra values|);
          `answer_keys` matched on word boundaries with numbers normalised ("$180.00" = "$180" =
          "180"; "$20" is not in "$207"); a yes/no key counts only for one polarity without a hedge
          ("yes or no", "possibly yes, possibly not" state neither); an extra value is a money amount,
          number, date or time, code or capitalised name that the answer states and neither A*_t nor
          a key holds (srt.metrics.extra_values: listing candidates is the answer's over-recall, so
          pasting the history pays for every value it adds; restating A*_t's threshold costs
          nothing). share is 1 exactly when evaluate.py's accuracy counts the answer right: one
          matcher, srt.metrics.answer_is_right.
  both    the facts gate, the wording ranks: keys while a key is missing (or a value is extra),
          else the mean of keys (1) and cosine, (1 + cos) / 2 in [0, 1]; with two keys every
          incomplete answer (<= 0) scores below every complete one (>= 0).
A record without answer_keys gets the cosine under every choice.

`answer_gate` (`--answer-gate` here and in stage 2; not in the paper, off by default): with `recall`,
an answer whose recall missed H* entirely (Jaccard 0 on a turn that needs recall) earns what a missing
answer earns, -1. Eq. (4) adds its terms, so with the whole history in the prompt a policy can earn
the answer term without recalling anything right, and GRPO on dev learned to do just that
(docs/experiments/grpo-recall.md). The gate pays an answer only when it comes through the recall, as
§3's "recall, then answer" intends.

Every function is total: any string, however malformed, gets a score in range and never raises.

Paper vs this implementation, the one list (docs/pipeline.md links here):

  1. Eq. (6)'s alignment: the paper aligns each <HIS> tag to the utterance of maximal normalised
     overlap; here a tag recalls an utterance only if it copies it verbatim in `canonical` form
     (above), and a tag that copies nothing enters H^ as an element of its own. The overlap is kept
     as a diagnostic (match_piece's `nearest`).
  2. Eq. (5)'s is_valid: the paper names what it checks (tags well formed, paired, parseable); the
     rules used here are format_reward's six, 'Final answer:' after the think block among them.
  3. Eq. (7)'s embeddings are all-MiniLM-L6-v2's (the paper names no encoder); a completion with no
     answer earns -1.
  4. --answer-reward keys | both (default cosine, the paper's): above.
  5. --answer-gate recall (default off): above.

    python reward.py --gallery                                  # reward-hacking gallery (Markdown)
    python reward.py --gallery --markdown > docs/reward-gallery.md   # the same, as a whole page
    python reward.py --gallery --reward docs/rewards/keyword_answer.py   # your own reward against it
    python reward.py --data runs/data/test.jsonl --index 3 --completion completion.txt
    python reward.py --data runs/data/test.jsonl --completions preds.jsonl --answer-reward keys \\
        [--answer-gate recall]
"""

from __future__ import annotations

import srt.startup  # noqa: F401  # isort: skip  (first: Ctrl-C while torch loads is one line)

import argparse
import importlib.machinery
import importlib.util
import inspect
import os
import re
import sys
from collections import Counter
from pathlib import Path
from typing import NamedTuple

import numpy as np

from srt.completion import (
    ANSWER_MARK,
    LABEL,
    HistoryIndex,
    Piece,
    canonical,
    format_problems,
    index_history,
    parse_completion,
    short,
    split_tag,
    tokens,
)
from srt.config import add_data, add_out, add_overwrite, at_least, claim_out, interruptible, write_config
from srt.data_io import DataError, decode_utf8, read_jsonl, read_lines, write_json, write_jsonl
from srt.embedder import embed
from srt.exercise_list import unfinished_exercise
from srt.metrics import extra_values, jaccard, keys_affirmed
from srt.prompt import format_target
from srt.reward_gallery import gallery_page, gallery_scores, gallery_table, reward_report, reward_scores

# Eq. (6) constants: recall = RECALL_SCALE * IoU - RECALL_SHIFT, in [-1.25, 1.25].
RECALL_SCALE, RECALL_SHIFT = 2.5, 1.25
ANSWER_REWARDS = ("cosine", "keys", "both")
ANSWER_GATES = ("off", "recall")


# ==== 1. Eq. (5): the format reward ====
def format_reward(completion: str) -> tuple[float, list[str]]:
    """Eq. (5): R_format(Z_t) = I(is_valid(Z_t)) -> (1.0 or 0.0, the broken rules, a sentence each).

    is_valid(Z_t) holds exactly when the completion breaks none of these rules (srt.completion's
    format_problems lists those it breaks; each check there carries its rule's number). Rule 1 reads
    the completion as written, the others its NFKC form, in which a full-width ＜HIS＞ is the tag itself.
      1. Every marker written exactly (<think>, </think>, <HIS>, </HIS>, 'Final answer:'): no tag in
         look-alike characters (<his>, ＜HIS＞, a Cyrillic Н, a zero-width space inside), no
         full-width 'Final answer:'.
      2. One think block, first: one <think>, one </think> after it, nothing before <think>, text
         between them.
      3. After </think>, only whitespace, then 'Final answer:' in exactly this case, once, then an answer.
      4. The answer starts no new turn: no later line opens with a label or a role (`Q8:`, `user:`),
         and no chat-template token (`<|im_start|>`, `[INST]`) appears in it.
      5. Every <HIS> and </HIS> inside the think block, paired, not nested: each tag closed before
         the next opens.
      6. No empty tag, and every label in a tag followed by its utterance (not `<HIS>Q2: A5: ...`).
    """
    problems = format_problems(completion)
    return (0.0 if problems else 1.0), problems


# ==== 2. The recall set H^ (verbatim alignment) and Eq. (6) ====
def overlap(a: Counter, b: Counter) -> float:
    """|a n b| / max(|a|, |b|) on token multisets, in [0, 1]: how near a miss came (diagnostic)."""
    longer = max(sum(a.values()), sum(b.values()))
    return sum((a & b).values()) / longer if longer else 0.0


class TagMatch(NamedTuple):
    text: str  # the piece as written
    label: str | None  # the history utterance it verbatim-copies, None if none
    nearest: str | None  # the utterance of maximal token overlap (= label when matched)
    overlap: float  # that overlap (1.0 when matched)


def match_piece(piece: Piece, index: HistoryIndex) -> TagMatch:
    labels = index.by_text.get(piece.body)
    if labels:  # Eq. (6) alignment: a verbatim copy; the written label breaks ties between twins
        label = piece.hint if piece.hint in labels else labels[0]
        return TagMatch(piece.text, label, label, 1.0)
    mine, best_i, best = Counter(tokens(piece.body)), None, 0.0
    for i, text in enumerate(index.texts):
        score = overlap(mine, Counter(tokens(text)))
        if score > best:
            best_i, best = i, score
    return TagMatch(piece.text, None, index.labels[best_i] if best_i is not None else None, best)


def match_tags(tags: list[str], history: list[dict] | HistoryIndex) -> list[TagMatch]:
    """Align every non-empty piece of every tag to the history (one TagMatch each, in writing order).
    Pieces with an empty body (a bare label) recall nothing; Eq. (5) reports them."""
    index = history if isinstance(history, HistoryIndex) else index_history(history)
    return [match_piece(p, index) for tag in tags for p in split_tag(tag, index) if p.body]


def unmatched_key(text: str) -> str:
    """H^ element of a piece that matched nothing: it cannot collide with a label, and the same
    hallucination written twice is one element (H^ is a set)."""
    return "?" + canonical(LABEL.sub("", text, count=1) if LABEL.match(text) else text)


def recall_sets(matches: list[TagMatch], history_labels: list[str]) -> tuple[list[str], list[str], set[str]]:
    """(recalled labels in history order, texts of unmatched pieces, H^ as the set Eq. (6) uses)."""
    order = {label: i for i, label in enumerate(history_labels)}
    recalled = sorted({m.label for m in matches if m.label is not None}, key=order.__getitem__)
    unmatched = [m.text for m in matches if m.label is None]
    return recalled, unmatched, set(recalled) | {unmatched_key(t) for t in unmatched}


def recall_reward(recalled_set, gold_set) -> float:
    """Eq. (6): R_recall = 2.5 * |H^ n H*| / |H^ u H*| - 1.25 in [-1.25, 1.25], H^ the recalled set
    and H* the gold one (any iterables of labels, read as sets; two empty sets agree: IoU 1). The IoU
    is srt.metrics.jaccard, the one the evaluation reports."""
    return RECALL_SCALE * jaccard(recalled_set, gold_set) - RECALL_SHIFT


# ==== 3. Eq. (7): the answer reward (cosine, as the paper defines it) and the answer-key alternative ====
def key_reward(answer: str | None, keys: list[str], reference: str) -> tuple[float, list[bool], list[str]]:
    """2 * share - 1 in [-1, 1], share = |keys present| / (|keys| + |extra values|): the matcher of
    srt.metrics.answer_is_right (keys_affirmed, extra_values), so the reward is 1 exactly when
    accuracy counts the answer right: a key stated only to be denied ("was not $106") is not
    present, as a list's extra values cost. -> (reward, keys present, extra values)."""
    present, extras = keys_affirmed(answer, keys, reference), extra_values(answer, reference, keys)
    share = sum(present) / (len(keys) + len(extras)) if keys else 0.0
    return 2.0 * share - 1.0, present, extras


def answer_cosines(answers: list[str | None], references: list[str]) -> list[float]:
    """Eq. (7): cos(v_A, v_A*) with all-MiniLM-L6-v2 (embedder.embed: unit-norm rows, so a dot
    product), in one embedding call. A missing answer gets the minimum, -1, and is not embedded.
    -> one float in [-1, 1] per answer: answer i against references[i], its own reference only."""
    rewards = [-1.0] * len(answers)
    present = [i for i, a in enumerate(answers) if a is not None]
    if present:
        vectors = embed([answers[i] for i in present] + [references[i] for i in present])
        cosines = np.sum(vectors[: len(present)] * vectors[len(present) :], axis=1)
        for i, c in zip(present, cosines):
            rewards[i] = float(np.clip(c, -1.0, 1.0))
    return rewards


def answer_keys(record: dict) -> list[str]:
    """The record's non-empty answer keys (the field is optional, docs/design.md "Data"; one string is
    one key)."""
    keys = record.get("answer_keys") or []
    return [str(k) for k in ([keys] if isinstance(keys, str) else keys) if str(k).strip()]


def answer_rewards(
    answers: list[str | None], examples: list[dict], answer_reward: str = "cosine"
) -> list[dict]:
    """The answer component under `answer_reward` (see the module docstring), with its parts:
    answer, answer_cosine (None when not needed: `keys` on a record with keys), answer_keys (None
    without keys), keys_present, extra_values."""
    if answer_reward not in ANSWER_REWARDS:
        raise ValueError(f"answer_reward must be one of {ANSWER_REWARDS}, got {answer_reward!r}")
    parts = []
    for answer, example in zip(answers, examples):
        keys = answer_keys(example)
        value, present, extras = key_reward(answer, keys, example["answer"]) if keys else (None, [], [])
        parts.append({"answer_keys": value, "keys_present": present, "extra_values": extras})
    need = [i for i, p in enumerate(parts) if answer_reward != "keys" or p["answer_keys"] is None]
    cosines = {}
    if need:  # `keys` on records with keys embeds nothing, so it works before Eq. (7)'s exercise is done
        answers_needed, references = [answers[i] for i in need], [examples[i]["answer"] for i in need]
        cosines = dict(zip(need, answer_cosines(answers_needed, references)))
    for i, part in enumerate(parts):
        cos, keys = cosines.get(i), part["answer_keys"]
        part["answer_cosine"] = cos
        if keys is None:  # no answer_keys: Eq. (7) as the paper defines it, under every choice
            part["answer"] = cos
        else:
            both = keys if keys < 1.0 or cos is None else (keys + cos) / 2
            part["answer"] = {"cosine": cos, "keys": keys, "both": both}[answer_reward]
    return parts


# ==== 4. Eq. (4): the composite reward, batched for GRPO ====
def compute_rewards(
    completions: list[str], examples: list[dict], answer_reward: str = "cosine", answer_gate: str = "off"
) -> list[dict]:
    """Score completion i against stage-0 record examples[i] (history, recall, answer, answer_keys).
    ValueError when there are not as many completions as examples, or answer_gate is not one of
    ANSWER_GATES. H^ is recall_sets' third value: a piece that copies nothing stays in it. A completion
    without 'Final answer:' has final_answer None, and its answer earns what a missing answer earns,
    -1 (its text is never read as an answer).

    One dict per completion: format, recall, answer, total (Eq. (4)); jaccard (the IoU of Eq. (6)),
    recalled (labels of H^ in history order), unmatched (pieces that copy nothing), final_answer,
    matches ([text, label, nearest, overlap] per piece), format_problems; answer_cosine,
    answer_keys, keys_present, extra_values (the parts of the answer component)."""
    if len(completions) != len(examples):
        raise ValueError(f"{len(completions)} completions but {len(examples)} examples")
    if answer_gate not in ANSWER_GATES:
        raise ValueError(f"answer_gate must be one of {ANSWER_GATES}, got {answer_gate!r}")
    indexes = {}  # id(history) -> HistoryIndex: the K rollouts of one prompt share one index
    results, answers = [], []
    for text, example in zip(completions, examples):
        history_id = id(example["history"])
        index = indexes[history_id] = indexes.get(history_id) or index_history(example["history"])
        parsed = parse_completion(text)
        format_value, problems = format_reward(text)
        matches = match_tags(parsed.tags, index)
        recalled, unmatched, predicted = recall_sets(matches, index.labels)
        iou = jaccard(predicted, example["recall"])
        results.append(
            {
                "format": format_value,  # Eq. (5)
                "recall": recall_reward(predicted, example["recall"]),  # Eq. (6)
                "jaccard": iou,
                "recalled": recalled,
                "unmatched": unmatched,
                "final_answer": parsed.final_answer,
                "format_problems": problems,
                "matches": [[m.text, m.label, m.nearest, round(m.overlap, 4)] for m in matches],
            }
        )
        answers.append(parsed.final_answer)
    for result, part, example in zip(results, answer_rewards(answers, examples, answer_reward), examples):
        result.update(part)  # Eq. (7)
        result["answer_gated"] = (
            answer_gate == "recall" and bool(example["recall"]) and result["jaccard"] == 0.0
        )
        if result["answer_gated"]:  # the module docstring: an answer that did not come through the recall
            result["answer"] = -1.0
        result["total"] = result["format"] + result["recall"] + result["answer"]  # Eq. (4)
    return results


def compute_reward(
    completion: str, example: dict, answer_reward: str = "cosine", answer_gate: str = "off"
) -> dict:
    return compute_rewards([completion], [example], answer_reward, answer_gate)[0]


# ==== Command line: the gallery, explain one score, or average a file of them ====
def explain(completion: str, record: dict, answer_reward: str = "cosine", answer_gate: str = "off") -> str:
    """A report a student can read: each component and where it came from."""
    r = compute_reward(completion, record, answer_reward, answer_gate)
    index, gold = index_history(record["history"]), record["recall"]
    lines = [
        f"record {record.get('id', '?')}: query Q{record.get('query_turn', '?')}: {record.get('query', '')}",
        f"gold H* = {{{', '.join(gold)}}}   reference A* = {record['answer']!r}",
        "",
    ]
    lines += (
        ["format  0    (Eq. 5) failed:"] + [f"          - {p}" for p in r["format_problems"]]
        if r["format_problems"]
        else [
            f"format  1    (Eq. 5) one <think> block, well-formed <HIS> tags in it, "
            f"then '{ANSWER_MARK}' and an answer"
        ]
    )
    lines.append(
        "\nrecall tags (a tag matches an utterance only if it copies it verbatim)"
        + ("" if r["matches"] else "\n  (no <HIS> tags with text)")
    )
    for k, (text, label, nearest, score) in enumerate(r["matches"], 1):
        hint = LABEL.match(text)
        if label:
            verdict = f"-> {label}  verbatim  {'in H*' if label in gold else 'NOT in H*'}" + (
                f"  (written label {hint.group(1)}, but the text is {label})"
                if hint and hint.group(1) != label
                else ""
            )
        else:
            verdict = "-> nothing: copies no utterance, enters the union" + (
                f"; nearest {nearest} (token overlap {score:.2f}): "
                f"{short(index.texts[index.labels.index(nearest)], 60)}"
                if nearest
                else ""
            )
        lines.append(f"  [{k}] {short(text, 60)}\n      {verdict}")
    predicted = set(r["recalled"]) | {unmatched_key(t) for t in r["unmatched"]}
    shown = r["recalled"] + [f"unmatched#{i + 1}" for i in range(len(predicted) - len(r["recalled"]))]
    union = predicted | set(gold)
    lines += [
        "",
        f"H^ = {{{', '.join(shown)}}}   |H^ n H*| = {len(predicted & set(gold))}   |H^ u H*| = "
        f"{len(union)}   IoU = {r['jaccard']:.4f}" + ("" if union else "  (both empty: IoU 1)"),
        f"recall  {r['recall']:+.4f} (Eq. 6) = 2.5 * {r['jaccard']:.4f} - 1.25",
    ]
    parts = [f"cosine {r['answer_cosine']:+.4f}"] if r["answer_cosine"] is not None else []
    if r["answer_keys"] is not None:
        found = ", ".join(
            f"{k!r} {'found' if p else 'missing'}" for k, p in zip(answer_keys(record), r["keys_present"])
        )
        parts.append(f"keys {r['answer_keys']:+.4f} ({found}; extra values {r['extra_values']})")
    lines += [
        f"answer  -1.0000 (Eq. 7) no final answer after '{ANSWER_MARK}': the minimum"
        if r["final_answer"] is None
        else f"answer  -1.0000 (--answer-gate recall) the recall missed H*; ungated: {'; '.join(parts)}"
        if r["answer_gated"]
        else f"answer  {r['answer']:+.4f} (Eq. 7, {answer_reward}) {'; '.join(parts)}",
        f"total   {r['total']:+.4f} (Eq. 4) = {r['format']:.0f} {r['recall']:+.4f} {r['answer']:+.4f}   "
        f"range [-2.25, 3.25]",
    ]
    return "\n".join(lines)


def read_completions(path: str, records: list[dict]) -> list[tuple[dict, str]]:
    """Lines {"id": ..., "completion": ...} (matched by id to --data) or
    {"index": ..., "completion": ...}."""
    by_id = {r["id"]: r for r in records}
    index_of = {r["id"]: k for k, r in enumerate(records)}
    line_of = {}  # record index -> the line that scored it

    def parse(row, path, line_no):
        where = f"{path}:{line_no}:"
        if not isinstance(row, dict):
            raise DataError(f"{where} line is not a JSON object")
        if not isinstance(row.get("completion"), str):
            raise DataError(f"{where} field 'completion' is missing or not a string")
        if "id" in row and row["id"] not in by_id:
            raise DataError(f"{where} field 'id' names {row['id']!r}, which is not in the --data file")
        i = row.get("index")
        if "id" not in row and (not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < len(records)):
            raise DataError(
                f"{where} field 'id' (or 'index', an integer in [0, {len(records)})) is missing or wrong"
            )
        k = index_of[row["id"]] if "id" in row else i
        record = records[k]
        if k in line_of:  # scored twice, it would weigh twice in every mean
            raise DataError(f"{where} scores record {record['id']!r} again (line {line_of[k]} did)")
        line_of[k] = line_no
        return record, row["completion"]

    pairs = read_lines(path, parse)
    if not pairs:  # a mean of nothing would read like a score
        raise DataError(f"{path} holds no completions; nothing to score")
    return pairs


def add_answer_reward(
    parser,
    help="Eq. (7): cosine (the paper), keys (answer_keys present), both (keys; the cosine ranks complete "
    "answers)",
) -> None:
    """--answer-reward, Eq. (7)'s answer component (evaluate.py's reward columns score with it too)."""
    parser.add_argument("--answer-reward", choices=ANSWER_REWARDS, default="cosine", help=help)


def add_answer_flags(parser) -> None:
    """--answer-reward and --answer-gate, the two choices of the reward a script scores with (this
    one, and stage2_grpo.py's group of departures from the paper)."""
    add_answer_reward(parser)
    parser.add_argument(
        "--answer-gate",
        choices=ANSWER_GATES,
        default="off",
        help="recall: an answer whose recall missed H* earns -1 (not in the paper; reward.py)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="SRT composite reward (paper §3.4, Eqs. 4-7): the reward-hacking "
        "gallery, one completion's score explained, or the mean scores of a file."
    )
    parser.add_argument("--gallery", action="store_true", help="print the reward-hacking gallery (Markdown)")
    parser.add_argument(
        "--markdown",
        action="store_true",
        help="with --gallery: print a whole Markdown page (title, what it is, the table), "
        "as in docs/reward-gallery.md",
    )
    parser.add_argument(
        "--reward",
        default=None,
        metavar="PATH",
        help="with --gallery: score a reward of your own against every attack instead: a Python file "
        "with one function of compute_rewards' signature, returning a dict with a 'total' per "
        "completion (e.g. docs/rewards/keyword_answer.py)",
    )
    add_data(parser, None, "stage-0 JSONL (e.g. runs/data/test.jsonl)")
    parser.add_argument(
        "--index", type=at_least(0), default=0, help="which record of --data to score (0-based)"
    )
    parser.add_argument("--id", default=None, help="pick the record by id instead of --index")
    parser.add_argument(
        "--completion",
        default=None,
        help="a file holding the completion, or the text itself; "
        "default: the record's own reference target (the best possible score)",
    )
    parser.add_argument(
        "--completions", default=None, help="JSONL of {'id' or 'index', 'completion'}: print the means"
    )
    add_answer_flags(parser)
    add_out(parser, None, "with --completions: folder for scores.jsonl, summary.json, config.json")
    add_overwrite(parser, "replace the scores --out holds (without it: refused)")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.gallery and not args.data:
        parser.error("--data is required (or --gallery)")
    if args.markdown and not args.gallery:
        parser.error("--markdown goes with --gallery")
    if args.reward and not args.gallery:
        parser.error("--reward goes with --gallery")
    if args.reward and args.markdown:
        parser.error("--markdown prints the project's own gallery page; it does not go with --reward")
    if args.out and not args.completions:
        parser.error("--out goes with --completions (one completion is explained on the screen)")
    return args


def looks_like_a_path(text: str) -> bool:
    """--completion is a file or the completion's text. One line that ends like a file name, or
    is made of a path's characters with a slash among them, is a mistyped path (a completion has
    its <think> block and its answer on lines of their own), not a completion to score."""
    return "\n" not in text and (
        text.endswith((".txt", ".json", ".jsonl", ".md"))
        or ("/" in text and re.fullmatch(r"[\w.~/-]+", text))
    )


def load_reward(path: str):
    """The reward function of a student's file: its function named compute_rewards, else its only
    function; it must take (completions, examples). -> (function, its name). The file is imported
    (it is the student's own code); every problem exits with one line."""
    where = f"error: --reward {path}:"
    if not os.path.isfile(path):
        sys.exit(f"{where} no such file")
    # read as Python whatever its suffix: by suffix, a .txt file had no loader at all
    loader = importlib.machinery.SourceFileLoader("student_reward", path)
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("student_reward", loader))
    try:
        loader.exec_module(module)
    except Exception as e:  # a syntax error or a failed import in the student's file
        sys.exit(f"{where} importing it raised {type(e).__name__}: {e}")
    functions = {
        name: value
        for name, value in vars(module).items()
        if inspect.isfunction(value) and value.__module__ == module.__name__ and not name.startswith("_")
    }
    if "compute_rewards" in functions:
        name = "compute_rewards"
    elif len(functions) == 1:
        (name,) = functions
    else:
        found = f"{len(functions)} functions ({', '.join(functions)})" if functions else "no function"
        sys.exit(f"{where} it defines {found}; name the reward compute_rewards")
    try:
        inspect.signature(functions[name]).bind([], [])
    except TypeError:
        sys.exit(
            f"{where} {name}{inspect.signature(functions[name])} does not take (completions, examples) "
            "as compute_rewards does"
        )
    return functions[name], name


def main(argv=None):
    args = parse_args(argv)
    with interruptible(
        lambda: "nothing was written: the scores are written at the end; run the command again",
        args.out,
    ):
        return score(args)


def score(args):
    """--gallery, --completions (scores.jsonl and summary.json under --out) or one completion explained."""
    if args.gallery and args.reward:
        reward_fn, name = load_reward(args.reward)
        try:
            scores = reward_scores(reward_fn)
        except NotImplementedError as e:  # a student's copy: the reward calls an exercise still blank
            sys.exit(f"error: --reward {args.reward}: {name} {unfinished_exercise(e)}")
        except Exception as e:  # the student's reward raised, or returned the wrong shape
            sys.exit(f"error: --reward {args.reward}: {name}: {type(e).__name__}: {e}")
        passed, report = reward_report(scores, f"{name} of {args.reward}")
        print(report)
        if not passed:  # a failed verdict fails the command, as a failed grade does
            sys.exit(1)
        return None
    if args.gallery:
        scores = gallery_scores(compute_rewards, ANSWER_REWARDS)
        print(gallery_page(scores) if args.markdown else gallery_table(scores))
        return None
    if args.out:
        claim_out(args.out, "reward.py", overwrite=args.overwrite, resumable=False)
    try:
        records = read_jsonl(args.data)
        pairs = read_completions(args.completions, records) if args.completions else None
    except (DataError, OSError) as e:
        sys.exit(f"error: {e}")
    if not records:
        sys.exit(f"error: {args.data} holds no records")

    if pairs is not None:
        results = []
        for start in range(0, len(pairs), 256):
            chunk = pairs[start : start + 256]
            results += compute_rewards(
                [c for _, c in chunk], [r for r, _ in chunk], args.answer_reward, args.answer_gate
            )
        n = max(len(results), 1)
        summary = {
            "n": len(results),
            "answer_reward": args.answer_reward,
            "answer_gate": args.answer_gate,
            **{k: sum(r[k] for r in results) / n for k in ("format", "recall", "answer", "total", "jaccard")},
            "unmatched_tags_per_completion": sum(len(r["unmatched"]) for r in results) / n,
            "no_final_answer": sum(r["final_answer"] is None for r in results) / n,
        }
        print(
            f"{summary['n']} completions from {args.completions}, answer reward {args.answer_reward}\n"
            + "".join(
                f"  mean {k:<8} {summary[k]:+.4f}\n"
                for k in ("format", "recall", "answer", "total", "jaccard")
            )
            + f"  unmatched tags per completion {summary['unmatched_tags_per_completion']:.2f}, "
            f"no final answer {100 * summary['no_final_answer']:.1f}%"
        )
        if args.out:
            write_jsonl(
                os.path.join(args.out, "scores.jsonl"),
                [{"id": r["id"], **s} for (r, _), s in zip(pairs, results)],
            )
            write_json(os.path.join(args.out, "summary.json"), summary)
            write_config(args.out, args, "reward.py")
        return summary

    matching = (
        [r for r in records if r["id"] == args.id] if args.id is not None else records[args.index :][:1]
    )
    if args.id is not None and not matching:
        sys.exit(f"error: {args.data}: no record has id {args.id!r}")
    if not matching or args.index < 0:
        sys.exit(f"error: --index {args.index} is out of range: {args.data} holds {len(records)} records")
    record = matching[0]
    completion = format_target(record) if args.completion is None else args.completion
    if args.completion is not None and os.path.isfile(args.completion):
        try:
            completion = decode_utf8(Path(args.completion).read_bytes(), args.completion)
        except (DataError, OSError) as e:
            sys.exit(f"error: --completion {e}")
    elif args.completion is not None and looks_like_a_path(args.completion):
        sys.exit(
            f"error: --completion {args.completion}: no such file (--completion takes a file, or the "
            "completion's text itself)"
        )
    print(explain(completion, record, args.answer_reward, args.answer_gate))
    return None


if __name__ == "__main__":
    main()
