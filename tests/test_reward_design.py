"""The reward-design exercise: `python reward.py --gallery --reward PATH` scores a reward of one's
own against every attack of the gallery. The two example rewards of docs/rewards/ lose to the attacks
their docstrings name, the project's own reward beats every attack, and a bad file gets one line."""

from pathlib import Path

import pytest

import reward
from srt.reward_gallery import reward_scores, winning_attacks

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


def gallery_with(path: str, capsys) -> str:
    reward.main(["--gallery", "--reward", str(path)])
    return capsys.readouterr().out


@pytest.mark.parametrize("example", BEATEN_BY)
def test_each_example_reward_is_beaten_by_the_attacks_it_names(example, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    reward_fn, name = reward.load_reward(example)
    assert name == "compute_rewards"
    winners = {s["name"] for s in winning_attacks(reward_scores(reward_fn))}
    assert winners == BEATEN_BY[example]
    out = gallery_with(example, capsys)
    assert f"{len(winners)} of 31 attacks score as high as the honest completion" in out
    assert all(f"  +3.250  {attack}" in out for attack in winners)


def test_the_projects_own_reward_beats_every_attack(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert winning_attacks(reward_scores(reward.compute_rewards)) == []
    assert "Every one of the 31 attacks scores below the honest completion." in gallery_with(
        "reward.py", capsys
    )


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
