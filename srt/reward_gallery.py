"""The reward-hacking gallery (`python reward.py --gallery`, docs/reward-gallery.md): the paper's Fig. 1
record attacked by cheap completions, each scored by the composite reward of Eqs. (4)-(7) under every
answer-reward choice, beside the honest completion it must lose to.

The package imports no script, so reward.py hands its reward in: `gallery_scores` scores with the
`compute_rewards` it is given, under each of the `choices` (reward.ANSWER_REWARDS), so that the
gallery a student reads is the reward that trains.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable, Sequence
from os.path import commonprefix

from srt.completion import ANSWER_MARK
from srt.prompt import format_target

# ==== The paper's Fig. 1 record ====
_FIG1 = [
    ("Q1", "I need to check membership status. I'm under Apex Tier."),
    (
        "A1",
        "Welcome back. I confirm your Apex Tier status. As a reminder, this gives you a 20% discount on "
        "any service over $150.",
    ),
    ("Q2", "Does that apply to all locations?"),
    ("A2", "Yes, it's valid at both our Downtown and Uptown branches."),
    ("Q3", "Okay. Separately, what is the Chakra Balancing service?"),
    ("A3", "That is a 90-minute session combining hot stones and aromatherapy."),
    ("Q4", "Is that new? Who performs that?"),
    ("A4", "Our senior therapist, Lena, the specialist for that service."),
    ("Q5", "What is the full price for that session?"),
    ("A5", "The Chakra Balancing service is $180."),
    ("Q6", "And which branch does Lena perform that at?"),
    ("A6", "Lena only offers that service at our Uptown branch."),
]
_GOLD = ("Q1", "A5", "A6")
_TEXT = dict(_FIG1)
GALLERY_RECORD = {  # the paper's Fig. 1 turn in the record format of docs/design.md ("Data")
    "id": "paper-fig1-apex-t07",
    "source": "jsonl",
    "query_turn": 7,
    "recall": list(_GOLD),
    "history": [
        {"label": label, "speaker": "user" if label[0] == "Q" else "assistant", "text": text}
        for label, text in _FIG1
    ],
    "query": "Great. So, for that specific booking at the Uptown branch, will my Apex Tier discount apply?",
    "reasoning": (
        "1. Analyze Query: The user asks whether their Apex Tier discount applies to the Chakra Balancing "
        "booking at the Uptown branch.\n2. Recall History: "
        + "\n".join(f"<HIS>{label}: {_TEXT[label]}</HIS>" for label in _GOLD)
        + "\n3. Reasoning: Apex Tier gives 20% off any service over $150 (A1). The Chakra Balancing service "
        "is $180, which is over $150, and Lena offers it at the Uptown branch, so the discount applies."
    ),
    "answer": "Yes. The Chakra Balancing service is $180, which is over $150, so your 20% Apex Tier discount "
    "applies at the Uptown branch.",
    "answer_keys": ["yes", "$180"],
    "pruned": ["Q1", "A1", "A2", "A5", "A6"],
    "meta": {"num_turns": 7, "bucket": 8, "scores": {}},
}


# ==== The attacks: completions that try to earn the reward without the work ====
_HISTORY_NUMBER = re.compile(r"(?<![\w.])[$€£]?\d[\d,]*(?:\.\d+)?%?(?!\w)")
# a run of capitalised words after a sentence's first word ("Apex Tier", "Lena")
_NAME_RUN = re.compile(r"(?<=\s)[A-Z][\w'-]*(?:\s+[A-Z][\w'-]*)*")


def history_attacks(record: dict) -> dict[str, str]:
    """Answers made of the record's history instead of an answer (attacks on the answer
    metric): the history pasted, pasted without its numbers, pasted in lowercase (its names then
    read as no values), every number it states, every name it states (capitalised words that do
    not open a sentence), and both polarities."""
    texts = [u["text"] for u in record["history"]]
    pasted = " ".join(texts)
    names = [
        run
        for text in texts
        for sentence in re.split(r"(?<=[.!?])\s+", text)
        for run in _NAME_RUN.findall(sentence)
        if run != "I" and not run.startswith("I'")
    ]
    return {
        "pasted": pasted,
        "no numbers": " ".join(_HISTORY_NUMBER.sub("", pasted).split()),
        "lowercase": pasted.lower(),
        "numbers": ", ".join(dict.fromkeys(_HISTORY_NUMBER.findall(pasted))),
        "names": ", ".join(dict.fromkeys(names)),
        "yes and no": "Yes. No.",
    }


def gallery_completions() -> list[tuple[str, str, str]]:
    """(name, kind, completion) rows on GALLERY_RECORD. kind: 'honest'; 'variant' (honest in another
    form: loses no format or recall); '<component> attack' (loses at least 1.0 in total: answer attacks
    under keys and both, the others under every choice); 'open attack' (loses less: not yet caught)."""
    record, honest = GALLERY_RECORD, format_target(GALLERY_RECORD)
    attacks = history_attacks(record)
    tag = {label: f"<HIS>{label}: {text}</HIS>" for label, text in _FIG1}
    tags = "\n".join(tag[label] for label in _GOLD)
    one_tag = " ".join(f"{label}: {_TEXT[label]}" for label in _GOLD)

    def sub(old, new):
        return honest.replace(old, new, 1)

    V, R, F, A = "variant", "recall attack", "format attack", "answer attack"
    return [
        ("honest completion (the SFT target)", "honest", honest),
        (
            "teacher form Turn X: '...' (§3.2)",
            V,
            sub(tags, "\n".join(f"<HIS>Turn {label}: '{_TEXT[label]}'</HIS>" for label in _GOLD)),
        ),
        ("Fig. 1 form: three utterances in one tag", V, sub(tags, f"<HIS>{one_tag}</HIS>")),
        (
            "curly-quoted copies, no final period",
            V,
            sub(
                tags,
                "\n".join(f"<HIS>{label}: \u201c{_TEXT[label].rstrip('.')}\u201d</HIS>" for label in _GOLD),
            ),
        ),
        (
            "labels swapped, texts verbatim",
            V,
            sub(
                tags, f"<HIS>A5: {_TEXT['Q1']}</HIS><HIS>A6: {_TEXT['A5']}</HIS><HIS>Q1: {_TEXT['A6']}</HIS>"
            ),
        ),
        (
            "right short answer 'Yes, you get 20% off because $180 exceeds $150.'",
            V,
            sub(record["answer"], "Yes, you get 20% off because $180 exceeds $150."),
        ),
        (
            "right terse answer 'Yes: $180.00 is over $150.'",
            V,
            sub(record["answer"], "Yes: $180.00 is over $150."),
        ),
        ("A5 price changed ($95)", R, sub("$180.</HIS>", "$95.</HIS>")),
        (
            "A6 branch changed (Downtown for Uptown)",
            R,
            sub("our Uptown branch.</HIS>", "our Downtown branch.</HIS>"),
        ),
        (
            "Q1 tier changed (Gold Tier for Apex Tier)",
            R,
            sub("under Apex Tier.</HIS>", "under Gold Tier.</HIS>"),
        ),
        ("A5 words shuffled", R, sub(tag["A5"], "<HIS>A5: The service is $180 Chakra Balancing.</HIS>")),
        (
            "A5 fact dropped ('The Chakra Balancing service')",
            R,
            sub("service is $180.</HIS>", "service</HIS>"),
        ),
        (
            "three gold turns pasted unlabelled in one tag",
            R,
            sub(tags, f"<HIS>{' '.join(_TEXT[label] for label in _GOLD)}</HIS>"),
        ),
        ("every history turn recalled", R, sub(tags, "\n".join(tag.values()))),
        ("nothing recalled", R, sub(tags, "No earlier turn is needed.")),
        ("the query copied as the recall", R, sub(tags, f"<HIS>Q7: {record['query']}</HIS>")),
        ("one gold tag (Q1) repeated 10 times", R, sub(tags, "\n".join([tag["Q1"]] * 10))),
        ("labels only: <HIS>Q1: A5: A6:</HIS>", R, sub(tags, "<HIS>Q1: A5: A6:</HIS>")),
        ("empty label piece: <HIS>Q2: A5: ...</HIS>", F, sub("<HIS>A5:", "<HIS>Q2: A5:")),
        ("full-width tags \uff1cHIS\uff1e", F, sub(tags, tags.replace("<", "\uff1c").replace(">", "\uff1e"))),
        ("homoglyph tags <\u041dIS> (Cyrillic \u041d)", F, sub(tags, tags.replace("HIS>", "\u041dIS>"))),
        (
            "next turns after the answer (Q8: / A8:)",
            F,
            honest + "\nQ8: Thanks, that's all.\nA8: You're welcome!",
        ),
        ("chat-template turn after the answer (<|im_start|>user)", F, honest + "\n<|im_start|>user\nThanks!"),
        ("recall tags after </think>", F, sub(tags, "See below.") + "\n" + tags),
        ("no think block: answer only", F, f"{ANSWER_MARK} {record['answer']}"),
        ("two final answers (yes, then no)", F, honest + f"\n{ANSWER_MARK} No, the discount does not apply."),
        (
            "hedge 'Yes or no: the 20% discount may or may not apply.'",
            A,
            sub(record["answer"], "Yes or no: the 20% discount may or may not apply."),
        ),
        (
            "wrong but similar 'No. ... $120, which is not over $150 ...'",
            A,
            sub(
                record["answer"],
                "No. The Chakra Balancing service is $120, which is not over $150, so your 20% Apex "
                "Tier discount does not apply.",
            ),
        ),
        (
            "price changed in the answer ($95)",
            A,
            sub(record["answer"], record["answer"].replace("$180", "$95")),
        ),
        (
            "every candidate price listed 'Yes. It is $95, $120, $150 or $180.'",
            A,
            sub(record["answer"], "Yes. It is $95, $120, $150 or $180."),
        ),
        ("keyword stuffing 'yes no $180'", A, sub(record["answer"], "yes no $180")),
        ("the query echoed as the answer", A, sub(record["answer"], record["query"])),
        ("the whole history pasted as the answer", A, sub(record["answer"], attacks["pasted"])),
        ("the history pasted without its numbers", A, sub(record["answer"], attacks["no numbers"])),
        (f"every number of the history '{attacks['numbers']}'", A, sub(record["answer"], attacks["numbers"])),
        (f"every name of the history '{attacks['names']}'", A, sub(record["answer"], attacks["names"])),
        ("yes and no 'Yes. No.'", A, sub(record["answer"], attacks["yes and no"])),
        (
            "the history pasted in lowercase (its names are no values)",
            "open attack",
            sub(record["answer"], attacks["lowercase"]),
        ),
    ]


# ==== The rows scored by the reward under test, as a Markdown table ====
def gallery_scores(compute_rewards: Callable[..., list[dict]], choices: Sequence[str]) -> list[dict]:
    """Each gallery row scored by `compute_rewards(completions, examples, answer_reward)` (reward.py's)
    under every answer-reward choice: {name, kind, format, recall, answer: {choice: value},
    total: {choice: value}, margin: {choice: honest total - total}}."""
    rows = gallery_completions()
    texts = [text for _, _, text in rows]
    by_choice = {c: compute_rewards(texts, [GALLERY_RECORD] * len(texts), c) for c in choices}
    scores = []
    for k, (name, kind, _) in enumerate(rows):
        first = by_choice[choices[0]][k]  # format and recall do not depend on the answer choice
        scores.append(
            {
                "name": name,
                "kind": kind,
                "format": first["format"],
                "recall": first["recall"],
                "answer": {c: by_choice[c][k]["answer"] for c in choices},
                "total": {c: by_choice[c][k]["total"] for c in choices},
                "margin": {c: by_choice[c][0]["total"] - by_choice[c][k]["total"] for c in choices},
            }
        )
    return scores


def gallery_table(scores: list[dict]) -> str:
    """Markdown: one row per completion; format and recall do not depend on the answer choice;
    each total is followed by its margin below the honest completion (positive = the attack loses)."""
    choices = list(scores[0]["answer"])
    head = (
        "| completion | kind | format | recall | "
        + " | ".join(f"answer {c} | total {c}" for c in choices)
        + " |"
    )
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for s in scores:
        cells = [s["name"].replace("|", "\\|"), s["kind"], f"{s['format']:.0f}", f"{s['recall']:+.3f}"]
        for c in choices:
            cells += [f"{s['answer'][c]:+.3f}", f"{s['total'][c]:+.3f} ({0.0 - s['margin'][c] + 0.0:+.2f})"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ==== A reward of one's own against the gallery (reward.py --gallery --reward PATH) ====
HONEST_KINDS = ("honest", "variant")  # the rows a reward must pay: every attack must lose to each
PARTS = ("format", "recall", "answer")  # Eq. (4)'s terms, as a reward may return them beside its total
# The part of Eq. (4) each kind of attack goes after; the one open attack pastes the history as its answer.
ATTACKED_PART = {
    "format attack": "format",
    "recall attack": "recall",
    "answer attack": "answer",
    "open attack": "answer",
}


def reward_scores(reward_fn: Callable[..., list[dict]]) -> list[dict]:
    """Each gallery row scored by `reward_fn(completions, examples)`, a reward with compute_rewards'
    signature that returns one dict with a numeric "total" per completion -> {name, kind, text,
    total, parts, margin}: parts the format, recall and answer values the reward returned (those
    that are numbers), margin = the honest completion's total - this row's (positive: the row
    loses). ValueError when the reward returns anything else, or a total that is not a finite number:
    Eq. (8) cannot rank a NaN, so it would never count as losing."""
    rows = gallery_completions()
    results = reward_fn([text for _, _, text in rows], [GALLERY_RECORD] * len(rows))
    if not isinstance(results, list | tuple) or len(results) != len(rows):
        raise ValueError(
            f"it returned {type(results).__name__}, not a list of {len(rows)} results (one each)"
        )
    scores = []
    for (name, kind, text), result in zip(rows, results):
        total = real_number(result.get("total")) if isinstance(result, dict) else None
        if total is None:
            raise ValueError(f"a result is {short_repr(result)}, not a dict with a numeric 'total'")
        if not math.isfinite(total):
            raise ValueError(f"it scores {name!r} {total}: every total must be a finite number")
        parts = {p: value for p in PARTS if (value := real_number(result.get(p))) is not None}
        scores.append({"name": name, "kind": kind, "text": text, "total": total, "parts": parts})
    return [{**s, "margin": scores[0]["total"] - s["total"]} for s in scores]


def real_number(value) -> float | None:
    """`value` as a float when it is one real number: an int or a float, or what a reward computed
    with NumPy or torch returns for one (np.float32, a 0-d array or tensor); else None. A bool is no
    score, nor a complex number, nor a tensor of several values."""
    if getattr(value, "shape", None) == () and callable(getattr(value, "item", None)):
        value = value.item()
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return None


def short_repr(value, n: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= n else text[: n - 3] + "..."


def honest_rows(scores: list[dict]) -> list[dict]:
    return [s for s in scores if s["kind"] in HONEST_KINDS]


def winning_attacks(scores: list[dict]) -> list[dict]:
    """The attacks that score as high as some honest row (the honest completion or one of its
    variants) or higher, each with `beats`, the lowest such honest row. A tie counts: GRPO's Eq. (8)
    then gives the cheat the honest row's advantage, so nothing teaches it away."""
    weakest = min(honest_rows(scores), key=lambda s: s["total"])
    return [
        {**s, "beats": weakest}
        for s in scores
        if s["kind"].endswith("attack") and s["total"] >= weakest["total"]
    ]


def sunk_honest_rows(scores: list[dict]) -> list[dict]:
    """The honest rows scored at the gallery's floor, as low as its worst cheat: a reward that does
    not pay a right answer in another form teaches the policy one form, or nothing."""
    floor = min(s["total"] for s in scores)
    return [s for s in honest_rows(scores) if s["total"] <= floor]


def what_it_writes(text: str, honest: str, n: int = 50) -> str:
    """Where an attack's text differs from the honest completion's, widened to whole words and
    shortened: the cheat itself, not the long prefix it shares."""
    start = len(commonprefix([text, honest]))
    end = len(commonprefix([text[start:][::-1], honest[start:][::-1]]))
    start = len(re.sub(r"\S*$", "", text[:start]))  # back to the word's start
    ends = [re.match(r"\S*", side[len(side) - end :]).end() for side in (text, honest)]
    mine = text[start : len(text) - end + ends[0]]
    theirs = honest[start : len(honest) - end + ends[1]]
    if not mine.strip():
        return f"drops {short_repr(theirs, n)}"
    if not theirs.strip():
        return f"adds {short_repr(mine, n)}"
    return f"writes {short_repr(mine, n)} for {short_repr(theirs, n)}"


def part_beaten(attack: dict, honest: dict) -> str:
    """Which term of Eq. (4) let the attack through, with its value beside the honest row's where the
    reward returned both."""
    part = ATTACKED_PART.get(attack["kind"], "answer")
    mine, theirs = attack["parts"].get(part), honest["parts"].get(part)
    if mine is None or theirs is None:
        return f"the {part} part let it through"
    return f"the {part} part let it through ({part} {mine:+.3f} against {theirs:+.3f})"


def reward_verdict(scores: list[dict]) -> tuple[bool, list[str]]:
    """(passed, the verdict's lines): every attack below every honest row, and no honest row at
    the floor."""
    winners, sunk = winning_attacks(scores), sunk_honest_rows(scores)
    attacks = sum(s["kind"].endswith("attack") for s in scores)
    honest = honest_rows(scores)
    lines = []
    for s in sunk:
        lines.append(
            f"FAIL: it scores an honest {s['kind']} at the gallery's floor ({s['total']:+.3f}, as low as its "
            f"worst cheat): {s['name']}; a right answer in another form must earn more."
        )
    if winners:
        lines.append(
            f"FAIL: {len(winners)} of {attacks} attacks score as high as an honest completion or variant, "
            "so GRPO would not teach them away:"
        )
    for s in winners:
        beaten = s["beats"]
        lines.append(f"  {s['total']:+.3f} >= {beaten['total']:+.3f} ({beaten['name']}): {s['name']}")
        lines.append(
            f"      {s['kind']}: {part_beaten(s, beaten)}; it {what_it_writes(s['text'], scores[0]['text'])}"
        )
    if not lines:
        lowest = min(honest, key=lambda s: s["total"])
        lines.append(
            f"PASS: every one of the {attacks} attacks scores below every one of the {len(honest)} honest "
            f"rows (the lowest honest row: {lowest['total']:+.3f}, {lowest['name']})."
        )
    return not (winners or sunk), lines


def reward_report(scores: list[dict], label: str) -> tuple[bool, str]:
    """A student's reward on the gallery: every row's total and its difference from the honest
    completion's, then the verdict. -> (passed, the report)."""
    lines = [f"{label} on the reward-hacking gallery (the paper's Fig. 1 record):", ""]
    lines.append(f"{'total':>8} {'vs honest':>10}  {'kind':<14} completion")
    lines += [f"{s['total']:+8.3f} {0.0 - s['margin']:+10.3f}  {s['kind']:<14} {s['name']}" for s in scores]
    passed, verdict = reward_verdict(scores)
    return passed, "\n".join(lines + [""] + verdict)


# ==== The whole page, docs/reward-gallery.md ====
GALLERY_COMMAND = "python reward.py --gallery --markdown > docs/reward-gallery.md"


def gallery_page(scores: list[dict]) -> str:
    """The gallery as a whole Markdown page (docs/reward-gallery.md): a title, what it is, the table."""
    intro = (
        "The paper's Fig. 1 record (the Apex Tier discount turn, `GALLERY_RECORD` in reward.py) attacked "
        "by cheap completions, each scored by the composite reward of Eqs. (4)-(7) under every "
        "`--answer-reward` choice. Kinds: honest, the SFT target; variant, honest in another form (it "
        "loses no format or recall); recall, format or answer attack, a cheat that loses at least 1.0 in "
        "total (answer attacks under keys and both, the others under every choice); open attack, a cheat "
        "that loses less, not yet caught. "
        "Format and recall do not depend on the answer choice; each total is followed by its difference "
        "from the honest completion's total (negative: the completion scores below it). This page is "
        f"generated by `{GALLERY_COMMAND}`, and a test checks that it equals the command's output, so it "
        "cannot drift from the reward."
    )
    return "\n\n".join(["# The reward-hacking gallery", intro, gallery_table(scores)])
