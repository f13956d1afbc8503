"""bench/pair_evals.py: two evaluate.py runs of the same LoCoMo questions paired by question id,
against hand-computed means."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import pair_evals  # noqa: E402


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_pairs_by_id_not_by_order_and_splits_out_the_answerable(tmp_path):
    # A and B hold the same three questions in different orders, and B one more that A lacks.
    a = write_rows(tmp_path / "a.jsonl", [
        {"id": "q1", "locomo_category": 1, "locomo_score": 0.0, "f1": 0.2},
        {"id": "q2", "locomo_category": 5, "locomo_score": 1.0, "f1": 1.0},
        {"id": "q3", "locomo_category": 4, "locomo_score": 0.5, "f1": None},
    ])  # fmt: skip
    b = write_rows(tmp_path / "b.jsonl", [
        {"id": "q3", "locomo_category": 4, "locomo_score": 1.0, "f1": 0.9},
        {"id": "q9", "locomo_category": 4, "locomo_score": 1.0, "f1": 1.0},
        {"id": "q1", "locomo_category": 1, "locomo_score": 1.0, "f1": 0.6},
        {"id": "q2", "locomo_category": 5, "locomo_score": 0.0, "f1": 0.0},
    ])  # fmt: skip
    result = pair_evals.main([str(a), str(b), "--out", str(tmp_path / "out")])
    assert result["shared"] == 3
    every, answerable = result["subsets"]["all"], result["subsets"]["answerable"]
    # all: diffs +1, -1, +0.5 -> mean 1/6; answerable (q1, q3): +1, +0.5 -> 0.75, every resample in [0.5, 1]
    assert every["locomo_score"]["diff"] == pytest.approx(1 / 6)
    assert answerable["locomo_score"]["diff"] == pytest.approx(0.75)
    assert 0.5 <= answerable["locomo_score"]["low"] <= answerable["locomo_score"]["high"] <= 1.0
    # a metric missing on one side of a pair (q3's f1 in A) leaves that pair out, not counted as 0
    assert every["f1"]["n"] == 2 and every["f1"]["diff"] == pytest.approx(((0.6 - 0.2) + (0.0 - 1.0)) / 2)
    # each side's mean over the paired items, and the categories apart (q1 alone in category 1)
    assert answerable["locomo_score"]["a"] == pytest.approx(0.25) and answerable["locomo_score"]["b"] == 1.0
    assert result["subsets"]["1"]["locomo_score"]["diff"] == pytest.approx(1.0)
    assert (tmp_path / "out" / "results.md").read_text().count("| answerable |") >= 2


def test_a_row_without_an_id_is_named_with_its_file_and_line(tmp_path):
    a = write_rows(tmp_path / "a.jsonl", [{"id": "q1", "locomo_category": 1}, {"locomo_category": 2}])
    with pytest.raises(SystemExit, match=r"a\.jsonl:2: field 'id' is missing"):
        pair_evals.main([str(a), str(a), "--out", str(tmp_path / "out")])


def test_files_that_share_no_question_are_refused(tmp_path):
    a = write_rows(tmp_path / "a.jsonl", [{"id": "q1", "locomo_category": 1, "f1": 0.1}])
    b = write_rows(tmp_path / "b.jsonl", [{"id": "q2", "locomo_category": 1, "f1": 0.1}])
    with pytest.raises(SystemExit, match="share no LoCoMo question id"):
        pair_evals.main([str(a), str(b), "--out", str(tmp_path / "out")])


def test_a_row_repeated_whole_counts_once_and_a_different_one_is_refused(tmp_path, capsys):
    rows = [
        {"id": "q1", "locomo_category": 1, "locomo_score": 0.0, "f1": 0.2},
        {"id": "q2", "locomo_category": 2, "locomo_score": 1.0, "f1": 1.0},
    ]
    a = write_rows(tmp_path / "a.jsonl", rows)
    b = write_rows(tmp_path / "b.jsonl", [dict(r, locomo_score=1.0) for r in rows])
    once = pair_evals.main([str(a), str(b), "--out", str(tmp_path / "once")])
    twice = write_rows(
        tmp_path / "b2.jsonl", [dict(r, locomo_score=1.0) for r in rows + rows]
    )  # appended twice
    result = pair_evals.main([str(a), str(twice), "--out", str(tmp_path / "twice")])
    assert "2 repeated row(s) counted once" in capsys.readouterr().err
    assert result["n_b"] == 2 and result["subsets"] == once["subsets"]
    clash = write_rows(tmp_path / "b3.jsonl", [*rows, dict(rows[0], f1=0.9)])
    with pytest.raises(SystemExit, match=r"b3\.jsonl:3: id 'q1' again, with other values than on line 1"):
        pair_evals.main([str(a), str(clash), "--out", str(tmp_path / "clash")])


def test_a_nan_value_is_left_out_not_a_nan_interval(tmp_path, capsys):
    a = tmp_path / "a.jsonl"  # json.dumps writes NaN for float("nan"): what a run can leave in a row
    a.write_text("".join(json.dumps(r) + "\n" for r in [
        {"id": "q1", "locomo_category": 1, "locomo_score": float("nan"), "f1": 0.5},
        {"id": "q2", "locomo_category": 1, "locomo_score": 0.0, "f1": 0.5},
    ]))  # fmt: skip
    b = write_rows(tmp_path / "b.jsonl", [
        {"id": "q1", "locomo_category": 1, "locomo_score": 1.0, "f1": 1.0},
        {"id": "q2", "locomo_category": 1, "locomo_score": 1.0, "f1": 1.0},
    ])  # fmt: skip
    result = pair_evals.main([str(a), str(b), "--out", str(tmp_path / "out")])
    assert "1 NaN or infinite value(s) left out" in capsys.readouterr().err
    cell = result["subsets"]["all"]["locomo_score"]
    assert cell["n"] == 1 and cell["diff"] == cell["low"] == cell["high"] == 1.0
    assert "NaN" not in (tmp_path / "out" / "results.json").read_text()
