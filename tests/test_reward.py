"""Tests of reward.py (paper §3.4, Eqs. (4)-(7)): hand-computed values, verbatim alignment, the
format's edge cases, the answer keys, the reward-hacking gallery, and property tests over
arbitrary strings. The cosine answer reward embeds for real with all-MiniLM-L6-v2."""

import json
import os
import sys
import time
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import reward  # noqa: E402
from reward import (  # noqa: E402
    ANSWER_REWARDS,
    compute_reward,
    compute_rewards,
    jaccard,
    key_reward,
    match_tags,
    overlap,
    recall_reward,
)
from srt.completion import (  # noqa: E402
    canonical,
    format_problems,
    is_valid_format,
    parse_completion,
    split_tag,
    tokens,
)
from srt.embedder import embed  # noqa: E402
from srt.metrics import keys_present, normalize_number  # noqa: E402
from srt.prompt import format_target  # noqa: E402
from srt.reward_gallery import GALLERY_COMMAND, GALLERY_RECORD, gallery_scores  # noqa: E402

# The paper's running example (Fig. 1): is the Apex Tier discount valid for Lena's Chakra Balancing?
TURNS = [
    ("Q1", "I need to check membership status. I'm under Apex Tier."),
    (
        "A1",
        "Welcome back. I confirm your Apex Tier status. As a reminder, this gives you a 20% discount "
        "on any service over $150.",
    ),
    ("Q2", "Does that apply to all locations?"),
    ("A2", "Yes, the Apex Tier discount is valid at every one of our branches."),
    ("Q3", "Great. What treatments do you offer this month?"),
    ("A3", "We have hot stone massage, aromatherapy facials and Chakra Balancing."),
    ("Q4", "Who are the therapists for Chakra Balancing?"),
    ("A4", "Lena and Marco both practice it."),
    ("Q5", "How much is the Chakra Balancing service?"),
    ("A5", "The Chakra Balancing service is $180."),
    ("Q6", "I'd like Lena to do it. Where can I book her?"),
    ("A6", "Lena only offers that service at our Uptown branch."),
]
TEXT = dict(TURNS)
ANSWER = "Yes, the 20% discount applies."


