"""bench/grpo_replicate.py and bench/pool_replicates.py: one replicate's chain end to end on
tiny-random (stage 0 -> SFT -> GRPO -> evaluation, each a subprocess with --resume), its resume,
its result.json, and the pooling math on hand-computed cases."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]


def load(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


replicate = load("grpo_replicate")
pool = load("pool_replicates")

MEASURES = ("jaccard", "f1", "accuracy", "right_without_recall")


# --------------------------------------------------------------------------------------------
# The pooling math. Plain float64 numpy on planted values, no model: every CPU computes the same
# bits, and abs=1e-12 only absorbs the rounding of a mean of a few doubles (about 1e-16 each).
# --------------------------------------------------------------------------------------------
def test_one_replicate_with_constant_differences_collapses_to_the_value():
    """Every resample of a constant set of differences has that mean: the interval is the point."""
    got = pool.pooled_gain([np.full(7, 0.25)], resamples=1000, seed=3)
    assert got["diff"] == pytest.approx(0.25, abs=1e-12)
    assert got["low"] == pytest.approx(0.25, abs=1e-12) and got["high"] == pytest.approx(0.25, abs=1e-12)
    assert got["replicates"] == 1


def test_the_pooled_gain_is_the_mean_of_the_replicates_not_of_all_queries():
    """Planted per-query differences: replicate means 0.1 (2 queries), 0.2 (3), 0.6 (5). The pooled
    gain weighs each replicate once: (0.1 + 0.2 + 0.6) / 3 = 0.3; pooling the 10 queries would give
    (0.2 + 0.6 + 3.0) / 10 = 0.38."""
    diffs = [np.array([0.0, 0.2]), np.array([0.1, 0.2, 0.3]), np.array([0.2, 0.4, 0.6, 0.8, 1.0])]
    got = pool.pooled_gain(diffs, resamples=1000, seed=0)
    assert got["diff"] == pytest.approx(0.3, abs=1e-12)


def test_the_interval_resamples_replicates():
    """Three replicates, constant within each (0.1, 0.2, 0.6): only the draw of replicates varies. A
    resample is the mean of 3 draws from {0.1, 0.2, 0.6}; all three at 0.1 (or at 0.6) has chance
    1/27 = 3.7% > 2.5%, so the 95% interval is exactly [0.1, 0.6]. An interval that resampled only
    queries would collapse to 0.3."""
    diffs = [np.full(4, 0.1), np.full(6, 0.2), np.full(5, 0.6)]
    got = pool.pooled_gain(diffs, resamples=2000, seed=0)
    assert got["low"] == pytest.approx(0.1, abs=1e-12) and got["high"] == pytest.approx(0.6, abs=1e-12)


def test_the_interval_resamples_queries_within_each_replicate():
    """Two replicates with the same differences, five 0s and five 1s: their means agree (0.5), so a
    bootstrap over replicates alone would give [0.5, 0.5]. Resampling the queries of each, a slot's
    mean has variance 0.25 / 10 and the mean of two independent slots 0.0125: 95% about
    0.5 +- 1.96 x 0.112 = [0.28, 0.72]. The bounds are means of 20 draws of 0/1 (steps of 0.05)."""
    d = np.array([0.0, 1.0] * 5)
    got = pool.pooled_gain([d, d.copy()], resamples=2000, seed=0)
    assert got["diff"] == pytest.approx(0.5, abs=1e-12)
    assert 0.2 <= got["low"] <= 0.35 and 0.65 <= got["high"] <= 0.8


def test_query_differences_pair_by_position_and_mark_missing_values():
    """Aligned with the ids, NaN where a value is missing: replicates on the same queries then share
    one query draw position by position."""
    per_query = {
        "ids": ["a", "b", "c"],
        "start": {"jaccard": [0.5, None, 0.0]},
        "grpo": {"jaccard": [1.0, 1.0, 0.25]},
    }
    got = pool.query_differences(per_query, "jaccard", "start", "grpo")
    assert got[0] == 0.5 and np.isnan(got[1]) and got[2] == 0.25
    assert pool.pooled_gain([got], resamples=1000)["diff"] == pytest.approx(0.375, abs=1e-12)
    assert pool.query_differences(per_query, "jaccard", "placebo", "grpo") is None


def _pooled(jaccard_low, f1_diff, versus_low=None, placebos=2):
    one = {"diff": 0.05, "low": jaccard_low, "high": 0.1}
    pooled = {"grpo-start": {"jaccard": one, "f1": {"diff": f1_diff, "low": -0.1, "high": 0.1}}}
    if versus_low is not None:
        pooled["grpo-placebo"] = {
            "jaccard": {"diff": 0.04, "low": versus_low, "high": 0.1, "replicates": placebos}
        }
    return pooled


def test_the_pooled_verdict_at_its_boundaries():
    """Passes: the Jaccard interval above 0 (touching is not), above the placebo where one ran, and
    F1 down by at most 2 points (2.1 is more)."""
    assert pool.verdict(_pooled(0.01, -0.019))["passes"]
    assert not pool.verdict(_pooled(0.0, 0.0))["passes"]
    assert not pool.verdict(_pooled(0.01, -0.021))["passes"]
    assert not pool.verdict(_pooled(0.01, 0.0, versus_low=-0.01))["passes"]
    with_placebo = pool.verdict(_pooled(0.01, 0.0, versus_low=0.001))
    assert with_placebo["passes"] and with_placebo["jaccard_above_placebo"]
    assert pool.verdict(_pooled(0.01, 0.0))["jaccard_above_placebo"] is None


def test_one_placebo_gives_no_verdict_and_a_borderline_bound_does_not_pass():
    """One replicate's placebo is one run: "above the placebo" needs at least two. A pooled bound
    whose sign changes with the bootstrap's seed decides nothing."""
    one = pool.verdict(_pooled(0.01, 0.0, versus_low=0.05, placebos=1))
    assert one["jaccard_above_placebo"] is None and one["placebo_replicates"] == 1
    shaky = _pooled(0.001, 0.0)
    shaky["grpo-start"]["jaccard"]["signs"] = {"borderline": True}
    decision = pool.verdict(shaky)
    assert decision["jaccard_above_zero_borderline"] and not decision["passes"]


