"""The synthetic corpus: the embedded default data of stage 0 (SRQA, the paper's set, is not public).

A dialogue is a list of rounds (user utterance Q_i, assistant utterance A_i) in one of four
customer-service domains. Fact rounds (a membership tier, discount rules, prices, who performs
what where, order numbers, dates, addresses, codes) sit at random positions and in random order
among distractor rounds; some facts are updated later (the newer value is right); same-entity
confusers stand beside them (two services and two prices, two tiers in one rule, a second
therapist); the queries at the end need one, two or three facts combined, or none at all. Each
query round carries its ground truth (H*, Z, A*, answer_keys) under "gold", which stage 0's
oracle teacher serves.

What makes the task honest:
- Unique gold: no utterance outside H* states a fact the answer needs. Every value that can be an
  answer key is drawn distinct within its dialogue, a template states it in one utterance only,
  queries in one dialogue never share a fact, and no distractor mentions it.
  `keys_outside_recall` is the check; tests run it on every generated query.
- No position or template shortcut: fact positions and order are random, so no gold label set
  dominates a query type.
- Yes/no queries need the recalled facts: the policy that decides them (a return window, a bag
  weight limit, a data allowance, a tier's discount threshold) is drawn per dialogue and stated in
  its history. Dialogues come in twins (2k, 2k + 1; PairPlan) that share their domain, length,
  queries and the number in each yes/no query, with opposite answers, and stay in one split
  (meta.split_group): within every split each query number comes with as many "yes" as "no", so a
  rule that reads the query alone is at chance exactly. Every query number admits both answers
  (YES_NO_RULES): the old generator's 5-day returns were always "yes", 91 days always "no".
- No lookups: a query that needs no history ("none") is self-contained and varied. Its
  numbers are drawn at random and its answer follows from them ("If I book 3 Thai Massage sessions
  at $85 each, what do I pay in all?" -> "$255"), not a fixed sentence that the same question in
  train would give away. Query openers and closers, entities in the questions and values drawn
  from wide ranges make a test query and its answer, word for word, all but absent from train;
  stage 0's lookup checks count what remains (stats.json "lookup_checks").
- Real distractors: most filler rounds are whole short exchanges of real human small talk from
  the chitchat-dataset package (about 7,000 conversations, MIT); "related" rounds that talk about
  the queried entity without stating the fact sit shortly before a query, so that Eq. (2) keeps
  distractors in the pruned history the way real data does.

The output is the raw dialogue format stage0_build.py reads from every source:
    {"id", "source": "synthetic", "domain", "meta": {"split_group"},
     "rounds": [{"user", "assistant", "kind", "gold"?}, ...]}

    generate_synthetic(num_dialogues, seed) -> list of dialogues (same seed, same bytes)
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

NAMES = [
    "Lena",
    "Marco",
    "Priya",
    "Jonas",
    "Aiko",
    "Sofia",
    "Tomas",
    "Nadia",
    "Ravi",
    "Elena",
    "Omar",
    "Greta",
    "Mateo",
    "Ingrid",
    "Kofi",
    "Yara",
    "Dmitri",
    "Leila",
    "Hugo",
    "Amara",
    "Farah",
    "Bruno",
    "Keiko",
    "Anders",
    "Zainab",
    "Luca",
    "Mira",
    "Tariq",
    "Celine",
    "Viktor",
    "Noor",
    "Emil",
]
BRANCHES = [
    "Uptown",
    "Downtown",
    "Riverside",
    "Lakeside",
    "Midtown",
    "Harbor",
    "Westgate",
    "Hillcrest",
    "Northgate",
    "Bayview",
]
TIERS = ["Apex", "Gold", "Silver", "Platinum", "Emerald", "Summit", "Azure", "Onyx"]
SERVICES = [
    "Chakra Balancing",
    "Deep Tissue Massage",
    "Hot Stone Therapy",
    "Aromatherapy Facial",
    "Reflexology Session",
    "Hydra Glow Facial",
    "Bamboo Massage",
    "Salt Scrub Ritual",
    "Lymphatic Drainage",
    "Thai Massage",
    "Seaweed Wrap",
    "Cupping Therapy",
]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
SPA_SLOTS = range(9 * 60, 18 * 60, 15)  # appointment start times, minutes after midnight
FLIGHT_SLOTS = range(6 * 60, 22 * 60, 5)  # departure times
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
ITEMS = [
    "wireless headphones",
    "coffee grinder",
    "yoga mat",
    "desk lamp",
    "hiking backpack",
    "blender",
    "smartwatch",
    "rain jacket",
    "air fryer",
    "bookshelf",
    "espresso machine",
    "standing desk",
    "robot vacuum",
    "electric kettle",
    "office chair",
    "camping tent",
]
STREETS = ["Maple", "Cedar", "Harbor", "Elm", "Willow", "Sunset", "Oak", "Lincoln", "Park", "River"]
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
HOTELS = [
    "Grand Harbor Hotel",
    "Maple Inn",
    "Sunset Suites",
    "Blue Lagoon Resort",
    "City Loft Hotel",
    "Alpine Lodge",
    "Old Mill Hotel",
    "Riverview Inn",
]
PLANS = [
    "Unlimited Plus",
    "Basic Talk",
    "Family Share",
    "Value Saver",
    "Premium Max",
    "Starter Lite",
    "Data Flex",
    "Student Saver",
    "Global Roam",
    "Smart Choice",
    "Everyday Plus",
    "Talk and Text",
]
WHEN = [  # when a user might come back: context in a query that changes nothing in its answer
    "next week",
    "next month",
    "for my birthday",
    "before my holiday",
    "with my partner",
    "after work one day",
    "on a weekend",
    "in the spring",
    "for my anniversary",
    "with my mother",
    "before a wedding",
    "after my exams",
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
DEVICES = ["tablet", "laptop", "phone", "smart TV", "hotspot", "kid's phone", "car's wifi", "watch"]
BAGS = [
    "suitcase",
    "duffel bag",
    "ski bag",
    "hard case",
    "travel backpack",
    "golf bag",
    "trunk",
    "surfboard bag",
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
# The domains. Each returns (name, state, facts, updates, queries, self_contained, services,
# protected): fact rounds, updates of facts, query specs, the queries that need no history
# (SelfContained), general service exchanges (question, answer) that serve as distractor rounds,
# and the distinctive values of this dialogue that no distractor may mention. `plan` holds the
# draws a dialogue shares with its twin (PairPlan).
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


def _spa(rng, pair):
    used = set()
    tier, other_tier = rng.sample(TIERS, 2)
    pct, other_pct = rng.sample([10, 15, 20, 25, 30], 2)
    threshold, other_threshold = rng.sample([100, 120, 150, 200], 2)
    used |= {threshold, other_threshold}
    service_a, service_b = rng.sample(SERVICES, 2)
    # the discount query is a fair coin (opposite in the twin); the price lands on the side of the
    # threshold it says
    applies = pair.coin()
    price_a = _distinct(
        rng,
        lambda r: (
            r.randrange(threshold + 5, threshold + 120, 5)
            if applies
            else r.randrange(max(40, threshold - 90), threshold, 5)
        ),
        used,
    )
    price_b = _distinct(rng, lambda r: r.randrange(40, 320, 5), used)
    therapist, therapist_b = rng.sample(NAMES, 2)
    branch = _pick(rng, BRANCHES)
    slot = _pick(rng, SPA_SLOTS)
    s = {"day": _pick(rng, DAYS), "time": _clock(slot)}
    new_day, new_time = (
        _pick(rng, [d for d in DAYS if d != s["day"]]),
        _other_time(rng, SPA_SLOTS, slot),
    )
    rules = [
        f"{tier} Tier gives {pct}% off any service over ${threshold}",
        f"{other_tier} Tier gives {other_pct}% off services over ${other_threshold}",
    ]
    rng.shuffle(rules)
    facts = [
        Round(
            _pick(
                rng,
                [
                    f"I need to check my membership status. I'm under {tier} Tier.",
                    f"Hi, I'm {'an' if tier[0] in 'AEIOU' else 'a'} {tier} Tier member and want to "
                    "book something.",
                    f"Hello! My membership level is {tier} Tier.",
                    f"Just so you know, I hold a {tier} Tier membership.",
                ],
            ),
            _pick(
                rng,
                [
                    "Welcome back. I can confirm your membership.",
                    "Thanks, your membership is confirmed.",
                    "Great, I have found your member profile.",
                    "Lovely, your membership shows as active.",
                ],
            ),
            {"tier": "Q"},
        ),
        Round(
            _pick(
                rng,
                [
                    "How do the member discounts work?",
                    "What do the different tiers get?",
                    "Do members get any discount on treatments?",
                    "Can you explain the tier discounts?",
                ],
            ),
            _pick(
                rng,
                [
                    f"{rules[0]}, and {rules[1]}.",
                    f"Two tiers have discounts: {rules[0]}; {rules[1]}.",
                    f"It depends on the tier. {rules[0]}. {rules[1]}.",
                ],
            ),
            {"rule": "A"},
        ),
        Round(
            _pick(
                rng,
                [
                    f"How much is the {service_a}?",
                    f"What does the {service_a} cost?",
                    f"Could you tell me the price of the {service_a}?",
                ],
            ),
            _pick(
                rng,
                [
                    f"The {service_a} is ${price_a}.",
                    f"The {service_a} costs ${price_a}.",
                    f"Our {service_a} is priced at ${price_a}.",
                ],
            ),
            {"price_a": "A"},
        ),
        Round(
            _pick(
                rng,
                [
                    f"And the {service_b}?",
                    f"What about the {service_b}, how much is that?",
                    f"Is the {service_b} more expensive?",
                ],
            ),
            _pick(
                rng,
                [
                    f"The {service_b} is ${price_b}.",
                    f"The {service_b} costs ${price_b}.",
                    f"We charge ${price_b} for the {service_b}.",
                ],
            ),
            {"price_b": "A"},
        ),
        Round(
            _pick(
                rng,
                [
                    f"Who performs the {service_a}?",
                    f"Which therapist does the {service_a}?",
                    f"Is there a specialist for the {service_a}?",
                ],
            ),
            _pick(
                rng,
                [
                    f"Our senior therapist, {therapist}, is the specialist for the {service_a}.",
                    f"{therapist} performs the {service_a}; they designed that treatment.",
                    f"That would be {therapist}, our {service_a} specialist.",
                ],
            ),
            {"therapist": "A"},
        ),
        Round(
            _pick(rng, [f"Who does the {service_b}?", f"Is the {service_b} done by someone else?"]),
            _pick(
                rng, [f"{therapist_b} handles the {service_b}.", f"The {service_b} is done by {therapist_b}."]
            ),
            {"therapist_b": "A"},
        ),
        Round(
            _pick(
                rng,
                [
                    "Where would my treatment take place?",
                    "Which of your locations would I go to?",
                    "Where is the treatment done?",
                ],
            ),
            _pick(
                rng,
                [
                    f"{therapist} only works at our {branch} branch, so it would be there.",
                    f"{therapist} is based at the {branch} branch.",
                    f"You'd see {therapist} at our {branch} location.",
                ],
            ),
            {"branch": "A"},
        ),
        Round(
            _pick(
                rng,
                [
                    f"Can I book the {service_a} this week?",
                    "Could you put me down for an appointment?",
                    f"I'd like to schedule the {service_a}, please.",
                ],
            ),
            _pick(
                rng,
                [
                    f"Done, you're booked for {s['day']} at {s['time']}.",
                    f"Your appointment is set for {s['day']} at {s['time']}.",
                ],
            ),
            {"appointment": "A"},
        ),
    ]
    updates = {
        "appointment": Round(
            _pick(
                rng,
                [
                    "Actually, something came up. Could we move my appointment?",
                    "Can I switch my appointment to another slot?",
                    "I need to reschedule, sorry.",
                ],
            ),
            _pick(
                rng,
                [
                    f"No problem, your appointment is now {new_day} at {new_time}.",
                    f"I've moved you to {new_day} at {new_time}.",
                ],
            ),
            {"appointment": "A"},
            apply=lambda st: st.update(day=new_day, time=new_time),
            kind="update",
        )
    }

    def discount(st):
        verdict = (
            f"Yes. The {service_a} is ${price_a}, which is over ${threshold}, so your {pct}% "
            f"{tier} Tier discount applies."
            if applies
            else f"No. The {service_a} is ${price_a}, which is not over ${threshold}, so your "
            f"{pct}% {tier} Tier discount does not apply."
        )
        return QueryRound(
            query=_pick(
                rng,
                [
                    f"For that {service_a} booking, will my discount apply?",
                    f"Great. So will my member discount work on the {service_a}?",
                    f"Do I get my tier discount on the {service_a}?",
                    f"Would my membership knock anything off the {service_a}?",
                ],
            ),
            answer=verdict,
            answer_keys=["yes" if applies else "no", f"${price_a}"],
            analysis=f"whether their membership discount applies to the {service_a}",
            reasoning=f"The user is {tier} Tier; that tier gives {pct}% off services over ${threshold}. "
            f"The {service_a} costs ${price_a}, which is {'over' if applies else 'not over'} ${threshold}, "
            f"so the discount {'applies' if applies else 'does not apply'}.",
            derived_yes_no=True,
        )

    def cheaper(st):
        name, price = (service_a, price_a) if price_a < price_b else (service_b, price_b)
        return QueryRound(
            query=_pick(
                rng,
                [
                    f"Which is cheaper, the {service_a} or the {service_b}?",
                    f"Between the {service_a} and the {service_b}, which costs less?",
                    f"Is the {service_a} or the {service_b} the less expensive one?",
                ],
            ),
            answer=_pick(rng, [f"The {name} is cheaper, at ${price}.", f"The {name}: it's ${price}."]),
            answer_keys=[f"${price}"],
            analysis="which of the two services costs less",
            reasoning=f"The {service_a} costs ${price_a} and the {service_b} costs ${price_b}, so "
            f"the {name} is cheaper.",
            derived_yes_no=False,
        )

    about_a = [
        (
            f"My sister tried the {service_a} last month and loved it.",
            f"The {service_a} is one of our favourites.",
        ),
        (
            f"I've been curious about the {service_a} for a while.",
            f"Many guests come back for the {service_a}.",
        ),
        (f"Is the {service_a} relaxing?", f"Most guests find the {service_a} very relaxing."),
    ]

    def ask_price_a(st):
        return QueryRound(
            query=_pick(
                rng,
                [
                    f"Remind me, how much was the {service_a}?",
                    f"What was the price of the {service_a} again?",
                    f"Sorry, what did you say the {service_a} costs?",
                    f"How much did you say the {service_a} was?",
                    f"I'd like the {service_a} {_pick(rng, WHEN)}. What does it cost?",
                    f"If I book the {service_a} {_pick(rng, WHEN)}, what will I pay?",
                ],
            ),
            answer=_pick(
                rng,
                [
                    f"The {service_a} is ${price_a}.",
                    f"The {service_a} costs ${price_a}.",
                    f"It's ${price_a} for the {service_a}.",
                ],
            ),
            answer_keys=[f"${price_a}"],
            analysis=f"for the price of the {service_a}",
            reasoning=f"The price was stated earlier: the {service_a} is ${price_a}.",
            derived_yes_no=False,
        )

    def ask_therapist_and_branch(st):
        return QueryRound(
            query=_pick(
                rng,
                [
                    f"So who would do my {service_a}, and where?",
                    f"Who am I seeing for the {service_a}, and at which branch?",
                    f"Which therapist does my {service_a}, and at which location?",
                    f"Remind me who does the {service_a} and where I should go?",
                    f"If I book the {service_a} {_pick(rng, WHEN)}, who do I see and where?",
                    f"I'll come in for the {service_a} {_pick(rng, WHEN)}. Who does it, and at which branch?",
                ],
            ),
            answer=_pick(
                rng,
                [
                    f"{therapist} performs it, at the {branch} branch.",
                    f"You'd see {therapist} at our {branch} branch.",
                    f"{therapist} does the {service_a}, at the {branch} location.",
                ],
            ),
            answer_keys=[therapist, branch],
            analysis=f"who performs the {service_a} and at which branch",
            reasoning=f"{therapist} is the {service_a} specialist and works at the {branch} branch.",
            derived_yes_no=False,
        )

    def ask_appointment(st):
        return QueryRound(
            query=_pick(
                rng,
                [
                    "What time is my appointment again?",
                    "When am I booked in?",
                    "Can you confirm my appointment time?",
                    "When is my appointment now?",
                    "What day and time am I booked for?",
                    "So when should I come in for my appointment?",
                    "Which day was my appointment, and at what time?",
                    "I need to put my appointment in my calendar. When is it?",
                ],
            ),
            answer=_pick(
                rng,
                [
                    f"Your appointment is on {st['day']} at {st['time']}.",
                    f"You're booked for {st['day']} at {st['time']}.",
                    f"You're seeing us on {st['day']} at {st['time']}.",
                    f"It's {st['day']} at {st['time']}.",
                    f"We have you down for {st['day']} at {st['time']}.",
                ],
            ),
            answer_keys=[st["day"], st["time"]],
            analysis="for the current appointment time",
            reasoning=f"The most recent booking says {st['day']} at {st['time']}; a later change "
            "overrides an earlier one.",
            derived_yes_no=False,
        )

    def ask_therapist_b(st):
        when = _pick(rng, WHEN)
        return QueryRound(
            query=_pick(
                rng,
                [
                    f"Who was it that does the {service_b}?",
                    f"Remind me who performs the {service_b}?",
                    f"Which therapist did you say does the {service_b}?",
                    f"Who would I see for the {service_b}?",
                    f"If I come back {when} for the {service_b}, who would do it?",
                    f"I might book the {service_b} {when}. Who performs it?",
                    f"I'd like the {service_b} {when}. Who would I be seeing?",
                ],
            ),
            answer=_pick(
                rng,
                [
                    f"{therapist_b} does the {service_b}.",
                    f"The {service_b} is done by {therapist_b}.",
                    f"That's {therapist_b}, who does the {service_b}.",
                ],
            ),
            answer_keys=[therapist_b],
            analysis=f"who performs the {service_b}",
            reasoning=f"Earlier I said the {service_b} is done by {therapist_b}.",
            derived_yes_no=False,
        )

    queries = [
        QuerySpec(
            "single",
            ["price_a"],
            f"the price of the {service_a}",
            ask_price_a,
            about_a,
        ),
        QuerySpec(
            "pair",
            ["therapist", "branch"],
            f"who does the {service_a} and where",
            ask_therapist_and_branch,
            about_a,
        ),
        QuerySpec(
            "triple",
            ["tier", "rule", "price_a"],
            f"your member discount on the {service_a}",
            discount,
            [
                ("I love getting a good deal on treatments.", "Our members do save quite a bit over a year."),
                (
                    f"I'm trying to keep the {service_a} within my budget.",
                    "That makes sense; treatments add up.",
                ),
            ],
        ),
        QuerySpec(
            "update",
            ["appointment"],
            "your appointment time",
            ask_appointment,
            [
                ("I keep forgetting my appointments lately.", "A reminder on your phone can help with that."),
                (
                    "My calendar is a mess this week.",
                    "Busy weeks happen; we can help keep track of your booking.",
                ),
            ],
        ),
        QuerySpec(
            "pair",
            ["price_a", "price_b"],
            f"the prices of the {service_a} and the {service_b}",
            cheaper,
            [
                (
                    f"I can't decide between the {service_a} and the {service_b}.",
                    "Both are popular choices with our guests.",
                )
            ],
        ),
        QuerySpec(
            "single",
            ["therapist_b"],
            f"who does the {service_b}",
            ask_therapist_b,
            [(f"A friend recommended the {service_b} to me.", f"The {service_b} has lovely reviews.")],
        ),
    ]
    services = [
        ("Do you sell gift cards?", "Yes, gift cards are available at the front desk in any amount."),
        ("What are your opening hours?", "We are open from early morning until late every day."),
        ("Is there parking nearby?", "Yes, every branch has free parking for guests."),
        ("Do I need to bring anything to a session?", "No, we provide robes, towels and slippers."),
        ("Can I bring a friend along?", "Yes, we have couple rooms if you book them ahead."),
        ("Do you sell the oils you use?", "Yes, our oils are on sale at the reception desk."),
    ]

    def sessions_total(r):
        service, n, price = _pick(r, SERVICES), r.randrange(2, 7), r.randrange(40, 200, 5)
        total = n * price
        return _self_contained(
            f"what {n} sessions at ${price} each cost in all",
            f"{n} sessions at ${price} each: {n} x ${price} = ${total}.",
            _pick(
                r,
                [
                    f"If I book {n} {service} sessions at ${price} each, what do I pay in all?",
                    f"What would {n} sessions of the {service} come to at ${price} a session?",
                    f"Say I buy a pack of {n} {service} sessions at ${price} each. What's the total?",
                ],
            ),
            _pick(
                r,
                [
                    f"{n} sessions at ${price} each come to ${total} in all.",
                    f"That would be ${total}: {n} sessions at ${price} each.",
                ],
            ),
            [f"${total}"],
        )

    def tip(r):
        service, pct = _pick(r, SERVICES), _pick(r, [10, 15, 20, 25])
        price = r.randrange(40, 300, 10 if pct in (10, 20) else 20)
        amount = price * pct // 100
        return _self_contained(
            f"how much a {pct}% tip on ${price} is",
            f"{pct}% of ${price} is ${amount}.",
            _pick(
                r,
                [
                    f"I'd like to leave a {pct}% tip on my ${price} {service}. How much is that?",
                    f"What's a {pct}% tip on a ${price} {service}?",
                    f"How much should I add for a {pct}% tip on the ${price} {service}?",
                ],
            ),
            _pick(
                r,
                [
                    f"A {pct}% tip on ${price} is ${amount}.",
                    f"That's ${amount}, which is {pct}% of ${price}.",
                ],
            ),
            [f"${amount}"],
        )

    def gift_card_left(r):
        service, card = _pick(r, SERVICES), _pick(r, [50, 75, 100, 120, 150, 200, 250, 300])
        price = r.randrange(25, card, 5)
        left = card - price
        return _self_contained(
            f"what is left on a ${card} gift card after a ${price} treatment",
            f"${card} - ${price} = ${left}.",
            _pick(
                r,
                [
                    f"I have a ${card} gift card. If I use it for the {service} at ${price}, what's left "
                    "on it?",
                    f"How much would remain on my ${card} gift card after a ${price} {service}?",
                ],
            ),
            _pick(
                r,
                [
                    f"${left} would be left on the card.",
                    f"After the ${price} {service}, ${left} remains on your ${card} card.",
                ],
            ),
            [f"${left}"],
        )

    def finish_time(r):
        service, minutes, start = _pick(r, SERVICES), _pick(r, [30, 45, 60, 75, 90, 120]), _pick(r, SPA_SLOTS)
        begin, end = _clock(start), _clock(start + minutes)
        return _self_contained(
            f"when a {minutes}-minute treatment that starts at {begin} finishes",
            f"{begin} plus {minutes} minutes is {end}.",
            _pick(
                r,
                [
                    f"If my {minutes}-minute {service} starts at {begin}, when will it finish?",
                    f"I'm booked for a {minutes}-minute {service} at {begin}. What time will I be done?",
                ],
            ),
            _pick(
                r, [f"It would finish at {end}.", f"A {minutes}-minute session from {begin} ends at {end}."]
            ),
            [end],
        )

    self_contained = [
        SelfContained(
            "the total for several sessions of a treatment",
            sessions_total,
            [
                ("I'm thinking about booking several sessions this season.", "A course works really well."),
                ("I want to treat myself to a few sessions this year.", "You deserve a bit of pampering."),
            ],
        ),
        SelfContained(
            "how much to tip on a treatment",
            tip,
            [("I never know how much to tip for a treatment.", "Lots of guests wonder about that.")],
        ),
        SelfContained(
            "what is left on a gift card after a treatment",
            gift_card_left,
            [("Someone gave me a spa gift card for my birthday.", "What a lovely present.")],
        ),
        SelfContained(
            "what time a treatment finishes",
            finish_time,
            [("I need to know when my treatment will be done.", "We'll make sure you're not late.")],
        ),
    ]
    protected = [f"${p}" for p in (price_a, price_b)] + [
        therapist,
        therapist_b,
        branch,
        s["day"],
        s["time"],
        new_day,
        new_time,
    ]
    return "spa", s, facts, updates, queries, self_contained, services, protected


def _shop(rng, pair):
    used = set()
    order = str(rng.randrange(10000, 99999))
    item_a, item_b = rng.sample(ITEMS, 2)
    price_a = _distinct(rng, lambda r: r.randrange(15, 400), used)
    price_b = _distinct(rng, lambda r: r.randrange(15, 400), used)
    address = f"{rng.randrange(2, 999)} {_pick(rng, STREETS)} Street, {_pick(rng, CITIES)}"
    ok, days_since, window = pair.yes_no(rng, "shop")
    s = {"date": f"{_pick(rng, MONTHS)} {rng.randrange(1, 29)}"}
    new_date = _distinct(rng, lambda r: f"{_pick(r, MONTHS)} {r.randrange(1, 29)}", {s["date"]})
    facts = [
        Round(
            _pick(
                rng,
                [
                    f"Hi, I'm calling about order #{order}.",
                    f"My order number is {order}.",
                    f"Hello, I have a question about my order, number {order}.",
                ],
            ),
            _pick(
                rng,
                [
                    "Thanks, I've pulled up your order.",
                    "Sure, I have the order in front of me.",
                    "Got it, the order is open on my screen.",
                    "Thank you, I can see that order now.",
                ],
            ),
            {"order": "Q"},
        ),
        Round(
            _pick(
                rng,
                [
                    f"I bought the {item_a} for ${price_a}.",
                    f"It has the {item_a}, which was ${price_a}.",
                    f"The {item_a} I paid ${price_a} for is on it.",
                ],
            ),
            _pick(
                rng,
                [
                    f"I see the {item_a} on the order.",
                    f"Yes, the {item_a} is listed.",
                    f"Right, the {item_a} is there.",
                ],
            ),
            {"price_a": "Q"},
        ),
        Round(
            _pick(
                rng,
                [
                    f"There's also a {item_b} at ${price_b} on it.",
                    f"I also added the {item_b} for ${price_b}.",
                ],
            ),
            _pick(rng, [f"Yes, the {item_b} is on the same order.", f"I see the {item_b} as well."]),
            {"price_b": "Q"},
        ),
        Round(
            _pick(
                rng,
                [
                    "Where is it being shipped?",
                    "Can you confirm the delivery address?",
                    "Which address do you have for delivery?",
                ],
            ),
            _pick(rng, [f"It's shipping to {address}.", f"The delivery address on file is {address}."]),
            {"address": "A"},
        ),
        Round(
            _pick(
                rng, ["When should it arrive?", "What's the delivery date?", "When can I expect the package?"]
            ),
            _pick(rng, [f"It is scheduled to arrive on {s['date']}.", f"Expected delivery is {s['date']}."]),
            {"delivery": "A"},
        ),
        Round(
            _pick(
                rng,
                [
                    "What's your return policy?",
                    "How long do I have to return something?",
                    f"If the {item_a} doesn't work out, can I send it back?",
                ],
            ),
            _pick(
                rng,
                [
                    f"You can return items within {window} days of delivery for a full refund.",
                    f"Returns are accepted up to {window} days after delivery, with a full refund.",
                ],
            ),
            {"window": "A"},
        ),
    ]
    updates = {
        "delivery": Round(
            _pick(rng, ["Is there any update on the shipment?", "Has anything changed with the delivery?"]),
            _pick(
                rng,
                [
                    f"Yes, the carrier moved your delivery to {new_date}.",
                    f"Update: it will now arrive on {new_date}.",
                ],
            ),
            {"delivery": "A"},
            apply=lambda st: st.update(date=new_date),
            kind="update",
        )
    }

    def can_return(st):
        answer = (
            f"Yes. {days_since} days is within the {window}-day window, so you would get back ${price_a}."
            if ok
            else f"No. {days_since} days is past the {window}-day return window, so the ${price_a} "
            "cannot be refunded."
        )
        return QueryRound(
            query=_pick(
                rng,
                [
                    f"It's been {days_since} days since delivery. Can I still return the {item_a} "
                    "for a full refund?",
                    f"If I send the {item_a} back now, {days_since} days after delivery, do I get "
                    "my money back?",
                    f"The {item_a} arrived {days_since} days ago. Can I still send it back for a refund?",
                ],
            ),
            answer=answer,
            answer_keys=["yes" if ok else "no", f"${price_a}"],
            analysis=f"whether the {item_a} can still be returned for a refund",
            reasoning=f"The return window is {window} days and it has been {days_since} days; the "
            f"{item_a} cost ${price_a}.",
            derived_yes_no=True,
        )

    about_order = [
        ("I've been waiting for this package all week.", "I understand, waiting is never fun."),
        ("This is the first time I've ordered from you.", "Thanks for choosing us for your order."),
    ]

    def ask_order(st):
        return QueryRound(
            query=_pick(rng, ["What was my order number again?", "Can you remind me of my order number?"]),
            answer=f"Your order number is {order}.",
            answer_keys=[order],
            analysis="for their order number",
            reasoning=f"The user gave the order number earlier: {order}.",
            derived_yes_no=False,
        )

    def ask_address(st):
        return QueryRound(
            query=_pick(rng, ["Where is the package going?", "Which address will it be delivered to?"]),
            answer=f"It is going to {address}.",
            answer_keys=[address],
            analysis="for the delivery address",
            reasoning=f"The delivery address on file is {address}.",
            derived_yes_no=False,
        )

    def ask_delivery(st):
        return QueryRound(
            query=_pick(
                rng,
                [
                    "So when will it arrive?",
                    "What's the latest delivery date?",
                    "When will my package get here, then?",
                    "So what day does the delivery come?",
                    "When can I expect the package now?",
                    "I need to be home for the delivery. Which day is it?",
                    "What date is the delivery set for now?",
                ],
            ),
            answer=_pick(
                rng,
                [
                    f"It should arrive on {st['date']}.",
                    f"The latest delivery date is {st['date']}.",
                    f"Your package is now due on {st['date']}.",
                    f"Delivery is set for {st['date']}.",
                    f"Expect it on {st['date']}.",
                ],
            ),
            answer_keys=[st["date"]],
            analysis="for the current delivery date",
            reasoning=f"The latest delivery date given is {st['date']}; it replaces any earlier date.",
            derived_yes_no=False,
        )

    def ask_order_and_address(st):
        return QueryRound(
            query=_pick(
                rng,
                [
                    "For my records, what's the order number and where is it shipping?",
                    "Can you confirm both the order number and the address?",
                ],
            ),
            answer=f"Order {order} is shipping to {address}.",
            answer_keys=[order, address],
            analysis="for the order number and the shipping address",
            reasoning=f"The order number is {order} and the address on file is {address}.",
            derived_yes_no=False,
        )

    def ask_price_b(st):
        return QueryRound(
            query=_pick(
                rng,
                [
                    f"How much did I pay for the {item_b}?",
                    f"What did the {item_b} cost me?",
                    f"Remind me what the {item_b} was?",
                    f"I want to give the {item_b} to {_pick(rng, RECIPIENTS)}. What did I pay for it?",
                ],
            ),
            answer=_pick(rng, [f"The {item_b} was ${price_b}.", f"You paid ${price_b} for the {item_b}."]),
            answer_keys=[f"${price_b}"],
            analysis=f"for the price of the {item_b}",
            reasoning=f"The user said the {item_b} was ${price_b}.",
            derived_yes_no=False,
        )

    queries = [
        QuerySpec(
            "single",
            ["order"],
            "your order number",
            ask_order,
            about_order,
        ),
        QuerySpec(
            "single",
            ["address"],
            "the delivery address",
            ask_address,
            [
                (
                    "I moved house recently, so I worry about deliveries.",
                    "Moving is a lot; let's make sure the package finds you.",
                )
            ],
        ),
        QuerySpec(
            "update",
            ["delivery"],
            "the delivery date",
            ask_delivery,
            [
                ("I really need the delivery before my trip.", "I hope the delivery arrives in time for it."),
                ("The tracking page hasn't changed in days.", "Tracking pages are sometimes slow to update."),
            ],
        ),
        QuerySpec(
            "pair",
            ["window", "price_a"],
            f"returning the {item_a} for a refund",
            can_return,
            [(f"Honestly, the {item_a} isn't what I expected.", f"I'm sorry the {item_a} disappointed you.")],
        ),
        QuerySpec(
            "pair",
            ["order", "address"],
            "your order number and shipping address",
            ask_order_and_address,
            about_order,
        ),
        QuerySpec(
            "single",
            ["price_b"],
            f"what you paid for the {item_b}",
            ask_price_b,
            [(f"I'm thinking of giving the {item_b} as a present.", f"A {item_b} makes a thoughtful gift.")],
        ),
    ]
    services = [
        ("Do you offer gift wrapping?", "Yes, gift wrapping is available at checkout."),
        ("Do you ship internationally?", "Yes, we ship to most countries."),
        ("Can I pay with PayPal?", "Yes, we accept PayPal and all major cards."),
        ("Do you have a loyalty program?", "Yes, you earn points on every purchase."),
        ("Do you price match?", "Yes, we match the price of most major stores."),
        ("Can I pick up in a store?", "Yes, most orders can be collected in store."),
    ]

    def quantity_total(r):
        item, n, price = _pick(r, ITEMS), r.randrange(2, 7), r.randrange(12, 150)
        total = n * price
        return _self_contained(
            f"what {n} of an item at ${price} each cost",
            f"{n} x ${price} = ${total}.",
            _pick(
                r,
                [
                    f"If I order {n} of the {item} at ${price} each, what's the total?",
                    f"What would {n} units of the {item} cost at ${price} apiece?",
                    f"I'm buying the {item} for my team: {n} of them at ${price} each. How much is that?",
                ],
            ),
            _pick(r, [f"{n} at ${price} each come to ${total}.", f"That would be ${total} in total."]),
            [f"${total}"],
        )

    def sale_price(r):
        item, pct, price = _pick(r, ITEMS), _pick(r, [10, 20, 25, 30, 40, 50]), r.randrange(20, 400, 20)
        paid = price * (100 - pct) // 100
        return _self_contained(
            f"what a ${price} item costs at {pct}% off",
            f"{pct}% off ${price} takes ${price - paid} off, leaving ${paid}.",
            _pick(
                r,
                [
                    f"The {item} is ${price} and your sale takes {pct}% off. What would I pay?",
                    f"If the ${price} {item} is {pct}% off, what's the sale price?",
                    f"With {pct}% off, how much is a {item} that normally costs ${price}?",
                ],
            ),
            _pick(r, [f"You would pay ${paid}.", f"At {pct}% off, the ${price} {item} comes to ${paid}."]),
            [f"${paid}"],
        )

    def credit_left(r):
        item, credit = _pick(r, ITEMS), _pick(r, [50, 75, 100, 150, 200, 250, 300, 500])
        price = r.randrange(15, credit - 4)
        left = credit - price
        return _self_contained(
            f"how much of ${credit} in store credit is left after a ${price} purchase",
            f"${credit} - ${price} = ${left}.",
            _pick(
                r,
                [
                    f"I have ${credit} in store credit. If I buy a {item} for ${price}, how much is left?",
                    f"After a ${price} {item}, what would remain of my ${credit} store credit?",
                ],
            ),
            _pick(r, [f"${left} of credit would be left.", f"You would have ${left} left in credit."]),
            [f"${left}"],
        )

    def split_order(r):
        people, share = r.randrange(2, 7), r.randrange(9, 120)
        total = people * share
        return _self_contained(
            f"each person's share of a ${total} order split {people} ways",
            f"${total} / {people} = ${share}.",
            _pick(
                r,
                [
                    f"{people} of us are splitting a ${total} order evenly. What does each person pay?",
                    f"If a ${total} order is shared equally by {people} friends, what is each share?",
                    f"We are {people} people sharing the cost of a ${total} {_pick(r, ITEMS)}. What's each "
                    "share?",
                ],
            ),
            _pick(r, [f"Each person pays ${share}.", f"Split {people} ways, that's ${share} each."]),
            [f"${share}"],
        )

    self_contained = [
        SelfContained(
            "the total for several units of an item",
            quantity_total,
            [("I might need a few more of these for the office.", "Bulk orders are no problem for us.")],
        ),
        SelfContained(
            "what an item costs in our sale",
            sale_price,
            [("I heard there's a sale on at the moment.", "There are some good deals on right now.")],
        ),
        SelfContained(
            "how much store credit is left after a purchase",
            credit_left,
            [("I still have some store credit from a return.", "Store credit never expires with us.")],
        ),
        SelfContained(
            "splitting the cost of an order evenly",
            split_order,
            [("My flatmates and I often order things together.", "Group orders can save on shipping.")],
        ),
    ]
    protected = [order, f"${price_a}", f"${price_b}", address, s["date"], new_date]
    return "shop", s, facts, updates, queries, self_contained, services, protected


def _travel(rng, pair):
    ref = "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ23456789") for _ in range(6))
    flight = f"{rng.choice(['TK', 'LH', 'BA', 'AF', 'UA', 'QF'])}{rng.randrange(100, 9999)}"
    city, hotel, nights = _pick(rng, CITIES), _pick(rng, HOTELS), rng.randrange(2, 9)
    seat = f"{rng.randrange(3, 40)}{rng.choice('ABCDEF')}"
    covered, weight, limit = pair.yes_no(rng, "travel")
    bag = _pick(rng, BAGS)
    slot = _pick(rng, FLIGHT_SLOTS)
    s = {"date": f"{_pick(rng, MONTHS)} {rng.randrange(1, 29)}", "time": _clock(slot)}
    new_time = _other_time(rng, FLIGHT_SLOTS, slot)

    facts = [
        Round(
            _pick(
                rng,
                [f"I'm flying to {city} on flight {flight}.", f"I have a trip to {city}, flight {flight}."],
            ),
            _pick(
                rng,
                [
                    "Great, I found your booking.",
                    "Thanks, your trip is on my screen.",
                    "Got it, I have your itinerary open.",
                ],
            ),
            {"flight": "Q"},
        ),
        Round(
            _pick(rng, ["What's my booking reference?", "Can I get the reference for this booking?"]),
            _pick(rng, [f"Your booking reference is {ref}.", f"The reference code is {ref}."]),
            {"ref": "A"},
        ),
        Round(
            _pick(rng, ["When does the flight leave?", "What time is departure?", "When do I fly out?"]),
            _pick(
                rng,
                [f"It departs on {s['date']} at {s['time']}.", f"It leaves on {s['date']} at {s['time']}."],
            ),
            {"departure": "A"},
        ),
        Round(
            _pick(
                rng,
                [
                    f"I also booked the {hotel} for {nights} nights.",
                    f"My hotel is the {hotel}, {nights} nights.",
                ],
            ),
            _pick(
                rng,
                [
                    "Noted, I've linked the hotel to your trip.",
                    "Thanks, the hotel is added to your itinerary.",
                ],
            ),
            {"hotel": "Q"},
        ),
        Round(
            _pick(rng, ["Do I have a seat assigned?", "Which seat did I get?"]),
            _pick(rng, [f"You're in seat {seat}.", f"Seat {seat} is assigned to you."]),
            {"seat": "A"},
        ),
        Round(
            _pick(rng, ["How much luggage can I check?", "What's my baggage allowance?"]),
            _pick(
                rng,
                [
                    f"Your fare includes one checked bag of up to {_kg(limit)}.",
                    f"You can check one bag weighing up to {_kg(limit)}.",
                    f"Checked bags on your fare can weigh up to {_kg(limit)}.",
                ],
            ),
            {"bags": "A"},
        ),
    ]
    updates = {
        "departure": Round(
            _pick(rng, ["Any changes to my flight?", "Is my flight still on time?"]),
            _pick(
                rng,
                [
                    f"The airline rescheduled it: it now departs at {new_time}.",
                    f"There's a schedule change; departure is now {new_time}.",
                ],
            ),
            {"departure": "A"},
            apply=lambda st: st.update(time=new_time),
            kind="update",
        )
    }

    def bag_check(st):
        return QueryRound(
            query=_pick(
                rng,
                [
                    f"My {bag} weighs {_kg(weight)}. Can I check it at no extra cost?",
                    f"Will a {_kg(weight)} {bag} be within my baggage allowance?",
                    f"Is {_kg(weight)} okay for my checked {bag} on the flight to {city}?",
                    f"I just weighed my {bag} at {_kg(weight)}. Can it go in the hold for free?",
                ],
            ),
            answer=_pick(
                rng,
                [
                    f"{'Yes' if covered else 'No'}. Your fare to {city} allows up to {_kg(limit)}, so a "
                    f"{_kg(weight)} {bag} {'is within it' if covered else 'is over the limit'}.",
                    f"{'Yes' if covered else 'No'}. At {_kg(weight)}, your {bag} is "
                    f"{'within' if covered else 'over'} the {_kg(limit)} limit of your {city} fare.",
                ],
            ),
            answer_keys=["yes" if covered else "no"],
            analysis=f"whether their {bag} is within the checked-bag weight limit",
            reasoning=f"The fare allows one checked bag of up to {_kg(limit)}; the {bag} weighs "
            f"{_kg(weight)}.",
            derived_yes_no=True,
        )

    about_trip = [
        (f"I've never been to {city} before.", f"{city} is a wonderful place to visit."),
        (f"I'm so excited about this trip to {city}.", "It sounds like a great trip."),
    ]

    def ask_ref(st):
        return QueryRound(
            query=_pick(rng, ["What's my booking reference again?", "Remind me of the reference code?"]),
            answer=f"Your booking reference is {ref}.",
            answer_keys=[ref],
            analysis="for the booking reference",
            reasoning=f"The reference given earlier is {ref}.",
            derived_yes_no=False,
        )

    def ask_departure(st):
        return QueryRound(
            query=_pick(
                rng,
                [
                    "So what time do I leave now?",
                    "What's the current departure time?",
                    "So what time does my flight leave now?",
                    "After all that, when do I take off?",
                    "I'm booking a taxi to the airport. What time does my flight depart?",
                    "Remind me of the departure time as it stands?",
                    "What time is my flight now, with the changes?",
                ],
            ),
            answer=_pick(
                rng,
                [
                    f"You now depart at {st['time']}.",
                    f"Your flight now leaves at {st['time']}.",
                    f"Departure is now at {st['time']}.",
                    f"It departs at {st['time']}.",
                    f"The flight leaves at {st['time']}.",
                ],
            ),
            answer_keys=[st["time"]],
            analysis="for the current departure time",
            reasoning=f"The latest departure time is {st['time']}; it overrides the earlier schedule.",
            derived_yes_no=False,
        )

    def ask_hotel_and_flight(st):
        return QueryRound(
            query=_pick(
                rng,
                ["Which flight am I on and where am I staying?", "Remind me of my flight and my hotel?"],
            ),
            answer=f"You're on flight {flight} and staying at the {hotel} for {nights} nights.",
            answer_keys=[flight, hotel],
            analysis="for their flight and their hotel",
            reasoning=f"The flight is {flight}; the hotel is the {hotel}, {nights} nights.",
            derived_yes_no=False,
        )

    def ask_seat_and_ref(st):
        return QueryRound(
            query=_pick(
                rng,
                [
                    "What seat do I have, and what's the booking reference?",
                    "Give me my seat and reference code, please.",
                ],
            ),
            answer=f"Seat {seat}, booking reference {ref}.",
            answer_keys=[seat, ref],
            analysis="for the seat and the booking reference",
            reasoning=f"The seat is {seat} and the reference is {ref}.",
            derived_yes_no=False,
        )

    queries = [
        QuerySpec(
            "single",
            ["ref"],
            "your booking reference",
            ask_ref,
            [("I always lose track of booking emails.", "Your inbox search usually finds them quickly.")],
        ),
        QuerySpec(
            "update",
            ["departure"],
            "your departure time",
            ask_departure,
            [
                ("I hate rushing to the airport.", "Leaving early makes the airport much calmer."),
                ("My friend is driving me to the airport.", "That's kind of them; it saves you a taxi."),
            ],
        ),
        QuerySpec(
            "pair",
            ["hotel", "flight"],
            "your flight and hotel",
            ask_hotel_and_flight,
            about_trip,
        ),
        QuerySpec(
            "pair",
            ["seat", "ref"],
            "your seat and booking reference",
            ask_seat_and_ref,
            [("I prefer sitting near the front of the plane.", "The front is quicker to get off, too.")],
        ),
        QuerySpec(
            "single",
            ["bags"],
            "the weight limit for your checked bag",
            bag_check,
            [
                ("I always pack far too much for trips.", "Packing light is harder than it sounds."),
                ("My suitcase is already nearly full.", "Packing cubes can help you fit more in."),
                ("I think my bag is heavier than usual this time.", "Bags do get heavy with souvenirs."),
            ],
        ),
    ]
    services = [
        ("Is there Wi-Fi on board?", "Yes, Wi-Fi is available on all our long-haul flights."),
        ("Can I bring a pet?", "Small pets can travel in the cabin for a fee."),
        ("Do you offer travel insurance?", "Yes, you can add travel insurance to any booking."),
        ("How early should I get to the airport?", "We recommend arriving two hours before departure."),
        ("Are meals included?", "Yes, meals are included on flights over three hours."),
        ("Can I choose a window seat?", "Yes, you can pick a seat when you check in online."),
    ]

    def room_total(r):
        place, n, rate = _pick(r, CITIES), r.randrange(2, 10), r.randrange(60, 300, 5)
        total = n * rate
        return _self_contained(
            f"what {n} nights at ${rate} a night cost",
            f"{n} x ${rate} = ${total}.",
            _pick(
                r,
                [
                    f"A room in {place} at ${rate} a night for {n} nights: what does that come to?",
                    f"If I stay {n} nights in {place} at ${rate} per night, what's the total?",
                    f"What do {n} nights in {place} cost at a nightly rate of ${rate}?",
                ],
            ),
            _pick(r, [f"{n} nights at ${rate} come to ${total}.", f"That comes to ${total} for the stay."]),
            [f"${total}"],
        )

    def landing_time(r):
        place, hours, start = _pick(r, CITIES), r.randrange(1, 8), _pick(r, range(6 * 60, 15 * 60, 5))
        begin, end = _clock(start), _clock(start + 60 * hours)
        return _self_contained(
            f"when a {hours}-hour flight that leaves at {begin} lands, in the same time zone",
            f"{begin} plus {hours} hours is {end}.",
            _pick(
                r,
                [
                    f"If a {hours}-hour flight to {place} leaves at {begin}, what time does it land, in "
                    "the same time zone?",
                    f"A flight to {place} takes {hours} hours with no time change. Leaving at {begin}, when "
                    "do I arrive?",
                ],
            ),
            _pick(r, [f"It would land at {end}.", f"Leaving at {begin}, you would arrive at {end}."]),
            [end],
        )

    def extra_bags(r):
        place, n, fee = _pick(r, CITIES), r.randrange(2, 7), r.randrange(20, 100)
        total = n * fee
        return _self_contained(
            f"what {n} extra bags at ${fee} each cost",
            f"{n} x ${fee} = ${total}.",
            _pick(
                r,
                [
                    f"If each extra bag costs ${fee}, what would {n} extra bags to {place} cost me?",
                    f"Say we add {n} extra bags at ${fee} a bag for the {place} trip. What's the total?",
                ],
            ),
            _pick(r, [f"{n} extra bags at ${fee} each come to ${total}.", f"That would be ${total}."]),
            [f"${total}"],
        )

    def group_tickets(r):
        place, n, price = _pick(r, CITIES), r.randrange(2, 9), r.randrange(8, 60)
        total = n * price
        return _self_contained(
            f"what {n} tickets at ${price} each cost",
            f"{n} x ${price} = ${total}.",
            _pick(
                r,
                [
                    f"{n} of us are taking the airport train in {place} at ${price} a ticket. What's the "
                    "total?",
                    f"What do {n} airport shuttle tickets in {place} cost at ${price} each?",
                ],
            ),
            _pick(r, [f"{n} tickets at ${price} each come to ${total}.", f"That's ${total} for all {n}."]),
            [f"${total}"],
        )

    self_contained = [
        SelfContained(
            "the total cost of a hotel stay",
            room_total,
            [("I'm still comparing hotels for the trip.", "It pays to compare a few options.")],
        ),
        SelfContained(
            "what time a flight lands",
            landing_time,
            [("I'm trying to plan what happens after I land.", "A little planning helps on arrival day.")],
        ),
        SelfContained(
            "what extra bags cost",
            extra_bags,
            [("We might bring a lot of gear this time.", "Extra gear can add up quickly.")],
        ),
        SelfContained(
            "the cost of airport train tickets for a group",
            group_tickets,
            [("A few friends are coming along on this trip.", "Travelling in a group is fun.")],
        ),
    ]
    protected = [ref, flight, hotel, seat, s["date"], s["time"], new_time]
    return "travel", s, facts, updates, queries, self_contained, services, protected


def _telecom(rng, pair):
    used = set()
    account, card = (_distinct(rng, lambda r: str(r.randrange(1000, 9999)), used) for _ in range(2))
    plan, new_plan = rng.sample(PLANS, 2)
    s = {"plan": plan, "fee": rng.randrange(15, 120)}
    new_fee = _distinct(rng, lambda r: r.randrange(15, 120), {s["fee"]})
    over, usage, data_gb = pair.yes_no(rng, "telecom")
    place, month = _pick(rng, CITIES), _pick(rng, MONTHS)
    bill_day = rng.randrange(1, 29)
    facts = [
        Round(
            _pick(
                rng, [f"Hi, my account number ends in {account}.", f"Hello, account ending {account} here."]
            ),
            _pick(
                rng,
                [
                    "Thanks, I've verified your account.",
                    "Got it, your account is open.",
                    "Thank you, I can see your account now.",
                ],
            ),
            {"account": "Q"},
        ),
        Round(
            _pick(
                rng,
                ["Which plan am I on?", "Can you check my current plan?", "What plan do I have right now?"],
            ),
            _pick(
                rng,
                [
                    f"You're on the {plan} plan at ${s['fee']} per month.",
                    f"Your plan is {plan}, which costs ${s['fee']} a month.",
                ],
            ),
            {"plan": "A"},
        ),
        Round(
            _pick(
                rng,
                ["How much data do I get?", "What's my data allowance?", "How much mobile data is included?"],
            ),
            _pick(
                rng,
                [f"Your plan includes {data_gb} GB of data each month.", f"You get {data_gb} GB per month."],
            ),
            {"data": "A"},
        ),
        Round(
            _pick(
                rng,
                ["When is my bill issued?", "What day do I get billed?", "When does my billing cycle start?"],
            ),
            _pick(
                rng,
                [
                    f"Your bill is issued on day {bill_day} of each month.",
                    f"Billing happens on day {bill_day} every month.",
                ],
            ),
            {"bill_day": "A"},
        ),
        Round(
            _pick(
                rng,
                [
                    f"Please use my card ending in {card} for autopay.",
                    f"I want autopay on the card ending {card}.",
                ],
            ),
            _pick(rng, ["Done, autopay is set up.", "Autopay is now active.", "All set, autopay is on."]),
            {"card": "Q"},
        ),
    ]
    updates = {
        "plan": Round(
            _pick(rng, [f"I'd like to switch to the {new_plan} plan.", f"Can you move me to {new_plan}?"]),
            _pick(
                rng,
                [
                    f"Done. You're now on {new_plan} at ${new_fee} per month.",
                    f"I've switched you to {new_plan}; it costs ${new_fee} a month.",
                ],
            ),
            {"plan": "A"},
            apply=lambda st: st.update(plan=new_plan, fee=new_fee),
            kind="update",
        )
    }

    def over_limit(st):
        return QueryRound(
            query=_pick(
                rng,
                [
                    f"If I use {usage} GB in {month}, will I go over?",
                    f"Would {usage} GB in {month} exceed my allowance?",
                    f"I'll probably stream about {usage} GB of video in {month}. Is that more than my plan "
                    "includes?",
                    f"My trip to {place} in {month} could take {usage} GB of data. Would that put me over my "
                    "allowance?",
                ],
            ),
            answer=_pick(
                rng,
                [
                    f"{'Yes' if over else 'No'}. Your allowance is {data_gb} GB a month, so {usage} GB in "
                    f"{month} {'goes over it' if over else 'stays within it'}.",
                    f"{'Yes' if over else 'No'}. {usage} GB is {'more' if over else 'not more'} than the "
                    f"{data_gb} GB your plan includes for {month}.",
                ],
            ),
            answer_keys=["yes" if over else "no"],
            analysis="whether their planned usage exceeds the data allowance",
            reasoning=f"The allowance is {data_gb} GB and the user plans {usage} GB.",
            derived_yes_no=True,
        )

    about_bill = [
        ("My bills always seem to come at a bad time.", "Many customers feel that way about bills."),
        ("I'm trying to get my monthly budget in order.", "A clear budget really helps."),
    ]

    def ask_account(st):
        return QueryRound(
            query=_pick(
                rng,
                [
                    "Which account number did I give you?",
                    "What are the last digits of my account again?",
                    "Sorry, which account did I say this was?",
                    "Can you read my account number back to me?",
                ],
            ),
            answer=_pick(
                rng,
                [
                    f"Your account number ends in {account}.",
                    f"It's the account ending in {account}.",
                    f"You gave the account ending {account}.",
                ],
            ),
            answer_keys=[account],
            analysis="for their account number",
            reasoning=f"The user said the account ends in {account}.",
            derived_yes_no=False,
        )

    def ask_plan(st):
        return QueryRound(
            query=_pick(
                rng,
                [
                    "How much do I pay per month now?",
                    "What's my monthly fee at the moment?",
                    "So what will my monthly bill be from now on?",
                    "Remind me what my plan costs each month now?",
                    f"What will I be paying for my plan in {month}?",
                    f"I'm planning my budget for {month}. What's my monthly fee?",
                ],
            ),
            answer=_pick(
                rng,
                [
                    f"You're on {st['plan']} at ${st['fee']} per month.",
                    f"Your {st['plan']} plan costs ${st['fee']} a month.",
                    f"It's ${st['fee']} a month, for {st['plan']}.",
                ],
            ),
            answer_keys=[f"${st['fee']}"],
            analysis="for their current monthly fee",
            reasoning=f"The latest plan is {st['plan']} at ${st['fee']} per month; it replaces the "
            "earlier plan.",
            derived_yes_no=False,
        )

    def ask_bill_day_and_card(st):
        return QueryRound(
            query=_pick(
                rng,
                [
                    "When am I billed and which card pays it?",
                    "Remind me of my billing day and the autopay card?",
                ],
            ),
            answer=f"You're billed on day {bill_day}, paid by the card ending in {card}.",
            answer_keys=[f"day {bill_day}", card],
            analysis="for the billing day and the autopay card",
            reasoning=f"Billing is on day {bill_day}; autopay uses the card ending {card}.",
            derived_yes_no=False,
        )

    def ask_account_and_bill_day(st):
        return QueryRound(
            query=_pick(
                rng,
                [
                    "Confirm my account and billing day, please.",
                    "What's my account number and my billing day?",
                ],
            ),
            answer=f"Account ending {account}, billed on day {bill_day}.",
            answer_keys=[account, f"day {bill_day}"],
            analysis="for the account number and the billing day",
            reasoning=f"The account ends in {account}; billing is on day {bill_day}.",
            derived_yes_no=False,
        )

    queries = [
        QuerySpec(
            "single",
            ["account"],
            "your account number",
            ask_account,
            [("I have so many accounts I can't keep them straight.", "It's easy to mix them up.")],
        ),
        QuerySpec(
            "update",
            ["plan"],
            "your monthly fee",
            ask_plan,
            about_bill,
        ),
        QuerySpec(
            "pair",
            ["bill_day", "card"],
            "your billing day and autopay card",
            ask_bill_day_and_card,
            about_bill,
        ),
        QuerySpec(
            "single",
            ["data"],
            "your data allowance",
            over_limit,
            [
                ("I stream a lot of videos on my phone.", "Video can use a lot of mobile data."),
                ("I'll be travelling a lot this month.", "Maps and video on the road add up quickly."),
            ],
        ),
        QuerySpec(
            "pair",
            ["account", "bill_day"],
            "your account number and billing day",
            ask_account_and_bill_day,
            about_bill,
        ),
    ]
    services = [
        ("Do you have 5G coverage?", "Yes, 5G covers all major cities on our network."),
        ("Can I keep my number if I switch?", "Yes, number transfer is free."),
        ("Is there a contract?", "No, all our plans are month to month."),
        ("Do you sell phones?", "Yes, we sell phones with monthly payment options."),
        ("Can I use my phone abroad?", "Yes, roaming works in most countries."),
        ("Do you offer home internet?", "Yes, we offer fibre home internet in many areas."),
    ]

    def months_total(r):
        n, fee, who = r.randrange(2, 13), r.randrange(10, 100), _pick(r, RECIPIENTS)
        total = n * fee
        return _self_contained(
            f"what {n} months at ${fee} a month cost",
            f"{n} x ${fee} = ${total}.",
            _pick(
                r,
                [
                    f"If a plan costs ${fee} a month, what do {n} months come to?",
                    f"What would I pay over {n} months for a ${fee} monthly plan?",
                    f"I'm paying for a ${fee} a month plan for {who} for {n} months. What's that in total?",
                ],
            ),
            _pick(r, [f"{n} months at ${fee} come to ${total}.", f"That's ${total} over {n} months."]),
            [f"${total}"],
        )

    def instalment(r):
        n, monthly = _pick(r, [6, 10, 12, 18, 24, 36]), r.randrange(9, 80)
        product = _pick(r, ["phone", "tablet", "smartwatch", "laptop", "games console", "router"])
        price = n * monthly
        return _self_contained(
            f"the monthly payment for a ${price} {product} over {n} months",
            f"${price} / {n} = ${monthly}.",
            _pick(
                r,
                [
                    f"If I pay off a ${price} {product} over {n} months, how much is that each month?",
                    f"A ${price} {product} split into {n} equal monthly payments: what is each payment?",
                ],
            ),
            _pick(r, [f"That's ${monthly} a month.", f"Each payment would be ${monthly}."]),
            [f"${monthly}"],
        )

    def weekly_data(r):
        device, per_week, weeks = _pick(r, DEVICES), r.randrange(2, 31), r.randrange(2, 9)
        total = per_week * weeks
        return _self_contained(
            f"how much data {per_week} GB a week adds up to over {weeks} weeks",
            f"{per_week} GB x {weeks} = {total} GB.",
            _pick(
                r,
                [
                    f"If my {device} uses {per_week} GB a week, how much is that over {weeks} weeks?",
                    f"My {device} uses about {per_week} GB a week. What's that for {weeks} weeks?",
                ],
            ),
            _pick(
                r,
                [f"That's {total} GB in total.", f"Over {weeks} weeks your {device} would use {total} GB."],
            ),
            [f"{total} GB"],
        )

    def call_minutes(r):
        calls, minutes = r.randrange(2, 12), r.randrange(5, 45)
        total = calls * minutes
        return _self_contained(
            f"how many minutes {calls} calls of {minutes} minutes make",
            f"{calls} x {minutes} = {total} minutes.",
            _pick(
                r,
                [
                    f"I made {calls} calls of {minutes} minutes each. How many minutes is that?",
                    f"If I have {calls} calls a week of about {minutes} minutes, how many minutes is that "
                    "a week?",
                ],
            ),
            _pick(
                r, [f"That's {total} minutes.", f"{calls} calls of {minutes} minutes make {total} minutes."]
            ),
            [f"{total} minutes"],
        )

    self_contained = [
        SelfContained(
            "what a monthly plan costs over several months",
            months_total,
            [("I'm trying to get my yearly budget in order.", "A clear budget really helps.")],
        ),
        SelfContained(
            "monthly payments for a new device",
            instalment,
            [("My phone screen cracked last week.", "That's annoying; a new phone might be due.")],
        ),
        SelfContained(
            "how much data you use over a few weeks",
            weekly_data,
            [("I watch a lot of shows on my tablet.", "Streaming can use a lot of data.")],
        ),
        SelfContained(
            "how many minutes your calls add up to",
            call_minutes,
            [("I spend a lot of time on the phone for work.", "Work calls really add up.")],
        ),
    ]
    protected = [account, card, f"${s['fee']}", f"${new_fee}", f"day {bill_day}"]
    return "telecom", s, facts, updates, queries, self_contained, services, protected


DOMAINS = [_spa, _shop, _travel, _telecom]
# (nominal bucket, rounds range, weight). Buckets go by the query's round t and the questions
# fill the last several rounds, so a long dialogue feeds two buckets; these weights give each
# Table 3 bucket a fifth to a third of the queries (dialogues over 32 rounds fail stage 0's filter).
LENGTH_PLAN = [(8, (8, 11), 0.31), (16, (15, 22), 0.28), (24, (26, 27), 0.06), (32, (31, 32), 0.35)]
RELATED_ROUND_RATE = 0.95  # a question is preceded by talk about its topic (Eq. (2) then keeps a distractor)
SERVICE_DISTRACTOR_RATE = 0.1  # filler rounds that are general service questions rather than small talk
OFFERS_OF_HELP = [
    "Happy to go over {} whenever you like.",
    "Just ask if you want me to check {}.",
    "I can look up {} for you at any point.",
    "Let me know if you have questions about {}.",
    "If it helps, I can confirm {} later.",
]
USER_OPENERS = [
    "Oh, and ",
    "Quick question: ",
    "Sorry, one more thing. ",
    "Also, ",
    "Hmm, ",
    "By the way, ",
    "Okay. ",
    "Right. ",
    "One thing: ",
]
# A question late in a conversation usually starts with a few words that tie it to what came
# before. These make query texts varied enough that two dialogues rarely share a query and its
# answer word for word (stage 0's lookup check).
QUERY_OPENERS = USER_OPENERS + [
    "Before I forget, ",
    "Just to check, ",
    "Actually, ",
    "Sorry, ",
    "Thanks. ",
    "Great, thanks. ",
    "Perfect. ",
    "Got it. ",
    "Alright, ",
    "Oh, right. ",
    "Hold on, ",
    "Quick one: ",
    "Another thing: ",
    "I was wondering, ",
    "Sorry to bother you again. ",
    "Okay, next question. ",
    "One last thing: ",
    "Thanks for that. ",
    "That's helpful. ",
    "Good to know. ",
    "Mm, okay. ",
    "Oh, also, ",
    "And ",
    "Just wondering, ",
    "Can I ask something else? ",
    "Okay, so ",
    "Cool. ",
]
QUERY_OPENER_RATE = 0.75
QUERY_CLOSERS = [  # and some end with a word more
    " Thanks.",
    " Thank you.",
    " Cheers.",
    " Thanks so much.",
    " Sorry, I forgot.",
    " I didn't write it down.",
    " I want to make a note of it.",
    " Just checking.",
    " I can't quite remember.",
    " Sorry to ask again.",
]
QUERY_CLOSER_RATE = 0.4
ASSISTANT_OPENERS = [
    "Sure. ",
    "Of course. ",
    "Let me check. ",
    "One moment. ",
    "Certainly. ",
    "Happy to help. ",
]


def _opener(rng, text, openers, rate):
    """Templates say each thing a few ways; openers multiply that, so that no handful of strings
    makes up much of the corpus."""
    if rng.random() >= rate:
        return text
    opener = rng.choice(
        [o for o in openers if text.endswith("?") or not o.endswith(": ")]
    )  # "Quick question:" asks
    lower = opener.endswith(("and ", "And ", "so ", ": ", ", ")) and not re.match(r"I\b", text)
    return opener + (text[0].lower() + text[1:] if lower else text)


def _draw_self_contained(rng, spec, earlier, protected) -> QueryRound:
    """A draw of a self-contained query whose answer keys no earlier utterance holds (its H* is
    empty, so the unique-gold rule allows them nowhere) and that states none of this dialogue's
    answer values (a later query's key must stay in that query's H*)."""
    for _ in range(1000):
        query_round = spec.make(rng)
        keys = distinctive_keys(query_round.answer_keys)
        text = f"{query_round.query} {query_round.answer}"
        if not any(mentions(t, k) for t in earlier for k in keys) and not any(
            mentions(text, v) for v in protected
        ):
            return query_round
    raise RuntimeError(f"no self-contained query about {spec.topic} fits this dialogue")


def generate_dialogue(index: int, seed: int) -> dict:
    """One synthetic dialogue in the raw source format (see stage0_build.read_dialogues): rounds
    of user/assistant text; query rounds carry their ground truth under "gold"."""
    rng, pair = random.Random(f"{seed}-{index}"), PairPlan(seed, index)
    make_domain = pair.rng.choice(DOMAINS)
    domain, state, facts, updates, queries, self_contained, services, protected = make_domain(rng, pair)
    _, (low, high), _ = pair.rng.choices(LENGTH_PLAN, weights=[w for *_, w in LENGTH_PLAN])[0]
    num_rounds = pair.rng.randint(low, high)

    # Which queries, and so which facts, this dialogue needs. Their needs are disjoint: an answer
    # restates the facts it used, so a later query on the same fact could recall that answer
    # instead, and H* would no longer be the unique minimal set.
    num_queries = 2 + num_rounds // 10
    chosen, used = [], set()
    # Multi-fact first, mostly. The twins ask the same queries: their yes/no queries pair up.
    for q in sorted(queries, key=lambda q: pair.rng.random() * 2.5 - len(q.needs)):
        if len(chosen) < num_queries and not used & set(q.needs):
            chosen.append(q)
            used |= set(q.needs)
    needed = {k for q in chosen for k in q.needs}
    general_queries = rng.sample(self_contained, 1 if num_rounds < 20 else 2) if rng.random() < 0.5 else []
    fact_rounds = [f for f in facts if set(f.provides) & needed]
    update_rounds = [updates[k] for k in updates if k in needed and rng.random() < 0.7]

    # The tail: the questions in random order, each preceded (room permitting) by a related round:
    # a remark about its entity and an offer to help with its topic, stating no fact.
    # (a round of kind "general" holds a self-contained query, query type "none")
    tail = [("query", q) for q in chosen] + [("general", g) for g in general_queries]
    rng.shuffle(tail)
    related = {}
    for k, (kind, item) in enumerate(tail):
        remark, topic = rng.choice(item.related)[0], item.topic
        if rng.random() < RELATED_ROUND_RATE:
            related[k] = (remark, rng.choice(OFFERS_OF_HELP).format(topic))
    while num_rounds - len(tail) - len(related) < len(fact_rounds) + len(update_rounds) + 1:
        general_at = [k for k, (kind, _) in enumerate(tail) if kind == "general"]
        if general_at:  # short of room, a general question goes first, its related round with it
            tail.pop(general_at[-1])
            related = {k - (k > general_at[-1]): r for k, r in related.items() if k != general_at[-1]}
        elif related:
            related.pop(rng.choice(sorted(related)))
        else:
            update_rounds.pop()

    # The setup before it: every fact at a random position in random order, each update after the
    # fact it changes, some spare facts (confusers), and filler everywhere else.
    setup_size = num_rounds - len(tail) - len(related)
    spare = [f for f in facts if not set(f.provides) & needed]
    rng.shuffle(spare)
    room = setup_size - len(fact_rounds) - len(update_rounds) - max(1, setup_size // 2)
    fact_rounds += [f for f in spare[: max(0, room)] if rng.random() < 0.6]
    placed = fact_rounds + update_rounds
    rng.shuffle(placed)
    for u in update_rounds:  # an update must follow its fact: swap them when drawn the other way
        key = next(iter(u.provides))
        i, j = (
            placed.index(u),
            next(i for i, f in enumerate(placed) if f.kind == "fact" and key in f.provides),
        )
        if i < j:
            placed[i], placed[j] = placed[j], placed[i]
    setup = [None] * setup_size
    for slot, r in zip(sorted(rng.sample(range(setup_size), len(placed))), placed):
        setup[slot] = r
    services = list(services)
    talk = small_talk_exchanges()
    for i in (i for i, r in enumerate(setup) if r is None):
        if rng.random() < SERVICE_DISTRACTOR_RATE and services:
            setup[i] = Round(*services.pop(rng.randrange(len(services))), kind="distractor")
            continue
        while True:  # small talk that happens to mention one of this dialogue's facts would state it twice
            user, reply = talk[rng.randrange(len(talk))]
            if not any(mentions(user, v) or mentions(reply, v) for v in protected):
                break
        setup[i] = Round(user, reply, kind="small_talk")

    rounds, latest = [], {}
    for r in setup:
        if r.apply:
            r.apply(state)
        for key, side in r.provides.items():
            latest[key] = f"{side}{len(rounds) + 1}"
        if r.kind == "small_talk":
            rounds.append({"user": r.user, "assistant": r.assistant, "kind": r.kind})
        else:
            rounds.append(
                {
                    "user": _opener(rng, r.user, USER_OPENERS, 0.5),
                    "assistant": _opener(rng, r.assistant, ASSISTANT_OPENERS, 0.4),
                    "kind": r.kind,
                }
            )
    for k, (kind, item) in enumerate(tail):
        if k in related:
            rounds.append(
                {
                    "user": _opener(rng, related[k][0], USER_OPENERS, 0.5),
                    "assistant": related[k][1],
                    "kind": "related",
                }
            )
        if kind == "general":
            earlier = [text for r in rounds for text in (r["user"], r["assistant"])]
            query_round = _draw_self_contained(rng, item, earlier, protected)
            user, answer = query_round.query, query_round.answer
            gold = {
                "recall": [],
                "answer_keys": query_round.answer_keys,
                "derived_yes_no": False,
                "query_type": "none",
                "analysis": query_round.analysis,
                "reasoning": query_round.reasoning,
            }
        else:
            query_round = item.make(state)
            user, answer = query_round.query, query_round.answer
            recall = sorted(
                {latest[k] for k in item.needs}, key=lambda label: (int(label[1:]), label[0] == "A")
            )
            gold = {
                "recall": recall,
                "answer_keys": query_round.answer_keys,
                "derived_yes_no": query_round.derived_yes_no,
                "query_type": item.kind,
                "analysis": query_round.analysis,
                "reasoning": query_round.reasoning,
            }
        rounds.append(
            {
                "user": _opener(rng, user, QUERY_OPENERS, QUERY_OPENER_RATE)
                + (rng.choice(QUERY_CLOSERS) if rng.random() < QUERY_CLOSER_RATE else ""),
                "assistant": answer,
                "kind": kind,
                "gold": gold,
            }
        )
    return {
        "id": f"synthetic-{index:06d}",
        "source": "synthetic",
        "domain": domain,
        "meta": {"split_group": pair.group},
        "rounds": rounds,
    }


def generate_synthetic(num_dialogues: int, seed: int = 0) -> list[dict]:
    return [generate_dialogue(i, seed) for i in range(num_dialogues)]
