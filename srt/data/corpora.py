"""Real dialogue corpora -> the raw dialogue form stage 0 consumes (paper §3.2, §4.2).

The paper builds SRQA from MG-ShopDial, MultiWOZ, DailyDialog, ReDial and LoCoMo and also tests on
CoQA; `chitchat` (the PyPI package chitchat-dataset) gives real open-domain dialogue offline, and
`jsonl` is our own documented input. Each loader reads its corpus's published file format:

    dialogues, report = load_corpus("multiwoz", "data.json", max_rounds=32)

The dialogue form stage 0 annotates (parse_jsonl_dialogue checks it in our JSONL):

    {"id": str, "source": str, "domain": str, "meta": {...},
     "rounds": [{"user": Qi, "assistant": Ai, "gold": {...}?, "query": True?, "meta": {...}?}, ...]}

- Round i holds the user utterance Qi and the assistant utterance Ai.
- A round with `gold` is a query turn whose ground truth comes from the corpus: gold["recall"] is
  H*_t as labels ("Q3", "A5"), gold["answer"] the reference A*_t, plus what the corpus adds
  (query_type, category, ...). Only LoCoMo (and JSONL that carries it) has gold.
- A round with `"query": True` and no gold is a query turn for the LLM teacher of §3.2: its user
  text is Q_t, the rounds before it are C_t, its assistant text is the corpus's reference reply
  (passed to the teacher as the answer to agree with). Chat corpora mark their last round; CoQA
  marks every question; `queries="all"` marks every round from the second on.
- Rounds without either are history only.

Shared conventions (every loader, counted in the report):
- Consecutive messages of one speaker are merged into one utterance (joined by a space).
- Corpora with fixed roles (MultiWOZ user/system, ReDial seeker/recommender, MG-ShopDial
  client/wizard): a dialogue that opens on the assistant side loses those opening assistant
  messages (`leading_assistant_dropped`; in practice a greeting such as "Hello, how can I help?").
  Symmetric corpora (LoCoMo, DailyDialog, chitchat) give the user role to whoever speaks first,
  so they never open on the assistant side.
- A dialogue that ends on the user side loses that unanswered user message (`trailing_user_dropped`):
  every round has both utterances.
- Dialogues longer than `max_rounds` are cut to their first `max_rounds` rounds (`truncated`);
  LoCoMo builds a window per question instead. Fewer than 2 rounds (no history) are skipped
  (`too_short`); the §3.2 length filter (8..32 rounds) stays in stage 0.
"""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from pathlib import Path
from typing import NamedTuple

from srt.data_io import MAX_UTTERANCE_CHARS, DataError, decode_utf8, not_utf8, read_lines, too_long

ROLES = ("user", "assistant")


# --------------------------------------------------------------------------------------------
# Turns -> rounds: the conventions above, in one place
# --------------------------------------------------------------------------------------------
def merge_turns(turns, report) -> list[dict]:
    """[{"role", "text", ...}] -> the same with consecutive turns of one role merged; empty texts
    dropped. Extra keys of merged turns are gathered into lists under "parts"."""
    merged = []
    for turn in turns:
        text = " ".join(str(turn.get("text") or "").split())
        if not text:
            report["empty_messages"] += 1
            continue
        if merged and merged[-1]["role"] == turn["role"]:
            merged[-1]["text"] += " " + text
            merged[-1]["parts"].append(turn)
            report["merged_messages"] += 1
        else:
            merged.append({"role": turn["role"], "text": text, "parts": [turn]})
    return merged


def pair_merged(merged, report) -> list[tuple[dict, dict]]:
    """Merged turns -> (user turn, assistant turn) pairs: opening assistant turns and a closing
    unanswered user turn are dropped and counted."""
    while merged and merged[0]["role"] == "assistant":
        merged.pop(0)
        report["leading_assistant_dropped"] += 1
    if merged and merged[-1]["role"] == "user":
        merged.pop()
        report["trailing_user_dropped"] += 1
    return [(merged[i], merged[i + 1]) for i in range(0, len(merged), 2)]


def pair_rounds(turns, report) -> list[dict]:
    """Role-tagged turns {"role", "text"} -> rounds {"user", "assistant"} (the conventions above)."""
    return [
        {"user": u["text"], "assistant": a["text"]}
        for u, a in pair_merged(merge_turns(turns, report), report)
    ]


def finish_dialogue(dialogue_id, source, domain, rounds, report, max_rounds=32, queries="last", meta=None):
    """Cut, mark query rounds and wrap; None (counted) when fewer than two rounds remain."""
    if max_rounds and len(rounds) > max_rounds:
        rounds = rounds[:max_rounds]
        report["truncated"] += 1
    if len(rounds) < 2:
        report["too_short"] += 1
        return None
    mark_queries(rounds, queries)
    report["queries"] += sum(1 for r in rounds if r.get("query") or "gold" in r)
    dialogue = {"id": str(dialogue_id), "source": source, "domain": domain, "rounds": rounds}
    if meta:
        dialogue["meta"] = meta
    return dialogue


def mark_queries(rounds, queries="last") -> None:
    """'last': the last round is the teacher's query; 'all': every round from the second on;
    'none': leave the marks the loader set. Rounds with gold keep their gold and get no flag."""
    if queries not in ("last", "all", "none"):
        raise ValueError(f"queries must be last, all or none, not {queries!r}")
    chosen = {"last": rounds[-1:], "all": rounds[1:], "none": []}[queries]
    for r in chosen:
        if "gold" not in r:
            r["query"] = True


def resolve_file(path, names) -> Path:
    """`path` itself, or inside a folder the first of `names` (glob patterns) that exists."""
    path = Path(path)
    if path.is_dir():
        for pattern in names:
            found = sorted(path.glob(pattern))
            if found:
                return found[0]
        raise DataError(f"{path}: no {' or '.join(names)} inside")
    if not path.exists():
        raise DataError(f"{path}: no such file")
    return path


def read_json(path):
    try:
        return json.loads(decode_utf8(Path(path).read_bytes(), path))
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None


