"""Training on a mix (srt/data_io.py: --data PATH[:WEIGHT] ...): one file trains exactly as it
always did; several fill an epoch at their weights, every source seen; a bad PATH:WEIGHT is a
one-line error. Records are built by hand; nothing here loads a model except the tiny tokenizer of
the prompt-stream checks and one two-step tiny-random SFT run."""

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from records import hand_record

import stage1_sft
import stage2_grpo
from srt.data_io import (
    DataError,
    data_paths,
    mix_sources,
    parse_data_spec,
    read_jsonl,
    read_mixture,
    write_jsonl,
)
from srt.rollouts import PromptStream

pytestmark = pytest.mark.usefixtures("one_thread")


def source(tmp_path, name, n, rounds=4, first=0):
    """n hand-made records in tmp_path/name.jsonl; ids hand-<first + k>, so sources never share one."""
    records = [hand_record(first + k, rounds=rounds, recall=("Q1",) if k % 2 else ()) for k in range(n)]
    for r in records:
        r["source"] = name
    path = tmp_path / f"{name}.jsonl"
    write_jsonl(path, records)
    return str(path)


def phase_plan(records, seed=3, steps=25):
    """The record ids of stage 1's first `steps` optimizer steps (phase 2, global batch 4)."""
    data = stage1_sft.PhaseData(None, records, 2, 1024, "full", seed=seed, global_batch=4, group_batches=4)
    return [[records[i]["id"] for i in data.batch_indices(step)] for step in range(steps)]


def stream_plan(records, tokenizer, n, seed=3):
    """The record ids of stage 2's first n prompts."""
    stream = PromptStream(records, tokenizer, 0, seed=seed)
    return [record["id"] for record, _ in stream.next_batch(n)]


# ---------------------------------------------------------------------------------------------
# PATH[:WEIGHT]
# ---------------------------------------------------------------------------------------------
def test_a_bare_path_weighs_one_and_a_weight_follows_the_last_colon():
    assert parse_data_spec("runs/syn/train.jsonl") == ("runs/syn/train.jsonl", 1.0)
    assert parse_data_spec("runs/locomo/train.jsonl:0.25") == ("runs/locomo/train.jsonl", 0.25)
    assert parse_data_spec("a.jsonl:3") == ("a.jsonl", 3.0)
    assert data_paths("a.jsonl") == ["a.jsonl"] and data_paths(["a.jsonl:2", "b.jsonl"]) == [
        "a.jsonl",
        "b.jsonl",
    ]


def test_a_path_with_a_colon_is_a_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert parse_data_spec("run:1/train.jsonl") == ("run:1/train.jsonl", 1.0)  # a folder, not a weight
    assert parse_data_spec("run:1/train.jsonl:2") == ("run:1/train.jsonl", 2.0)
    Path("odd:3").write_text("")
    assert parse_data_spec("odd:3") == ("odd:3", 1.0)  # a file of that name: what the user typed
    assert parse_data_spec("odd:3:0.5") == ("odd:3", 0.5)
    for stage in (stage1_sft, stage2_grpo):
        assert stage.parse_args(["--data", "run:1/train.jsonl", "odd:3"]).data == [
            "run:1/train.jsonl",
            "odd:3",
        ]


@pytest.mark.parametrize(
    "spec", ["a.jsonl:", "a.jsonl:half", "a.jsonl:0", "a.jsonl:-1", "a.jsonl:nan", "a.jsonl:inf", ":2"]
)
def test_a_bad_weight_is_a_one_line_error_naming_the_flag(spec, capsys):
    with pytest.raises(DataError, match="not PATH or PATH:WEIGHT"):
        parse_data_spec(spec)
    for stage in (stage1_sft, stage2_grpo):
        with pytest.raises(SystemExit):
            stage.parse_args(["--data", "ok.jsonl", spec])
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert "error: argument --data: " in last and repr(spec) in last


