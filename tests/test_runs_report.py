"""The runs report (srt/runs_report.py): paired training runs read per run and across runs, against
hand-computed values; and `make demo SEEDS=...`'s paired seeds, read off the Makefile."""

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from test_evaluate import make_record, write_records  # noqa: E402

import evaluate  # noqa: E402
from srt import runs_report  # noqa: E402


def planted_run(label, srt, control, jaccard=None, ids=None, sha="abc"):
    ids = ids or [f"q{i:02d}" for i in range(len(srt))]
    return {
        "label": label,
        "source": f"runs/{label}",
        "data_sha256": sha,
        "ids": ids,
        "srt_correct": list(srt),
        "control_correct": list(control),
        "srt_jaccard": list(jaccard) if jaccard is not None else [0.5] * len(srt),
    }


# ---------------------------------------------------------------------------------------------
# Across runs: mean, SD, t interval, wins
# ---------------------------------------------------------------------------------------------
def test_across_runs_is_the_t_interval_over_runs_by_hand():
    # mean 0.2, SD (n - 1) 0.1; t(2) 97.5% = 4.302653 -> half-width 4.302653 * 0.1 / sqrt(3) = 0.248414
    out = runs_report.across_runs([0.1, 0.2, 0.3])
    assert out["mean"] == pytest.approx(0.2)
    assert out["sd"] == pytest.approx(0.1)
    assert out["low"] == pytest.approx(0.2 - 0.248414, abs=1e-6)
    assert out["high"] == pytest.approx(0.2 + 0.248414, abs=1e-6)
    assert (out["min"], out["max"], out["runs"]) == (0.1, 0.3, 3)
    # five runs: t(4) = 2.776445, not the normal 1.96 a bootstrap over queries would suggest
    five = runs_report.across_runs([-0.021, 0.156, 0.167, 0.042, 0.021])
    sd = float(np.std([-0.021, 0.156, 0.167, 0.042, 0.021], ddof=1))
    assert five["high"] - five["mean"] == pytest.approx(2.776445 * sd / math.sqrt(5), rel=1e-6)


def test_one_run_has_no_spread_to_report():
    out = runs_report.across_runs([0.04])
    assert out["mean"] == 0.04 and out["sd"] is None and out["low"] is None


def test_one_runs_report_calls_it_one_run_and_states_no_interval_over_runs():
    """A t(0) interval or "across the 1 runs" would read as a claim about the methods."""
    one = runs_report.summarize([planted_run("seed 1", [1, 0, 1, 0] * 6, [1, 1, 1, 0] * 6)], resamples=200)
    text = runs_report.markdown(one, {})
    assert "One run: a claim about the methods needs paired runs (seeds)." in text
    assert "t(0)" not in text and "Across the" not in text
    two = runs_report.summarize(
        [planted_run(f"seed {s}", [1, 0, 1, 0] * 6, [1, 1, 1, 0] * 6) for s in (1, 2)], resamples=200
    )
    assert "Across the 2 runs" in runs_report.markdown(
        two, {}
    ) and "t(1) over the runs" in runs_report.markdown(two, {})


def test_wins_count_each_side_and_the_runs_whose_query_interval_excludes_zero():
    deltas = [
        {"diff": 0.15, "low": 0.02, "high": 0.28},  # control ahead, interval above 0
        {"diff": 0.04, "low": -0.06, "high": 0.14},  # control ahead, interval holds 0
        {"diff": -0.02, "low": -0.17, "high": 0.13},  # SRT ahead, interval holds 0
        {"diff": -0.20, "low": -0.30, "high": -0.05},  # SRT ahead, interval below 0
        {"diff": 0.0, "low": -0.1, "high": 0.1},
    ]
    assert runs_report.wins(deltas) == {
        "control": 2,
        "srt": 2,
        "even": 1,
        "control_interval_above_0": 1,
        "srt_interval_below_0": 1,
    }