def make_record(turns=TURNS, recall=("Q1", "A5", "A6"), answer=ANSWER, rid="paper-apex-t07", keys=None):
    history = [
        {"label": label, "speaker": "user" if label[0] == "Q" else "assistant", "text": text}
        for label, text in turns
    ]
    record = {
        "id": rid,
        "source": "jsonl",
        "history": history,
        "query": "If I book Lena for Chakra Balancing, does my membership discount apply?",
        "query_turn": len(turns) // 2 + 1,
        "recall": list(recall),
        "answer": answer,
        "reasoning": "1. Analyze Query: discount for Lena's Chakra Balancing?\n2. Recall History: "
        f"<HIS>Q1: {TEXT['Q1']} A5: {TEXT['A5']} A6: {TEXT['A6']}</HIS>\n"
        "3. Reasoning: $180 is over $150, so the discount applies.",
        "pruned": list(recall),
        "meta": {"num_turns": len(turns) // 2 + 1, "bucket": 8, "scores": {}},
    }
    if keys is not None:
        record["answer_keys"] = list(keys)
    return record


RECORD = make_record()
KEYED = make_record(
    keys=["yes", "$180"], answer="Yes. The service is $180, over $150, so the 20% discount applies."
)


def completion(tags, answer="yes, the 20% discount applies", think_extra=""):
    """A well-formed completion with one <HIS> tag per item of `tags` (labels or literal text)."""
    his = "\n".join(f"<HIS>{t}: {TEXT[t]}</HIS>" if t in TEXT else f"<HIS>{t}</HIS>" for t in tags)
    return (
        f"<think>\n1. Analyze Query: does the discount apply?\n2. Recall History: {his}\n"
        f"3. Reasoning: it does.{think_extra}\n</think>\nFinal answer: {answer}"
    )


def cosine(a, b):
    v = embed([a, b])
    return float(v[0] @ v[1])


# ------------------------------------------------------------------ parsing and normalization
def test_parse_the_paper_target_and_split_the_fig1_tag_on_its_labels():
    parsed = parse_completion(format_target(RECORD))
    assert parsed.think.strip().startswith("1. Analyze Query")
    assert parsed.final_answer == ANSWER
    assert len(parsed.tags) == 1
    pieces = split_tag(parsed.tags[0])
    assert [p.hint for p in pieces] == ["Q1", "A5", "A6"]
    assert pieces[1].text == "A5: " + TEXT["A5"]
    assert pieces[1].body == "the chakra balancing service is $180"


def test_unlabelled_head_of_a_tag_is_its_own_piece():
    pieces = split_tag("Recalled: the price. A5: The Chakra Balancing service is $180.")
    assert [(p.hint, p.text) for p in pieces] == [
        (None, "Recalled: the price."),
        ("A5", "A5: The Chakra Balancing service is $180."),
    ]
    assert [p.hint for p in split_tag("- Q1: a, Turn A5: 'b'")] == ["Q1", "A5"]  # punctuation is no head


def test_tokens_normalization():
    assert tokens("I'm under Apex Tier.") == ["i", "m", "under", "apex", "tier"]
    assert tokens("$180, 20%!") == ["180", "20"]
    assert tokens("ＡＰＥＸ Tier") == ["apex", "tier"]  # NFKC folds full-width letters
    assert tokens("Straße") == ["strasse"]  # casefold
    assert tokens("我需要查看会员") == list("我需要查看会员")  # one token per ideograph
    assert tokens("snake_case") == ["snake", "case"]


def test_overlap_hand_computed():
    a5 = Counter(tokens(TEXT["A5"]))  # 6 tokens
    assert overlap(Counter(tokens("the service is $180")), a5) == pytest.approx(4 / 6)
    assert overlap(a5, a5) == 1.0
    assert overlap(Counter(), a5) == 0.0 and overlap(Counter(), Counter()) == 0.0
    assert overlap(Counter(["a", "a", "b"]), Counter(["a", "b", "b"])) == pytest.approx(2 / 3)


@pytest.mark.parametrize(
    "copy",
    [
        "The Chakra Balancing service is $180.",
        "the chakra balancing SERVICE is $180.",  # case folding
        "The  Chakra\nBalancing service   is $180.",  # whitespace folding
        "The Chakra Balancing service is $180",  # no final period
        "'The Chakra Balancing service is $180.'",  # the teacher's quotes
        "\u201cThe Chakra Balancing service is $180.\u201d",  # curly quotes
        "'The Chakra Balancing service is $180'.",  # period moved outside the quotes
        "The Chakra Balancing service is $180.,",  # a separator after the piece
        "Ｔｈｅ Chakra Balancing service is ＄180.",  # NFKC
    ],
)
def test_verbatim_tolerances_match(copy):
    assert canonical(copy) == canonical(TEXT["A5"]) == "the chakra balancing service is $180"
    assert [m.label for m in match_tags([f"A5: {copy}"], RECORD["history"])] == ["A5"]


@pytest.mark.parametrize(
    "copy",
    [
        "The Chakra Balancing service is $95.",  # a changed number
        "The Chakra Balancing service is $180.00.",  # a changed number form
        "The Chakra Balancing service is 180.",  # a dropped currency sign
        "The Chakra Balancing service",  # a dropped half
        "The service is $180 Chakra Balancing.",  # reordered words
        "The Chakra Balancing service is only $180.",  # an added word
        "The Chakra-Balancing service is $180.",  # changed inner punctuation
        "Chakra Balancing service is $180.",  # a dropped word
    ],
)
def test_altered_copies_match_nothing(copy):
    [m] = match_tags([f"A5: {copy}"], RECORD["history"])
    assert m.label is None and m.nearest == "A5"


def test_final_answer_parsing_rules():
    assert parse_completion("<think>x</think>\nFinal answer:   42  ").final_answer == "42"
    assert parse_completion("<think>Final answer: 1</think>\nso").final_answer is None  # only inside think
    assert parse_completion("<think>x</think>\nFinal answer:").final_answer is None  # empty
    assert parse_completion("no think at all. final ANSWER: maybe").final_answer == "maybe"
    assert parse_completion("<think>x</think> Final answer: a Final answer: b").final_answer == "b"
    assert parse_completion("<think>unclosed <HIS>Q1: x</HIS>").think == "unclosed <HIS>Q1: x</HIS>"
    assert parse_completion("plain text").think is None
    assert parse_completion("<think>x</think>\nＦｉｎａｌ answer: ＄180").final_answer == "$180"  # NFKC first


# ------------------------------------------------------------------ Eq. (5): format
@pytest.mark.parametrize(
    "text",
    [
        completion(["Q1", "A5", "A6"]),
        format_target(RECORD),  # Fig. 1 form: three utterances in one tag
        "<think>\nNo earlier turn is needed.\n</think>\nFinal answer: hello",  # no tags at all
        "\n  <think>x <HIS>Q1: a</HIS></think>Final answer: y\n\n",
        "<think><HIS>Turn A5: 'The Chakra Balancing service is $180.'</HIS></think>\nFinal answer: y",
        "<think>so my final answer: yes</think>\nFinal answer: yes",  # prose inside the think block
        # no label at a line start
        "<think>a</think>\nFinal answer: Yes.\nThe Q8 form is not needed: A5 says $180.",
    ],
)
def test_valid_formats(text):
    assert format_problems(text) == []
    assert is_valid_format(text)


@pytest.mark.parametrize(
    "text, phrase",
    [
        ("", "empty"),
        ("Final answer: yes", "exactly one <think>"),
        (
            "<think>a</think>\n<think>b</think>\nFinal answer: y",
            "exactly one <think> and one </think>, found 2 and 2",
        ),
        ("Sure! <think>a</think>\nFinal answer: y", "text before <think>"),
        ("<think>a</think>\n", "no 'Final answer:'"),
        ("<think>a</think>\nFinal answer:  ", "followed by no answer"),
        ("<think>a</think>\nFinal Answer: y", "write 'Final answer:' exactly"),
        ("<think>a</think>\nSo. Final answer: y", "text between </think> and 'Final answer:'"),
        ("<think>a</think>\nFinal answer: y\nFinal answer: z", "appears 2 times"),
        ("<think>   </think>\nFinal answer: y", "think block is empty"),
        ("<think>a</think>\nFinal answer: y <HIS>Q1: x</HIS>", "outside the think block"),
        ("<HIS>Q1: x</HIS><think>a</think>\nFinal answer: y", "outside the think block"),
        ("<think><HIS>Q1: a <HIS>A1: b</HIS></HIS></think>\nFinal answer: y", "nested <HIS>"),
        ("<think><HIS>Q1: a</think>\nFinal answer: y", "never closed"),
        ("<think>a</HIS></think>\nFinal answer: y", "has no opening <HIS>"),
        ("<think><HIS>  </HIS></think>\nFinal answer: y", "<HIS> tag 1 is empty"),
        ("<think><HIS>Q1: A5:</HIS></think>\nFinal answer: y", "label Q1 has no utterance text"),
        (
            "<think><HIS>Q2: A5: The Chakra Balancing service is $180.</HIS></think>\nFinal answer: y",
            "<HIS> tag 1: label Q2 has no utterance text",
        ),
        ("<think><HIS>A5: ''</HIS></think>\nFinal answer: y", "label A5 has no utterance text"),
        # look-alike markers, either way
        ("<think><his>Q1: a</his></think>\nFinal answer: y", "'<his>' looks like a marker"),
        (
            "<think>\uff1cHIS\uff1eQ1: a\uff1c/HIS\uff1e</think>\nFinal answer: y",
            "'\uff1cHIS\uff1e' looks like a marker",
        ),
        ("<think>\ufe64HIS\ufe65Q1: a</HIS></think>\nFinal answer: y", "looks like a marker"),
        ("<think><\u041dIS>Q1: a</\u041dIS></think>\nFinal answer: y", "'<\u041dIS>' looks like a marker"),
        ("<think><H\u200bIS>Q1: a</HIS></think>\nFinal answer: y", "looks like a marker"),
        ("<think><H\u00cdS>Q1: a</HI\u0301S></think>\nFinal answer: y", "'<H\u00cdS>' looks like a marker"),
        ("<think>a\u3008/think\u3009\nFinal answer: y", "looks like a marker"),
        ("\uff1cthink\uff1ea\uff1c/think\uff1e\nFinal answer: y", "'\uff1cthink\uff1e' looks like a marker"),
        ("<think>a</think>\n\uff26inal answer: y", "'\uff26inal answer:' looks like a marker"),
        ("<think>a</think>\nFinal \u0430nswer: y", "no 'Final answer:'"),  # Cyrillic a
        # the model writing the next turn after its answer
        ("<think>a</think>\nFinal answer: y\nQ8: thanks\nA8: welcome", "start a new turn: 'Q8:'"),
        ("<think>a</think>\nFinal answer: y\n  a8 : welcome", "start a new turn"),
        ("<think>a</think>\nFinal answer: y\nTurn Q8: thanks", "start a new turn"),
        ("<think>a</think>\nFinal answer: y\n\nUser: thanks", "start a new turn: 'User:'"),
        ("<think>a</think>\nFinal answer: y\nAssistant: anything else?", "start a new turn"),
        (
            "<think>a</think>\nFinal answer: y<|im_end|>\n<|im_start|>user\nthanks",
            "start a new turn: '<|im_end|>'",
        ),
        ("<think>a</think>\nFinal answer: y\n### Human\nthanks", "start a new turn"),
    ],
)
def test_invalid_formats_and_their_explanations(text, phrase):
    problems = format_problems(text)
    assert any(phrase in p for p in problems), problems
    assert not is_valid_format(text)
    assert compute_reward(text, RECORD)["format"] == 0.0


def test_full_width_tags_are_parsed_but_fail_the_format():
    honest = completion(["Q1", "A5", "A6"])
    wide = honest.replace("<HIS>", "\uff1cHIS\uff1e").replace("</HIS>", "\uff1c/HIS\uff1e")
    r, h = compute_reward(wide, RECORD), compute_reward(honest, RECORD)
    assert r["format"] == 0.0 and r["recall"] == h["recall"] == 1.25  # NFKC parses them: no hiding place
    assert h["total"] - r["total"] == pytest.approx(1.0)


# ------------------------------------------------------------------ recall set and Eq. (6)
def test_jaccard_and_recall_reward_hand_computed():
    assert jaccard(set(), set()) == 1.0
    assert recall_reward(set(), set()) == 1.25
    assert recall_reward({"Q1", "A5", "A6"}, ["Q1", "A5", "A6"]) == 1.25
    assert recall_reward({"Q1"}, {"Q1", "A5", "A6"}) == pytest.approx(2.5 / 3 - 1.25)
    assert recall_reward({"Q1", "A5", "Q2"}, {"Q1", "A5", "A6"}) == pytest.approx(0.0)  # IoU 2/4
    assert recall_reward({"Q1", "A5", "A6", "Q2"}, {"Q1", "A5", "A6"}) == pytest.approx(0.625)
    assert recall_reward({"Q2"}, {"Q1"}) == -1.25
    assert recall_reward(set(), {"Q1"}) == -1.25 and recall_reward({"Q1"}, set()) == -1.25


def test_paper_example_reference_scores_the_maximum():
    for choice in ANSWER_REWARDS:
        r = compute_reward(format_target(KEYED), KEYED, choice)
        assert r["format"] == 1.0
        assert r["recalled"] == ["Q1", "A5", "A6"] and r["unmatched"] == []
        assert r["jaccard"] == 1.0 and r["recall"] == 1.25
        assert r["answer"] == pytest.approx(1.0, abs=1e-5)
        assert r["total"] == pytest.approx(3.25, abs=1e-5)


def test_paper_example_with_a_paraphrased_answer():
    text = completion(["A6", "Q1", "A5"], answer="yes, the 20% discount applies")
    r = compute_reward(text, RECORD)
    assert r["recalled"] == ["Q1", "A5", "A6"]  # history order, not writing order
    assert r["final_answer"] == "yes, the 20% discount applies"
    expected = cosine("yes, the 20% discount applies", ANSWER)
    assert r["answer"] == pytest.approx(expected, abs=1e-5) and r["answer"] > 0.9
    assert r["total"] == pytest.approx(1.0 + 1.25 + expected, abs=1e-5)


@pytest.mark.parametrize(
    "tags, recalled, iou",
    [
        (["Q1", "A5"], ["Q1", "A5"], 2 / 3),  # partial recall
        (["Q1", "A5", "Q2"], ["Q1", "Q2", "A5"], 2 / 4),  # 2 of 3 gold + 1 wrong: recall 0
        (["Q1", "Q2", "A5", "A6"], ["Q1", "Q2", "A5", "A6"], 3 / 4),  # over-recall
        (["A2", "Q3"], ["A2", "Q3"], 0.0),  # all wrong
        (["Q1", "A5", "A6", "The spa opens at 9 am on Sundays."], ["Q1", "A5", "A6"], 3 / 4),  # hallucination
        (["Q1", "A5", "A6", "The spa opens at 9 am.", "The spa opens at 9 am."], ["Q1", "A5", "A6"], 3 / 4),
        (["Q1", "Q1", "A5", "A6", "A5"], ["Q1", "A5", "A6"], 1.0),  # the same utterance twice counts once
        (["Q1", "A5", "A6", "The spa opens at 9 am.", "Parking is free."], ["Q1", "A5", "A6"], 3 / 5),
        (["Q1", "A6", "A5: The Chakra Balancing service is $95."], ["Q1", "A6"], 2 / 4),  # altered copy
    ],
)
def test_recall_component_hand_computed(tags, recalled, iou):
    r = compute_reward(completion(tags), RECORD)
    assert r["recalled"] == recalled
    assert r["jaccard"] == pytest.approx(iou)
    assert r["recall"] == pytest.approx(2.5 * iou - 1.25)
    assert r["format"] == 1.0


def test_empty_gold_set():
    record = make_record(recall=())
    no_tags = "<think>\nNo earlier turn is needed.\n</think>\nFinal answer: " + ANSWER
    r = compute_reward(no_tags, record)
    assert r["jaccard"] == 1.0 and r["recall"] == 1.25 and r["recalled"] == []
    assert compute_reward(completion(["Q1"]), record)["recall"] == -1.25
    assert compute_reward(no_tags, RECORD)["recall"] == -1.25  # missing recall


def test_hallucinated_tag_is_reported_unmatched_with_its_nearest_utterance():
    matches = match_tags(["The spa opens at 9 am.", f"Q1: {TEXT['Q1']}"], RECORD["history"])
    assert [m.label for m in matches] == [None, "Q1"]
    assert matches[1].overlap == 1.0 and matches[1].nearest == "Q1"
    text, label, nearest, score = matches[0]  # plain tuples
    assert text == "The spa opens at 9 am." and label is None and score < 1.0


def test_teacher_form_earns_full_recall_credit():
    one_per_tag = completion([f"Turn {label}: '{TEXT[label]}'" for label in ("Q1", "A5", "A6")])
    fig1 = completion([", ".join(f"Turn {label}: '{TEXT[label]}'" for label in ("Q1", "A5", "A6"))])
    for text in (one_per_tag, fig1):
        r = compute_reward(text, RECORD)
        assert r["format"] == 1.0 and r["recalled"] == ["Q1", "A5", "A6"] and r["unmatched"] == []
        assert r["recall"] == 1.25


def test_empty_label_piece_is_a_format_error_not_a_wrong_recall():
    text = completion(["Q1", f"Q2: A5: {TEXT['A5']}", "A6"])
    r = compute_reward(text, RECORD)
    assert r["format"] == 0.0 and any("label Q2 has no utterance text" in p for p in r["format_problems"])
    assert r["recalled"] == ["Q1", "A5", "A6"] and r["unmatched"] == [] and r["recall"] == 1.25


def test_text_decides_when_label_and_text_disagree():
    r = compute_reward(completion([f"A5: {TEXT['Q1']}", "A5", "A6"]), RECORD)
    assert r["recalled"] == ["Q1", "A5", "A6"] and r["recall"] == 1.25
    r = compute_reward(completion([f"A5: {TEXT['Q1']}", "A6"]), RECORD)  # the mislabel does not earn A5
    assert r["recalled"] == ["Q1", "A6"] and r["jaccard"] == pytest.approx(2 / 3)
    r = compute_reward(completion([f"A5: {TEXT['Q2']}", "Q1", "A6"]), RECORD)  # nor does a copy of Q2
    assert r["recalled"] == ["Q1", "Q2", "A6"] and r["jaccard"] == pytest.approx(2 / 4)


def test_label_breaks_exact_ties_between_identical_utterances():
    turns = [("Q1", "Is it open?"), ("A1", "Yes."), ("Q2", "Is Lena in?"), ("A2", "Yes.")]
    history = make_record(turns)["history"]
    assert [m.label for m in match_tags(["A2: Yes."], history)] == ["A2"]
    assert [m.label for m in match_tags(["A1: Yes."], history)] == ["A1"]
    assert [m.label for m in match_tags(["Yes."], history)] == ["A1"]  # no hint: the earliest
    assert [m.label for m in match_tags(["Q2: Yes"], history)] == ["A1"]  # a wrong hint: the earliest


def test_a_label_inside_an_utterance_does_not_cut_it():
    turns = [
        ("Q1", "Which plan? Take plan A2: it is cheaper."),
        ("A1", "OK."),
        ("Q2", "And A1: the old one?"),
    ]
    history = make_record(turns)["history"]
    tags = [f"Q1: {turns[0][1]} A1: OK.", f"Q2: {turns[2][1]}"]
    assert [m.label for m in match_tags(tags, history)] == ["Q1", "A1", "Q2"]
    assert [p.hint for p in split_tag(tags[0])] == ["Q1", "A2", "A1"]  # without the history: every label


def test_unlabelled_paste_of_several_utterances_matches_nothing():
    paste = " ".join(TEXT[label] for label in ("Q1", "A5", "A6"))  # 11 + 6 + 9 = 26 tokens
    [m] = match_tags([paste], RECORD["history"])
    assert m.label is None and m.nearest == "Q1" and m.overlap == pytest.approx(11 / 26)
    r = compute_reward(completion([paste]), RECORD)
    assert r["recalled"] == [] and r["unmatched"] == [paste] and r["recall"] == -1.25


def test_half_a_copy_matches_nothing():
    half = "I need to check membership status."  # 6 of Q1's 11 tokens
    [m] = match_tags([f"Q1: {half}"], RECORD["history"])
    assert m.label is None and m.nearest == "Q1" and m.overlap == pytest.approx(6 / 11)


def test_unmatched_key_folds_label_and_canonical_form():
    assert reward.unmatched_key("A5: The spa opens at 9 am.") == reward.unmatched_key(
        "'the spa opens at 9 am'"
    )
    assert reward.unmatched_key("x").startswith("?")


# ------------------------------------------------------------------ Eq. (7): cosine and answer keys
def test_normalize_number():
    assert normalize_number("$180.00") == normalize_number("$180") == normalize_number("180") == "180"
    assert normalize_number("1,800") == "1800" and normalize_number("$12.50") == "12.5"
    assert normalize_number("20 %") == normalize_number("20%") == "20%" != normalize_number("$20")
    assert normalize_number("＄１８０") == "180" and normalize_number("abc") is None


def test_keys_present_normalises_numbers_on_word_boundaries():
    for answer in ("It is $180.00.", "It is $180.", "It is 180", "It costs 180 dollars"):
        assert keys_present(answer, ["$180", "180", "$180.00"]) == [True, True, True], answer
    assert keys_present("It is $207.", ["$20"]) == [False]
    assert keys_present("20% off", ["$20"]) == [False]
    assert keys_present("It is $1,800.", ["$1800", "$180"]) == [True, False]
    assert keys_present("Lena, at Uptown.", ["lena", "Uptown branch", "Up"]) == [True, False, False]
    assert keys_present(None, ["yes"]) == [False] and keys_present("x", []) == []


def test_yes_no_keys_need_one_polarity():
    assert keys_present("Yes, it applies.", ["yes"]) == [True]
    assert keys_present("Yes or no: it may apply.", ["yes"]) == [False]  # the hedge states neither
    assert keys_present("No.", ["no", "yes"]) == [True, False]
    assert keys_present("Yes, I know it is not over.", ["yes"]) == [True]  # 'know' and 'not' are not 'no'
    for hedge in ("Possibly yes, possibly not.", "Maybe yes.", "Yes, probably.", "Yes. No.", "yes/no"):
        assert keys_present(hedge, ["yes"]) == [False], hedge


def test_key_reward_hand_computed():
    ref = KEYED["answer"]
    assert key_reward("Yes, $180.", ["yes", "$180"], ref)[0] == 1.0  # share 2/2
    assert key_reward("Yes, $95.", ["yes", "$180"], ref)[0] == pytest.approx(-1 / 3)  # 1 / (2 + 1 extra)
    assert key_reward("$180", ["yes", "$180"], ref)[0] == 0.0  # 1 / 2
    value, present, extras = key_reward("Yes. $95, $120, $150 or $180.", ["yes", "$180"], ref)
    assert (value, present, extras) == (0.0, [True, True], ["120", "95"])  # 2 / (2 + 2)
    value, present, extras = key_reward("Yes, $180, with Lena at Downtown.", ["yes", "$180"], ref)
    assert (value, extras) == (0.0, ["downtown", "lena"])  # extra names cost as extra numbers do
    # restating the reference's threshold ($150) costs nothing
    assert key_reward("Yes: $180.00 is over $150.", ["yes", "$180"], ref)[0] == 1.0
    assert key_reward(None, ["yes"], ref)[0] == -1.0


def test_answer_reward_choices_on_one_record():
    wrong = completion(["Q1", "A5", "A6"], answer="No. The service is $120, which is not over $150.")
    right = completion(["Q1", "A5", "A6"], answer="Yes: $180.00 is over $150.")
    for text, keys in ((wrong, -1.0), (right, 1.0)):
        by = {c: compute_reward(text, KEYED, c) for c in ANSWER_REWARDS}
        cos = cosine(parse_completion(text).final_answer, KEYED["answer"])
        assert by["cosine"]["answer"] == pytest.approx(cos, abs=1e-5)
        assert by["keys"]["answer"] == keys and by["keys"]["answer_cosine"] is None  # keys need no embedder
        assert by["both"]["answer"] == pytest.approx(keys if keys < 1 else (1 + cos) / 2, abs=1e-5)
        assert by["cosine"]["answer_keys"] == keys  # logged under every choice
    with pytest.raises(ValueError):
        compute_reward(right, KEYED, "f1")


def test_keys_without_embedder_and_fallback_without_keys(monkeypatch):
    text = completion(["Q1", "A5", "A6"], answer="Yes, $180.")
    cos = compute_reward(text, RECORD)["answer"]
    for choice in ANSWER_REWARDS:  # RECORD has no answer_keys: the cosine
        r = compute_reward(text, RECORD, choice)
        assert r["answer"] == pytest.approx(cos, abs=1e-6) and r["answer_keys"] is None
    assert compute_reward(text, {**KEYED, "answer_keys": ["", " "]}, "keys")["answer_keys"] is None  # no keys
    monkeypatch.setattr(reward, "embed", lambda texts: pytest.fail("keys must not embed"))
    assert compute_reward(text, KEYED, "keys")["answer"] == 1.0
    assert compute_reward(text, {**KEYED, "answer_keys": "$180"}, "keys")["keys_present"] == [
        True
    ]  # one string


def test_missing_final_answer_gets_the_minimum():
    for choice in ANSWER_REWARDS:
        for text in ("<think>\n<HIS>Q1: " + TEXT["Q1"] + "</HIS>\n</think>\n", "", "Final answer:   "):
            r = compute_reward(text, KEYED, choice)
            assert r["final_answer"] is None and r["answer"] == -1.0
            assert r["total"] == pytest.approx(r["format"] + r["recall"] - 1.0)


def test_answer_gate_takes_the_answer_only_from_a_recall_that_missed_h_star_entirely():
    """H* = {Q1, A5, A6}. The gate sets the answer term to -1 exactly when the recall shares no turn
    with H* on a turn that needs recall; a partial recall keeps its answer, and so does a turn whose
    H* is empty (nothing to miss). Totals stay format + recall + answer."""
    right = "Yes. The service is $180, over $150, so the 20% discount applies."
    for choice in ANSWER_REWARDS:
        for tags, gated in ((["Q2", "A3"], True), (["A6"], False), (["Q1", "A5", "A6"], False), ([], True)):
            text = completion(tags, answer=right)
            off, on = compute_reward(text, KEYED, choice), compute_reward(text, KEYED, choice, "recall")
            assert off["answer"] > 0.5 and on["answer_gated"] is gated and off["answer_gated"] is False
            assert on["answer"] == (-1.0 if gated else off["answer"]), (choice, tags)
            assert on["total"] == pytest.approx(on["format"] + on["recall"] + on["answer"])
            assert (on["recall"], on["format"]) == (off["recall"], off["format"])
    no_recall = make_record(recall=(), keys=["yes"])
    for tags in ([], ["Q2"]):  # H* empty: Jaccard 1 for silence, 0 for a recall, never gated
        r = compute_reward(completion(tags, answer="yes"), no_recall, "keys", "recall")
        assert r["answer_gated"] is False and r["answer"] == 1.0
    with pytest.raises(ValueError, match="answer_gate"):
        compute_reward(completion(["A6"]), KEYED, "keys", "always")
    gated = reward.explain(completion(["Q2"], answer=right), KEYED, "keys", "recall")
    assert "answer  -1.0000 (--answer-gate recall) the recall missed H*; ungated: keys +1.0000" in gated
    assert "(--answer-gate" not in reward.explain(completion(["A6"], answer=right), KEYED, "keys", "recall")


# ------------------------------------------------------------------ the reward-hacking gallery
@pytest.fixture(scope="module")
def gallery():
    return gallery_scores(compute_rewards, ANSWER_REWARDS)


def test_gallery_covers_the_recall_format_and_answer_attacks(gallery):
    names = " ".join(s["name"] for s in gallery)
    for phrase in (
        "price changed ($95)",
        "Downtown",
        "Gold Tier",
        "shuffled",
        "fact dropped",
        "empty label piece",
        "full-width",
        "next turns after the answer",
        "hedge",
        "wrong but similar",
        "right short answer",
        "every history turn",
        "nothing recalled",
        "query copied",
        "repeated",
        "after </think>",
        "homoglyph",
        "two final answers",
        "query echoed",
        "every candidate price",
        "keyword stuffing",
    ):
        assert phrase in names, phrase
    assert gallery[0]["kind"] == "honest"
    assert all(gallery[0]["total"][c] == pytest.approx(3.25, abs=1e-5) for c in ANSWER_REWARDS)


def test_every_recall_and_format_attack_loses_at_least_one_under_every_choice(gallery):
    attacks = [s for s in gallery if s["kind"] in ("recall attack", "format attack")]
    assert len(attacks) >= 18
    for s in attacks:
        for choice in ANSWER_REWARDS:
            assert s["margin"][choice] >= 1.0 - 1e-9, (s["name"], choice, s["margin"])


def test_answer_attacks_lose_at_least_one_under_keys_and_both_but_not_under_cosine(gallery):
    attacks = {s["name"].split(" '")[0]: s for s in gallery if s["kind"] == "answer attack"}
    for s in attacks.values():
        assert s["format"] == 1.0 and s["recall"] == 1.25
        assert s["margin"]["keys"] >= 1.0 - 1e-9 and s["margin"]["both"] >= 1.0 - 1e-9, s["name"]
    # Eq. (7) as the paper defines it: the wrong answers that share the reference's words stay close.
    for name in ("hedge", "wrong but similar", "price changed in the answer ($95)"):
        assert attacks[name]["margin"]["cosine"] < 0.5, name


def test_honest_variants_lose_nothing_under_keys(gallery):
    variants = [s for s in gallery if s["kind"] == "variant"]
    names = " ".join(s["name"] for s in variants)
    assert "teacher form" in names and "Fig. 1 form" in names and "labels swapped" in names
    for s in variants:
        assert s["format"] == 1.0 and s["recall"] == 1.25, s["name"]
        assert s["margin"]["keys"] == pytest.approx(0.0, abs=1e-9), s["name"]
    short = next(s for s in variants if s["name"].startswith("right short answer"))
    assert short["margin"]["cosine"] > 0.3  # the cosine pays less for a right answer in other words


def test_open_attacks_are_listed_and_still_lose_something(gallery):
    assert {s["kind"] for s in gallery} == {
        "honest",
        "variant",
        "recall attack",
        "format attack",
        "answer attack",
        "open attack",
    }
    open_rows = [s for s in gallery if s["kind"] == "open attack"]
    assert [s["name"] for s in open_rows] == ["the history pasted in lowercase (its names are no values)"]
    for s in open_rows:  # keys find "yes" (A2) and "$180" (A5) in it; lowercased, Lena and Downtown are
        # no names, so only its extra number "90" costs (the keys here are no names: a name key must
        # be capitalised, so on a record keyed by a name this attack fails, tests/test_metrics_matcher.py)
        assert s["format"] == 1.0 and s["recall"] == 1.25
        assert all(0.2 < s["margin"][c] < 1.0 for c in ANSWER_REWARDS), s["margin"]


def test_history_attacks_are_answer_attacks(gallery):
    """The answers made of the history lose at least 1.0 under keys and both: the pasted
    history (an open attack before the matcher counted extra names), without its numbers, its
    numbers, its names, and both polarities."""
    rows = {s["name"].split(" '")[0]: s for s in gallery}
    for name in (
        "the whole history pasted as the answer",
        "the history pasted without its numbers",
        "every number of the history",
        "every name of the history",
        "yes and no",
    ):
        assert rows[name]["kind"] == "answer attack", name
        assert rows[name]["margin"]["keys"] >= 1.0 - 1e-9 and rows[name]["margin"]["both"] >= 1.0 - 1e-9
    names = next(s["name"] for s in gallery if s["name"].startswith("every name of the history"))
    assert "Lena" in names and "Downtown" in names and "Apex Tier" in names


def test_gallery_cli_prints_a_markdown_table(capsys, gallery):
    assert reward.main(["--gallery"]) is None
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("| completion | kind | format | recall | answer cosine | total cosine")
    assert lines[1].startswith("|---|") and len(lines) == 2 + len(gallery)
    assert all(line.count(" | ") == lines[0].count(" | ") for line in lines[2:])
    assert "| honest | 1 | +1.250 | +1.000 | +3.250 (+0.00) |" in lines[2]


def test_committed_gallery_page_is_the_commands_output(capsys):
    """docs/reward-gallery.md is `python reward.py --gallery --markdown`'s output: rerun that command
    when this fails (a change to the reward or to the gallery moved a score)."""
    assert reward.main(["--gallery", "--markdown"]) is None
    page = capsys.readouterr().out
    assert page.startswith("# ") and GALLERY_COMMAND in page
    committed = os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "reward-gallery.md"
    )
    with open(committed, encoding="utf-8") as f:
        assert f.read() == page, f"{committed} is stale: rerun `{GALLERY_COMMAND}`"