# ---------------------------------------------------------------------------------------------
# One file: exactly as before
# ---------------------------------------------------------------------------------------------
def test_one_file_trains_on_the_same_batches_in_the_same_order_as_before(tmp_path, tiny):
    """Before the mix, stage 1 and stage 2 read `read_jsonl(--data)` and built their plans on it; a
    one-file --data (bare, weighted, or as the list argparse makes of it) must give the very same
    records in the very same order, so the same batches, steps and prompts."""
    path = source(tmp_path, "one", 23, rounds=3)
    before = read_jsonl(path)
    for specs in (path, [path], [f"{path}:0.3"], stage1_sft.parse_args(["--data", path]).data):
        after = read_mixture(specs, seed=7)
        assert after == before
        assert phase_plan(after) == phase_plan(before)  # 25 steps, 6 an epoch: over four epochs
    assert stream_plan(read_mixture(path, 7), tiny[1], 50) == stream_plan(before, tiny[1], 50)
    # stage 2's --train-turns dependent: the filter, then the same order as before
    dependent = read_mixture(path, 7, keep=lambda r: bool(r["recall"]))
    assert dependent == [r for r in before if r["recall"]]


# ---------------------------------------------------------------------------------------------
# Several files: the weights, every source seen, determinism
# ---------------------------------------------------------------------------------------------
def test_an_epoch_of_the_mix_holds_each_source_at_its_weight(tmp_path):
    """300 short records at weight 1 and 60 long ones at weight 3: an epoch is N = 360 places,
    round(360 / 4) = 90 of the first source and 270 of the second, whose 60 records then appear
    4 or 5 times each (every record once before any twice); 90 distinct records of the first."""
    a, b = source(tmp_path, "a", 300, rounds=3), source(tmp_path, "b", 60, rounds=9, first=1000)
    mix = read_mixture([f"{a}:1", f"{b}:3"], seed=0)
    counts = Counter(r["source"] for r in mix)
    assert len(mix) == 360 and counts == {"a": 90, "b": 270}
    per_record = Counter(r["id"] for r in mix if r["source"] == "b")
    assert len(per_record) == 60 and set(per_record.values()) == {4, 5}
    assert len({r["id"] for r in mix if r["source"] == "a"}) == 90
    # weights are relative: 0.25 and 0.75 are 1 and 3
    assert [r["id"] for r in read_mixture([f"{a}:0.25", f"{b}:0.75"], seed=0)] == [r["id"] for r in mix]


def test_places_are_rounded_shares_and_a_tiny_weight_still_gets_one():
    small, large = [{"id": f"s{k}"} for k in range(7)], [{"id": f"l{k}"} for k in range(5)]
    mix = mix_sources([(small, 0.2), (large, 0.8)], seed=0)  # N = 12: 2.4 -> 2, 9.6 -> 10
    assert Counter(r["id"][0] for r in mix) == {"s": 2, "l": 10}
    big, rare = [{"id": f"b{k}"} for k in range(1000)], [{"id": "r0"}, {"id": "r1"}, {"id": "r2"}]
    mix = mix_sources([(big, 1.0), (rare, 1e-4)], seed=0)  # 1003 * 1e-4 / 1.0001 rounds to 0
    assert sum(r["id"][0] == "r" for r in mix) == 1 and sum(r["id"][0] == "b" for r in mix) == 1003


