"""The parts every domain of the synthetic corpus is built from (srt/data/synthetic.py assembles the
dialogues): the word lists the domains share, seeded draws and formats, the yes/no rules and the
draws two twin dialogues share (PairPlan), the checks that keep the gold unique, the real small
talk of the distractor rounds, and the round and query types a domain returns.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import random
import re
import string
from pathlib import Path
from typing import NamedTuple

MONTHS = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
]
CITIES = [
    "Lisbon",
    "Denver",
    "Osaka",
    "Toronto",
    "Madrid",
    "Austin",
    "Dublin",
    "Seoul",
    "Oslo",
    "Nairobi",
    "Lima",
    "Prague",
]
RECIPIENTS = [
    "my brother",
    "my sister",
    "my mum",
    "my dad",
    "a friend",
    "my neighbour",
    "my son",
    "my daughter",
]

# The derived yes/no queries: (the values the number in the query takes, the values of the policy
# the history states, whether the answer is yes). Every query value admits both answers: for each
# one some policy value gives yes and some gives no, so twin dialogues can share it (PairPlan).
RETURN_WINDOWS = [7, 10, 14, 21, 30, 45, 60, 90]  # days, drawn per dialogue
RETURN_DAYS = [d for d in range(8, 90) if d not in RETURN_WINDOWS]  # days since delivery, in the query
BAG_LIMITS_KG = [15, 18, 20, 23, 25, 28, 30, 32]  # checked-bag weight limit of the fare
BAG_WEIGHTS_KG = [w / 2 for w in range(32, 64) if w / 2 not in BAG_LIMITS_KG]  # 16 to 31.5 kg
DATA_ALLOWANCES = [3, 5, 8, 10, 15, 20, 25, 30, 40, 50, 60, 75, 100, 120, 150]  # GB a month
DATA_USAGES = [u for u in range(4, 150) if u not in DATA_ALLOWANCES]  # GB the user plans to use
YES_NO_RULES = {
    "shop": (RETURN_DAYS, RETURN_WINDOWS, lambda days, window: days <= window),
    "travel": (BAG_WEIGHTS_KG, BAG_LIMITS_KG, lambda weight, limit: weight <= limit),
    "telecom": (DATA_USAGES, DATA_ALLOWANCES, lambda use, allowance: use > allowance),
}


def _pick(rng, options):
    return options[rng.randrange(len(options))]


def _distinct(rng, draw, used: set):
    """A value from `draw(rng)` that no other fact of this dialogue holds: two facts with one
    value would make a second utterance state the answer."""
    while True:
        value = draw(rng)
        if value not in used:
            used.add(value)
            return value


def _clock(minutes: int) -> str:
    """Minutes after midnight as the corpus writes a time: "9 am", "2:45 pm", "noon"."""
    h, m = divmod(minutes, 60)
    if (h, m) == (12, 0):
        return "noon"
    return f"{h % 12 or 12}{f':{m:02d}' if m else ''} {'am' if h < 12 else 'pm'}"


def _other_time(rng, slots, slot) -> str:
    """A time of `slots` other than _clock(slot) where neither text holds the other: "10 am" is
    in "9:10 am" for `mentions`, so a stale 9:10 am would state an updated 10 am."""
    first = _clock(slot)
    apart = [t for t in slots if t != slot and not (mentions(_clock(t), first) or mentions(first, _clock(t)))]
    return _clock(_pick(rng, apart))


def _kg(weight: float) -> str:
    return f"{weight:g} kg"


def _money(amount: int) -> str:
    return f"${amount}"


class PairPlan:
    """The draws that dialogues 2k and 2k + 1 (twins) share: the domain, the length, the queries
    asked, and the number in each yes/no query, whose answer is opposite in the two. The twins
    share meta.split_group, so stage 0 puts them in one split: within every split, every query
    number of every yes/no query type comes with as many "yes" as "no" answers, and a rule that
    reads the query alone is at chance exactly, not only in expectation. Everything else (facts,
    the policy that decides the answer, wording, layout, small talk) each twin draws on its own."""

    def __init__(self, seed, index: int):
        self.rng = random.Random(f"{seed}-pair-{index // 2}")
        self.flip = index % 2 == 1
        self.group = f"synthetic-pair-{index // 2:06d}"

    def coin(self) -> bool:
        return (self.rng.random() < 0.5) != self.flip

    def yes_no(self, rng, domain):
        """(answer, query value, policy value) of the domain's yes/no query: the query value and
        the answer from the shared draws, the policy value (stated in the history) by this dialogue's
        own rng among those that give the answer."""
        query_values, policy_values, holds = YES_NO_RULES[domain]
        q = _pick(self.rng, query_values)
        answer = self.coin()
        fitting = [f for f in policy_values if holds(q, f) == answer]
        assert fitting, (domain, q, answer)  # YES_NO_RULES admits both answers for every query value
        return answer, q, _pick(rng, fitting)


# --------------------------------------------------------------------------------------------
# Unique gold: the distinctive answer keys (a digit, or a capitalised word of three letters or
# more) of a query may appear in H* only. "yes", "no", "noon" are not distinctive.
# --------------------------------------------------------------------------------------------
DISTINCTIVE = re.compile(r"\d|\b[A-Z][A-Za-z]{2,}")


def distinctive_keys(answer_keys) -> list[str]:
    return [k for k in answer_keys if DISTINCTIVE.search(k)]


def mentions(text: str, key: str) -> bool:
    """Case-insensitive, on token boundaries: "$18" is not in "$180", "5 GB" not in "15 GB"."""
    return (
        re.search(r"(?<![0-9a-z])" + re.escape(key.casefold()) + r"(?![0-9a-z])", text.casefold()) is not None
    )


def keys_outside_recall(history, recall, answer_keys) -> list[tuple[str, str]]:
    """(label, key) for every utterance outside H* that contains a distinctive answer key.
    `history` holds {"label", "text"} utterances; empty means the gold set is unique."""
    keys, gold = distinctive_keys(answer_keys), set(recall)
    return [
        (u["label"], k) for u in history if u["label"] not in gold for k in keys if mentions(u["text"], k)
    ]


# --------------------------------------------------------------------------------------------
# Real small talk: whole short exchanges (one message group and the other speaker's reply) from
# chitchat-dataset, filtered for length, plain English text and nothing offensive.
# --------------------------------------------------------------------------------------------
OFFENSIVE = re.compile(
    r"\b(?:fuck\w*|shit\w*|bitch\w*|damn\w*|crap\w*|ass|asses|asshole\w*|dick\w*|sex\w*|porn\w*|wtf"
    r"|stfu|piss\w*|bastard\w*|slut\w*|whore\w*|cunt\w*|nigg\w*|fag\w*|retard\w*|rape\w*|kill\w*"
    r"|suicid\w*|drunk\w*|weed|boobs?|nude\w*|naked|hooker\w*|gun\w*|drugs?)\b",
    re.I,
)
# The same words, and anything that looks like a label, matched in lower-cased ASCII text: for ASCII,
# lower() then a case-sensitive pattern is what re.I does, at a third of the time.
_OFFENSIVE_LOWER = re.compile(OFFENSIVE.pattern)
_LABEL_LIKE_LOWER = re.compile(r"http|www\.|@|<|>|\b[qa]\d+\b|answer:")
ENGLISH_WORDS = {
    "the",
    "i",
    "you",
    "a",
    "to",
    "and",
    "is",
    "it",
    "that",
    "of",
    "in",
    "my",
    "what",
    "do",
    "have",
    "so",
    "for",
    "was",
    "are",
    "me",
    "but",
    "be",
    "like",
    "how",
    "that's",
    "i'm",
    "it's",
    "your",
}
SMALL_TALK_WORDS = (4, 20)  # words per utterance: no "lol", no paragraphs


_LETTERS_AND_SPACE = str.maketrans("", "", string.ascii_letters + " ")


def _plain_english(text: str) -> bool:
    # str methods rather than loops over characters: stage 0 reads about 140,000 messages here. For
    # printable ASCII, isalpha() is exactly the ASCII letters: translate() deletes them and the
    # spaces, and what remains must be at most a fifth of the text.
    words = text.split()
    return (
        SMALL_TALK_WORDS[0] <= len(words) <= SMALL_TALK_WORDS[1]
        and len(text) <= 120
        and text.isascii()
        and text.isprintable()  # with isascii: every character in 32..126
        and len(text) - len(text.translate(_LETTERS_AND_SPACE)) >= 0.8 * len(text)
        and max(len(w) for w in words) <= 18
        and any(w.lower().strip(".,!?") in ENGLISH_WORDS for w in words)
        and not _OFFENSIVE_LOWER.search(lower := text.lower())
        and not _LABEL_LIKE_LOWER.search(lower)
    )  # nothing that looks like a label


@functools.lru_cache(maxsize=1)
def small_talk_exchanges() -> tuple[tuple[str, str], ...]:
    """Every usable (user line, reply) pair of chitchat-dataset, in a fixed order. The opening
    group of each conversation is skipped: greetings would repeat across thousands of dialogues."""
    spec = importlib.util.find_spec("chitchat_dataset")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the synthetic corpus needs the chitchat-dataset package: pip install chitchat-dataset==0.9.0"
        )
    conversations = json.loads((Path(spec.origin).parent / "dataset.json").read_text(encoding="utf-8"))
    pairs, seen = [], set()
    for conversation_id in sorted(conversations):
        groups = conversations[conversation_id]["messages"]
        texts = [" ".join(" ".join(m["text"].split()) for m in group) for group in groups]
        for i in range(1, len(groups) - 1):
            if groups[i][0]["sender"] == groups[i + 1][0]["sender"]:
                continue
            pair = (texts[i], texts[i + 1])
            if (
                pair[0] not in seen
                and pair[1] not in seen
                and _plain_english(pair[0])
                and _plain_english(pair[1])
            ):
                seen.update(pair)
                pairs.append(pair)
    return tuple(pairs)


# --------------------------------------------------------------------------------------------
# What a domain returns. draw_domain(rng, pair) of each synthetic_<domain>.py gives (name, state,
# facts, updates, queries, self_contained, services, protected): fact rounds, updates of facts,
# query specs, the queries that need no history (SelfContained), general service exchanges
# (question, answer) that serve as distractor rounds, and the distinctive values of this dialogue
# that no distractor may mention. `pair` holds the draws a dialogue shares with its twin (PairPlan).
# --------------------------------------------------------------------------------------------
class Round:
    """One round: the user's Q_i, the assistant's A_i, the facts it states ({key: "Q" | "A"}), and
    an optional state change applied when the round is laid out (a knowledge update)."""

    def __init__(self, user, assistant, provides=None, apply=None, kind="fact"):
        self.user, self.assistant, self.kind = user, assistant, kind
        self.provides, self.apply = provides or {}, apply


class QueryRound(NamedTuple):
    """A query round as it is asked, with its ground truth: the user's question Q_t, the reference
    answer A*_t, its answer keys, the analysis and the reasoning step of Z_t, and whether the answer
    is a yes/no derived from the recalled facts (not stated in any of them)."""

    query: str
    answer: str
    answer_keys: list[str]
    analysis: str
    reasoning: str
    derived_yes_no: bool


class QuerySpec:
    """A query that needs the facts `needs`; `make(state)` returns its QueryRound, built from the
    state at the moment it is asked. `topic` names what it asks about without a value; `related`
    are (user, assistant) remarks about the same entity that state none of its facts."""

    def __init__(self, kind, needs, topic, make, related=()):
        self.kind, self.needs, self.topic, self.make, self.related = kind, needs, topic, make, list(related)


class SelfContained:
    """A query that needs no history (query type "none"): `make(rng)` draws its numbers and its
    wording and returns its QueryRound, whose answer follows from the query alone (a total, a
    remainder, a sale price, a finishing time). Nothing is a fixed sentence that a lookup in other
    dialogues could answer. `topic` and `related` as in QuerySpec."""

    def __init__(self, topic, make, related):
        self.topic, self.make, self.related = topic, make, list(related)


def _self_contained(analysis, reasoning, query, answer, keys):
    return QueryRound(
        query=query,
        answer=answer,
        answer_keys=keys,
        analysis=analysis,
        reasoning=f"{reasoning} The question gives every number it needs; nothing from earlier in the "
        "conversation is needed.",
        derived_yes_no=False,
    )
