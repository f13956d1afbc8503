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

This module assembles the dialogues; each domain draws its facts and queries in its own module
(synthetic_spa.py, synthetic_shop.py, synthetic_travel.py, synthetic_telecom.py), from the parts
in synthetic_common.py.
"""

from __future__ import annotations

import random
import re

from srt.data import synthetic_shop, synthetic_spa, synthetic_telecom, synthetic_travel
from srt.data.synthetic_common import (
    PairPlan,
    QueryRound,
    Round,
    distinctive_keys,
    mentions,
    small_talk_exchanges,
)

# the order of the list is part of the seed's meaning: a dialogue draws its domain from it
DOMAINS = [
    synthetic_spa.draw_domain,
    synthetic_shop.draw_domain,
    synthetic_travel.draw_domain,
    synthetic_telecom.draw_domain,
]
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