def test_a_runs_row_is_control_minus_srt_on_its_paired_queries():
    # 10 queries: SRT right on 6, the control on 8; control right where SRT is wrong on 3, the reverse on 1
    srt = [1, 1, 1, 1, 1, 1, 0, 0, 0, 0]
    control = [1, 1, 1, 1, 1, 0, 1, 1, 1, 0]
    row = runs_report.run_statistics(planted_run("seed 1", srt, control, jaccard=[1.0, 0.5] * 5))
    assert row["srt_accuracy"] == pytest.approx(0.6) and row["control_accuracy"] == pytest.approx(0.8)
    assert row["delta"]["diff"] == pytest.approx(0.2)  # positive: the control ahead, report.md's sign
    assert row["delta"]["low"] <= 0.2 <= row["delta"]["high"]
    assert (row["mcnemar"]["a_only"], row["mcnemar"]["b_only"]) == (1, 3)
    assert row["jaccard"]["mean"] == pytest.approx(0.75)
    assert 0.5 <= row["jaccard"]["low"] <= 0.75 <= row["jaccard"]["high"] <= 1.0


def test_summary_reads_the_spread_between_runs_not_within_one():
    """Three runs whose query intervals are each wide, but which agree: the SD over runs is small.
    And three that disagree: the t interval is wide though each run's own interval is the same."""
    rng = np.random.default_rng(0)
    srt = rng.integers(0, 2, 96).tolist()

    def shifted(k):  # the control right on k more queries than SRT
        control = list(srt)
        wrong = [i for i, s in enumerate(srt) if not s][:k]
        for i in wrong:
            control[i] = 1
        return control

    agree = runs_report.summarize([planted_run(f"seed {s}", srt, shifted(5)) for s in range(3)])
    assert agree["across"]["delta_accuracy"]["sd"] == pytest.approx(0.0)
    assert agree["across"]["delta_accuracy"]["mean"] == pytest.approx(5 / 96)
    apart = runs_report.summarize(
        [planted_run(f"seed {s}", srt, shifted(k)) for s, k in enumerate((0, 8, 16))]
    )
    d = apart["across"]["delta_accuracy"]
    assert d["mean"] == pytest.approx(8 / 96) and d["sd"] == pytest.approx(8 / 96)
    assert (d["min"], d["max"]) == (0.0, pytest.approx(16 / 96))
    assert d["low"] < 0 < d["high"]  # t(2) over three runs that disagree: no verdict
    assert apart["wins"]["control"] == 2 and apart["wins"]["even"] == 1


# ---------------------------------------------------------------------------------------------
# Runs that do not pair are refused, in one line
# ---------------------------------------------------------------------------------------------
def test_runs_on_other_queries_or_another_test_file_do_not_pair():
    a = planted_run("seed 1", [1, 0], [0, 1])
    with pytest.raises(runs_report.RunsError, match="other queries"):
        runs_report.check_paired([a, planted_run("seed 2", [1, 0], [0, 1], ids=["q00", "q99"])])
    with pytest.raises(runs_report.RunsError, match="another test file"):
        runs_report.check_paired([a, planted_run("seed 2", [1, 0], [0, 1], sha="other")])
    with pytest.raises(runs_report.RunsError, match="given twice"):
        runs_report.check_paired([a, dict(a, source="elsewhere")])


def test_bad_run_arguments_end_in_one_line_naming_the_file(tmp_path, capsys):
    for args, expected in (
        ([str(tmp_path / "nothing")], "nothing"),
        ([f"seed 1={tmp_path / 'nofolder'}"], "config.json"),
        ([f"={tmp_path}"], "empty label"),
    ):
        with pytest.raises(SystemExit) as stop:
            runs_report.main([*args, "--out", str(tmp_path / "out")])
        assert str(stop.value).startswith("error: ") and expected in str(stop.value)
        assert "\n" not in str(stop.value)