def test_gallery_markdown_needs_gallery(capsys):
    with pytest.raises(SystemExit) as e:
        reward.main(["--markdown", "--data", "records.jsonl"])
    assert e.value.code == 2 and "--markdown goes with --gallery" in capsys.readouterr().err


def test_gallery_record_is_a_valid_stage0_record():
    from srt.data_io import validate_record

    validate_record(dict(GALLERY_RECORD))
    assert compute_reward(format_target(GALLERY_RECORD), GALLERY_RECORD)["recalled"] == ["Q1", "A5", "A6"]


# ------------------------------------------------------------------ robustness
def test_a_20000_character_tag():
    words = "lorem ipsum dolor sit amet consectetur adipiscing elit".split()
    long_tag = " ".join(words[i % len(words)] + str(i) for i in range(3000))[:19000] + " " + TEXT["Q1"]
    assert len(long_tag) > 19000
    text = completion([long_tag])
    start = time.perf_counter()
    r = compute_reward(text, RECORD)
    assert time.perf_counter() - start < 5
    assert r["format"] == 1.0
    assert r["recalled"] == [] and len(r["unmatched"]) == 1 and r["recall"] == -1.25


def test_many_labels_in_one_tag_stay_fast():
    tag = " ".join(f"Q{i}: word{i}" for i in range(1, 200)) + " " + " ".join(f"{lb}: {t}" for lb, t in TURNS)
    start = time.perf_counter()
    r = compute_reward(completion([tag]), RECORD)
    assert time.perf_counter() - start < 5
    assert r["recalled"] == [label for label, _ in TURNS] and len(r["unmatched"]) == 199


