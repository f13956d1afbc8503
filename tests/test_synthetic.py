"""The synthetic task: unique gold sets checked on every generated query, no position or
template shortcut, yes/no queries that need the recalled facts, real and varied small talk; and
no lookups: "none" queries that are self-contained but varied, yes/no answers that the
number in the query does not predict, query/answer pairs that other dialogues do not repeat.
No embedder: these run on the raw dialogues in a few seconds (stage 0's lookup checks on a
generated corpus are in test_stage0.py)."""

import copy
import random
import re
from collections import Counter, defaultdict

import pytest

from srt.data.synthetic import generate_synthetic
from srt.data.synthetic_common import (
    ENGLISH_WORDS,
    OFFENSIVE,
    SMALL_TALK_WORDS,
    YES_NO_RULES,
    _clock,
    _other_time,
    _plain_english,
    distinctive_keys,
    keys_outside_recall,
    mentions,
    small_talk_exchanges,
)
from srt.data.synthetic_spa import SPA_SLOTS
from srt.data.synthetic_travel import FLIGHT_SLOTS


def queries_of(dialogues):
    """(dialogue, t, round, history) for every query round, with the history as stage 0 labels it."""
    for d in dialogues:
        history = []
        for t, r in enumerate(d["rounds"], 1):
            if "gold" in r:
                yield d, t, r, list(history)
            history += [
                {"label": f"Q{t}", "text": r["user"], "kind": r["kind"]},
                {"label": f"A{t}", "text": r["assistant"], "kind": r["kind"]},
            ]


@pytest.fixture(scope="module")
def corpus():
    return generate_synthetic(1200, seed=11)


# ---- unique gold -----------------------------------------------------------------------------
def test_distinctive_keys_and_mentions():
    assert distinctive_keys(["yes", "$180", "noon", "Lena", "3 pm", "no", "day 5", "at"]) == [
        "$180",
        "Lena",
        "3 pm",
        "day 5",
    ]
    assert mentions("The Chakra Balancing service is $180.", "$180")
    assert not mentions("That one is $1800.", "$180") and not mentions("It was $18.", "$180")
    assert not mentions("You get 15 GB per month.", "5 GB") and mentions("you get 5 gb", "5 GB")
    assert mentions("LENA works at Uptown", "Lena") and not mentions("Lenard is here", "Lena")


def test_every_generated_query_has_a_unique_gold_set(corpus):
    """The check runs on every query round the generator emits (nothing filtered first): no
    utterance outside H* may hold a distinctive answer key; at most 2% may, and only as a
    chance mention in small talk."""
    checked, leaks = 0, []
    for d, t, r, history in queries_of(corpus):
        gold = r["gold"]
        assert set(gold["recall"]) <= {u["label"] for u in history}
        found = keys_outside_recall(history, gold["recall"], gold["answer_keys"])
        leaks += [(d["id"], t, label, key) for label, key in found]
        checked += 1
    leaky_queries = {(d_id, t) for d_id, t, *_ in leaks}
    assert checked > 4000
    assert len(leaky_queries) <= 0.02 * checked, leaks[:5]
    by_label = {(d["id"], u["label"]): u["kind"] for d, _, _, history in queries_of(corpus) for u in history}
    assert all(by_label[(d_id, label)] == "small_talk" for d_id, _, label, _ in leaks), leaks[:5]


def test_checker_catches_a_planted_violation(corpus):
    d, t, r, history = next(
        (d, t, r, h)
        for d, t, r, h in queries_of(corpus)
        if r["gold"]["query_type"] == "pair" and distinctive_keys(r["gold"]["answer_keys"])
    )
    gold, key = r["gold"], distinctive_keys(r["gold"]["answer_keys"])[0]
    assert keys_outside_recall(history, gold["recall"], gold["answer_keys"]) == []
    # the flaw the old generator had: the request states the value its confirmation states again
    planted = copy.deepcopy(history)
    victim = next(u for u in planted if u["label"] not in gold["recall"] and u["kind"] != "small_talk")
    victim["text"] += f" Just to repeat it: {key.upper()}."
    assert keys_outside_recall(planted, gold["recall"], gold["answer_keys"]) == [(victim["label"], key)]
    # the same text inside H* is fine
    assert keys_outside_recall(planted, gold["recall"] + [victim["label"]], gold["answer_keys"]) == []