# --------------------------------------------------------------------------------------------
# LoCoMo (Maharana et al., 2024): locomo10.json. Evidence dia_ids give H* directly.
# --------------------------------------------------------------------------------------------
LOCOMO_CATEGORIES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop", 5: "adversarial"}
LOCOMO_ABSTAIN = "Not mentioned in the conversation."
# how a question's history window is chosen (load_locomo); only 'evidence' reads the gold
LOCOMO_WINDOWS = ("retrieved", "recent", "evidence", "all")
# "D3:12", and the release's variants of it: "D30:05" (leading zero), "D:11:26" (stray colon).
DIA_ID = re.compile(r"^D\s*:?\s*(\d+)\s*:\s*(\d+)$", re.IGNORECASE)


def normalise_dia_id(text) -> str | None:
    m = DIA_ID.match(str(text).strip())
    return f"D{int(m[1])}:{int(m[2])}" if m else None


def normalise_evidence(raw) -> tuple[list[str], list[str], int]:
    """A qa's `evidence` -> (canonical dia_ids in the order given, fragments that cannot be read,
    how many ids needed normalising). Entries that pack several ids ("D8:6; D9:17",
    "D9:1 D4:4 D4:6") are split on spaces, semicolons and commas."""
    entries = raw if isinstance(raw, list) else ([raw] if raw else [])
    ids, unreadable, normalised = [], [], 0
    for entry in entries:
        parts = [p for p in re.split(r"[\s;,]+", str(entry).strip()) if p]
        if len(parts) > 1:
            normalised += len(parts)
        for part in parts:
            canonical = normalise_dia_id(part)
            if canonical is None:
                unreadable.append(part)
                continue
            normalised += canonical != part and len(parts) == 1
            if canonical not in ids:
                ids.append(canonical)
    return ids, unreadable, normalised


def locomo_stream(conversation) -> tuple[list[dict], dict]:
    """All sessions in order -> (turns {"speaker", "text", "session", "dia_id"}, session dates)."""
    numbers = sorted(
        int(m[1])
        for key in conversation
        for m in [re.fullmatch(r"session_(\d+)", key)]
        if m and isinstance(conversation[key], list)
    )
    turns, dates = [], {}
    for n in numbers:
        dates[n] = str(conversation.get(f"session_{n}_date_time") or f"session {n}")
        for turn in conversation[f"session_{n}"]:
            text = str(turn.get("text") or "").strip()
            if turn.get("blip_caption"):  # a shared image: the caption is what a reader can recall
                text = f"{text} [shares a photo of {turn['blip_caption']}]".strip()
            turns.append(
                {
                    "speaker": str(turn.get("speaker", "")),
                    "text": text,
                    "session": n,
                    "dia_id": normalise_dia_id(turn.get("dia_id", "")),
                }
            )
    return turns, dates


def choose_window(num_rounds, evidence_rounds, budget, rng) -> tuple[list[int] | None, str]:
    """Round indices (0-based, ascending) of a history window of at most `budget` rounds that
    holds every evidence round; the rest are the rounds around the evidence, as distractors.
    -> (indices, how): 'whole' (the conversation fits), 'latest' (no evidence: the last rounds),
    'contiguous' (one run of rounds covering the evidence, placed at a seeded random offset so
    the evidence sits nowhere in particular), 'segments' (evidence too far apart: each evidence
    round with its neighbours, grown outwards one round at a time while the budget lasts), or
    None when there are more evidence rounds than the budget."""
    if num_rounds <= budget:
        return list(range(num_rounds)), "whole"
    if not evidence_rounds:
        return list(range(num_rounds - budget, num_rounds)), "latest"
    first, last = min(evidence_rounds), max(evidence_rounds)
    if last - first + 1 <= budget:
        start = rng.randint(max(0, last - budget + 1), min(first, num_rounds - budget))
        return list(range(start, start + budget)), "contiguous"
    if len(set(evidence_rounds)) > budget:
        return None, "evidence_exceeds_window"
    kept = set(evidence_rounds)
    radius = 1
    while len(kept) < budget:
        for e in sorted(set(evidence_rounds)):
            for candidate in (e - radius, e + radius):
                if 0 <= candidate < num_rounds and len(kept) < budget:
                    kept.add(candidate)
        radius += 1
    return sorted(kept), "segments"


def gold_free_window(kind, num_rounds, budget, similarity=None) -> tuple[list[int], str]:
    """Round indices (0-based, ascending) of a window chosen from the question alone, as a user who
    asks after the whole conversation has it: the evidence is never read. -> (indices, how):
    'whole' (the conversation fits the budget), 'retrieved' (the `budget` rounds most similar to
    the question, `similarity` holding one cosine per round; a tie goes to the earlier round),
    'recent' (the last `budget` rounds) or 'all' (every round, whatever the budget)."""
    if num_rounds <= budget:
        return list(range(num_rounds)), "whole"
    if kind == "all":
        return list(range(num_rounds)), "all"
    if kind == "recent":
        return list(range(num_rounds - budget, num_rounds)), "recent"
    if kind == "retrieved":
        ranked = sorted(range(num_rounds), key=lambda i: -float(similarity[i]))  # stable: ties in round order
        return sorted(ranked[:budget]), "retrieved"
    raise ValueError(f"a gold-free window is retrieved, recent or all, not {kind!r}")


def runs_of(indices) -> list[list[int]]:
    """[3, 4, 5, 9, 10] -> [[4, 6], [10, 11]]: runs of consecutive rounds, 1-based, inclusive."""
    runs = []
    for i in indices:
        if runs and i == runs[-1][1]:
            runs[-1][1] = i + 1
        else:
            runs.append([i + 1, i + 1])
    return runs


class LocomoConversation(NamedTuple):
    sample_id: str
    rounds_parts: list[tuple[list[dict], list[dict]]]  # per round: the turns merged into Qi, into Ai
    where: dict[str, tuple[int, str]]  # dia_id -> (round index, "Q" | "A"), in conversation order
    dates: dict[int, str]  # session -> its date
    user_speaker: str
    assistant_speaker: str