def test_non_ascii_text():
    turns = [
        ("Q1", "Je voudrais réserver un soin à 180 €, s'il vous plaît."),
        ("A1", "我需要查看您的会员状态。"),
        ("Q2", "Danke schön, und die Straße zum Spa? 🙂"),
        ("A2", "Уточните, пожалуйста, филиал."),
    ]
    record = make_record(turns, recall=("Q1", "A1"), answer="Oui, la réduction s'applique.")
    text = (
        "<think>\n<HIS>Q1: Je voudrais réserver un soin à 180 €, s'il vous plaît.</HIS>\n"
        "<HIS>A2: Уточните, пожалуйста, филиал</HIS>\n"
        "<HIS>A1: 我需要查看你的会员状态。</HIS>\n</think>\nFinal answer: Oui, la réduction s'applique ✓"
    )
    r = compute_reward(text, record)
    assert r["format"] == 1.0
    assert r["recalled"] == ["Q1", "A2"] and len(r["unmatched"]) == 1  # 1 of 11 ideographs changed
    assert r["matches"][2][1:] == [None, "A1", pytest.approx(10 / 11, abs=1e-4)]
    assert r["jaccard"] == pytest.approx(1 / 4)
    assert (
        match_tags(["A1: 我需要查看您的会员状态"], record["history"])[0].label == "A1"
    )  # 。 is final punctuation
    assert -1.0 <= r["answer"] <= 1.0 and r["final_answer"].endswith("✓")