def test_replicates_on_the_same_queries_share_one_query_draw():
    """Three copies of one replicate on the same queries are one replicate's evidence about those
    queries: with one shared draw the pooled interval is that replicate's own; drawing each copy's
    queries apart would average the query noise down by sqrt(3) and narrow it for nothing."""
    d = np.array([0.0, 1.0] * 5)
    ids = [f"q{i}" for i in range(10)]
    alone = pool.pooled_gain([d], resamples=20_000, seed=1)
    shared = pool.pooled_gain([d, d.copy(), d.copy()], resamples=20_000, seed=1, ids=[ids] * 3)
    apart = pool.pooled_gain([d, d.copy(), d.copy()], resamples=20_000, seed=1)
    assert shared["shared_queries"] and not apart["shared_queries"]
    assert (shared["low"], shared["high"]) == pytest.approx((alone["low"], alone["high"]), abs=1e-12)
    assert apart["high"] - apart["low"] < 0.75 * (shared["high"] - shared["low"])
    # other ids: each replicate gets its own draw again
    other = [f"x{i}" for i in range(10)]
    assert not pool.pooled_gain([d, d.copy()], resamples=1000, ids=[ids, other])["shared_queries"]


def test_the_t_interval_over_replicates_by_hand_and_the_default_resamples():
    """Replicate means 0.1, 0.2, 0.6: mean 0.3, SD sqrt(0.07) = 0.264575, t(2) 97.5% = 4.302653, so
    0.3 +- 4.302653 * 0.264575 / sqrt(3) = 0.3 +- 0.657241. One replicate has none."""
    got = pool.pooled_gain([np.full(4, 0.1), np.full(6, 0.2), np.full(5, 0.6)], resamples=1000)
    assert got["t"]["low"] == pytest.approx(0.3 - 0.657241, abs=1e-6)
    assert got["t"]["high"] == pytest.approx(0.3 + 0.657241, abs=1e-6)
    assert pool.pooled_gain([np.full(4, 0.1)], resamples=1000)["t"]["low"] is None
    assert pool.build_parser().parse_args(["x.json"]).resamples >= 20_000
    assert pool.pooled_gain([np.full(4, 0.1)])["resamples"] >= 20_000


