"""The answer matcher of accuracy and of the keys answer reward (srt.metrics.answer_is_right):
an answer is right when it states every key and no other money amount, number, date or time, code
or capitalised name that the reference answer and the keys do not hold.

Attack tests on a generated corpus's test split: answers made of the history (pasted whole, pasted
without its numbers, pasted in lowercase, its numbers, its names, both polarities) must score accuracy
at most 5% and a keys reward at most -0.5 on average, and every honest reference 100%. Then hand-made
strings for each value kind, the restated threshold and the hedge."""

import re
import statistics

import numpy as np
import pytest

import reward
import stage0_build as s0
from srt.data_io import read_jsonl
from srt.metrics import (
    accuracy,
    answer_is_right,
    answer_keys,
    extra_values,
    keys_present,
    stated_values,
    states_several_candidates,
)

MAX_ATTACK_ACCURACY = 0.05
MAX_ATTACK_KEY_REWARD = -0.5
NUMBER = re.compile(r"(?<![\w.])[$€£]?\d[\d,]*(?:\.\d+)?%?(?!\w)")


@pytest.fixture(scope="module")
def test_split(tmp_path_factory):
    """The test split of the cpu-table2 corpus (600 synthetic dialogues, seed 0) built by stage 0 with
    the oracle teacher. Eq. (2)'s embedder only decides `pruned` (and drops a dialogue none of whose
    turns passes the threshold): a constant one keeps every dialogue and leaves history, answer and
    answer_keys as the real build writes them, in seconds instead of minutes."""
    out = tmp_path_factory.mktemp("corpus")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(s0, "embed", lambda texts: np.full((len(texts), 4), 0.5, dtype=np.float32))
        s0.main(["--num-dialogues", "600", "--seed", "0", "--out", str(out), "--quiet"])
    records = read_jsonl(out / "test.jsonl")
    assert len(records) >= 150
    return records


def is_yes_no(key: str) -> bool:
    return key.strip(" .!").lower() in ("yes", "no")


def history_names(texts: list[str]) -> list[str]:
    """Capitalised words of the history that do not open a sentence, runs kept whole (Old Mill
    Hotel), "I" left out: every name an answer could list."""
    names = []
    for text in texts:
        for sentence in re.split(r"(?<=[.!?])\s+", text):
            for run in re.findall(r"(?<=\s)[A-Z][\w'-]*(?:\s+[A-Z][\w'-]*)*", sentence):
                if run != "I" and not run.startswith("I'"):
                    names.append(run)
    return list(dict.fromkeys(names))


def attacks(record: dict) -> dict[str, str]:
    texts = [u["text"] for u in record["history"]]
    pasted = " ".join(texts)
    return {
        "history pasted": pasted,
        "history without numbers": " ".join(NUMBER.sub("", pasted).split()),
        "history lowercased": pasted.lower(),
        "every number": ", ".join(dict.fromkeys(NUMBER.findall(pasted))),
        "every name": ", ".join(history_names(texts)),
    }


def scores(pairs) -> tuple[float, float, int]:
    """(mean accuracy, mean keys reward, n) over (answer, record) pairs."""
    acc = [accuracy(answer, r) for answer, r in pairs]
    keys = [reward.key_reward(answer, reward.answer_keys(r), r["answer"])[0] for answer, r in pairs]
    return statistics.mean(acc), statistics.mean(keys), len(acc)


def assert_attack_fails(name, pairs):
    acc, keys, n = scores(pairs)
    assert n > 0, name
    assert acc <= MAX_ATTACK_ACCURACY, f"{name}: accuracy {acc:.1%} on {n} records"
    assert keys <= MAX_ATTACK_KEY_REWARD, f"{name}: mean keys reward {keys:+.3f} on {n} records"


# ---- attacks on the test split ---------------------------------------------------------------
def test_honest_references_are_right(test_split):
    wrong = [
        (r["id"], r["answer"], answer_keys(r), extra_values(r["answer"], r["answer"], answer_keys(r)))
        for r in test_split
        if accuracy(r["answer"], r) != 1.0
    ]
    assert not wrong, wrong
    for r in test_split:
        keys = reward.answer_keys(r)
        assert reward.key_reward(r["answer"], keys, r["answer"])[0] == 1.0, r["id"]
        assert not states_several_candidates(r["answer"], r), r["id"]


@pytest.mark.parametrize(
    "name",
    ["history pasted", "history without numbers", "history lowercased", "every number", "every name"],
)
def test_history_attacks_fail_on_the_test_split(test_split, name):
    assert_attack_fails(name, [(attacks(r)[name], r) for r in test_split])


