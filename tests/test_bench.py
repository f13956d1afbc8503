"""bench/grpo_vs_trl.py without TRL: the reward wrapper TRL would call, the summary and ratio table
on hand-computed step times, the fairness checks, and the argument checks that run before any
model or TRL is touched. The benchmark itself (two training subprocesses, TRL in its own venv) is
run by hand: see bench/README.md."""
import importlib.util
import json
from pathlib import Path

import pytest

from records import hand_record
from reward import compute_rewards

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("grpo_vs_trl", REPO / "bench" / "grpo_vs_trl.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


# ---------------------------------------------------------------------------------------------
# The reward wrapper: TRL's calling convention -> reward.compute_rewards
# ---------------------------------------------------------------------------------------------
def test_trl_reward_wrapper_decodes_records_shares_them_per_group_and_logs():
    a, b = hand_record(1), hand_record(2)
    seen = []

    def fake_reward(completions, examples):
        seen.append(examples)
        return [{"total": len(text) / 10.0} for text in completions[:-1]] + [{"total": float("nan")}]

    log = []
    reward = bench.make_trl_reward(fake_reward, log=log)
    prompts = ["prompt a", "prompt a", "prompt b", "prompt b"]
    records = [json.dumps(a), json.dumps(a), json.dumps(b), json.dumps(b)]
    out = reward(prompts=prompts, completions=["x", "xx", "xxx", "xxxx"], record=records,
                 completion_ids=[[1], [1, 2], [1, 2, 3], [1, 2, 3, 4]], trainer_state=None)
    assert out == [0.1, 0.2, 0.3, None]  # a NaN total goes back to TRL as None
    examples = seen[0]
    assert examples[0] == a and examples[2] == b
    assert examples[0] is examples[1] and examples[2] is examples[3]  # one decoded record per group
    assert log[0]["prompts"] == [bench.digest("prompt a"), bench.digest("prompt b")]
    assert log[0]["completion_length"] == 2.5 and log[0]["seconds"] >= 0


def test_trl_reward_wrapper_gives_compute_rewards_totals():
    """The real reward, on completions that need no sentence embedder (no final answer: R_answer = -1)."""
    record = hand_record(3, recall=("Q1", "A2"))
    text = {t["label"]: t["text"] for t in record["history"]}
    completions = [f"<think>\n<HIS>Q1: {text['Q1']}</HIS>\n<HIS>A2: {text['A2']}</HIS>\n</think>",
                   f"<think>\n<HIS>A4: {text['A4']}</HIS>\n</think>"]
    expected = [s["total"] for s in compute_rewards(completions, [record, record])]
    got = bench.make_trl_reward()(prompts=["p", "p"], completions=completions, record=[json.dumps(record)] * 2)
    assert got == pytest.approx(expected)
    assert got[0] == pytest.approx(0 + 1.25 - 1)  # format 0, IoU 1 -> 2.5 - 1.25, no answer -> -1


# ---------------------------------------------------------------------------------------------
# Summary and ratio table
# ---------------------------------------------------------------------------------------------
def side(seconds, generate, score, lengths, updates, rss, cuda=None):
    steps = [{"step": i + 1, "seconds": s, "generate_s": g, "score_s": c, "completion_length": n}
             for i, (s, g, c, n) in enumerate(zip(seconds, generate, score, lengths))]
    return {"steps": steps, "updates_per_step": updates, "peak_rss_gib": rss, "peak_cuda_allocated_gib": cuda}


def test_summary_leaves_the_warm_up_step_out_and_splits_the_step():
    s = bench.summarize(side([30.0, 5.0, 7.0], [20.0, 2.0, 4.0], [1.0, 0.5, 0.5], [100, 50, 70], 4, 2.5))
    assert s["measured_steps"] == 2
    assert s["seconds"] == 6.0 and s["generate_s"] == 3.0 and s["score_s"] == 0.5
    assert s["train_s"] == 2.5 and s["seconds_per_update"] == 1.5 and s["completion_length"] == 60
    assert s["peak_rss_gib"] == 2.5 and s["peak_cuda_allocated_gib"] is None


def test_summary_without_a_sampling_clock_has_no_split():
    s = bench.summarize(side([9.0, 4.0], [None, None], [0.1, 0.1], [10, 10], 1, 1.0))
    assert s["seconds"] == 4.0 and s["generate_s"] is None and s["train_s"] is None


def test_ratio_rows_and_markdown():
    ours = bench.summarize(side([30.0, 5.0, 7.0], [20.0, 2.0, 4.0], [1.0, 0.5, 0.5], [100, 50, 70], 4, 2.0))
    trl = bench.summarize(side([40.0, 8.0, 8.0], [25.0, 4.0, 4.0], [1.0, 1.0, 1.0], [90, 60, 60], 4, 4.0))
    rows = {r["metric"]: r for r in bench.ratio_rows(ours, trl)}
    assert "peak_cuda_allocated_gib" not in rows  # neither side ran on a GPU
    assert rows["seconds"]["ours"] == 6.0 and rows["seconds"]["trl"] == 8.0 and rows["seconds"]["ratio"] == 0.75
    assert rows["generate_s"]["ratio"] == 0.75 and rows["train_s"]["ratio"] == 2.5 / 3.0
    assert rows["seconds_per_update"]["ratio"] == 0.75 and rows["peak_rss_gib"]["ratio"] == 0.5
    table = bench.markdown_table(bench.ratio_rows(ours, trl))
    assert "| GRPO step, s (mean, warm-up left out) | 6 | 8 | 0.75 |" in table
    assert "| peak RSS, GiB | 2 | 4 | 0.50 |" in table


def test_ratio_is_undefined_where_a_side_has_no_value():
    rows = bench.ratio_rows({"seconds": 3.0, "peak_cuda_allocated_gib": 1.0}, {"seconds": 0.0})
    by = {r["metric"]: r for r in rows}
    assert by["seconds"]["ratio"] is None and by["peak_cuda_allocated_gib"]["ratio"] is None
    assert "| peak CUDA allocated, GiB | 1 | n/a | n/a |" in bench.markdown_table(rows)


def test_compare_reports_prompt_order_tokenization_and_versions():
    spec = {"expected_prompts": [["a"], ["b"]], "updates_per_step": 2}
    v = {"torch": "2.13.0", "transformers": "5.24.0"}
    ours = {"steps": [{"prompts": ["a"], "updates": 2}, {"prompts": ["b"], "updates": 2}], "versions": v,
            "device": "cpu", "autocast": None}
    trl = {"steps": [{"prompts": ["b"], "updates": 2}, {"prompts": ["a"], "updates": 2}],
           "versions": dict(v, transformers="5.25.0"), "device": "cpu", "autocast": None,
           "prompt_tokens_identical": False}
    notes = bench.compare(ours, trl, spec)
    assert ("ours: trained on the expected prompts in the expected order: True; "
            "optimizer updates per GRPO step: 2 (expected 2)") in notes
    assert any(n.startswith("TRL: trained on the expected prompts in the expected order: False") for n in notes)
    assert any("tokenization" in n for n in notes) and any("transformers differs" in n for n in notes)


# ---------------------------------------------------------------------------------------------
# Argument checks (before any model, data or TRL is touched)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["--steps", "1"], "at least 2"),
    (["-K", "1", "--sample-ratio", "1"], "-K must be at least 2"),
    (["-K", "3", "--sample-ratio", "2"], "equal minibatches"),
    (["-K", "2", "--sample-ratio", "2", "--data", "no/such/train.jsonl"], "--synthetic N"),
])
def test_bad_arguments_stop_with_one_line(argv, message, tmp_path):
    with pytest.raises(SystemExit) as stop:
        bench.main(argv + ["--out", str(tmp_path)])
    assert message in str(stop.value) and "\n" not in str(stop.value)


def test_help_lists_the_flags(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--help"])
    text = capsys.readouterr().out
    for flag in ("--model", "--data", "--synthetic", "--steps", "-K", "--max-new-tokens", "--max-prompt-length",
                 "--out", "--trl-python"):
        assert flag in text
    assert "--worker" not in text