def test_a_bound_whose_sign_follows_the_bootstrap_seed_is_borderline(monkeypatch):
    lows = iter([-0.002, 0.003, 0.001])
    monkeypatch.setattr(pool, "pooled_gain", lambda *a, **k: {"low": next(lows), "high": 0.08})
    assert pool.bound_signs([], None, 1000, 3)["borderline"]
    steady = iter([0.01, 0.02, 0.015])
    monkeypatch.setattr(pool, "pooled_gain", lambda *a, **k: {"low": next(steady), "high": 0.08})
    signs = pool.bound_signs([], None, 1000, 3)
    assert not signs["borderline"] and signs["low_range"] == [0.01, 0.02]


def _result(seed, start, grpo, placebo=None):
    """A result.json with planted per-query values (the same for every measure)."""
    models = {"start": start, "grpo": grpo, **({"placebo": placebo} if placebo else {})}
    per_query = {"ids": [f"q{i}" for i in range(len(start))]}
    per_query.update({name: {m: list(v) for m in MEASURES} for name, v in models.items()})
    diff = {"diff": 0.0, "low": 0.0, "high": 0.0, "n": len(start)}
    names = ["grpo-start"] + (["placebo-start", "grpo-placebo"] if placebo else [])
    return {
        "seed": seed,
        "differences": {n: {m: diff for m in MEASURES} for n in names},
        "per_query": per_query,
    }


def test_pool_script_reads_results_and_writes_its_table_json_and_plot(tmp_path):
    """Two replicates, one with a placebo: GRPO - start pools both (0.5 and 0.25 -> 0.375), the
    placebo rows only the one that has it."""
    paths = []
    for seed, result in (
        (1, _result(1, [0.0, 0.0], [0.5, 0.5], placebo=[0.0, 0.25])),
        (2, _result(2, [0.5, 0.25, 0.0], [0.75, 0.5, 0.25])),
    ):
        path = tmp_path / f"replicate-{seed}" / "result.json"
        path.parent.mkdir()
        path.write_text(json.dumps(result))
        paths.append(str(path))
    out = tmp_path / "pooled"
    payload = pool.main([*paths, "--out", str(out)])
    gain = payload["pooled"]["grpo-start"]["jaccard"]
    assert gain["diff"] == pytest.approx(0.375, abs=1e-12) and gain["replicates"] == 2
    assert payload["pooled"]["placebo-start"]["jaccard"]["diff"] == pytest.approx(0.125, abs=1e-12)
    assert payload["pooled"]["placebo-start"]["jaccard"]["replicates"] == 1
    assert payload["pooled"]["grpo-placebo"]["jaccard"]["diff"] == pytest.approx(0.375, abs=1e-12)
    table = (out / "pooled.md").read_text()
    assert (out / "pooled.png").stat().st_size > 0 and "pooled, 2 replicates" in table
    assert "**one run, queries only** | placebo-start" in table  # one placebo: one run, not a pool
    assert "above the placebo: no verdict" in table and "above the placebo: yes" not in table
    assert "one query draw shared" not in table  # seed 1 and 2 answered other numbers of queries
    assert "| seed 1 (replicate-1) | grpo-start |" in table
    assert pool.replicate_name("docs/experiments/grpo-replicates/k8-seed-2.json") == "k8-seed-2"


def test_pool_script_names_a_file_that_is_not_a_result(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"seed": 1}))
    with pytest.raises(SystemExit, match="x.json: no field 'differences'"):
        pool.main([str(bad), "--out", str(tmp_path / "out")])


# --------------------------------------------------------------------------------------------
# The replicate's chain
# --------------------------------------------------------------------------------------------
def test_the_evaluation_grows_until_it_holds_enough_queries_that_need_recall(tmp_path):
    """Planted dev set: 6 queries that need recall and 6 that need none. The limit grows from 4 until
    the stratified selection holds 5 that need recall; a request for 7 cannot be met."""
    from srt.data_io import write_jsonl
    from tests.records import hand_record

    records = [hand_record(i, recall=("Q1",) if i % 2 else ()) for i in range(12)]
    dev = tmp_path / "dev.jsonl"
    write_jsonl(dev, records)
    limit, need = replicate.eval_limit_for(dev, 4, 5)
    assert need >= 5 and limit >= 4
    from evaluate import select_examples

    assert sum(1 for r in select_examples(records, limit - 1, 0) if r["recall"]) < 5  # the smallest such
    with pytest.raises(SystemExit, match="fewer than --eval-min-recall 7"):
        replicate.eval_limit_for(dev, 4, 7)