def test_yes_and_no_fails_on_yes_no_records(test_split):
    yes_no = [r for r in test_split if any(is_yes_no(k) for k in answer_keys(r))]
    assert len(yes_no) >= 10
    for answer in ("Yes. No.", "yes or no", "Possibly yes, possibly not."):
        assert_attack_fails(answer, [(answer, r) for r in yes_no])
        assert keys_present(answer, ["yes", "no"]) == [False, False], answer


def test_attacks_fail_on_the_records_they_used_to_win(test_split):
    """The old matcher's wins: the history without its numbers on records keyed by names, branches,
    hotels and codes (no number in any key), and every number on records keyed only by numbers."""
    no_number_keys = [r for r in test_split if not any(NUMBER.search(k) for k in answer_keys(r))]
    no_number_keys = [r for r in no_number_keys if not any(is_yes_no(k) for k in answer_keys(r))]
    assert len(no_number_keys) >= 20
    for name in ("history pasted", "history without numbers", "history lowercased", "every name"):
        assert_attack_fails(f"{name} (name and code keys)", [(attacks(r)[name], r) for r in no_number_keys])
    numeric = [r for r in test_split if all(NUMBER.fullmatch(k.strip()) for k in answer_keys(r))]
    assert len(numeric) >= 20
    for name in ("history pasted", "history without numbers", "every number"):
        assert_attack_fails(f"{name} (number keys)", [(attacks(r)[name], r) for r in numeric])


def test_one_matcher_for_accuracy_and_the_key_reward(test_split):
    """The keys reward is 1 exactly when accuracy counts the answer right."""
    for r in test_split[:80]:
        keys = reward.answer_keys(r)
        for answer in [r["answer"], *attacks(r).values(), "Yes. No."]:
            right = answer_is_right(answer, answer_keys(r), r["answer"])
            assert accuracy(answer, r) == float(right)
            if keys:
                assert (reward.key_reward(answer, keys, r["answer"])[0] == 1.0) is right, (r["id"], answer)


def test_pasted_history_states_several_candidates(test_split):
    share = statistics.mean(states_several_candidates(attacks(r)["history pasted"], r) for r in test_split)
    assert share >= 0.5


# ---- hand-made strings, one value kind at a time -----------------------------------------------
def test_stated_values_of_each_kind():
    assert stated_values("It is $180.00, or 180 dollars, 20% off and 3 nights.") == {
        ("money", "180"),
        ("number", "20%"),
        ("number", "3"),
    }
    assert stated_values("On Friday at 3 pm, May 11th, the 2nd of March, noon or 15:30.") == {
        ("date", "friday"),
        ("date", "15:00"),
        ("date", "may 11"),
        ("date", "march 2"),
        ("date", "12:00"),
        ("date", "15:30"),
    }
    assert stated_values("Flight BA9742, seat 37C, reference BCERKM, 10 GB.") == {
        ("code", "ba9742"),
        ("code", "37c"),
        ("code", "bcerkm"),
        ("number", "10"),
    }
    # a name: capitalised, not a common word, not a sentence's first word unless that sentence
    # has no lowercase word ("Osaka, Lena." lists values)
    assert stated_values("Mateo does it at the Uptown branch, and I'm happy.") == {("name", "uptown")}
    assert stated_values("Osaka, Lena.") == {("name", "osaka"), ("name", "lena")}
    assert stated_values("Yes. OK, thanks.") == set()


def test_money_and_numbers():
    ref, keys = "The smartwatch was $239.", ["$239"]
    assert answer_is_right("$239.00", keys, ref) and answer_is_right("It cost 239 dollars.", keys, ref)
    assert not answer_is_right("$239 or $278", keys, ref)
    assert extra_values("$239 or $278, or 20%", ref, keys) == ["20%", "278"]
    assert not answer_is_right("$2390", keys, ref) and not answer_is_right("$23", keys, ref)
    ref, keys = "Account ending 8084, billed on day 21.", ["8084", "day 21"]
    assert answer_is_right("8084, day 21", keys, ref)
    assert extra_values("8084 and 5938, day 21", ref, keys) == ["5938"]


def test_dates_and_times():
    ref, keys = "Your appointment is on Friday at 1 pm.", ["Friday", "1 pm"]
    assert answer_is_right("Friday, 1 pm.", keys, ref) and answer_is_right("friday at 1pm", keys, ref)
    assert keys_present("On Fridays, at 13:00.", keys) == [True, True]  # a date or time in any form
    assert keys_present("Friday at 1", keys) == [True, False]
    assert extra_values("Friday or Saturday at 1 pm", ref, keys) == ["saturday"]
    assert extra_values("Friday at 1 pm, not 13:30", ref, keys) == ["13:30"]
    assert not answer_is_right("Friday at 1 pm or 3 pm", keys, ref)
    ref, keys = "Your check-in is on October 14.", ["October 14"]
    assert answer_is_right("October 14", keys, ref)
    assert extra_values("October 14 or September 19", ref, keys) == ["september 19"]


