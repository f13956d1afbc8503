"""Stage 0 (§3.2): Eq. (2), the synthetic generator's planted ground truth, the verification
filter, deduplication, splits, the lookup checks and bad input."""

import copy
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

import stage0_build as s0
from srt import prompt
from srt.data.leakage import lookup_checks, lookup_summary, lookup_type, yes_no_answer
from srt.data.synthetic import generate_synthetic
from srt.data.teacher import APITeacher
from srt.data_io import DataError, bucket_of, read_jsonl, validate_record, write_jsonl

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("data")
    s0.main(["--num-dialogues", "60", "--seed", "3", "--out", str(out), "--quiet"])
    records = {split: read_jsonl(out / f"{split}.jsonl") for split in ("train", "dev", "test")}
    return out, records


def all_records(built):
    return [r for part in built[1].values() for r in part]


# ---- Eq. (2) ---------------------------------------------------------------------------------
def test_eq2_hand_values():
    # 10 rounds apart the decay term is exp(-1.5) = 0.2231 (the paper's "0.22")
    assert math.isclose(s0.dependency_score(0.0, 11, 1), 0.4 * math.exp(-1.5), rel_tol=1e-9)
    assert math.isclose(math.exp(-0.15 * 10), 0.2231, abs_tol=1e-4)
    # 0.6 * 0.5 + 0.4 * exp(-0.15 * 2) = 0.3 + 0.29633 = 0.59633
    assert math.isclose(s0.dependency_score(0.5, 7, 5), 0.59633, abs_tol=1e-5)
    assert math.isclose(s0.dependency_score(1.0, 3, 3), 1.0)


def test_eq2_threshold_is_strict():
    assert not s0.passes_threshold(0.6)
    assert s0.passes_threshold(0.6000001)
    # flags reach the formula
    assert math.isclose(s0.dependency_score(1.0, 2, 1, w_sem=0.5, w_dist=0.5, decay=0.0), 1.0)


def test_pruned_is_scored_turns_plus_recall(built):
    for r in all_records(built):
        above = {label for label, score in r["meta"]["scores"].items() if score > 0.6}
        assert set(r["pruned"]) == above | set(r["recall"])
        assert set(r["meta"]["scores"]) == {u["label"] for u in r["history"]}


# ---- the synthetic corpus --------------------------------------------------------------------
def test_same_seed_same_bytes_other_seed_other_dialogues(tmp_path):
    a, b = generate_synthetic(30, seed=5), generate_synthetic(30, seed=5)
    assert json.dumps(a) == json.dumps(b)
    c = generate_synthetic(30, seed=6)
    assert json.dumps(a) != json.dumps(c)


def test_records_valid_and_recall_holds_planted_facts(built):
    for r in all_records(built):
        validate_record(r)
        labels = {u["label"] for u in r["history"]}
        assert set(r["recall"]) <= labels
        assert len(r["history"]) == 2 * (r["query_turn"] - 1)
        evidence = " ".join(u["text"] for u in r["history"] if u["label"] in r["recall"]).lower()
        for key in r["answer_keys"]:
            if r["recall"] and key.lower() not in ("yes", "no"):
                assert key.lower() in evidence, (r["id"], key)
        assert s0.verify_record(r) is None
        assert r["meta"]["bucket"] == bucket_of(r["query_turn"])


def test_long_range_confusers_and_updates_occur():
    dialogues = generate_synthetic(300, seed=0)
    far, updates_used, confusers, empty, multi = 0, 0, 0, 0, 0
    for d in dialogues:
        kinds = [r["kind"] for r in d["rounds"]]
        for t, r in enumerate(d["rounds"], 1):
            gold = r.get("gold")
            if not gold:
                continue
            far += any(t - int(label[1:]) >= 20 for label in gold["recall"])
            empty += not gold["recall"]
            multi += len(gold["recall"]) >= 2
            if gold["query_type"] == "update" and "update" in kinds[: t - 1]:
                # the newer value is right: H* points at the update round, not the stale one
                update_round = max(i for i, k in enumerate(kinds[: t - 1], 1) if k == "update")
                assert gold["recall"] == [f"A{update_round}"]
                updates_used += 1
        text = " ".join(r["user"] + " " + r["assistant"] for r in d["rounds"])
        confusers += d["domain"] == "spa" and text.count("$") >= 2
    assert far >= 50 and updates_used >= 20 and confusers >= 20 and empty >= 20 and multi >= 100