def test_an_updated_time_never_holds_the_old_one():
    """Times run to the minute: "10 am" is in "9:10 am" for `mentions` (and for a key matcher), so
    a stale 9:10 am departure would state an updated 10 am. An update draws a time apart from the
    old one."""
    assert mentions("It departs on July 3 at 9:10 am.", "10 am")
    rng = random.Random(0)
    for slots in (FLIGHT_SLOTS, SPA_SLOTS):
        for slot in slots:
            old, new = _clock(slot), _other_time(rng, slots, slot)
            assert new != old and not mentions(new, old) and not mentions(old, new), (old, new)


def test_old_style_template_leak_is_caught():
    """A hand-made dialogue in the old generator's style: the flight number stated in Q1 and A1."""
    history = [
        {"label": "Q1", "text": "I'm flying to Oslo on flight TK4821."},
        {"label": "A1", "text": "Great, I found flight TK4821 to Oslo."},
        {"label": "Q2", "text": "My hotel is the Maple Inn, 3 nights."},
        {"label": "A2", "text": "Noted."},
    ]
    assert keys_outside_recall(history, ["Q1", "Q2"], ["TK4821", "Maple Inn"]) == [("A1", "TK4821")]


# ---- no position or template shortcut --------------------------------------------------------
def test_no_gold_label_set_dominates_a_query_type(corpus):
    """Within every (domain, query type) with 30+ queries no single H* covers more than 30%. Queries
    that need no history ("none") are left out: their one correct gold set is the empty one."""
    sets = defaultdict(Counter)
    for d, _, r, _ in queries_of(corpus):
        if r["gold"]["query_type"] != "none":
            sets[(d["domain"], r["gold"]["query_type"])][tuple(r["gold"]["recall"])] += 1
    checked = 0
    for group, counts in sets.items():
        total = sum(counts.values())
        if total >= 30:
            checked += 1
            assert counts.most_common(1)[0][1] / total <= 0.30, (group, counts.most_common(3))
    assert checked >= 12


def test_gold_facts_sit_anywhere_before_the_questions(corpus):
    """Recalled fact rounds are spread over the whole stretch before the questions (uniform: about
    half in its second half); the old generator packed them into its first two thirds."""
    where = []
    for d in corpus:
        setup = next(k for k, r in enumerate(d["rounds"]) if r["kind"] in ("related", "query", "general"))
        for r in d["rounds"]:
            for label in r.get("gold", {}).get("recall", []):
                if d["rounds"][int(label[1:]) - 1]["kind"] == "fact":
                    where.append((int(label[1:]) - 1) / setup)
    assert len(where) > 2000 and 0.4 < sum(w >= 0.5 for w in where) / len(where) < 0.6


def test_facts_come_in_random_order(corpus):
    """Each pair of fact kinds appears in both orders: the old generator fixed the order per domain."""
    before = Counter()
    for d in corpus:
        facts = [r["user"] + " " + r["assistant"] for r in d["rounds"] if r["kind"] == "fact"]
        if d["domain"] == "telecom":
            account = next(
                (k for k, f in enumerate(facts) if "account number ends" in f or "account ending" in f), None
            )
            card = next((k for k, f in enumerate(facts) if "card ending" in f), None)
            if account is not None and card is not None:
                before[account < card] += 1
    assert before[True] >= 0.3 * sum(before.values()) and before[False] >= 0.3 * sum(before.values()), before


# ---- yes/no queries need the facts -----------------------------------------------------------
YES_NO_FACT = {  # what decides the answer: the number in the query against one recalled number
    "shop": (r"within (\d+) days|up to (\d+) days", lambda q, f: q <= f),
    "travel": (r"up to (\d+) kg", lambda q, f: q <= f),
    "telecom": (r"(\d+) GB", lambda q, f: q > f),
}
NUMBER = re.compile(r"\d+(?:\.\d+)?")


def yes_no_rows(dialogues):
    """(domain, split group, number in the query, answer is yes) of every derived yes/no query; the
    answer checked against the recalled fact on the way."""
    for d, t, r, history in queries_of(dialogues):
        gold = r["gold"]
        if gold["derived_yes_no"] and d["domain"] in YES_NO_FACT:
            number = float(NUMBER.search(r["user"]).group())
            pattern, rule = YES_NO_FACT[d["domain"]]
            evidence = " ".join(u["text"] for u in history if u["label"] in gold["recall"])
            fact = float(next(g for g in re.search(pattern, evidence).groups() if g))
            truth = gold["answer_keys"][0] == "yes"
            assert rule(number, fact) == truth, (d["id"], r["user"], evidence)
            yield d["domain"], d["meta"]["split_group"], number, truth