def read_locomo_samples(path) -> list:
    samples = read_json(resolve_file(path, ["locomo10.json", "*.json"]))
    if not isinstance(samples, list):
        raise DataError(f"{path}: expected a list of LoCoMo samples")
    return samples


def read_locomo_conversation(sample, s_index, report) -> LocomoConversation | None:
    """One sample's sessions -> its rounds, with the roles and the merging load_locomo describes;
    None (counted) for a sample without turns."""
    sample_id = str(sample.get("sample_id", f"sample-{s_index}"))
    conversation = sample.get("conversation") or {}
    turns, dates = locomo_stream(conversation)
    if not turns:
        report["samples_without_turns"] += 1
        return None
    user_speaker = turns[0]["speaker"]
    names = [conversation.get("speaker_a"), conversation.get("speaker_b")]
    assistant_speaker = next(
        (n for n in names if n and n != user_speaker),
        next((t["speaker"] for t in turns if t["speaker"] != user_speaker), ""),
    )
    merged = merge_turns(
        [dict(t, role="user" if t["speaker"] == user_speaker else "assistant") for t in turns], report
    )
    if merged and merged[-1]["role"] == "user":  # the conversation ends on the user's side: the
        merged.append({"role": "assistant", "parts": []})  # turn may be evidence, so it stays, unanswered
        report["trailing_user_kept"] += 1
    rounds_parts = [(u["parts"], a["parts"]) for u, a in pair_merged(merged, report)]
    where = {}
    for r_index, sides in enumerate(rounds_parts):
        for side, parts in zip("QA", sides):
            for part in parts:
                if part["dia_id"]:
                    where[part["dia_id"]] = (r_index, side)
    return LocomoConversation(sample_id, rounds_parts, where, dates, user_speaker, assistant_speaker)


def render_rounds(conversation, kept, date_headers) -> list[dict]:
    """The rounds `kept` (0-based, ascending) as a window shows them, {"user", "assistant"}: a
    date header goes wherever the session changes from the utterance before it in the window."""
    rounds, last_session, dates = [], None, conversation.dates
    for r_index in kept:
        texts = []
        for parts in conversation.rounds_parts[r_index]:
            text, last_session = render_locomo_utterance(parts, last_session, dates, date_headers)
            texts.append(text)
        rounds.append({"user": texts[0], "assistant": texts[1]})
    return rounds


def locomo_conversations(path, date_headers="session") -> list[dict]:
    """Every conversation of a LoCoMo file, whole, for the methods that retrieve from all of it
    (stage 0 writes them to conversations.jsonl): {"conversation_id": sample_id, "rounds":
    [{"user", "assistant"}, ...], "dia_labels": {dia_id: "Q12" | "A12"}}. The rounds are what a
    window holding every round renders, the labels that window's (1-based rounds)."""
    out = []
    for s_index, sample in enumerate(read_locomo_samples(path)):
        conversation = read_locomo_conversation(sample, s_index, Counter())  # load_locomo counts these
        if conversation is None:
            continue
        every_round = range(len(conversation.rounds_parts))
        out.append(
            {
                "conversation_id": conversation.sample_id,
                "rounds": render_rounds(conversation, every_round, date_headers),
                "dia_labels": {i: f"{side}{r + 1}" for i, (r, side) in conversation.where.items()},
            }
        )
    return out


def embed_with_minilm(texts):
    from srt.embedder import embed  # torch and the embedder load only when a window is retrieved

    return embed(texts)