def test_four_domains_and_varied_phrasing():
    dialogues = generate_synthetic(200, seed=1)
    assert {d["domain"] for d in dialogues} == {"spa", "shop", "travel", "telecom"}
    order_questions = {
        r["user"]
        for d in dialogues
        for r in d["rounds"]
        if r.get("gold", {}).get("query_type") == "single" and "order number" in r["user"]
    }
    assert len(order_questions) >= 2


def test_splits_share_no_dialogue(built):
    owners = {}
    for split, records in built[1].items():
        for r in records:
            assert owners.setdefault(r["meta"]["dialogue_id"], split) == split


def test_stats_written(built):
    stats = json.loads((built[0] / "stats.json").read_text())
    assert sum(stats["bucket_counts"].values()) == stats["queries"]
    assert set(stats["recall_distance_hist"]) == {"1-4", "5-9", "10-19", "20+"}
    assert "dependency_selection" in stats["dropped"] or stats["dialogues_kept"] == stats["dialogues_in"]
    records = all_records(built)
    equal = sum(set(r["pruned"]) == set(r["recall"]) for r in records) / len(records)
    assert stats["share_pruned_equals_recall"] == round(equal, 3)
    assert stats["mean_pruned_over_history"] == round(
        sum(len(r["pruned"]) / len(r["history"]) for r in records) / len(records), 3
    )
    assert stats["share_key_outside_recall"] == 0
    checks = stats["lookup_checks"]
    assert checks == json.loads(json.dumps(lookup_checks(built[1])))  # what the records say
    assert checks["pairs_in_train"] == {"dev": 0, "test": 0} and checks["within_bounds"]
    assert checks["yes_no"]["queries"] == sum(yes_no_answer(r) is not None for r in records) > 0


# ---- lookup checks ---------------------------------------------------------------------------
def generated_records(num_dialogues, seed):
    """Stage0-style records (the fields the lookup checks read) of every query of a generated
    corpus, without the embedder: Eq. (2) and the verification filter only drop a few."""
    records = []
    for d in generate_synthetic(num_dialogues, seed):
        for t, rnd in enumerate(d["rounds"], 1):
            if "gold" in rnd:
                gold = rnd["gold"]
                records.append(
                    {
                        "query": rnd["user"],
                        "answer": rnd["assistant"],
                        "answer_keys": gold["answer_keys"],
                        "meta": {
                            **d["meta"],
                            "dialogue_id": d["id"],
                            "domain": d["domain"],
                            "query_type": gold["query_type"],
                        },
                    }
                )
    return records


def test_lookup_checks_within_bounds_on_a_generated_corpus():
    """The lookup bounds on 300 dialogues: no test (or dev) query/answer pair in train, no test
    answer a train lookup gives, and every yes/no query type at chance per number bucket: the old
    generator had 39 of 242 test queries word for word in train and 5-day returns always "yes"."""
    splits = s0.split_by_dialogue(generated_records(300, seed=4), seed=4, dev_fraction=0.1, test_fraction=0.1)
    checks = lookup_checks(splits)
    assert checks["pairs_in_train"] == {"dev": 0, "test": 0}
    assert checks["test_answerable_by_lookup"]["count"] == 0
    yes_no = checks["yes_no"]
    assert set(yes_no["by_type"]) == {"spa/triple", "shop/pair", "travel/single", "telecom/single"}
    for kind, entry in yes_no["by_type"].items():
        assert entry["n"] >= 40 and entry["yes"] == entry["n"] / 2, (kind, entry)
        numbered = [b for b in entry["buckets"] if b != "none"]
        assert len(numbered) == (0 if kind == "spa/triple" else 4), (kind, entry["buckets"])
        for bucket, row in entry["buckets"].items():
            assert row["majority_rate"] <= 0.6, (kind, bucket, row)
    assert yes_no["max_majority_excess"] <= 0.10 and checks["within_bounds"]
    assert yes_no["train_rule_on_test"]["n"] > 0 and yes_no["train_rule_on_test"]["accuracy"] <= 0.6


def planted_record(i, query, answer, keys, kind="shop/pair"):
    domain, query_type = kind.split("/")
    meta = {"dialogue_id": f"d{i}", "domain": domain, "query_type": query_type}
    return {"query": query, "answer": answer, "answer_keys": keys, "meta": meta}