def test_codes():
    ref, keys = (
        "You're on flight BA9742 and staying at the Old Mill Hotel for 5 nights.",
        ["BA9742", "Old Mill Hotel"],
    )
    assert answer_is_right("BA9742, Old Mill Hotel", keys, ref)
    assert extra_values("BA9742 or LH9834, Old Mill Hotel, seat 37C, BCERKM", ref, keys) == [
        "37c",
        "bcerkm",
        "lh9834",
    ]
    assert not answer_is_right("BA9742 and the Old Mill Hotel. Reference BCERKM.", keys, ref)


def test_names():
    ref, keys = "Mateo does the Thai Massage.", ["Mateo"]
    assert answer_is_right(ref, keys, ref) and answer_is_right("It's Mateo.", keys, ref)
    assert answer_is_right("Mateo.", keys, ref)
    assert extra_values("Mateo or Lena, at Northgate", ref, keys) == ["lena", "northgate"]
    assert not answer_is_right("Mateo, Lena, Dmitri", keys, ref)
    # a name key must be written as a name: lowercased, the other names would hide as no values
    assert keys_present("mateo, lena, dmitri", keys) == [False]
    assert keys_present("BCERKM", ["BCERKM"]) == [True] and keys_present("bcerkm", ["BCERKM"]) == [False]


def test_an_honest_answer_may_restate_its_reference():
    ref = (
        "Yes. The Chakra Balancing service is $180, which is over $150, so your 20% Apex Tier discount "
        "applies."
    )
    keys = ["yes", "$180"]
    assert answer_is_right("Yes: $180.00 is over $150.", keys, ref)
    assert answer_is_right("Yes, you get 20% off because $180 exceeds $150.", keys, ref)
    assert answer_is_right("Yes, the Apex Tier discount applies to the Chakra Balancing.", ["yes"], ref)
    assert not answer_is_right("Yes: $180 is over $150, and Lena works at Uptown.", keys, ref)
    assert not answer_is_right("Yes. It is $95, $120, $150 or $180.", keys, ref)


def test_a_hedge_states_no_polarity():
    ref = "No. 68 days is past the 45-day return window, so the $278 cannot be refunded."
    keys = ["no", "$278"]
    assert answer_is_right("No, $278 cannot be refunded.", keys, ref)
    for hedge in (
        "Possibly yes, possibly not: $278.",
        "Maybe no, $278.",
        "Yes or no, $278.",
        "Yes. No. $278.",
        "It depends: no, $278.",
    ):
        assert not answer_is_right(hedge, keys, ref), hedge
        assert reward.key_reward(hedge, keys, ref)[0] <= 0.0, hedge
    assert answer_is_right("No, I know: $278 is not refunded.", keys, ref)  # 'know', 'not' are not 'yes'


def test_accuracy_without_keys_needs_the_whole_reference():
    record = {"answer": "On Friday at 3 pm", "answer_keys": []}
    assert accuracy("It is on Friday at 3 pm.", record) == 1.0
    assert accuracy("Friday at 3 pm", record) == 0.0
    assert accuracy("It is on Friday at 3 pm, or Monday.", record) == 0.0
    assert not answer_is_right(None, ["yes"], "Yes.") and not answer_is_right("", [], "Yes.")


def test_states_several_candidates():
    record = {
        "answer": "Yes. The Chakra Balancing service is $180, which is over $150, so the discount applies.",
        "answer_keys": ["yes", "$180"],
    }
    assert not states_several_candidates("Yes: $180 is over $150.", record)  # the threshold is no candidate
    assert not states_several_candidates("No, $95.", record)  # wrong, but one candidate
    assert states_several_candidates("Yes, $180 or $95.", record)
    assert states_several_candidates("Maybe $95 or $120.", record)
    assert states_several_candidates("Yes. No.", record)
    named = {"answer": "Mateo does the Thai Massage.", "answer_keys": ["Mateo"]}
    assert not states_several_candidates("Mateo.", named) and not states_several_candidates(None, named)
    assert states_several_candidates("Mateo or Lena.", named)
    assert states_several_candidates("It is Lena or Dmitri.", named)
    assert not states_several_candidates("Lena, $20.", named)  # one name (the amount is of no key's kind)