def load_locomo(
    path,
    max_rounds=32,
    report=None,
    seed=0,
    adversarial="abstain",
    date_headers="session",
    window="retrieved",
    embed=None,
    limit=None,
    **_,
) -> list[dict]:
    """One dialogue per question: a history window of at most `max_rounds - 1` rounds (so the
    dialogue, query round included, has at most `max_rounds`) and the question as the gold round.

    Fields relied on: sample_id; conversation.speaker_a/speaker_b; conversation.session_<n> (turns
    with speaker, dia_id, text, optional blip_caption); conversation.session_<n>_date_time;
    qa[].question, qa[].answer (str or number), qa[].adversarial_answer (category 5),
    qa[].evidence (list of dia_ids), qa[].category (1-5).

    Roles: whoever speaks first in session 1 is the user (Q), the other speaker the assistant (A).
    Every utterance starts with its speaker's name, because the questions name the speakers. A
    conversation that ends on the user's side keeps that last turn (it may be evidence) in a round
    whose assistant utterance is empty (`trailing_user_kept`).
    Window: LoCoMo asks its questions after the whole conversation, so a window chosen from the
    question alone is what a user has. 'retrieved' (the default) keeps the rounds closest to the
    question by `embed` (texts -> unit-norm rows; default all-MiniLM-L6-v2), each round embedded as
    the window renders it, once per conversation; 'recent' the last rounds; 'all' every round,
    whatever `max_rounds`; 'evidence' is an oracle that reads the evidence (choose_window) and drops
    a question whose evidence rounds outnumber the window. A window in conversation order keeps the
    labels of its position (Q1, A1, ...). H* is the utterances that hold the evidence turns inside
    the window: evidence outside it cannot be recalled, so it is not in H*, and a question with
    none inside has an empty H*. The gold keeps every evidence id, so evidence recall still counts
    them all. report["locomo_windows"] compares the kinds' evidence ceilings (window_ceilings).
    Dates: `date_headers='session'` writes "[<session date>]" before the first utterance of each
    session in the window and wherever the session changes ('turn': before every utterance), so
    dates an answer is computed from stay in the text.
    Category 5 (adversarial, unanswerable as asked: the question moves a fact to the other speaker
    or to another event): 'abstain' (the default) answers LOCOMO_ABSTAIN, which LoCoMo's own
    evaluation alone counts as right (srt/locomo_eval.py), so SFT teaches the model to decline
    after recalling the turns the question distorts; 'keep' takes `adversarial_answer`, the
    planted answer, as the reference (the reading of A-Mem and of some LoCoMo evaluations);
    'skip' drops those questions.
    Evidence blemishes are normalised where possible (normalise_evidence); a question with an
    evidence fragment that cannot be read or an id that names no turn is skipped and counted,
    since its H* would be incomplete."""
    if adversarial not in ("keep", "abstain", "skip"):
        raise ValueError(f"adversarial must be keep, abstain or skip, not {adversarial!r}")
    if window not in LOCOMO_WINDOWS:
        raise ValueError(f"window must be {', '.join(LOCOMO_WINDOWS)}, not {window!r}")
    report = Counter() if report is None else report
    embed = embed or embed_with_minilm
    dialogues, budget, tallies = [], max_rounds - 1, []
    for s_index, sample in enumerate(read_locomo_samples(path)):
        conversation = read_locomo_conversation(sample, s_index, report)
        if conversation is None:
            continue
        sample_id, where = conversation.sample_id, conversation.where
        num_rounds = len(conversation.rounds_parts)
        qas = sample.get("qa") or []
        similarities = None  # [question, round] cosines
        if num_rounds > budget:
            every_round = render_rounds(conversation, range(num_rounds), date_headers)
            texts = [f"{r['user']} {r['assistant']}".strip() for r in every_round]
            vectors = embed(texts + [str(qa.get("question") or "").strip() for qa in qas])
            similarities = vectors[num_rounds:] @ vectors[:num_rounds].T
        for q_index, qa in enumerate(qas):
            report["qa_read"] += 1
            category = qa.get("category")
            if category == 5:
                if adversarial == "skip":
                    report["qa_skipped_adversarial"] += 1
                    continue
                answer = qa.get("adversarial_answer") if adversarial == "keep" else LOCOMO_ABSTAIN
            else:
                answer = qa.get("answer")
            if answer is None or not str(qa.get("question") or "").strip():
                report["qa_skipped_no_answer"] += 1
                continue
            ids, unreadable, normalised = normalise_evidence(qa.get("evidence"))
            report["evidence_ids_normalised"] += normalised
            dangling = [i for i in ids if i not in where]
            if unreadable or dangling:
                report["evidence_fragments_unreadable"] += len(unreadable)
                report["evidence_ids_dangling"] += len(dangling)
                report["qa_skipped_unresolved_evidence"] += 1
                continue
            # every kind for every question, for window_ceilings; of them only 'evidence' reads the gold
            rng = random.Random(f"locomo-{seed}-{sample_id}-{q_index}")
            windows = {
                "retrieved": gold_free_window(
                    "retrieved", num_rounds, budget, None if similarities is None else similarities[q_index]
                ),
                "recent": gold_free_window("recent", num_rounds, budget),
                "evidence": choose_window(num_rounds, [where[i][0] for i in ids], budget, rng),
                "all": gold_free_window("all", num_rounds, budget),
            }
            if ids:
                inside = {
                    kind: None if kept is None else sum(where[i][0] in kept for i in ids)
                    for kind, (kept, _) in windows.items()
                }
                tallies.append((category, len(ids), inside))
            kept, how = windows[window]
            if kept is None:
                report["qa_skipped_evidence_exceeds_window"] += 1
                continue
            rounds = render_rounds(conversation, kept, date_headers)
            position = {r_index: k + 1 for k, r_index in enumerate(kept)}
            # dia_id -> the label of the utterance that holds it, for the evidence inside the window only
            labels = {i: f"{where[i][1]}{position[where[i][0]]}" for i in ids if where[i][0] in position}
            recall = sorted(set(labels.values()), key=lambda label: (int(label[1:]), label[0] == "A"))
            answer = str(answer)
            kind = LOCOMO_CATEGORIES.get(category, "unknown")
            # a templated Z so that the oracle teacher can serve LoCoMo; an LLM teacher writes the
            # real chain from the same H* (teacher.py)
            if category == 5 and adversarial == "abstain":
                reasoning = (
                    "The recalled turns are the closest the conversation comes, but none of them says "
                    "what the question asks: its premise is not in the conversation, so the answer "
                    f"is: {answer}"
                )
            elif recall:
                reasoning = (
                    "The recalled turns, with their session dates, hold what the question needs; from "
                    f"them the answer is: {answer}"
                )
            else:
                reasoning = f"No single earlier turn states it; the answer is: {answer}"
            gold = {
                "recall": recall,
                "answer_keys": [],
                "answer": answer,
                "query_type": f"locomo-{kind}",
                "category": category,
                "evidence": ids,
                # for LoCoMo's evidence recall, which counts dia_ids (several of one speaker's turns
                # may merge into one utterance); an id outside the window has no label
                "evidence_labels": labels,
                "derived_answer": True,
                "analysis": f"about the earlier conversation: {str(qa['question']).strip().rstrip('?.! ')}",
                "reasoning": reasoning,
                "reasoning_source": "template",
            }
            if category == 5:
                gold["adversarial_answer"] = str(qa.get("adversarial_answer"))
            rounds.append({"user": str(qa["question"]).strip(), "assistant": answer, "gold": gold})
            report["queries"] += 1
            dialogues.append(
                {
                    "id": f"locomo-{sample_id}-q{q_index:03d}",
                    "source": "locomo",
                    "domain": "long-term-chat",
                    "rounds": rounds,
                    "meta": {
                        "conversation_id": sample_id,
                        "split_group": sample_id,
                        "user_speaker": conversation.user_speaker,
                        "assistant_speaker": conversation.assistant_speaker,
                        "window": {
                            "kind": window,
                            "how": how,
                            "max_rounds": max_rounds,
                            "conversation_rounds": num_rounds,
                            "kept_rounds": runs_of(kept),
                            "evidence_rounds": sorted({where[i][0] + 1 for i in ids}),
                            "evidence_in_window": [len(labels), len(ids)],
                        },
                    },
                }
            )
            if limit and len(dialogues) >= limit:
                break
        if limit and len(dialogues) >= limit:
            break
    report["locomo_windows"] = window_ceilings(tallies, window, budget)
    return dialogues