def yes_no_record(i, query, yes, kind="shop/pair"):
    return planted_record(i, query, "Yes." if yes else "No.", ["yes" if yes else "no"], kind)


def test_lookup_checks_report_planted_leaks():
    """A hand-made split with the two flaws of the old corpus: a test pair copied into train (only
    case and punctuation differ) and a yes/no type whose answer the number in the query decides
    (up to 24 days "yes", from 25 "no"). A balanced type beside it stays at 50%, and a bucket of
    three is listed but not ranked."""
    night = planted_record(90, "What do 3 nights at $80 cost?", "It's $240.", ["$240"], "travel/none")
    train = [yes_no_record(i, f"It's been {5 + i} days. Can I return it?", 5 + i < 25) for i in range(40)]
    train += [
        yes_no_record(100 + i, f"Would {10 + i // 2} GB go over?", i % 2, "telecom/single") for i in range(40)
    ]
    train += [yes_no_record(200 + i, "Can I bring a pet?", True, "travel/single") for i in range(3)] + [night]
    copied = dict(night, query="what do 3 nights at $80 cost", answer="it's $240!")
    test = [yes_no_record(300 + i, f"Day {5 + 2 * i}: can I return it?", 5 + 2 * i < 25) for i in range(20)]
    checks = lookup_checks({"train": train, "dev": [], "test": test + [copied]})
    assert checks["pairs_in_train"] == {"dev": 0, "test": 1}
    assert checks["pairs_in_train_examples"] == [{"query": copied["query"], "answer": copied["answer"]}]
    assert checks["test_answerable_by_lookup"] == {"count": 1, "share": round(1 / 21, 4)}
    yes_no = checks["yes_no"]
    leaky, fair = yes_no["by_type"]["shop/pair"], yes_no["by_type"]["telecom/single"]
    assert [row["majority_rate"] for row in leaky["buckets"].values()] == [1.0] * 4
    assert [row["majority_rate"] for row in fair["buckets"].values()] == [0.5] * 4
    assert fair["majority_rate"] == 0.5 and leaky["majority_rate"] == 0.5  # balanced overall, not per bucket
    assert yes_no["by_type"]["travel/single"]["buckets"] == {"none": {"n": 3, "yes": 3, "majority_rate": 1.0}}
    assert yes_no["max_majority_excess"] == 0.5 and yes_no["max_excess_at"].startswith("shop/pair ")
    assert yes_no["train_rule_on_test"] == {"n": 20, "accuracy": 1.0}
    assert not checks["within_bounds"] and "OUTSIDE bounds" in lookup_summary(checks)

    # each number with both answers, and no copy: the same check passes
    def both(records):
        return [yes_no_record(0, r["query"], yes, lookup_type(r)) for r in records for yes in (True, False)]

    checks = lookup_checks({"train": both(train[:40]) + train[40:80], "dev": [], "test": both(test)})
    assert checks["pairs_in_train"]["test"] == 0 and checks["yes_no"]["max_majority_excess"] == 0
    assert checks["within_bounds"] and "within bounds" in lookup_summary(checks)


# ---- the teacher and the verification filter -------------------------------------------------
def test_build_teacher_follows_the_teacher_flag(tmp_path):
    for spec, kind in (("oracle", s0.OracleTeacher), ("api:test-model", APITeacher)):
        assert isinstance(s0.build_teacher(s0.parse_args(["--teacher", spec, "--out", str(tmp_path)])), kind)


def test_oracle_teacher_speaks_turn_form(built):
    r = next(r for r in all_records(built) if len(r["recall"]) >= 2)
    gold = {"recall": r["recall"], "answer_keys": r["answer_keys"], "analysis": "x", "reasoning": "y"}
    note = s0.OracleTeacher().annotate(r["query"], r["history"], gold, r["answer"])
    assert all(ref.startswith("Turn ") for ref in note["recall_turns"])
    assert s0.parse_turn_refs(note["recall_turns"]) == r["recall"]