def test_yes_no_answers_need_the_recalled_facts(corpus):
    """A rule that reads only the number in the query (its per-number majority answer, fitted on
    half the twin pairs) stays at chance on the other half; the rule that reads the recalled fact
    as well is always right."""
    by_domain = defaultdict(list)
    for domain, group, number, truth in yes_no_rows(corpus):
        by_domain[domain].append((int(group[-6:]) % 2, number, truth))
    assert set(by_domain) == set(YES_NO_FACT)
    for domain, rows in by_domain.items():
        fit = defaultdict(Counter)
        for half, number, truth in rows:
            if half == 0:
                fit[number][truth] += 1
        held_out = [(number, truth) for half, number, truth in rows if half == 1]
        majority = Counter(truth for _, _, truth in rows).most_common(1)[0][0]
        right = sum((fit[n].most_common(1)[0][0] if fit[n] else majority) == truth for n, truth in held_out)
        assert len(held_out) >= 50 and right / len(held_out) < 0.55, (domain, right / len(held_out))
        assert sum(truth for *_, truth in rows) / len(rows) == 0.5


def test_every_query_number_admits_both_answers():
    """The old generator drew 5-94 days against windows of 7-90: 5 days was always "yes", 91 days
    always "no". Now some stated policy gives each answer for every number a query can hold."""
    for domain, (query_values, policy_values, holds) in YES_NO_RULES.items():
        assert len(set(query_values)) >= 20, domain
        for q in query_values:
            assert {holds(q, f) for f in policy_values} == {True, False}, (domain, q)


def test_twins_balance_every_yes_no_number(corpus):
    """Twin dialogues (one split group) ask the same yes/no query with the same number and opposite
    answers: per (domain, number) there are exactly as many "yes" as "no", the discount query
    (no number) included, and the policy that decides it differs between the twins."""
    counts = defaultdict(Counter)
    for d, _, r, _ in queries_of(corpus):
        if r["gold"]["derived_yes_no"]:
            number = NUMBER.search(r["user"])
            counts[(d["domain"], number and float(number.group()))][r["gold"]["answer_keys"][0]] += 1
    assert {domain for domain, _ in counts} == {"spa", "shop", "travel", "telecom"}
    for key, c in counts.items():
        assert c["yes"] == c["no"], (key, c)
    twins = defaultdict(list)
    for d in corpus:
        twins[d["meta"]["split_group"]].append(d)
    assert all(len(pair) == 2 and pair[0]["domain"] == pair[1]["domain"] for pair in twins.values())
    assert sum(pair[0]["rounds"] != pair[1]["rounds"] for pair in twins.values()) == len(twins)


# ---- no lookups ------------------------------------------------------------------------------
def normalize(text):
    return " ".join(re.findall(r"[a-z0-9$]+", text.lower()))  # srt/data/leakage.py's normalize


EQUATION = re.compile(r"(\$?\d+)(?: GB)? (x|/|-) \$?(\d+) = (\$?\d+(?: GB| minutes)?)")


def test_none_queries_are_self_contained_and_varied(corpus):
    """A "none" query's answer was one of 24 fixed sentences. Now its key is a number computed from
    the numbers in the query (the reasoning states the sum, checked here where it is one), almost
    no two are alike, and no key is a sentence."""
    rows = [(d, r) for d, _, r, _ in queries_of(corpus) if r["gold"]["query_type"] == "none"]
    assert len(rows) >= 500
    checked = 0
    for d, r in rows:
        gold = r["gold"]
        assert gold["recall"] == [] and not gold["derived_yes_no"] and len(gold["answer_keys"]) == 1
        key = gold["answer_keys"][0]
        assert re.search(r"\d", key) or key == "noon", key
        assert len(key.split()) <= 2 and mentions(r["assistant"], key), (key, r["assistant"])
        numbers = re.findall(r"\d+|\bnoon\b", r["user"])
        assert len(numbers) >= 2, r["user"]  # the query carries what the answer needs
        m = EQUATION.search(gold["reasoning"])
        if m:
            a, op, b = int(m.group(1).lstrip("$")), m.group(2), int(m.group(3))
            result = int(re.match(r"\$?(\d+)", m.group(4)).group(1))
            assert {"x": a * b, "-": a - b, "/": a / b}[op] == result, gold["reasoning"]
            assert mentions(m.group(4), key), (gold["reasoning"], key)
            checked += 1
    assert checked >= 0.6 * len(rows)
    pairs = Counter((normalize(r["user"]), normalize(r["assistant"])) for _, r in rows)
    keys = Counter(r["gold"]["answer_keys"][0] for _, r in rows)
    assert len(pairs) >= 0.99 * len(rows)
    assert keys.most_common(1)[0][1] <= 0.02 * len(rows), keys.most_common(3)


