"""Tests of reward.py (paper §3.4, Eqs. (4)-(7)): hand-computed values, edge cases, reward hacking,
and property tests over arbitrary strings. The answer reward embeds for real with all-MiniLM-L6-v2."""
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
from reward import (compute_reward, compute_rewards, format_problems, is_valid_format, jaccard,  # noqa: E402
                    match_tags, overlap, parse_completion, predicted_recall_set, recall_reward,
                    recalled_labels, split_tag, tokens)
from stage0_build import embed, format_target  # noqa: E402

# The paper's running example (Fig. 1): is the Apex Tier discount valid for Lena's Chakra Balancing?
TURNS = [
    ("Q1", "I need to check membership status. I'm under Apex Tier."),
    ("A1", "Welcome back. I confirm your Apex Tier status. As a reminder, this gives you a 20% discount "
           "on any service over $150."),
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


def make_record(turns=TURNS, recall=("Q1", "A5", "A6"), answer=ANSWER, rid="paper-apex-t07"):
    history = [{"label": l, "speaker": "user" if l[0] == "Q" else "assistant", "text": t} for l, t in turns]
    return {"id": rid, "source": "jsonl", "history": history,
            "query": "If I book Lena for Chakra Balancing, does my membership discount apply?",
            "query_turn": len(turns) // 2 + 1, "recall": list(recall), "answer": answer,
            "reasoning": "1. Analyze Query: discount for Lena's Chakra Balancing?\n2. Recall History: "
                         f"<HIS>Q1: {TEXT['Q1']} A5: {TEXT['A5']} A6: {TEXT['A6']}</HIS>\n"
                         "3. Reasoning: $180 is over $150, so the discount applies.",
            "pruned": list(recall), "meta": {"num_turns": len(turns) // 2 + 1, "bucket": 8, "scores": {}}}


RECORD = make_record()


def completion(tags, answer="yes, the 20% discount applies", think_extra=""):
    """A well-formed completion with one <HIS> tag per item of `tags` (labels or literal text)."""
    his = "\n".join(f"<HIS>{t}: {TEXT[t]}</HIS>" if t in TEXT else f"<HIS>{t}</HIS>" for t in tags)
    return (f"<think>\n1. Analyze Query: does the discount apply?\n2. Recall History: {his}\n"
            f"3. Reasoning: it does.{think_extra}\n</think>\nFinal answer: {answer}")


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
    assert pieces[1].tokens == Counter(["the", "chakra", "balancing", "service", "is", "180"])


def test_unlabelled_head_of_a_tag_is_its_own_piece():
    pieces = split_tag("Recalled: the price. A5: The Chakra Balancing service is $180.")
    assert [(p.hint, p.text) for p in pieces] == [(None, "Recalled: the price."),
                                                  ("A5", "A5: The Chakra Balancing service is $180.")]


def test_tokens_normalization():
    assert tokens("I'm under Apex Tier.") == ["i", "m", "under", "apex", "tier"]
    assert tokens("$180, 20%!") == ["180", "20"]
    assert tokens("ＡＰＥＸ Tier") == ["apex", "tier"]        # NFKC folds full-width letters
    assert tokens("Straße") == ["strasse"]                   # casefold
    assert tokens("我需要查看会员") == list("我需要查看会员")   # one token per ideograph
    assert tokens("snake_case") == ["snake", "case"]


def test_overlap_hand_computed():
    a5 = Counter(tokens(TEXT["A5"]))                                        # 6 tokens
    assert overlap(Counter(tokens("the service is $180")), a5) == pytest.approx(4 / 6)
    assert overlap(a5, a5) == 1.0
    assert overlap(Counter(), a5) == 0.0 and overlap(Counter(), Counter()) == 0.0
    # multiset: a repeated word counts as often as both sides hold it
    assert overlap(Counter(["a", "a", "b"]), Counter(["a", "b", "b"])) == pytest.approx(2 / 3)


def test_final_answer_parsing_rules():
    assert parse_completion("<think>x</think>\nFinal answer:   42  ").final_answer == "42"
    assert parse_completion("<think>Final answer: 1</think>\nso").final_answer is None  # only inside think
    assert parse_completion("<think>x</think>\nFinal answer:").final_answer is None     # empty
    assert parse_completion("no think at all. final ANSWER: maybe").final_answer == "maybe"
    assert parse_completion("<think>x</think> Final answer: a Final answer: b").final_answer == "b"
    assert parse_completion("<think>unclosed <HIS>Q1: x</HIS>").think == "unclosed <HIS>Q1: x</HIS>"
    assert parse_completion("plain text").think is None


# ------------------------------------------------------------------ Eq. (5): format
@pytest.mark.parametrize("text", [
    completion(["Q1", "A5", "A6"]),
    format_target(RECORD),                                        # Fig. 1 form: three utterances in one tag
    "<think>\nNo earlier turn is needed.\n</think>\nFinal answer: hello",   # no tags at all
    "\n  <think>x <HIS>Q1: a</HIS></think>Final answer: y\n\n",
])
def test_valid_formats(text):
    assert format_problems(text) == []
    assert is_valid_format(text)


@pytest.mark.parametrize("text, phrase", [
    ("", "empty"),
    ("Final answer: yes", "exactly one <think>"),
    ("<think>a</think>\n<think>b</think>\nFinal answer: y", "exactly one <think> and one </think>, found 2 and 2"),
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
    ("<think><HIS>Q1: A5:</HIS></think>\nFinal answer: y", "labels but no utterance text"),
    ("<think><his>Q1: a</his></think>\nFinal answer: y", "'<his>' is not a tag"),
])
def test_invalid_formats_and_their_explanations(text, phrase):
    problems = format_problems(text)
    assert any(phrase in p for p in problems), problems
    assert not is_valid_format(text)
    assert compute_reward(text, RECORD)["format"] == 0.0


# ------------------------------------------------------------------ recall set and Eq. (6)
def test_jaccard_and_recall_reward_hand_computed():
    assert jaccard(set(), set()) == 1.0
    assert recall_reward(set(), set()) == 1.25
    assert recall_reward({"Q1", "A5", "A6"}, ["Q1", "A5", "A6"]) == 1.25
    assert recall_reward({"Q1"}, {"Q1", "A5", "A6"}) == pytest.approx(2.5 / 3 - 1.25)
    assert recall_reward({"Q1", "A5", "A6", "Q2"}, {"Q1", "A5", "A6"}) == pytest.approx(0.625)
    assert recall_reward({"Q2"}, {"Q1"}) == -1.25
    assert recall_reward(set(), {"Q1"}) == -1.25 and recall_reward({"Q1"}, set()) == -1.25


def test_paper_example_reference_scores_the_maximum():
    r = compute_reward(format_target(RECORD), RECORD)
    assert r["format"] == 1.0
    assert r["recalled"] == ["Q1", "A5", "A6"] and r["unmatched"] == []
    assert r["jaccard"] == 1.0 and r["recall"] == 1.25
    assert r["answer"] == pytest.approx(1.0, abs=1e-5)
    assert r["total"] == pytest.approx(3.25, abs=1e-5)


def test_paper_example_with_a_paraphrased_answer():
    text = completion(["A6", "Q1", "A5"], answer="yes, the 20% discount applies")
    r = compute_reward(text, RECORD)
    assert r["recalled"] == ["Q1", "A5", "A6"]               # history order, not writing order
    assert r["final_answer"] == "yes, the 20% discount applies"
    expected = cosine("yes, the 20% discount applies", ANSWER)
    assert r["answer"] == pytest.approx(expected, abs=1e-5) and r["answer"] > 0.9
    assert r["total"] == pytest.approx(1.0 + 1.25 + expected, abs=1e-5)


@pytest.mark.parametrize("tags, recalled, iou", [
    (["Q1", "A5"], ["Q1", "A5"], 2 / 3),                       # partial recall
    (["Q1", "Q2", "A5", "A6"], ["Q1", "Q2", "A5", "A6"], 3 / 4),  # over-recall
    (["A2", "Q3"], ["A2", "Q3"], 0.0),                          # all wrong
    (["Q1", "A5", "A6", "The spa opens at 9 am on Sundays."], ["Q1", "A5", "A6"], 3 / 4),  # hallucination
    (["Q1", "A5", "A6", "The spa opens at 9 am.", "The spa opens at 9 am."], ["Q1", "A5", "A6"], 3 / 4),
    (["Q1", "Q1", "A5", "A6", "A5"], ["Q1", "A5", "A6"], 1.0),  # the same utterance twice counts once
    (["Q1", "A5", "A6", "The spa opens at 9 am.", "Parking is free."], ["Q1", "A5", "A6"], 3 / 5),
])
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
    assert compute_reward(no_tags, RECORD)["recall"] == -1.25     # missing recall


def test_hallucinated_tag_is_reported_unmatched_with_its_best_overlap():
    matches = match_tags(["The spa opens at 9 am.", f"Q1: {TEXT['Q1']}"], RECORD["history"])
    assert [(m.label) for m in matches] == [None, "Q1"]
    assert matches[1].overlap == 1.0
    text, label, score = matches[0]                     # plain (text, label, overlap) tuples
    assert text == "The spa opens at 9 am." and label is None and score < reward.DEFAULT_THRESHOLD


def test_text_decides_when_label_and_text_disagree():
    r = compute_reward(completion([f"A5: {TEXT['Q1']}", "A5", "A6"]), RECORD)
    assert r["recalled"] == ["Q1", "A5", "A6"] and r["recall"] == 1.25
    r = compute_reward(completion([f"A5: {TEXT['Q1']}", "A6"]), RECORD)   # the mislabel does not earn A5
    assert r["recalled"] == ["Q1", "A6"] and r["jaccard"] == pytest.approx(2 / 3)


def test_label_breaks_exact_ties_between_identical_utterances():
    turns = [("Q1", "Is it open?"), ("A1", "Yes."), ("Q2", "Is Lena in?"), ("A2", "Yes.")]
    history = make_record(turns)["history"]
    assert [m.label for m in match_tags(["A2: Yes."], history)] == ["A2"]
    assert [m.label for m in match_tags(["A1: Yes."], history)] == ["A1"]
    assert [m.label for m in match_tags(["Yes."], history)] == ["A1"]     # no hint: the earliest


def test_unlabelled_paste_of_several_utterances_matches_nothing():
    paste = " ".join(TEXT[l] for l in ("Q1", "A5", "A6"))           # 11 + 6 + 9 = 26 tokens
    [m] = match_tags([paste], RECORD["history"])
    assert m.label is None and m.overlap == pytest.approx(11 / 26)
    r = compute_reward(completion([paste]), RECORD)
    assert r["recalled"] == [] and r["unmatched"] == [paste] and r["recall"] == -1.25


def test_threshold_flag_moves_the_decision():
    half = "I need to check membership status."                   # 6 of Q1's 11 tokens
    assert match_tags([half], RECORD["history"], threshold=0.6)[0].label is None
    assert match_tags([half], RECORD["history"], threshold=0.5)[0].label == "Q1"
    assert match_tags([half], RECORD["history"])[0].overlap == pytest.approx(6 / 11)


def test_helpers_evaluate_uses():
    text = completion(["A5", "Q1", "The spa opens at 9 am."])
    assert recalled_labels(text, RECORD["history"]) == ["Q1", "A5"]
    predicted = predicted_recall_set(text, RECORD["history"])
    assert predicted == {"Q1", "A5", "?the spa opens at 9 am"}
    assert jaccard(predicted, RECORD["recall"]) == pytest.approx(2 / 4)


# ------------------------------------------------------------------ reward hacking
def test_reward_hacking_scores_clearly_below_the_minimal_set():
    minimal = compute_reward(completion(["Q1", "A5", "A6"]), RECORD)["recall"]
    assert minimal == 1.25
    whole = " ".join(text for _, text in TURNS)
    labelled_whole = " ".join(f"{l}: {t}" for l, t in TURNS)
    attempts = {
        "whole history in one unlabelled tag": (completion([whole]), -1.25),
        "whole history in one labelled tag": (completion([labelled_whole]), 2.5 * 3 / 12 - 1.25),
        "one correct tag repeated 20 times": (completion(["Q1"] * 20), 2.5 / 3 - 1.25),
        "every history turn as its own tag": (completion([l for l, _ in TURNS]), 2.5 * 3 / 12 - 1.25),
    }
    for name, (text, expected) in attempts.items():
        r = compute_reward(text, RECORD)
        assert r["recall"] == pytest.approx(expected), name
        assert r["recall"] <= minimal - 1.5, name


# ------------------------------------------------------------------ Eq. (7) and robustness
def test_missing_final_answer_gets_the_minimum():
    for text in ("<think>\n<HIS>Q1: " + TEXT["Q1"] + "</HIS>\n</think>\n", "", "Final answer:   "):
        r = compute_reward(text, RECORD)
        assert r["final_answer"] is None and r["answer"] == -1.0
        assert r["total"] == pytest.approx(r["format"] + r["recall"] - 1.0)


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


def test_non_ascii_text():
    turns = [("Q1", "Je voudrais réserver un soin à 180 €, s'il vous plaît."),
             ("A1", "我需要查看您的会员状态。"),
             ("Q2", "Danke schön, und die Straße zum Spa? 🙂"),
             ("A2", "Уточните, пожалуйста, филиал.")]
    record = make_record(turns, recall=("Q1", "A1"), answer="Oui, la réduction s'applique.")
    text = ("<think>\n<HIS>Q1: Je voudrais réserver un soin à 180 €, s'il vous plaît.</HIS>\n"
            "<HIS>A1: 我需要查看你的会员状态。</HIS>\n</think>\nFinal answer: Oui, la réduction s'applique ✓")
    r = compute_reward(text, record)
    assert r["format"] == 1.0
    assert r["recalled"] == ["Q1", "A1"] and r["recall"] == 1.25
    assert [m[2] for m in r["matches"]] == [1.0, pytest.approx(10 / 11, abs=1e-4)]   # 1 of 11 ideographs changed
    assert -1.0 <= r["answer"] <= 1.0 and r["final_answer"].endswith("✓")


# ------------------------------------------------------------------ batching and properties
def test_compute_rewards_equals_compute_reward_item_by_item():
    other = make_record(turns=TURNS[:6], recall=("A1",), answer="It is valid at every branch.", rid="other")
    completions = [format_target(RECORD), completion(["Q1", "A5"], answer="no"), "", "garbage",
                   completion(["A1"], answer="every branch"), completion(["A1"], answer="every branch"),
                   "<think>a</think>\nFinal answer: yes, it applies"]
    examples = [RECORD, RECORD, other, RECORD, other, other, RECORD]
    batched = compute_rewards(completions, examples)
    for text, example, b in zip(completions, examples, batched):
        single = compute_reward(text, example)
        assert b.keys() == single.keys()
        for key in b:
            if key in ("answer", "total"):
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
    assert r["total"] == pytest.approx(r["format"] + r["recall"] + r["answer"])
    assert -2.25 <= r["total"] <= 3.25 + 1e-9
    json.dumps(r)  # loggable as is


FRAGMENTS = st.sampled_from(["<think>", "</think>", "<HIS>", "</HIS>", "Final answer:", "final answer:",
                             "Q1:", "A5:", "A99:", "\n", " ", TEXT["Q1"], TEXT["A5"], "<his>", "é中🙂"])


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=300))
def test_any_string_scores_in_range(text):
    check_ranges(compute_reward(text, RECORD))
    assert isinstance(is_valid_format(text), bool)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(FRAGMENTS, st.text(max_size=20)), max_size=25).map("".join))