# ------------------------------------------------------------------ batching and properties
def test_compute_rewards_equals_compute_reward_item_by_item():
    other = make_record(turns=TURNS[:6], recall=("A1",), answer="It is valid at every branch.", rid="other")
    completions = [
        format_target(KEYED),
        completion(["Q1", "A5"], answer="no"),
        "",
        "garbage",
        completion(["A1"], answer="every branch"),
        completion(["A1"], answer="every branch"),
        "<think>a</think>\nFinal answer: yes, it applies",
    ]
    examples = [KEYED, KEYED, other, RECORD, other, other, KEYED]
    for choice in ANSWER_REWARDS:
        batched = compute_rewards(completions, examples, choice)
        for text, example, b in zip(completions, examples, batched):
            single = compute_reward(text, example, choice)
            assert b.keys() == single.keys()
            for key in b:
                if key in ("answer", "total", "answer_cosine") and b[key] is not None:
                    assert b[key] == pytest.approx(single[key], abs=1e-5), key
                else:
                    assert b[key] == single[key], key
    with pytest.raises(ValueError):
        compute_rewards(["a"], [])


def check_ranges(r):
    assert r["format"] in (0.0, 1.0)
    assert -1.25 <= r["recall"] <= 1.25
    assert 0.0 <= r["jaccard"] <= 1.0
    assert -1.0 <= r["answer"] <= 1.0
    for key in ("answer_cosine", "answer_keys"):
        assert r[key] is None or -1.0 <= r[key] <= 1.0
    assert r["total"] == pytest.approx(r["format"] + r["recall"] + r["answer"])
    assert -2.25 <= r["total"] <= 3.25 + 1e-9
    json.dumps(r)  # loggable as is