def window_ceilings(tallies, used, budget) -> dict:
    """What each window kind leaves a method to find, over the questions with evidence (`tallies`:
    (category, evidence ids, {kind: ids inside the kind's window, None where it has none})):
    for all of them, the answerable categories 1-4 and each category, the share of evidence ids
    inside (`ids_inside`), the mean share per question (`evidence_recall_ceiling`: the most that
    LoCoMo's evidence recall, a mean over questions, can reach) and the share of questions with
    all their evidence inside (`all_inside`). A question the evidence window cannot hold (more
    evidence rounds than the budget) counts as none inside for that kind; `used` is the kind the
    dialogues were built with."""
    groups = ["all", "answerable", *LOCOMO_CATEGORIES.values()]
    kinds = {}
    for kind in LOCOMO_WINDOWS:
        sums = {g: Counter() for g in groups}
        for category, total, inside in tallies:
            n = inside[kind] or 0
            names = ["all"]
            if category in (1, 2, 3, 4):
                names.append("answerable")
            if category in LOCOMO_CATEGORIES:
                names.append(LOCOMO_CATEGORIES[category])
            for g in names:
                s = sums[g]
                s["questions"] += 1
                s["ids"] += total
                s["inside"] += n
                s["share"] += n / total
                s["complete"] += n == total
        kinds[kind] = {
            g: {
                "questions": s["questions"],
                "evidence_ids": s["ids"],
                "ids_inside": round(s["inside"] / s["ids"], 4),
                "evidence_recall_ceiling": round(s["share"] / s["questions"], 4),
                "all_inside": round(s["complete"] / s["questions"], 4),
            }
            for g, s in sums.items()
            if s["questions"]
        }
    return {
        "used": used,
        "budget_rounds": budget,
        "questions_with_evidence": len(tallies),
        "evidence_window_cannot_hold": sum(inside["evidence"] is None for _, _, inside in tallies),
        "kinds": kinds,
    }


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


def render_locomo_utterance(parts, last_session, dates, date_headers) -> tuple[str, int]:
    """'[8 May, 2023] Caroline: text ...' -> (text, session of its last part). A date header goes
    where the session changes ('session'), also before every utterance ('turn'), or nowhere
    ('none')."""
    if not parts:
        return "", last_session
    pieces, header = [], None
    for k, part in enumerate(parts):
        if date_headers != "none" and (
            part["session"] != last_session or (date_headers == "turn" and k == 0)
        ):
            if k == 0:
                header = f"[{dates[part['session']]}]"
            else:
                pieces.append(f"[{dates[part['session']]}]")
        last_session = part["session"]
        pieces.append(part["text"])
    speaker = f"{parts[0]['speaker']}: " + " ".join(pieces)
    return (f"{header} {speaker}" if header else speaker), last_session


# --------------------------------------------------------------------------------------------
# CoQA (Reddy et al., 2019): the story is read first, then the questions are asked in order.
# --------------------------------------------------------------------------------------------
STORY_ACK = "OK."


def split_story(story: str, words_per_part: int) -> list[str]:
    """Sentence-aligned parts of about `words_per_part` words: recall then copies the part that
    holds the rationale, not the whole story."""
    sentences = [s for s in re.split(r"(?<=[.!?])\s+", " ".join(story.split())) if s]
    parts, current = [], []
    for sentence in sentences:
        current.append(sentence)
        if sum(len(s.split()) for s in current) >= words_per_part:
            parts.append(" ".join(current))
            current = []
    if current:
        parts.append(" ".join(current))
    return parts


def load_coqa(
    path, max_rounds=32, report=None, story_part_words=60, queries="all", limit=None, **_
) -> list[dict]:
    """One dialogue per story. The story comes first, split into sentence-aligned parts, one part
    per round: "Story (part k of m): ..." as the user utterance, "OK." as the assistant's. Then
    each question is a round (question, answer input_text), marked `query` for the teacher
    (queries='all'; 'last' marks only the last question). The rationale span is kept in the round's
    meta with the label of the story part that holds it.

    Fields relied on: data[].id, .source (domain), .story, .questions[] {turn_id, input_text},
    .answers[] {turn_id, input_text, span_text, span_start}."""
    report = Counter() if report is None else report
    corpus = read_json(resolve_file(path, ["coqa-*.json", "*.json"]))
    dialogues = []
    for story_index, item in enumerate(corpus.get("data", []) if isinstance(corpus, dict) else []):
        story = str(item.get("story") or "")
        answers = {a.get("turn_id"): a for a in item.get("answers", [])}
        parts = split_story(story, story_part_words)
        if not parts:
            report["too_short"] += 1
            continue
        rounds = [
            {"user": f"Story (part {k} of {len(parts)}): {part}", "assistant": STORY_ACK}
            for k, part in enumerate(parts, 1)
        ]
        starts = _part_offsets(story, parts)
        for question in sorted(item.get("questions", []), key=lambda q: q.get("turn_id", 0)):
            answer = answers.get(question.get("turn_id"))
            if answer is None or not str(question.get("input_text") or "").strip():
                report["questions_without_answer"] += 1
                continue
            meta = {"turn_id": question.get("turn_id"), "rationale": answer.get("span_text", "")}
            span_start = answer.get("span_start", -1)
            if isinstance(span_start, int) and span_start >= 0:
                meta["rationale_label"] = f"Q{max(k for k, s in enumerate(starts, 1) if s <= span_start)}"
            rounds.append(
                {
                    "user": str(question["input_text"]).strip(),
                    "assistant": str(answer.get("input_text", "")).strip(),
                    "meta": meta,
                    **({"query": True} if queries == "all" else {}),
                }
            )
        if len(rounds) == len(parts):
            report["too_short"] += 1
            continue
        dialogue = finish_dialogue(
            f"coqa-{item.get('id', story_index)}",
            "coqa",
            str(item.get("source", "coqa")),
            rounds,
            report,
            max_rounds,
            "last" if queries == "last" else "none",
        )
        if dialogue:
            dialogues.append(dialogue)
        if limit and len(dialogues) >= limit:
            break
    return dialogues