def test_tag_soup_scores_in_range(text):
    r = compute_reward(text, RECORD)
    check_ranges(r)
    if r["format"] == 1.0:   # a valid format always parses into a think block and an answer
        parsed = parse_completion(text)
        assert parsed.think is not None and parsed.final_answer == r["final_answer"] is not None
    assert set(r["recalled"]) <= {l for l, _ in TURNS}


# ------------------------------------------------------------------ command line
@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "test.jsonl"
    other = make_record(recall=("Q2", "A2"), answer="Yes, at every branch.", rid="second")
    path.write_text(json.dumps(RECORD) + "\n" + json.dumps(other) + "\n", encoding="utf-8")
    return path


def test_cli_explains_one_completion(data_file, tmp_path, capsys):
    file = tmp_path / "c.txt"
    file.write_text(completion(["Q1", "A5", "Q2", "Nonsense here."]), encoding="utf-8")
    reward.main(["--data", str(data_file), "--index", "0", "--completion", str(file)])
    out = capsys.readouterr().out
    assert "format  1" in out and "-> Q2  overlap 1.00  NOT in H*" in out
    assert "-> nothing" in out and "|H^ n H*| = 2   |H^ u H*| = 5" in out
    assert "recall  -0.2500" in out                                  # 2.5 * 2/5 - 1.25
    reward.main(["--data", str(data_file), "--id", "paper-apex-t07", "--completion", "<think>x</think>"])
    out = capsys.readouterr().out
    assert "no 'Final answer:' after </think>" in out and "answer  -1.0000" in out