TINY = [
    "--model", "tiny-random", "--dtype", "float32", "--dialogues", "12",
    "--sft-steps", "2", "--sft-batch-size", "1", "--sft-grad-accum", "1",
    "--grpo-steps", "1", "--grpo-k", "2", "--grpo-prompts-per-step", "1", "--max-new-tokens", "8",
    "--eval-limit", "4", "--eval-min-recall", "2", "--eval-batch-size", "4",
]  # fmt: skip


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """One replicate run from nothing, timed: stage 0, SFT, GRPO, the evaluation."""
    root = tmp_path_factory.mktemp("replicates")
    argv = [*TINY, "--seed", "1", "--data-dir", str(root / "data"), "--out", str(root / "replicate-1")]
    t0 = time.perf_counter()
    result = replicate.main(argv)
    return {"root": root, "argv": argv, "result": result, "seconds": time.perf_counter() - t0}


def _stages(out: Path) -> dict:
    return json.loads((out / "stages.json").read_text())


def test_the_chain_runs_end_to_end_and_writes_its_result(chain):
    out = chain["root"] / "replicate-1"
    print(f"\nchain end to end: {chain['seconds']:.1f} s")
    result = json.loads((out / "result.json").read_text())
    assert result == json.loads(json.dumps(chain["result"]))
    assert result["seed"] == 1 and result["config"]["sft_steps"] == 2 and result["config"]["grpo_k"] == 2
    assert result["machine"]["cpu"] and result["machine"]["dtype"]["sft"]["autocast_dtype"] == "None"
    assert set(result["stages"]) == {"data", "sft", "grpo", "eval"}
    assert all(s["seconds"] > 0 and s["attempts"] == 1 for s in result["stages"].values())
    assert result["runs"]["sft"]["steps"] == 2 and result["runs"]["grpo"]["steps"] == 1
    assert result["eval"]["need_recall"] >= 2 and result["eval"]["queries"] >= 4
    assert set(result["differences"]) == {"grpo-start"}
    gain = result["differences"]["grpo-start"]
    for m in MEASURES:
        assert {"diff", "low", "high"} <= set(gain[m])
    # the per-query values are evaluate.py's rows, and the stored difference is their paired mean
    rows = {r["id"]: r for r in map(json.loads, (out / "eval" / "grpo.jsonl").read_text().splitlines())}
    per_query = result["per_query"]
    assert per_query["grpo"]["f1"] == [rows[i]["f1"] for i in per_query["ids"]]
    for m in ("jaccard", "f1"):
        paired = np.mean(np.array(per_query["grpo"][m]) - np.array(per_query["start"][m]))
        assert gain[m]["diff"] == pytest.approx(paired, abs=1e-12)
        assert gain[m]["n"] == len(per_query["ids"])


def test_a_killed_stage_is_picked_up_and_the_placebo_added_later(chain):
    """GRPO stopped after its last checkpoint (final/ and summary.json missing): the next call,
    which also asks for the placebo, resumes GRPO from its checkpoint (its metrics lines kept, not
    retrained), leaves stage 0 and SFT alone, runs the placebo from the same start, and evaluates
    only the placebo (the start's and GRPO's rows reused). A third call redoes nothing."""
    out = chain["root"] / "replicate-1"
    metrics_before = (out / "grpo" / "metrics.jsonl").read_text()
    start_rows = (out / "eval" / "start.jsonl").read_text()
    sft_final = (out / "sft" / "final" / "model.safetensors").stat().st_mtime_ns
    (out / "grpo" / "summary.json").unlink()
    for f in (out / "grpo" / "final").iterdir():
        f.unlink()
    (out / "grpo" / "final").rmdir()

    result = replicate.main([*chain["argv"], "--placebo"])
    stages = _stages(out)
    assert [stages[s]["attempts"] for s in ("data", "sft", "grpo", "placebo")] == [1, 1, 2, 1]
    assert (out / "grpo" / "metrics.jsonl").read_text() == metrics_before  # resumed, step_s kept
    assert (out / "sft" / "final" / "model.safetensors").stat().st_mtime_ns == sft_final
    assert (out / "eval" / "start.jsonl").read_text() == start_rows  # reused, not answered again
    assert set(result["differences"]) == {"grpo-start", "placebo-start", "grpo-placebo"}
    placebo_config = json.loads((out / "placebo" / "config.json").read_text())
    assert placebo_config["placebo"] and placebo_config["seed"] == 1
    assert len(result["per_query"]["placebo"]["jaccard"]) == len(result["per_query"]["ids"])

    before = _stages(out)
    again = replicate.main(chain["argv"])  # without --placebo: the placebo stays in the result
    assert _stages(out) == before
    assert set(again["differences"]) == set(result["differences"])