# ---------------------------------------------------------------------------------------------
# End to end on the tiny model: evaluate.py runs, the report, and an earlier report pooled
# ---------------------------------------------------------------------------------------------
def evaluate_run(root, name, data, *extra):
    out = root / name
    evaluate.main(
        ["--data", str(data), "--out", str(out), "--compare", "srt=srt:tiny-random", "nocot=srt:tiny-random",
         "--table2", "SRT=srt,w/o CoT=nocot", "--max-new-tokens", "4", "--max-new-tokens-direct", "3",
         "--batch-size", "2", "--latency-per-bucket", "0", "--attention-examples", "0", "--quiet", *extra]
    )  # fmt: skip
    return out


def plant(out, variant, accuracy):
    """Overwrite a variant's per-query accuracy: the ground truth the report must read back."""
    path = out / f"{variant}.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for row, value in zip(sorted(rows, key=lambda r: r["id"]), accuracy):
        row["accuracy"] = value
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_runs_report_on_tiny_evaluations_and_a_pooled_earlier_report(tmp_path):
    data = write_records(tmp_path / "test.jsonl", [make_record(i, t) for i, t in enumerate((8, 9, 10, 11))])
    first, second = evaluate_run(tmp_path, "seed-1", data), evaluate_run(tmp_path, "seed-2", data)
    plant(first, "srt", [1.0, 1.0, 0.0, 0.0])
    plant(first, "nocot", [1.0, 1.0, 1.0, 0.0])  # the control +25 points
    plant(second, "srt", [1.0, 1.0, 1.0, 0.0])
    plant(second, "nocot", [0.0, 1.0, 1.0, 0.0])  # the control -25 points
    report = runs_report.main(
        [f"seed 1={first}", f"seed 2={second}", "--out", str(tmp_path / "runs"), "--base", str(first)]
    )
    assert [r["delta"]["diff"] for r in report["runs"]] == [pytest.approx(0.25), pytest.approx(-0.25)]
    rows = [json.loads(line) for line in (first / "srt.jsonl").read_text().splitlines()]
    assert report["runs"][0]["srt_tokens"] == pytest.approx(np.mean([r["generated_tokens"] for r in rows]))
    assert report["across"]["delta_accuracy"]["mean"] == pytest.approx(0.0)
    assert report["across"]["delta_accuracy"]["sd"] == pytest.approx(math.sqrt(2) * 0.25)
    text = (tmp_path / "runs" / "runs.md").read_text()
    assert "| seed 1 |" in text and "| seed 2 |" in text and "95% over 4 queries" in text
    assert "t(1) over runs" in text
    assert (tmp_path / "runs" / "runs.png").stat().st_size > 1000
    spread = json.loads((tmp_path / "runs" / "spread.json").read_text())
    assert spread["runs"] == ["seed 1", "seed 2"] and spread["queries"] == 4
    # a third run on another day pools with the first two through their runs.json
    third = evaluate_run(tmp_path, "seed-3", data)
    plant(third, "srt", [0.0, 0.0, 0.0, 0.0])
    plant(third, "nocot", [1.0, 1.0, 0.0, 0.0])
    pooled = runs_report.main(
        [str(tmp_path / "runs" / "runs.json"), f"seed 3={third}", "--out", str(tmp_path / "pooled")]
    )
    assert [r["label"] for r in pooled["runs"]] == ["seed 1", "seed 2", "seed 3"]
    assert pooled["across"]["delta_accuracy"]["mean"] == pytest.approx(0.5 / 3)
    with pytest.raises(SystemExit, match="given twice"):
        runs_report.main(
            [str(tmp_path / "runs" / "runs.json"), f"seed 1={third}", "--out", str(tmp_path / "x")]
        )