FRAGMENTS = st.sampled_from(
    [
        "<think>",
        "</think>",
        "<HIS>",
        "</HIS>",
        "Final answer:",
        "final answer:",
        "Q1:",
        "A5:",
        "A99:",
        "Turn A6:",
        "\n",
        " ",
        "'",
        "\u201c",
        TEXT["Q1"],
        TEXT["A5"],
        "<his>",
        "\uff1cHIS\uff1e",
        "\u041d",
        "\u200b",
        "\nQ8:",
        "<|im_start|>",
        "$180",
        "yes",
        "no",
        "é中🙂",
    ]
)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=300), st.sampled_from(ANSWER_REWARDS))
def test_any_string_scores_in_range(text, choice):
    check_ranges(compute_reward(text, KEYED, choice))
    assert isinstance(is_valid_format(text), bool)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.one_of(FRAGMENTS, st.text(max_size=20)), max_size=25).map("".join),
    st.sampled_from(ANSWER_REWARDS),
)
def test_tag_soup_scores_in_range(text, choice):
    r = compute_reward(text, KEYED, choice)
    check_ranges(r)
    if r["format"] == 1.0:  # a valid format always parses into a think block and an answer
        parsed = parse_completion(text)
        assert parsed.think is not None and parsed.final_answer == r["final_answer"] is not None
    assert set(r["recalled"]) <= {label for label, _ in TURNS}


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=60), st.lists(st.text(max_size=10), max_size=4))
def test_keys_never_raise(answer, keys):
    assert len(keys_present(answer, keys)) == len(keys)
    value, _, extras = key_reward(answer, keys, "Yes, $180.")
    assert -1.0 <= value <= 1.0 and all(isinstance(x, str) for x in extras)
    normalize_number(answer)


