"""The reward-design exercise: `python reward.py --gallery --reward PATH` scores a reward of one's
own against every attack of the gallery. The two example rewards of docs/rewards/ lose to the attacks
their docstrings name; every attack is compared with every honest row (the honest completion and its
variants); a reward that sinks an honest row, or returns a total that is not a finite number, fails;
a bad file gets one line."""

import functools
import math
from pathlib import Path

import pytest

import reward
from srt.reward_gallery import (
    gallery_completions,
    reward_scores,
    reward_verdict,
    sunk_honest_rows,
    winning_attacks,
)

REPO = Path(__file__).resolve().parents[1]

BEATEN_BY = {
    "docs/rewards/substring_recall.py": {
        "A5 price changed ($95)",
        "A6 branch changed (Downtown for Uptown)",
        "Q1 tier changed (Gold Tier for Apex Tier)",
        "A5 words shuffled",
        "A5 fact dropped ('The Chakra Balancing service')",
        "every history turn recalled",
    },
    "docs/rewards/keyword_answer.py": {
        "keyword stuffing 'yes no $180'",
        "every candidate price listed 'Yes. It is $95, $120, $150 or $180.'",
        "the whole history pasted as the answer",
        "the history pasted in lowercase (its names are no values)",
    },
}


def gallery_with(path: str, capsys) -> tuple[int, str]:
    """reward.py --gallery --reward PATH -> (exit code, what it printed)."""
    try:
        reward.main(["--gallery", "--reward", str(path)])
        code = 0
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().out