def test_a_stage_killed_without_warning_keeps_the_time_it_ran(tmp_path):
    """SIGKILL (a machine taken back) cannot be caught, so the chain cannot write the
    stage's time when it stops: the time must already be in stages.json, written while the stage
    ran, with the attempt counted and the stage not done (a rerun redoes it). Before the fix a
    killed attempt left nothing, and a resumed SFT of 48 + 14 minutes read as 14."""
    log = tmp_path / "stages.json"
    chain_script = (
        "import importlib.util, sys\n"
        "from pathlib import Path\n"
        f"spec = importlib.util.spec_from_file_location('r', {str(REPO / 'bench' / 'grpo_replicate.py')!r})\n"
        "r = importlib.util.module_from_spec(spec); spec.loader.exec_module(r)\n"
        "r.RECORD_EVERY_S = 0.1\n"
        "stage = [sys.executable, '-c', 'import time; time.sleep(30)']\n"
        f"r.run_stage('sft', stage, {{'out': {str(tmp_path)!r}, 'data_dir': {str(tmp_path)!r}}}, {{}}, "
        f"Path({str(log)!r}), False)\n"
    )
    chain = subprocess.Popen([sys.executable, "-c", chain_script], start_new_session=True)
    try:
        deadline = time.monotonic() + 20  # well before the stage's 30 s end
        while time.monotonic() < deadline:
            if log.exists() and json.loads(log.read_text())["sft"]["seconds"] >= 0.5:
                break
            time.sleep(0.05)
        else:
            pytest.fail("the running stage wrote no time within 20 s")
        assert chain.poll() is None  # read while the stage runs, not after it ended
    finally:  # the chain and its stage together, as a machine taken back would
        os.killpg(chain.pid, signal.SIGKILL)
        chain.wait()
    entry = json.loads(log.read_text())["sft"]
    assert entry["attempts"] == 1 and entry["done"] is False and entry["seconds"] >= 0.5


def test_another_recipe_in_the_same_folder_stops_with_one_line(chain):
    out = chain["root"] / "replicate-1"
    config = (out / "config.json").read_text()
    argv = [*chain["argv"], "--grpo-steps", "3"]
    with pytest.raises(SystemExit, match=r"another recipe \(grpo_steps: 1 there, 3 now\)"):
        replicate.main(argv)
    assert (out / "config.json").read_text() == config


def test_make_target_passes_the_seed_and_the_placebo():
    def command(*args):
        text = subprocess.run(
            ["make", "-n", "grpo-replicate", *args], cwd=REPO, capture_output=True, text=True
        )
        return next(line for line in text.stdout.splitlines() if "grpo_replicate.py" in line).split()

    assert command("SEED=3", "PLACEBO=1")[-3:] == ["--seed", "3", "--placebo"]
    assert command("SEED=2")[-2:] == ["--seed", "2"]


def test_the_default_recipe_is_what_the_help_says_and_the_stages_get_it():
    args = replicate.parse_args(["--seed", "4"])
    assert args.out == "runs/replicate-4"
    commands = replicate.stage_commands(dict(vars(args)), 130)
    sft, grpo, ev = commands["sft"], commands["grpo"], commands["eval"]

    def flag(cmd, name):
        return cmd[cmd.index(name) + 1]

    assert flag(sft, "--max-steps") == "256" and flag(sft, "--phase1-fraction") == "0.4"
    assert flag(sft, "--seed") == "4" and flag(grpo, "--seed") == "4"
    assert flag(grpo, "-K") == "8" and flag(grpo, "--max-steps") == "30"  # the recipe the replicates test
    assert flag(grpo, "--eval-limit") == "0" and flag(grpo, "--sample-every") == "0"  # no probe, no samples
    assert flag(ev, "--limit") == "130" and flag(ev, "--latency-per-bucket") == "0"
    assert "placebo" not in commands and all("--resume" in c for c in commands.values())