def _part_offsets(story, parts) -> list[int]:
    """Character offset in the raw story where each part starts (its first word's position)."""
    offsets, cursor = [], 0
    for part in parts:
        first = part.split()[0]
        found = story.find(first, cursor)
        offsets.append(found if found >= 0 else cursor)
        cursor = max(cursor, offsets[-1] + 1)
    offsets[0] = 0
    return offsets


# --------------------------------------------------------------------------------------------
# MultiWOZ 2.x (Budzianowski et al., 2018): data.json, dialogue id -> log of alternating turns
# --------------------------------------------------------------------------------------------
MULTIWOZ_DOMAINS = ("attraction", "hospital", "hotel", "police", "restaurant", "taxi", "train")


def load_multiwoz(path, max_rounds=32, report=None, queries="last", limit=None, **_) -> list[dict]:
    """Fields relied on: the top-level object {dialogue id: {"goal", "log"}}; log[k].text, with
    even k the user and odd k the system (the 2.0/2.1/2.3/2.4 layout); goal[<domain>] non-empty for
    the domains the dialogue covers (joined with '+' as our domain)."""
    report = Counter() if report is None else report
    corpus = read_json(resolve_file(path, ["data.json", "*.json"]))
    if not isinstance(corpus, dict):
        raise DataError(f"{path}: expected MultiWOZ's object of dialogue id -> dialogue")
    dialogues = []
    for dialogue_id, item in corpus.items():
        log = item.get("log") if isinstance(item, dict) else None
        if not isinstance(log, list):
            report["malformed"] += 1
            continue
        turns = [{"role": ROLES[k % 2], "text": turn.get("text", "")} for k, turn in enumerate(log)]
        goal = item.get("goal") or {}
        domains = [d for d in MULTIWOZ_DOMAINS if goal.get(d)]
        dialogue = finish_dialogue(
            f"multiwoz-{Path(dialogue_id).stem}",
            "multiwoz",
            "+".join(domains) or "multiwoz",
            pair_rounds(turns, report),
            report,
            max_rounds,
            queries,
        )
        if dialogue:
            dialogues.append(dialogue)
        if limit and len(dialogues) >= limit:
            break
    return dialogues


# --------------------------------------------------------------------------------------------
# DailyDialog (Li et al., 2017): dialogues_text.txt, one dialogue a line, __eou__ after each turn
# --------------------------------------------------------------------------------------------
DAILYDIALOG_TOPICS = {
    1: "ordinary-life",
    2: "school-life",
    3: "culture-education",
    4: "attitude-emotion",
    5: "relationship",
    6: "tourism",
    7: "health",
    8: "work",
    9: "politics",
    10: "finance",
}


def detokenize(text: str) -> str:
    """DailyDialog is tokenized ("Say , Jim , how about it ?"): close up punctuation and the
    apostrophes it spaces out, so utterances read like chat."""
    text = " ".join(text.split())
    text = re.sub(r"\s+([.,!?;:%)])", r"\1", text)
    text = re.sub(r"([($])\s+", r"\1", text)
    text = re.sub(r"\s*([’'])\s*(s|t|m|re|ve|ll|d)\b", r"\1\2", text)
    return text


def load_dailydialog(path, max_rounds=32, report=None, queries="last", limit=None, **_) -> list[dict]:
    """Fields relied on: one dialogue per line, utterances separated (and ended) by '__eou__'; the
    speakers alternate and the first is the user. A dialogues_topic.txt beside the file (one topic
    number per line, the release's companion file) gives the domain."""
    report = Counter() if report is None else report
    text_file = resolve_file(path, ["dialogues_text.txt", "dialogues_*.txt"])
    topic_file = text_file.with_name("dialogues_topic.txt")
    topics = (
        topic_file.read_text(encoding="utf-8").split()
        if text_file.name == "dialogues_text.txt" and topic_file.exists()
        else []
    )
    dialogues = []
    with open(text_file, "rb") as f:
        for line_no, raw in enumerate(f):
            try:
                line = raw.decode("utf-8").replace("\r\n", "\n")  # as text mode read it
            except UnicodeDecodeError as e:
                raise not_utf8(text_file, line_no + 1, raw, e) from None
            utterances = [detokenize(u) for u in line.split("__eou__")]
            turns = [{"role": ROLES[k % 2], "text": u} for k, u in enumerate(u for u in utterances if u)]
            if not turns:
                continue
            topic = int(topics[line_no]) if line_no < len(topics) and topics[line_no].isdigit() else 0
            dialogue = finish_dialogue(
                f"dailydialog-{line_no:05d}",
                "dailydialog",
                DAILYDIALOG_TOPICS.get(topic, "daily-life"),
                pair_rounds(turns, report),
                report,
                max_rounds,
                queries,
            )
            if dialogue:
                dialogues.append(dialogue)
            if limit and len(dialogues) >= limit:
                break
    return dialogues


# --------------------------------------------------------------------------------------------
# ReDial (Li et al., 2018): JSONL, one conversation a line, seeker (initiator) and recommender
# --------------------------------------------------------------------------------------------
MOVIE_MENTION = re.compile(r"@(\d+)")