def test_training_batches_respect_the_weights_and_see_every_source(tmp_path, tiny):
    """Stage 1's batches and stage 2's prompts over the mix of the test above (a 1/4, b 3/4).

    Over a whole epoch the counts are exact: an epoch is a permutation of the mix (360 places,
    90 global batches of 4, no wrap-around). Inside an epoch they are random, and the bound is
    argued, not fitted: stage 2 walks a permutation, so the b-count of its first 120 prompts is
    hypergeometric (120 of 360, 270 b): mean 90, sd sqrt(120 * 3/4 * 1/4 * 240/359) = 3.9. Stage
    1's first 30 batches are 30 of the epoch's 90 batches drawn without replacement, but length
    grouping fills a batch with records of one length (here: one source), so a batch's b-count c
    lies in [0, 4] with mean 3, whose variance is at most (4 - 3)(3 - 0) = 3 (Bhatia-Davis):
    sd <= sqrt(30 * 3 * 60/89) = 7.8. Every seed must lie within 4 sd, and the mean over 20 seeds
    within 4 sd / sqrt(20) of 90, which a mix that ignored the weights (b at half: 60) fails."""
    a, b, c = (
        source(tmp_path, "a", 300, rounds=3),
        source(tmp_path, "b", 60, rounds=9, first=1000),
        source(tmp_path, "c", 50, rounds=5, first=2000),
    )
    mix = read_mixture([f"{a}:1", f"{b}:3"], seed=0)
    by_id = {r["id"]: r["source"] for r in mix}
    epoch = [by_id[i] for step in phase_plan(mix, steps=90) for i in step]
    assert Counter(epoch) == {"a": 90, "b": 270}
    stage1, stage2 = [], []
    for seed in range(20):
        first = [by_id[i] for step in phase_plan(mix, seed=seed, steps=30) for i in step]
        stage1.append(first.count("b"))
        stage2.append([by_id[i] for i in stream_plan(mix, tiny[1], 120, seed=seed)].count("b"))
    assert all(abs(n - 90) <= 4 * 7.8 for n in stage1) and abs(np.mean(stage1) - 90) <= 4 * 7.8 / 20**0.5
    assert all(abs(n - 90) <= 4 * 3.9 for n in stage2) and abs(np.mean(stage2) - 90) <= 4 * 3.9 / 20**0.5
    assert Counter(by_id[i] for i in stream_plan(mix, tiny[1], 360)) == {"a": 90, "b": 270}
    # a source at 1% of the weight is still in the epoch, and the first epoch trains on it
    rare = read_mixture([f"{a}:0.9", f"{b}:0.09", f"{c}:0.01"], seed=0)
    by_id = {r["id"]: r["source"] for r in rare}
    assert Counter(r["source"] for r in rare) == {"a": 369, "b": 37, "c": 4}  # N = 410
    seen = {by_id[i] for step in phase_plan(rare, steps=len(rare) // 4 + 1) for i in step}
    assert seen == {"a", "b", "c"}


def test_the_mix_is_seeded_and_filters_each_file_before_mixing(tmp_path):
    a, b = source(tmp_path, "a", 40), source(tmp_path, "b", 10, first=100)
    specs = [f"{a}:1", f"{b}:1"]
    assert [r["id"] for r in read_mixture(specs, seed=1)] == [r["id"] for r in read_mixture(specs, seed=1)]
    assert [r["id"] for r in read_mixture(specs, seed=1)] != [r["id"] for r in read_mixture(specs, seed=2)]
    # --train-turns dependent keeps half of each file (odd k recall Q1): 20 and 5, weights 1:1 of N = 25
    kept = read_mixture(specs, seed=1, keep=lambda r: bool(r["recall"]))
    assert all(r["recall"] for r in kept) and Counter(r["source"] for r in kept) == {"a": 12, "b": 12}
    empty = tmp_path / "none.jsonl"
    write_jsonl(empty, [hand_record(0, recall=())])
    with pytest.raises(DataError, match=r"none.jsonl: no records \(--train-turns dependent\)"):
        read_mixture([a, str(empty)], keep=lambda r: bool(r["recall"]), note=" (--train-turns dependent)")


def test_stage1_trains_on_a_mix_and_writes_it_in_its_config(tmp_path):
    a, b = source(tmp_path, "a", 6, rounds=3), source(tmp_path, "b", 4, rounds=4, first=100)
    out = tmp_path / "sft"
    argv = [
        "--model",
        "tiny-random",
        "--data",
        f"{a}:0.5",
        f"{b}:0.5",
        "--out",
        str(out),
        "--dtype",
        "float32",
    ]
    stage1_sft.main(argv + ["--max-steps", "2", "--batch-size", "2", "--warmup-steps", "0"])
    config = json.loads((out / "config.json").read_text())
    assert config["data"] == [f"{a}:0.5", f"{b}:0.5"] and config["total_steps"] == 2
    assert (out / "final" / "config.json").exists()