def test_cli_scores_a_file_and_reports_bad_lines(data_file, tmp_path, capsys):
    preds = tmp_path / "preds.jsonl"
    preds.write_text(json.dumps({"id": "paper-apex-t07", "completion": format_target(RECORD)}) + "\n"
                     + json.dumps({"index": 1, "completion": ""}) + "\n", encoding="utf-8")
    out_dir = tmp_path / "scores"
    summary = reward.main(["--data", str(data_file), "--completions", str(preds), "--out", str(out_dir)])
    assert summary["n"] == 2
    assert summary["format"] == 0.5 and summary["recall"] == pytest.approx((1.25 - 1.25) / 2)
    assert summary["answer"] == pytest.approx((1.0 - 1.0) / 2, abs=1e-5)
    assert "mean total" in capsys.readouterr().out
    assert len((out_dir / "scores.jsonl").read_text().splitlines()) == 2
    assert json.loads((out_dir / "config.json").read_text())["completions"] == str(preds)

    preds.write_text(json.dumps({"id": "paper-apex-t07", "completion": "x"}) + "\n"
                     + json.dumps({"id": "paper-apex-t07"}) + "\n", encoding="utf-8")
    with pytest.raises(SystemExit) as e:
        reward.main(["--data", str(data_file), "--completions", str(preds)])
    assert str(e.value) == f"error: {preds}:2: field 'completion' is missing or not a string"
    preds.write_text(json.dumps({"id": "nope", "completion": "x"}) + "\n", encoding="utf-8")
    with pytest.raises(SystemExit) as e:
        reward.main(["--data", str(data_file), "--completions", str(preds)])
    assert f"{preds}:1: field 'id' names 'nope'" in str(e.value)
    with pytest.raises(SystemExit) as e:
        reward.main(["--data", str(data_file), "--index", "7"])
    assert "out of range" in str(e.value)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n", encoding="utf-8")
    with pytest.raises(SystemExit) as e:
        reward.main(["--data", str(bad)])
    assert f"{bad}:1: not valid JSON" in str(e.value)


def test_cli_help():
    with pytest.raises(SystemExit) as e:
        reward.main(["--help"])
    assert e.value.code == 0