def test_verification_drops_tampered_records(built):
    r = next(r for r in all_records(built) if len(r["recall"]) >= 2 and not r["meta"]["derived_yes_no"])
    assert s0.verify_record(r) is None
    missing = copy.deepcopy(r)
    missing["recall"] = missing["recall"][:-1]  # Z cites a turn H* lacks
    assert s0.verify_record(missing) == "inconsistent_reasoning"
    altered = copy.deepcopy(r)  # a tag that no longer copies its turn verbatim
    first = next(u for u in r["history"] if u["label"] == r["recall"][0])
    altered["reasoning"] = altered["reasoning"].replace(
        prompt.his_tag(first), f"<HIS>{first['label']}: something else</HIS>"
    )
    assert altered["reasoning"] != r["reasoning"]
    assert s0.verify_record(altered) == "inconsistent_reasoning"
    outside = copy.deepcopy(r)
    outside["recall"] = outside["recall"] + ["A999"]
    assert s0.verify_record(outside) == "recall_outside_history"
    hallucinated = copy.deepcopy(r)
    hallucinated["answer_keys"] = ["Zanzibar-42"]
    hallucinated["answer"] += " Zanzibar-42"
    assert s0.verify_record(hallucinated) == "ungrounded_answer"


# ---- deduplication ---------------------------------------------------------------------------
def test_dedup_merges_near_identical_dialogues():
    dialogues = generate_synthetic(20, seed=2)
    duplicate = copy.deepcopy(dialogues[4])
    # a second copy from elsewhere: outside the generator's split group (twin dialogues share one,
    # and dedup never compares within a group)
    duplicate["id"], duplicate["meta"] = "duplicate", {}
    duplicate["rounds"][-1]["assistant"] += " Thanks!"  # one utterance differs
    kept, merged = s0.deduplicate(dialogues + [duplicate])
    assert merged == 1 and "duplicate" not in {d["id"] for d in kept}
    kept, merged = s0.deduplicate(dialogues)
    assert merged == 0


# ---- bad input -------------------------------------------------------------------------------
def test_malformed_source_names_file_line_field(tmp_path):
    src = tmp_path / "raw.jsonl"
    good = generate_synthetic(12, seed=0)
    bad = copy.deepcopy(good[0])
    del bad["rounds"][2]["assistant"]
    src.write_text("\n".join(json.dumps(d) for d in good[:5] + [bad] + good[5:]) + "\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "train.jsonl").write_text("precious\n")
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "stage0_build.py"),
            "--source",
            "jsonl",
            "--input",
            str(src),
            "--out",
            str(out),
            "--overwrite",  # a folder of other files is stage 0's to write
            "--quiet",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1
    assert f"{src}:6: field 'rounds[2].assistant'" in proc.stderr
    assert (out / "train.jsonl").read_text() == "precious\n"  # nothing already written is lost
    s0.main(["--source", "jsonl", "--input", str(src), "--out", str(out), "--on-error", "skip", "--quiet"])
    stats = json.loads((out / "stats.json").read_text())
    assert stats["dropped"]["malformed"] == 1 and stats["dialogues_in"] == 13


def test_read_jsonl_errors_name_the_field(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"id": "a"}\n')
    with pytest.raises(DataError, match=r"x.jsonl:1: field 'source' is missing"):
        read_jsonl(path)
    path.write_text("{not json\n")
    with pytest.raises(DataError, match=r"x.jsonl:1: not valid JSON"):
        read_jsonl(path)


def test_atomic_write_leaves_no_temp_files(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"x": 1}])
    assert [p.name for p in tmp_path.iterdir()] == ["a.jsonl"]


def test_prompt_and_target_format(built):
    r = next(r for r in all_records(built) if r["recall"])
    msgs = prompt.build_messages(r, keep=set(r["pruned"]))
    assert msgs[0]["content"] == prompt.SRT_SYSTEM_PROMPT and r["query"] in msgs[1]["content"]
    dropped = [u for u in r["history"] if u["label"] not in r["pruned"]]
    for u in dropped:
        assert f"{u['label']}: {u['text']}" not in msgs[1]["content"]
    target = prompt.format_target(r)
    assert target.startswith("<think>\n1. Analyze Query:") and "</think>\nFinal answer: " in target
    assert prompt.format_target(r, with_reasoning=False) == f"Final answer: {r['answer']}"


def test_preset_defaults_and_explicit_flags_win(built):
    assert s0.parse_args(["--preset", "cpu-table2"]).num_dialogues == 600
    assert s0.parse_args(["--preset", "cpu-table2", "--num-dialogues", "7"]).num_dialogues == 7
    assert s0.parse_args([]).num_dialogues == 2000
    config = json.loads((built[0] / "config.json").read_text())
    assert config["num_dialogues"] == 60 and config["seed"] == 3 and "quiet" not in config