def load_redial(
    path, max_rounds=32, report=None, queries="last", limit=None, on_error="skip", **_
) -> list[dict]:
    """Fields relied on: conversationId, initiatorWorkerId (the seeker: our user), messages[]
    {text, senderWorkerId}, movieMentions {movie id: "Title (year)"} (a list of {movieId,
    movieName} is read too). "@<movie id>" in a message becomes the movie's title."""
    report = Counter() if report is None else report
    errors = []

    def parse(obj, where, line):
        if not isinstance(obj, dict) or not isinstance(obj.get("messages"), list):
            raise DataError(f"{where}:{line}: field 'messages' is missing or not a list")
        return obj

    dialogues = []
    for item in read_lines(resolve_file(path, ["train_data.jsonl", "*.jsonl"]), parse, on_error, errors):
        mentions = item.get("movieMentions") or {}
        if isinstance(mentions, list):
            mentions = {str(m.get("movieId")): m.get("movieName") for m in mentions if isinstance(m, dict)}
        seeker = item.get(
            "initiatorWorkerId", item["messages"][0].get("senderWorkerId") if item["messages"] else None
        )

        def titles(text):
            return MOVIE_MENTION.sub(lambda m: str(mentions.get(m[1]) or m[0]), str(text or ""))

        turns = [
            {
                "role": "user" if m.get("senderWorkerId") == seeker else "assistant",
                "text": titles(m.get("text")),
            }
            for m in item["messages"]
            if isinstance(m, dict)
        ]
        dialogue = finish_dialogue(
            f"redial-{item.get('conversationId', len(dialogues))}",
            "redial",
            "movies",
            pair_rounds(turns, report),
            report,
            max_rounds,
            queries,
        )
        if dialogue:
            dialogues.append(dialogue)
        if limit and len(dialogues) >= limit:
            break
    report["malformed"] += len(errors)
    return dialogues


# --------------------------------------------------------------------------------------------
# MG-ShopDial (Bernard & Balog, 2023): MGShopDial.json, a list of annotated conversations
# --------------------------------------------------------------------------------------------
MGSHOPDIAL_USER = {"client", "user"}
MGSHOPDIAL_ASSISTANT = {"wizard", "assistant"}


def load_mgshopdial(path, max_rounds=32, report=None, queries="last", limit=None, **_) -> list[dict]:
    """The schema (the release's data card, MGShopDial/README.md, and MGShopDial.json):
    a list of {"id": "Books:45:109:118" (product category first), "metadata": {"desc", ...},
    "utterances": [{"utterance_id", "participant": "Client" | "Wizard" (the card calls the wizard
    "Assistant"), "utterance", "goal": "search" | "recommendation" | "qa" | "meta", "intents"}]}.

    Fields relied on: id (its first ':' field is the domain), utterances[].participant,
    .utterance, .goal, .utterance_id. Conversations open with the wizard's greeting, which the
    shared convention drops. queries='qa' marks every round whose client utterance has goal 'qa'
    (the paper's shop questions); 'last' (default) and 'all' as everywhere."""
    report = Counter() if report is None else report
    corpus = read_json(resolve_file(path, ["MGShopDial.json", "*.json"]))
    if not isinstance(corpus, list):
        raise DataError(f"{path}: expected MG-ShopDial's list of conversations")
    dialogues = []
    for index, item in enumerate(corpus):
        turns = []
        for u in sorted(item.get("utterances", []), key=lambda u: u.get("utterance_id", 0)):
            who = str(u.get("participant", "")).lower()
            if who not in MGSHOPDIAL_USER | MGSHOPDIAL_ASSISTANT:
                report["unknown_participant"] += 1
                continue
            turns.append(
                {
                    "role": "user" if who in MGSHOPDIAL_USER else "assistant",
                    "text": u.get("utterance", ""),
                    "goal": u.get("goal"),
                }
            )
        pairs = pair_merged(merge_turns(turns, report), report)
        rounds = [{"user": u["text"], "assistant": a["text"]} for u, a in pairs]
        if queries == "qa":
            for k, (user, _) in enumerate(pairs):
                if k > 0 and "qa" in [p.get("goal") for p in user["parts"]]:
                    rounds[k]["query"] = True
        domain = str(item.get("id", "")).split(":")[0].lower() or "shopping"
        dialogue = finish_dialogue(
            f"mgshopdial-{item.get('id', index)}",
            "mgshopdial",
            domain,
            rounds,
            report,
            max_rounds,
            "none" if queries == "qa" else queries,
            {"scenario": (item.get("metadata") or {}).get("desc", "")},
        )
        if dialogue and (queries != "qa" or any(r.get("query") for r in dialogue["rounds"])):
            dialogues.append(dialogue)
        elif dialogue:
            report["no_qa_round"] += 1
        if limit and len(dialogues) >= limit:
            break
    return dialogues


# --------------------------------------------------------------------------------------------
# chitchat-dataset (BYU PCC, MIT): real open-domain conversations, shipped inside the wheel
# --------------------------------------------------------------------------------------------
def chitchat_path() -> Path:
    """dataset.json inside the installed chitchat-dataset package (found without importing it)."""
    import importlib.util

    spec = importlib.util.find_spec("chitchat_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the chitchat corpus is missing; install it with `pip install chitchat-dataset`")
    return Path(spec.submodule_search_locations[0]) / "dataset.json"


def load_chitchat(path=None, max_rounds=32, report=None, queries="last", limit=None, **_) -> list[dict]:
    """Fields relied on: {conversation id: {"messages": [[{text, sender, timestamp}, ...], ...],
    "prompt"}}: each inner list is one speaker's group of messages. Whoever writes first is the user.
    `path` defaults to the package's dataset.json. About 3,150 of its 7,168 conversations hold one
    message group only (no reply) and are skipped as too short."""
    report = Counter() if report is None else report
    corpus = read_json(resolve_file(path, ["dataset.json"]) if path else chitchat_path())
    dialogues = []
    for conversation_id, item in corpus.items():
        messages = [m for group in item.get("messages", []) for m in group if isinstance(m, dict)]
        opener = messages[0].get("sender") if messages else None
        turns = [
            {"role": "user" if m.get("sender") == opener else "assistant", "text": m.get("text")}
            for m in messages
        ]
        dialogue = finish_dialogue(
            f"chitchat-{conversation_id}",
            "chitchat",
            "open-domain",
            pair_rounds(turns, report),
            report,
            max_rounds,
            queries,
            {"prompt": item.get("prompt", "")} if item.get("prompt") else None,
        )
        if dialogue:
            dialogues.append(dialogue)
        if limit and len(dialogues) >= limit:
            break
    return dialogues