def test_query_answer_pairs_do_not_repeat_across_dialogues(corpus):
    """Stage 0 puts whole split groups (twin pairs) in one split. A query and its answer, word for
    word after normalising, that another group repeats could be looked up in train; the old
    generator repeated 23% of test pairs (all "none" queries, the 10 departure times, the bag
    counts). Now at most one in 500 queries of this corpus."""
    owners = defaultdict(set)
    total = 0
    for d, _, r, _ in queries_of(corpus):
        owners[(normalize(r["user"]), normalize(r["assistant"]))].add(d["meta"]["split_group"])
        total += 1
    shared = [pair for pair, groups in owners.items() if len(groups) > 1]
    assert len(shared) <= 0.002 * total, shared[:5]


# ---- real small talk -------------------------------------------------------------------------
def test_small_talk_is_real_filtered_and_varied(corpus):
    pool = small_talk_exchanges()
    assert len(pool) > 10000
    real = {text for pair in pool for text in pair}
    talk = [(r["user"], r["assistant"]) for d in corpus for r in d["rounds"] if r["kind"] == "small_talk"]
    assert len(talk) > 5 * len(corpus)
    for user, reply in talk:
        assert user in real and reply in real
        for text in (user, reply):
            assert SMALL_TALK_WORDS[0] <= len(text.split()) <= SMALL_TALK_WORDS[1] and text.isascii()
            assert not OFFENSIVE.search(text) and not re.search(r"\b[QA]\d+\b", text)
    assert len(set(talk)) > 0.6 * len(talk)


def _plain_english_by_characters(text):
    """The small-talk filter as first written, a loop over characters and re.I patterns: the
    reference the faster filter must agree with exactly (the corpus, and every number measured on
    it, depends on which lines pass)."""
    words = text.split()
    return (
        SMALL_TALK_WORDS[0] <= len(words) <= SMALL_TALK_WORDS[1]
        and len(text) <= 120
        and all(32 <= ord(c) < 127 for c in text)
        and sum(c.isalpha() or c == " " for c in text) >= 0.8 * len(text)
        and max(len(w) for w in words) <= 18
        and any(w.lower().strip(".,!?") in ENGLISH_WORDS for w in words)
        and not OFFENSIVE.search(text)
        and not re.search(r"http|www\.|@|<|>|\b[QA]\d+\b|answer:", text, re.I)
    )


def test_the_fast_small_talk_filter_agrees_with_the_character_loop():
    """Edge cases where a case-insensitive or a character-class rewrite could differ: upper-case
    insults and labels, a tab, DEL, non-ASCII look-alikes (the Kelvin sign folds to 'k' under re.I),
    digits and punctuation at the 80% letter boundary; then the dataset's own messages."""
    crafted = [
        "I think that you are a FUCKING genius",
        "What do you think of A12 and the rest",
        "my ANSWER: is that it's fine by me",
        "do you like the new WWW.site thing",
        "it is\tfine by me and you know it",
        "it is fine by me and you know\x7f it",
        "I \u212aill time with the guitar all day",
        "i'm at 12345 67890 12345 67890 and you",
        "i'm at 1234 567 and what are you up to",
        "the café is nice and you would like it",
        "what do you do for fun on the weekend?",
        "is it,,,,,,,,,,,, a thing for you",
    ]
    texts = crafted + [text for pair in small_talk_exchanges()[:2000] for text in pair]
    texts += [f"{t} {t[:7].upper()}" for t in texts[: len(crafted) + 200]]
    assert sum(_plain_english(t) for t in crafted) not in (0, len(crafted))  # both outcomes occur
    for text in texts:
        assert _plain_english(text) == _plain_english_by_characters(text), text


def test_no_handful_of_strings_dominates(corpus):
    counts = Counter(text for d in corpus for r in d["rounds"] for text in (r["user"], r["assistant"]))
    assert sum(c for _, c in counts.most_common(100)) / sum(counts.values()) < 0.25