@pytest.mark.parametrize("example", BEATEN_BY)
def test_each_example_reward_is_beaten_by_the_attacks_it_names(example, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    reward_fn, name = reward.load_reward(example)
    assert name == "compute_rewards"
    winners = {s["name"] for s in winning_attacks(reward_scores(reward_fn))}
    assert winners == BEATEN_BY[example]
    code, out = gallery_with(example, capsys)
    assert code == 1
    assert f"FAIL: {len(winners)} of 31 attacks score as high as an honest completion or variant" in out
    assert all(
        f"  +3.250 >= +3.250 (honest completion (the SFT target)): {attack}\n" in out for attack in winners
    )


def test_the_verdict_names_each_winners_text_and_the_part_it_beat(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    out = gallery_with("docs/rewards/substring_recall.py", capsys)[1]
    assert (
        "recall attack: the recall part let it through (recall +1.250 against +1.250); "
        "it writes 'Downtown' for 'Uptown'" in out
    )
    out = gallery_with("docs/rewards/keyword_answer.py", capsys)[1]
    assert (
        "answer attack: the answer part let it through (answer +1.000 against +1.000); "
        "it writes 'yes no $180'" in out
    )


ANSWER_ATTACKS_ABOVE_THE_TERSE_ANSWER = {  # under the paper's cosine, above 'Yes: $180.00 is over $150.'
    "hedge 'Yes or no: the 20% discount may or may not apply.'",
    "wrong but similar 'No. ... $120, which is not over $150 ...'",
    "price changed in the answer ($95)",
    "every candidate price listed 'Yes. It is $95, $120, $150 or $180.'",
    "the query echoed as the answer",
    "the whole history pasted as the answer",
    "the history pasted without its numbers",
    "every name of the history 'Apex Tier, Downtown, Uptown, Chakra Balancing, Lena'",
    "the history pasted in lowercase (its names are no values)",
}


@pytest.mark.parametrize("answer_reward", reward.ANSWER_REWARDS)
def test_the_projects_own_reward_against_every_honest_row(answer_reward):
    """Under keys and both every attack scores below every honest row; under the paper's cosine the
    answer attacks that share the reference's words beat the right terse answer, whose words differ."""
    scores = reward_scores(functools.partial(reward.compute_rewards, answer_reward=answer_reward))
    winners = winning_attacks(scores)
    if answer_reward == "cosine":
        assert {s["name"] for s in winners} == ANSWER_ATTACKS_ABOVE_THE_TERSE_ANSWER
        assert {s["beats"]["name"] for s in winners} == {"right terse answer 'Yes: $180.00 is over $150.'"}
    else:
        assert winners == [] and sunk_honest_rows(scores) == []
        assert reward_verdict(scores)[0]


def test_the_paper_reward_fails_the_verdict_on_the_command_line(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    code, out = gallery_with("reward.py", capsys)
    assert code == 1 and "FAIL: 9 of 31 attacks" in out


def rows_scored(total_of):
    """A reward that scores each gallery row total_of(name, kind), format 1 and recall 1.25 beside it."""

    def compute_rewards(completions, examples):
        names = [(name, kind) for name, kind, _ in gallery_completions()]
        return [{"format": 1.0, "recall": 1.25, "answer": 0.0, "total": total_of(*row)} for row in names]

    return compute_rewards


def test_a_total_computed_with_numpy_or_torch_is_a_number():
    """np.float32, a 0-d array or a 0-d tensor is one real number: read as its float. Not finite, or
    more than one value, is still refused."""
    import numpy as np
    import torch

    for number in (np.float32, np.array, torch.tensor):
        scores = reward_scores(
            rows_scored(lambda name, kind: number(3.0 if kind in ("honest", "variant") else 1.0))
        )
        assert all(type(s["total"]) is float for s in scores)
        assert reward_verdict(scores)[0]
    with pytest.raises(ValueError, match="every total must be a finite number"):
        reward_scores(rows_scored(lambda name, kind: torch.tensor(float("nan"))))
    for not_one_number in (torch.tensor([1.0, 2.0]), np.bool_(True), True, "3"):
        with pytest.raises(ValueError, match="not a dict with a numeric 'total'"):
            reward_scores(rows_scored(lambda name, kind: not_one_number))


def test_a_reward_that_sinks_the_honest_variants_fails():
    """An exact-match reward: the honest completion 1, every other row 0, its variants included."""
    scores = reward_scores(rows_scored(lambda name, kind: 1.0 if kind == "honest" else 0.0))
    passed, lines = reward_verdict(scores)
    assert not passed and len(winning_attacks(scores)) == 31
    assert len(sunk_honest_rows(scores)) == 6
    assert lines[0] == (
        "FAIL: it scores an honest variant at the gallery's floor (+0.000, as low as its worst cheat): "
        "teacher form Turn X: '...' (§3.2); a right answer in another form must earn more."
    )


def test_a_reward_that_floors_one_variant_fails_though_every_attack_loses():
    floored = "right terse answer 'Yes: $180.00 is over $150.'"
    total = {"honest": 3.0, "variant": 3.0}
    scores = reward_scores(rows_scored(lambda name, kind: -5.0 if name == floored else total.get(kind, 0.0)))
    passed, lines = reward_verdict(scores)
    assert not passed and winning_attacks(scores) != []  # the floored variant is beaten by every attack
    assert [s["name"] for s in sunk_honest_rows(scores)] == [floored]


@pytest.mark.parametrize("bad_total", [math.nan, math.inf, -math.inf])
def test_a_non_finite_total_is_an_error_line(bad_total, tmp_path):
    path = tmp_path / "nan_reward.py"
    path.write_text(
        "def compute_rewards(completions, examples):\n"
        f"    return [{{'total': float('{bad_total}')}} for _ in completions]\n"
    )
    with pytest.raises(SystemExit) as exit_info:
        reward.main(["--gallery", "--reward", str(path)])
    message = str(exit_info.value.code)
    assert message.startswith(f"error: --reward {path}: compute_rewards: ValueError: it scores ")
    assert f" {bad_total}: every total must be a finite number" in message and "\n" not in message


def test_a_reward_that_wins_passes():
    scores = reward_scores(rows_scored(lambda name, kind: 3.0 if kind in ("honest", "variant") else 1.0))
    passed, lines = reward_verdict(scores)
    assert passed and lines == [
        "PASS: every one of the 31 attacks scores below every one of the 7 honest rows (the lowest "
        "honest row: +3.000, honest completion (the SFT target))."
    ]


BAD_REWARDS = {
    "no function": ("RECALL_SCALE = 2.5\n", "it defines no function; name the reward compute_rewards"),
    "two functions": (
        "def score(completions, examples):\n    return []\n\n\ndef helper(x):\n    return x\n",
        "it defines 2 functions (score, helper); name the reward compute_rewards",
    ),
    "wrong signature": (
        "def compute_rewards(completion):\n    return {}\n",
        "compute_rewards(completion) does not take (completions, examples) as compute_rewards does",
    ),
    "fails to import": ("import no_such_module\n", "importing it raised ModuleNotFoundError"),
    "wrong result": (
        "def compute_rewards(completions, examples):\n    return [1.0 for _ in completions]\n",
        "compute_rewards: ValueError: a result is 1.0, not a dict with a numeric 'total'",
    ),
}


@pytest.mark.parametrize("case", [*BAD_REWARDS, "missing"])
def test_a_bad_reward_file_gets_a_clear_one_line_error(case, tmp_path, capsys):
    path = tmp_path / "my_reward.py"
    if case == "missing":
        expected = "no such file"
    else:
        source, expected = BAD_REWARDS[case]
        path.write_text(source)
    with pytest.raises(SystemExit) as exit_info:
        reward.main(["--gallery", "--reward", str(path)])
    message = str(exit_info.value.code)
    assert message.startswith(f"error: --reward {path}: ") and expected in message
    assert "\n" not in message


def test_reward_goes_with_the_gallery(capsys):
    with pytest.raises(SystemExit) as exit_info:
        reward.main(["--reward", "docs/rewards/keyword_answer.py", "--data", "x.jsonl"])
    assert exit_info.value.code == 2 and "--reward goes with --gallery" in capsys.readouterr().err