# --------------------------------------------------------------------------------------------
# Our JSONL: one dialogue a line, with or without gold
# --------------------------------------------------------------------------------------------
def parse_jsonl_dialogue(obj, where="<dialogue>", line=0) -> dict:
    """Two forms, both with "id" and optional "source", "domain", "meta":
    - rounds: {"rounds": [{"user", "assistant", "gold"?, "query"?}]}: stage 0's own form; gold is
      {"recall": [labels], "answer_keys": [...], "reasoning"?, "analysis"?, ...}.
    - messages: {"messages": [{"role": "user" | "assistant" | "system", "content"}]}: a chat
      export; system messages are skipped, the shared conventions pair the rest, the last round
      is the query."""
    if not isinstance(obj, dict) or not isinstance(obj.get("id"), (str, int)):
        raise DataError(f"{where}:{line}: field 'id' is missing or not a string")
    if not isinstance(obj.get("meta", {}), dict):
        raise DataError(f"{where}:{line}: field 'meta' must be an object, got {type(obj['meta']).__name__}")
    if isinstance(obj.get("messages"), list) and "rounds" not in obj:
        for k, m in enumerate(obj["messages"]):
            if (
                not isinstance(m, dict)
                or m.get("role") not in ("user", "assistant", "system")
                or not isinstance(m.get("content"), str)
            ):
                raise DataError(
                    f"{where}:{line}: field 'messages[{k}]' needs role user|assistant|system "
                    "and string content"
                )
            if len(m["content"]) > MAX_UTTERANCE_CHARS:  # every later stage would refuse its records
                raise DataError(f"{where}:{line}: field 'messages[{k}].content' {too_long(m['content'])}")
        return obj
    if not isinstance(obj.get("rounds"), list):
        raise DataError(f"{where}:{line}: field 'rounds' (or 'messages') is missing or not a list")
    for k, r in enumerate(obj["rounds"]):
        for field in ROLES:
            if not isinstance(r, dict) or not isinstance(r.get(field), str):
                raise DataError(f"{where}:{line}: field 'rounds[{k}].{field}' is missing or not a string")
            if len(r[field]) > MAX_UTTERANCE_CHARS:  # every later stage would refuse its records
                raise DataError(f"{where}:{line}: field 'rounds[{k}].{field}' {too_long(r[field])}")
        if not isinstance(r.get("meta", {}), dict):
            raise DataError(f"{where}:{line}: field 'rounds[{k}].meta' must be an object")
        gold = r.get("gold")
        if gold is not None and not (
            isinstance(gold, dict)
            and isinstance(gold.get("recall", []), list)
            and isinstance(gold.get("answer_keys", []), list)
        ):
            raise DataError(f"{where}:{line}: field 'rounds[{k}].gold' needs list 'recall' and 'answer_keys'")
        for field in ("recall", "answer_keys"):  # labels and facts are text: 106 is not "$106"
            bad = next((i for i, x in enumerate((gold or {}).get(field, [])) if not isinstance(x, str)), None)
            if bad is not None:
                raise DataError(f"{where}:{line}: field 'rounds[{k}].gold.{field}[{bad}]' must be a string")
        labels = {f"{side}{i}" for i in range(1, k + 1) for side in "QA"}
        bad = [x for x in (gold or {}).get("recall", []) if x not in labels]
        if bad:
            raise DataError(
                f"{where}:{line}: field 'rounds[{k}].gold.recall' names {bad[0]!r}, not an earlier turn"
            )
    return obj


def load_jsonl(path, max_rounds=None, report=None, on_error="raise", limit=None, **_) -> list[dict]:
    """Our documented input (parse_jsonl_dialogue). Rounds-form dialogues keep their gold and
    query marks; when a dialogue marks nothing, its last round becomes the teacher's query. No
    cut by default: stage 0's length filter decides."""
    report = Counter() if report is None else report
    errors = []
    dialogues = []
    for obj in read_lines(resolve_file(path, ["*.jsonl"]), parse_jsonl_dialogue, on_error, errors):
        if "rounds" in obj:
            rounds = [dict(r) for r in obj["rounds"]]
            marks = any("gold" in r or r.get("query") for r in rounds)
        else:
            turns = [
                {"role": m["role"], "text": m["content"]} for m in obj["messages"] if m["role"] != "system"
            ]
            rounds, marks = pair_rounds(turns, report), False
        report["rounds_with_gold"] += sum("gold" in r for r in rounds)
        dialogue = finish_dialogue(
            obj["id"],
            str(obj.get("source", "jsonl")),
            str(obj.get("domain", "unknown")),
            rounds,
            report,
            max_rounds,
            "none" if marks else "last",
            obj.get("meta"),
        )
        if dialogue:
            dialogues.append(dialogue)
        if limit and len(dialogues) >= limit:
            break
    report["malformed"] += len(errors)
    report["errors"] = errors[:20]
    return dialogues


# --------------------------------------------------------------------------------------------
# The registry stage 0 uses: --source NAME --path FILE_OR_DIR
# --------------------------------------------------------------------------------------------
LOADERS = {
    "locomo": load_locomo,
    "coqa": load_coqa,
    "multiwoz": load_multiwoz,
    "dailydialog": load_dailydialog,
    "redial": load_redial,
    "mgshopdial": load_mgshopdial,
    "chitchat": load_chitchat,
    "jsonl": load_jsonl,
}


def load_corpus(source, path=None, **options) -> tuple[list[dict], dict]:
    """-> (dialogues in the form above, report of what was read, normalised and skipped).
    Options every loader takes: max_rounds, queries ('last' | 'all' | 'none'; mgshopdial also
    'qa'; LoCoMo has gold instead), limit (stop after that many dialogues). LoCoMo adds seed,
    adversarial, date_headers, window and embed; CoQA story_part_words; jsonl and redial on_error."""
    if source not in LOADERS:
        raise ValueError(f"unknown source {source!r}; choose one of {', '.join(sorted(LOADERS))}")
    if path is None and source != "chitchat":
        raise DataError(f"--source {source} needs --path FILE_OR_DIR")
    report = Counter()
    dialogues = LOADERS[source](path, report=report, **options)
    report["dialogues"] = len(dialogues)
    report["rounds"] = sum(len(d["rounds"]) for d in dialogues)
    return dialogues, dict(report)