# ------------------------------------------------------------------ command line
@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "test.jsonl"
    other = make_record(recall=("Q2", "A2"), answer="Yes, at every branch.", rid="second")
    path.write_text(json.dumps(KEYED) + "\n" + json.dumps(other) + "\n", encoding="utf-8")
    return path


def test_cli_explains_one_completion(data_file, tmp_path, capsys):
    file = tmp_path / "c.txt"
    file.write_text(
        completion(
            ["Q1", "A5", "Q2", "Nonsense here.", "A6: Lena only offers that service at our Downtown branch."],
            answer="Yes, $95.",
        ),
        encoding="utf-8",
    )
    reward.main(
        ["--data", str(data_file), "--index", "0", "--completion", str(file), "--answer-reward", "both"]
    )
    out = capsys.readouterr().out
    assert "format  1" in out and "-> Q2  verbatim  NOT in H*" in out
    assert "-> nothing" in out and "nearest A6 (token overlap 0.89)" in out
    assert "|H^ n H*| = 2   |H^ u H*| = 6" in out
    assert "recall  -0.4167" in out  # 2.5 * 2/6 - 1.25
    assert "keys -0.3333 ('yes' found, '$180' missing; extra values ['95'])" in out
    reward.main(["--data", str(data_file), "--id", "paper-apex-t07", "--completion", "<think>x</think>"])
    out = capsys.readouterr().out
    assert "no 'Final answer:' after </think>" in out and "answer  -1.0000" in out