def test_report_md_names_what_its_intervals_resample_and_prints_the_runs_spread(tmp_path, capsys):
    data = write_records(tmp_path / "test.jsonl", [make_record(i, t) for i, t in enumerate((8, 9, 10))])
    runs = [evaluate_run(tmp_path, f"seed-{s}", data) for s in (1, 2)]
    plant(runs[0], "nocot", [1.0, 1.0, 0.0])
    runs_report.main([f"seed {s}={run}" for s, run in zip((1, 2), runs)] + ["--out", str(tmp_path / "runs")])
    spread = tmp_path / "runs" / "spread.json"
    single = evaluate_run(tmp_path, "one", data, "--runs-spread", str(spread))
    text = (single / "report.md").read_text()
    assert "Δ Acc. vs SRT [95% over queries]" in text and "[95% CI]" not in text
    assert "over the 3 test queries of one training run per variant" in text
    assert "Across 2 training runs of this configuration" in text and str(spread) in text
    assert "This report's Δ is one draw from that spread" in text
    # a spread measured on another test file says nothing about these queries: left out, with a note
    other = write_records(tmp_path / "other.jsonl", [make_record(i, t) for i, t in enumerate((8, 9))])
    evaluate_run(tmp_path, "other", other, "--runs-spread", str(spread))
    assert "another test file" in capsys.readouterr().out
    assert "training runs of this configuration" not in (tmp_path / "other" / "report.md").read_text()
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(SystemExit, match="no field 'delta_accuracy'"):
        evaluate_run(tmp_path, "bad", data, "--runs-spread", str(bad))


# ---------------------------------------------------------------------------------------------
# make demo SEEDS=...: each seed's two sides share its batches; seeds differ by the seed alone
# ---------------------------------------------------------------------------------------------
def make_dry_run(*targets, **variables):
    command = ["make", "-n", "--no-print-directory", *targets, *(f"{k}={v}" for k, v in variables.items())]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=True).stdout


def commands(dry_run: str) -> list[str]:
    return [line for line in dry_run.replace("\\\n", " ").splitlines() if ".py" in line or "-m srt" in line]


def test_every_seed_trains_both_sides_and_grpo_with_its_seed_and_answers_the_same_queries():
    runs = {seed: commands(make_dry_run(f"lesson-seed-{seed}", LESSON="runs/x")) for seed in (3, 11)}
    for seed, lines in runs.items():
        trained = [line for line in lines if "stage1_sft.py" in line or "stage2_grpo.py" in line]
        assert len(trained) == 3  # SRT's SFT, the control's SFT, GRPO
        assert all(f"--seed {seed} " in line for line in trained)
        assert sum("--target answer" in line for line in trained) == 1
        (evaluation,) = [line for line in lines if "evaluate.py" in line]
        assert "--seed" not in evaluation  # evaluate.py's own seed picks the queries: one for every run
        assert (
            f"runs/x/seed-{seed}/grpo/final" in evaluation
            and f"runs/x/seed-{seed}/sft-nocot/final" in evaluation
        )

    # the two seeds' commands differ in the seed and its folder, in nothing else
    def normalized(seed):
        lines = [line.replace(f"seed-{seed}", "seed-N") for line in runs[seed]]
        return [line.replace(f"--seed {seed} ", "--seed N ") for line in lines]

    assert normalized(3) == normalized(11)


def test_demo_with_seeds_runs_each_seed_the_base_rows_once_and_the_report():
    lines = commands(make_dry_run("demo", SEEDS="1 2"))
    assert sum("stage0_build.py" in line for line in lines) == 1
    for seed in (1, 2):  # each seed trains both sides and GRPO, then evaluates (a phony seed ran nothing)
        assert sum(f"--seed {seed} " in line for line in lines) == 3
        assert sum(f"--out runs/demo/seed-{seed}/eval" in line for line in lines) == 1
    assert sum("rag=rag:" in line for line in lines) == 1
    (report,) = [line for line in lines if "srt.runs_report" in line]
    assert '"seed 1=runs/demo/seed-1/eval"' in report and '"seed 2=runs/demo/seed-2/eval"' in report
    plain = commands(make_dry_run("demo"))
    assert not any("seed-" in line or "runs_report" in line for line in plain)


def test_two_seeds_draw_other_batches_while_both_sides_of_a_seed_share_theirs(tiny):
    from records import hand_record

    import stage1_sft

    tok = tiny[1]
    records = [hand_record(i, rounds=3 + i % 5) for i in range(24)]

    def plan(seed, target):
        data = stage1_sft.PhaseData(tok, records, 2, 1024, target, seed=seed, global_batch=4, group_batches=2)
        return [data.batch_indices(step) for step in range(6)]

    assert plan(1, "full") == plan(1, "answer")
    assert plan(2, "full") == plan(2, "answer")
    assert plan(1, "full") != plan(2, "full")


# ---------------------------------------------------------------------------------------------
# A speed lever judged by demo.md's rule against the lesson's runs
# ---------------------------------------------------------------------------------------------
REFERENCE = {  # the lesson's runs: Jaccard 50 +- 9, Δ +18 +- 12 (points)
    "data_sha256": "abc",
    "runs": ["seed 1", "seed 2", "seed 3", "seed 4"],
    "jaccard": {"mean": 0.50, "sd": 0.09},
    "delta_accuracy": {"mean": 0.18, "sd": 0.12},
}


def lever_report(jaccards, deltas):
    runs = [planted_run(f"seed {i + 1}", [1, 0], [1, 1]) for i in range(len(jaccards))]
    report = {
        "runs": [{"label": r["label"], "jaccard": {"mean": j}} for r, j in zip(runs, jaccards)],
        "across": {
            "jaccard": runs_report.across_runs(jaccards),
            "delta_accuracy": runs_report.across_runs(deltas),
        },
    }
    return report, runs


def verdicts(jaccards, deltas):
    verdict = runs_report.judge_lever(*lever_report(jaccards, deltas), REFERENCE)
    return [c["passed"] for c in verdict["checks"]], verdict["passed"]


def test_a_lever_passes_within_one_sd_of_the_lessons_means_and_fails_outside():
    # Jaccard mean 0.45 in [0.41, 0.59]; Δ mean 0.20 in [0.06, 0.30]; lowest run 0.42; 3 runs
    assert verdicts([0.42, 0.45, 0.48], [0.10, 0.20, 0.30]) == ([True, True, True, True], True)
    # Δ mean 0.31 lies above 0.18 + 0.12: the lever moved the answers by more than a seed does
    assert verdicts([0.42, 0.45, 0.48], [0.25, 0.31, 0.37]) == ([True, False, True, True], False)
    # a Δ below the band fails as well (the rule is two-sided: SRT suddenly winning is a change too)
    assert verdicts([0.42, 0.45, 0.48], [-0.05, 0.05, 0.0]) == ([True, False, True, True], False)
    # Jaccard mean 0.40 is below 0.50 - 0.09
    assert verdicts([0.40, 0.40, 0.40], [0.18, 0.18, 0.18]) == ([False, True, True, True], False)


def test_a_lever_fails_on_one_run_that_stops_recalling_or_on_too_few_runs():
    # the mean 0.46 is inside the band, but one run recalls at 39%
    assert verdicts([0.39, 0.49, 0.50], [0.18, 0.18, 0.18]) == ([True, True, False, True], False)
    assert verdicts([0.45, 0.50], [0.18, 0.18]) == ([True, True, True, False], False)


def test_a_lever_on_another_test_file_or_other_seeds_is_refused():
    report, runs = lever_report([0.5, 0.5, 0.5], [0.2, 0.2, 0.2])
    with pytest.raises(runs_report.RunsError, match="data_sha256"):
        runs_report.judge_lever(report, runs, {**REFERENCE, "data_sha256": "other"})
    with pytest.raises(runs_report.RunsError, match="seed 3"):
        runs_report.judge_lever(report, runs, {**REFERENCE, "runs": ["seed 1", "seed 2"]})


def test_make_passes_a_levers_flags_to_both_sides_and_judges_it():
    lines = commands(make_dry_run("demo", SEEDS="1 2", SFT_FLAGS="--attention bf16_eager", JUDGE="ref.json"))
    sft = [line for line in lines if "stage1_sft.py" in line]
    assert len(sft) == 4 and all(line.rstrip().endswith("--attention bf16_eager") for line in sft)
    (report,) = [line for line in lines if "srt.runs_report" in line]
    assert "--judge-against ref.json" in report
    plain = commands(make_dry_run("demo", SEEDS="1"))
    assert not any("bf16_eager" in line or "--judge-against" in line for line in plain)