def test_cli_scores_a_file_and_reports_bad_lines(data_file, tmp_path, capsys):
    preds = tmp_path / "preds.jsonl"
    preds.write_text(
        json.dumps({"id": "paper-apex-t07", "completion": format_target(KEYED)})
        + "\n"
        + json.dumps({"index": 1, "completion": ""})
        + "\n",
        encoding="utf-8",
    )
    out_dir = tmp_path / "scores"
    summary = reward.main(
        [
            "--data",
            str(data_file),
            "--completions",
            str(preds),
            "--out",
            str(out_dir),
            "--answer-reward",
            "keys",
        ]
    )
    assert summary["n"] == 2 and summary["answer_reward"] == "keys"
    assert summary["format"] == 0.5 and summary["recall"] == pytest.approx((1.25 - 1.25) / 2)
    assert summary["answer"] == pytest.approx((1.0 - 1.0) / 2, abs=1e-5)
    assert "mean total" in capsys.readouterr().out
    assert len((out_dir / "scores.jsonl").read_text().splitlines()) == 2
    config = json.loads((out_dir / "config.json").read_text())
    assert config["completions"] == str(preds) and config["answer_reward"] == "keys"

    preds.write_text(
        json.dumps({"id": "paper-apex-t07", "completion": "x"})
        + "\n"
        + json.dumps({"id": "paper-apex-t07"})
        + "\n",
        encoding="utf-8",
    )
    with pytest.raises(SystemExit) as e:
        reward.main(["--data", str(data_file), "--completions", str(preds)])
    assert str(e.value) == f"error: {preds}:2: field 'completion' is missing or not a string"
    preds.write_text(json.dumps({"id": "nope", "completion": "x"}) + "\n", encoding="utf-8")
    with pytest.raises(SystemExit) as e:
        reward.main(["--data", str(data_file), "--completions", str(preds)])
    assert f"{preds}:1: field 'id' names 'nope'" in str(e.value)
    preds.write_text(json.dumps({"index": 9, "completion": "x"}) + "\n", encoding="utf-8")
    with pytest.raises(SystemExit) as e:
        reward.main(["--data", str(data_file), "--completions", str(preds)])
    assert f"{preds}:1: field 'id' (or 'index', an integer in [0, 2))" in str(e.value)
    with pytest.raises(SystemExit) as e:
        reward.main(["--data", str(data_file), "--index", "7"])
    assert "out of range" in str(e.value)
    with pytest.raises(SystemExit):  # refused by argparse, before the file is read
        reward.main(["--data", str(data_file), "--index", "-1"])
    assert "argument --index: must be >= 0, got -1" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n", encoding="utf-8")
    with pytest.raises(SystemExit) as e:
        reward.main(["--data", str(bad)])
    assert f"{bad}:1: not valid JSON" in str(e.value)


def test_cli_help_and_required_data(capsys):
    with pytest.raises(SystemExit) as e:
        reward.main(["--help"])
    assert e.value.code == 0 and "--answer-reward" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        reward.main([])
    assert e.value.code == 2 and "--data is required" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        reward.main(["--gallery", "--answer-reward", "f1"])
    assert e.value.code == 2
