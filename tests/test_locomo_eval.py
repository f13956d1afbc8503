"""LoCoMo's own scoring (srt/locomo_eval.py, after task_eval/evaluation.py of the release) against
hand-computed values, one rule per question category, the adversarial answers that must fail (the
planted answer) and pass (a declining one), evidence recall per dia_id, the per-category summary and
its paired comparison, and evaluate.py's report on hand-made LoCoMo records (tiny random model)."""

import json

import numpy as np
import pytest

import evaluate
from srt import locomo_eval, report
from srt.data_io import DataError, bucket_of, write_jsonl
from srt.locomo_eval import locomo_score, multi_answer_f1, normalize_answer, token_f1
from srt.metrics import f1_score

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------------------------
# evaluation.py's normalisation and token F1
# ---------------------------------------------------------------------------------------------
def test_normalisation_drops_commas_punctuation_and_a_an_the_and():
    assert normalize_answer("The cat, and a dog!") == "cat dog"
    assert normalize_answer("rock-and-roll, Don't") == "rockandroll dont"  # punctuation goes before the words
    assert normalize_answer("1,800 dollars") == "1800 dollars"  # the comma goes first, whatever it is in


def test_token_f1_stems_so_inflections_match_where_squad_f1_does_not():
    assert token_f1("Painting sunsets", "painted sunset") == 1.0  # paint + sunset on both sides
    assert f1_score("Painting sunsets", "painted sunset") == 0.0  # ours does not stem
    assert token_f1("", "Sweden") == 0.0 and token_f1("Norway", "Sweden") == 0.0


# ---------------------------------------------------------------------------------------------
# One rule per category
# ---------------------------------------------------------------------------------------------
def test_temporal_and_single_hop_are_token_f1():
    # "On 7 May, 2023": on 7 may 2023 vs 7 may 2023 -> P 3/4, R 1 -> 6/7
    assert locomo_score("On 7 May, 2023", "7 May 2023", 2) == pytest.approx(6 / 7)
    # she ran chariti race vs race -> P 1/4, R 1 -> 2/5
    assert locomo_score("She ran a charity race", "a race", 4) == pytest.approx(0.4)
    assert locomo_score("She ran a charity race", "a race", 2) == locomo_score(
        "She ran a charity race", "a race", 4
    )


def test_multi_hop_is_the_mean_over_reference_parts_of_the_best_answer_part():
    reference = "pottery, camping, painting, swimming"
    # two parts named exactly, two missed: (0 + 1 + 1 + 0) / 4
    assert locomo_score("camping, painting", reference, 1) == pytest.approx(0.5)
    # one part "pottery and camping" (no comma): pottery 2/3, camping 2/3, the rest 0 -> 1/3
    assert locomo_score("pottery and camping", reference, 1) == pytest.approx(1 / 3)
    # not the plain token F1 of the whole strings, which gives P 1, R 1/2 -> 2/3
    assert token_f1("camping, painting", reference) == pytest.approx(2 / 3)
    assert multi_answer_f1("Swimming, pottery, painting, camping", reference) == 1.0


def test_open_domain_reads_the_reference_up_to_its_first_semicolon():
    reference = "Likely no; though she likes reading, she wants to be a counselor"
    assert locomo_score("Likely no", reference, 3) == 1.0
    assert locomo_score("She wants to be a counselor", reference, 3) == 0.0  # the rationale does not count
    assert locomo_score("She wants to be a counselor", reference, 4) > 0.5  # as single-hop it would


@pytest.mark.parametrize(
    "answer, right",
    [
        ("Not mentioned in the conversation.", 1.0),
        ("That is not mentioned anywhere.", 1.0),
        ("There is NO INFORMATION AVAILABLE about it.", 1.0),
        ("a charity race", 0.0),  # the planted adversarial_answer: what the question baits
        ("She ran a charity race; not sure.", 0.0),
        ("No information.", 0.0),  # only the release's two phrasings count
        ("I don't know", 0.0),
        (None, 0.0),  # no 'Final answer:' at all
    ],
)
def test_adversarial_is_right_only_when_the_answer_declines(answer, right):
    assert locomo_score(answer, "a charity race", 5) == right


def test_an_unknown_category_is_an_error():
    with pytest.raises(ValueError, match="category 6"):
        locomo_score("x", "x", 6)


# ---------------------------------------------------------------------------------------------
# Records: category, evidence recall
# ---------------------------------------------------------------------------------------------
def locomo_record(index, category, answer, recall=("Q1", "A2"), evidence=None, labels=None) -> dict:
    """A LoCoMo-like stage-0 record: three earlier rounds, H* = `recall`, no answer keys."""
    history = []
    for r in range(1, 4):
        history += [
            {
                "label": f"Q{r}",
                "speaker": "user",
                "text": f"Caroline: line {r} of talk {index}, about item {r}",
            },
            {
                "label": f"A{r}",
                "speaker": "assistant",
                "text": f"Melanie: reply {r} of talk {index}, on item {r}",
            },
        ]
    evidence = list(evidence if evidence is not None else [f"D1:{k}" for k in range(len(recall))])
    labels = dict(labels if labels is not None else zip(evidence, recall))
    return {
        "id": f"locomo-conv-9-q{index:03d}-t04",
        "source": "locomo",
        "history": history,
        "query": f"What did they talk about in talk {index}?",
        "query_turn": 4,
        "recall": list(recall),
        "reasoning": "1. Analyze Query: x.\n2. Recall History: No earlier turn is needed.\n3. Reasoning: x",
        "answer": answer,
        "answer_keys": [],
        "pruned": list(recall),
        "meta": {
            "num_turns": 4,
            "bucket": bucket_of(4),
            "query_type": f"locomo-{locomo_eval.LOCOMO_CATEGORIES[category]}",
            "category": category,
            "evidence": evidence,
            "evidence_labels": labels,
        },
    }


def test_category_comes_from_meta_and_only_1_to_5_count():
    assert locomo_eval.category_of(locomo_record(0, 5, "x")) == 5
    assert locomo_eval.category_of({"meta": {"category": "5"}}) is None
    assert locomo_eval.category_of({"meta": {"category": 7}}) is None
    assert locomo_eval.category_of({"meta": {}}) is None
    assert locomo_eval.score_row("x", {"meta": {}}, ["Q1"]) == {
        "locomo_category": None,
        "locomo_score": None,
        "evidence_recall": None,
    }


def test_evidence_recall_counts_dia_ids_as_the_release_does():
    # D3:5 and D3:6, one speaker's consecutive turns, were merged into utterance A2
    record = locomo_record(0, 1, "x", recall=("Q1", "A2"), evidence=["D1:3", "D3:5", "D3:6"])
    record["meta"]["evidence_labels"] = {"D1:3": "Q1", "D3:5": "A2", "D3:6": "A2"}
    assert locomo_eval.evidence_recall(["A2"], record) == pytest.approx(2 / 3)  # per turn of H*: 1/2
    assert locomo_eval.evidence_recall(["A2", "Q1", "A3"], record) == 1.0  # extra turns cost nothing here
    assert locomo_eval.evidence_recall([], record) == 0.0
    assert locomo_eval.evidence_recall(None, record) is None  # the full history recalls nothing by design
    no_evidence = locomo_record(1, 3, "x", recall=(), evidence=[])
    assert locomo_eval.evidence_recall(["Q1"], no_evidence) is None  # the release would give it 1
    no_map = locomo_record(2, 4, "x", recall=("Q1", "A2"))
    no_map["meta"].pop("evidence_labels")
    assert locomo_eval.evidence_recall(["Q1"], no_map) == 0.5  # without the map: the turns of H*


def test_evidence_outside_the_window_counts_as_missed():
    """Regression: a window chosen without the evidence (stage 0 --locomo-window retrieved) labels
    only the evidence it holds; the rest once fell out of the denominator, so a window holding 1 of
    3 evidence turns scored 1.0 for recalling that one, and a window holding none fell back to an
    empty H* and scored nothing."""
    record = locomo_record(0, 1, "x", recall=("A2",), evidence=["D1:3", "D3:5", "D9:9"])
    record["meta"]["evidence_labels"] = {"D3:5": "A2"}  # D1:3 and D9:9 are outside the window
    assert locomo_eval.evidence_recall(["A2"], record) == pytest.approx(1 / 3)
    outside = locomo_record(1, 1, "x", recall=(), evidence=["D1:3"])
    outside["meta"]["evidence_labels"] = {}
    assert locomo_eval.evidence_recall(["Q1"], outside) == 0.0


# ---------------------------------------------------------------------------------------------
# The per-category table and its paired comparison
# ---------------------------------------------------------------------------------------------
def hand_rows(scores, recalls, jaccards, categories):
    return [
        {
            "id": f"q{k}",
            "locomo_category": c,
            "locomo_score": s,
            "evidence_recall": r,
            "jaccard": j,
            "f1": s,
            "input_tokens": 100 + k,
        }
        for k, (s, r, j, c) in enumerate(zip(scores, recalls, jaccards, categories))
    ]


def test_summary_means_per_category_over_the_rows_that_have_each_metric():
    rows = hand_rows([1.0, 0.5, 0.0, 1.0], [1.0, None, 0.5, 0.0], [0.5, None, 0.25, 0.0], [1, 1, 5, 5])
    rows.append({"id": "synthetic", "locomo_category": None, "f1": 0.3})  # not a LoCoMo row: left out
    summary = locomo_eval.summarize(rows)
    assert summary["1"]["n"] == 2 and summary["1"]["score"] == 0.75
    assert summary["1"]["evidence_recall"] == 1.0 and summary["1"]["n_evidence"] == 1
    assert summary["5"]["score"] == 0.5 and summary["5"]["evidence_recall"] == 0.25
    assert summary["all"]["n"] == 4 and summary["all"]["score"] == 0.625 and summary["all"]["jaccard"] == 0.25
    assert summary["2"]["n"] == 0 and summary["2"]["score"] is None
    assert summary["all"]["input_tokens"] == 101.5
    assert locomo_eval.summarize([{"id": "x", "locomo_category": None}]) is None


def test_comparison_pairs_by_question_and_per_category():
    srt = hand_rows([1.0, 0.0, 1.0, 0.0], [1.0, 0.0, 1.0, 0.5], [1.0, 0.0, 0.5, 0.5], [1, 1, 5, 5])
    other = hand_rows([0.0, 0.0, 1.0, 1.0], [0.0, 0.0, 1.0, None], [0.0, 0.0, 0.5, 0.5], [1, 1, 5, 5])
    other.append({"id": "only-here", "locomo_category": 4, "locomo_score": 1.0})  # unpaired: left out
    out = locomo_eval.compare({"srt": srt, "rag": other}, "srt", resamples=1000, seed=0)
    assert set(out) == {"rag"} and out["rag"]["all"]["n"] == 4
    assert out["rag"]["all"]["locomo_score"]["diff"] == 0.0  # (-1 + 0 + 0 + 1) / 4
    assert out["rag"]["1"]["locomo_score"]["diff"] == -0.5 and out["rag"]["5"]["locomo_score"]["diff"] == 0.5
    assert out["rag"]["all"]["evidence_recall"]["n"] == 3  # q3 has none for rag
    assert out["rag"]["all"]["evidence_recall"]["diff"] == pytest.approx(-1 / 3)
    assert out["rag"]["all"]["jaccard"]["diff"] == -0.25
    assert out["rag"]["2"]["n"] == 0 and out["rag"]["2"]["locomo_score"]["diff"] is None
    # a difference that is the same on every pair: every resample's mean is it, and so is the interval
    lower = [dict(r, locomo_score=r["locomo_score"] - 0.25) for r in srt]
    same = locomo_eval.compare({"srt": srt, "x": lower}, "srt", 1000)["x"]["all"]["locomo_score"]
    assert same["diff"] == same["low"] == same["high"] == -0.25


def test_an_answer_that_always_declines_scores_only_category_5_and_nothing_on_1_to_4():
    # The cheap answer a model trained on LoCoMo's abstaining category-5 targets can fall into:
    # "Not mentioned" everywhere. Scored as the release scores it (locomo_score), it gets the
    # share of category 5 over all questions; the answerable group must show 0 and a 100%
    # decline rate, and a model that answers must beat it there.
    decline = "Not mentioned in the conversation."
    references = {1: "pottery, camping", 2: "7 May 2023", 3: "Likely no; outdoors", 4: "a race", 5: decline}
    categories = [1, 2, 3, 4, 4, 5, 5, 4]
    rows = {"decline": [], "answer": []}
    for k, c in enumerate(categories):
        for name in rows:
            answer = decline if name == "decline" else references[c].split(";")[0]
            score = locomo_eval.locomo_score(answer, references[c], c)
            rows[name].append(
                {
                    "id": f"q{k}",
                    "locomo_category": c,
                    "locomo_score": score,
                    "final_answer": answer,
                    "f1": score,
                    "evidence_recall": None,
                    "jaccard": None,
                }
            )
    declines = locomo_eval.summarize(rows["decline"])
    assert declines["all"]["score"] == pytest.approx(2 / 8)
    assert declines["answerable"]["n"] == 6 and declines["answerable"]["score"] == 0.0
    assert declines["answerable"]["declined"] == 1.0 and declines["5"]["declined"] == 1.0
    answers = locomo_eval.summarize(rows["answer"])
    assert answers["answerable"]["score"] == 1.0 and answers["answerable"]["declined"] == 0.0
    paired = locomo_eval.compare(rows, "answer", resamples=500, seed=0)["decline"]
    assert paired["answerable"]["n"] == 6 and paired["answerable"]["locomo_score"]["diff"] == -1.0
    assert paired["5"]["locomo_score"]["diff"] == 0.0 and paired["answerable"]["f1"]["diff"] == -1.0
    # a row without a final answer (a chain cut off) is neither a decline nor an answer
    assert locomo_eval.declined({"final_answer": None}) is None
    assert locomo_eval.declined({"final_answer": "There is no information available."}) == 1.0


# ---------------------------------------------------------------------------------------------
# evaluate.py: the rows and the report
# ---------------------------------------------------------------------------------------------
def test_score_prediction_has_no_accuracy_without_keys_and_the_locomo_columns():
    record = locomo_record(0, 5, "Not mentioned in the conversation.", recall=("A2",), evidence=["D2:4"])
    completion = (
        "<think>\n2. Recall History: <HIS>A2: Melanie: reply 2 of talk 0, on item 2</HIS>\n</think>\n"
    )
    info = {"recalled": ["A2"], "unmatched": [], "format": 1.0, "recall": 1.25, "answer": 0.1, "total": 2.35}
    declines = evaluate.score_prediction(
        "srt", record, completion + "Final answer: Not mentioned.", ["A2"], info
    )
    planted = evaluate.score_prediction(
        "srt", record, completion + "Final answer: a charity race", ["A2"], info
    )
    for row in (declines, planted):
        assert row["accuracy"] is None and row["key_f1"] is None and row["error_type"] is None
        assert row["locomo_category"] == 5 and row["evidence_recall"] == 1.0 and row["jaccard"] == 1.0
    assert declines["locomo_score"] == 1.0 and planted["locomo_score"] == 0.0
    keyed = dict(locomo_record(1, 4, "$180"), answer_keys=["$180"])
    keyed["meta"] = {"num_turns": 4}  # our own data: keys, no category
    row = evaluate.score_prediction("full", keyed, "Final answer: $180\n", None)
    assert row["accuracy"] == 1.0 and row["key_f1"] == 1.0 and row["locomo_score"] is None


def test_evaluate_reports_the_per_category_table_for_every_method(tmp_path):
    records = [
        locomo_record(0, 1, "pottery, camping"),
        locomo_record(1, 2, "7 May 2023", recall=("Q2",)),
        locomo_record(2, 3, "Likely no; she likes the outdoors", recall=(), evidence=[]),
        locomo_record(3, 4, "a race", recall=("A3",)),
        locomo_record(4, 5, "Not mentioned in the conversation.", recall=("A1",)),
        locomo_record(5, 5, "Not mentioned in the conversation.", recall=("Q3",)),
    ]
    data = tmp_path / "dev.jsonl"
    write_jsonl(data, records)
    out = tmp_path / "eval"
    evaluate.main(
        ["--data", str(data), "--out", str(out), "--compare", "srt=srt:tiny-random", "full=full:tiny-random"]
        + ["rag=rag:tiny-random", "--rag-k", "2", "--max-new-tokens", "4", "--max-new-tokens-direct", "4"]
        + ["--latency-per-bucket", "0", "--attention-examples", "0", "--bootstrap", "1000", "--quiet"]
    )
    summary = json.loads((out / "summary.json").read_text())
    rows = {
        name: [json.loads(line) for line in (out / f"{name}.jsonl").read_text().splitlines()]
        for name in ("srt", "full", "rag")
    }
    for name, variant in summary["variants"].items():
        locomo = variant["locomo"]
        assert [locomo[str(c)]["n"] for c in range(1, 6)] == [1, 1, 1, 1, 2] and locomo["all"]["n"] == 6
        assert locomo["all"]["score"] == pytest.approx(np.mean([r["locomo_score"] for r in rows[name]]))
        assert all(r["accuracy"] is None for r in rows[name]) and variant["accuracy"] is None
    assert summary["variants"]["full"]["locomo"]["all"]["evidence_recall"] is None
    by_id = {r["id"]: r for r in records}
    for row in rows["rag"]:  # what RAG retrieved, counted against the evidence: 5 questions have some
        assert row["evidence_recall"] == locomo_eval.evidence_recall(row["recalled"], by_id[row["id"]])
    assert summary["variants"]["rag"]["locomo"]["all"]["n_evidence"] == 5
    assert set(summary["locomo_comparisons"]) == {"full", "rag"}
    assert summary["locomo_comparisons"]["rag"]["all"]["n"] == 6
    text = (out / "report.md").read_text()
    assert "## LoCoMo score per question category (%)" in text
    table = report.locomo_table(summary, "score").splitlines()
    assert table[0].startswith(
        "| Variant | Method | multi-hop (1) | temporal (2) | open-domain (3) | single-hop (4) | "
        "adversarial (5) | answerable (1-4) | all |"
    )
    assert len(table) == 2 + 3 + 1 and table[-1].startswith(
        "| questions (n, srt) | | 1 | 1 | 1 | 1 | 2 | 4 | 6 |"
    )
    for row in table[2:-1]:  # every column of the header is filled on every variant's row
        assert row.count("|") == table[0].count("|")
    answerable = [r for r in rows["srt"] if r["locomo_category"] != 5]
    assert summary["variants"]["srt"]["locomo"]["answerable"]["declined"] == pytest.approx(
        np.mean(
            [
                locomo_eval.says_not_mentioned(r["final_answer"])
                for r in answerable
                if r["final_answer"] is not None
            ]
        )
    )
    assert summary["locomo_comparisons"]["rag"]["answerable"]["n"] == 4
    assert "## LoCoMo evidence recall per question category (%)" in text and "task_eval/evaluation.py" in text


# ---------------------------------------------------------------------------------------------
# The memory systems read the whole conversation; SRT its window
# ---------------------------------------------------------------------------------------------
def planted_conversation(rounds=40):
    """A conversation whose answer lies in its first utterance, far before any short window."""
    turns = [
        {
            "user": f"Melanie: the garden needed water again on day {k}, nothing else happened",
            "assistant": f"Caroline: I cooked soup and read a book on day {k}",
        }
        for k in range(1, rounds + 1)
    ]
    turns[0]["user"] = "Caroline: I ran a charity race for mental health in Boston last Saturday"
    labels = {f"D{k}:1": f"Q{k}" for k in range(1, rounds + 1)} | {
        f"D{k}:2": f"A{k}" for k in range(1, rounds + 1)
    }
    return {"conversation_id": "conv-9", "rounds": turns, "dia_labels": labels}


def window_record(conversation, last=3):
    """A stage-0 record whose window is the conversation's last `last` rounds: no evidence inside."""
    record = locomo_record(0, 4, "a charity race", recall=(), evidence=["D1:1"], labels={})
    rounds = conversation["rounds"][-last:]
    record["history"] = [
        {"label": f"{side}{k}", "speaker": speaker, "text": turn[key]}
        for k, turn in enumerate(rounds, 1)
        for side, speaker, key in (("Q", "user", "user"), ("A", "assistant", "assistant"))
    ]
    record["query"], record["query_turn"] = "What race did Caroline run for charity?", last + 1
    record["meta"].update(conversation_id="conv-9", num_turns=last + 1)
    return record


def test_the_conversation_view_holds_every_round_and_moves_h_star_to_its_labels():
    conversation = planted_conversation()
    record = window_record(conversation)
    view = evaluate.conversation_record(record, conversation)
    assert len(view["history"]) == 80 and view["query_turn"] == 41 and view["history"][0]["label"] == "Q1"
    assert view["recall"] == ["Q1"] and view["meta"]["evidence_labels"] == {"D1:1": "Q1"}
    assert (view["id"], view["query"], view["answer"]) == (record["id"], record["query"], record["answer"])
    assert locomo_eval.evidence_recall(["Q1"], view) == 1.0
    assert locomo_eval.evidence_recall(["Q1"], record) == 0.0  # the window holds none of it
    newest = evaluate.conversation_record(record, conversation, keep_rounds=5)
    assert [t["label"] for t in newest["history"]][:2] == ["Q36", "A36"] and newest["recall"] == []
    assert newest["meta"]["evidence_labels"] == {}  # D1:1 is outside the newest five rounds


@pytest.mark.parametrize("capacity", [0, 1, 7, 39, 40, 100])
def test_newest_that_fits_keeps_the_most_rounds_the_budget_allows(capacity):
    conversation = planted_conversation()
    record = window_record(conversation)
    view = evaluate.newest_that_fits(record, conversation, lambda v: len(v["history"]) <= 2 * capacity)
    kept = min(capacity, 40)
    assert len(view["history"]) == 2 * kept
    if kept:
        assert view["history"][-1]["label"] == "A40" and view["history"][0]["label"] == f"Q{41 - kept}"


def test_rag_and_cuemem_retrieve_an_answer_outside_srts_window_from_the_whole_conversation(tmp_path):
    conversation = planted_conversation()
    data = tmp_path / "dev.jsonl"
    write_jsonl(data, [window_record(conversation)])
    write_jsonl(tmp_path / "conversations.jsonl", [conversation])
    out = tmp_path / "eval"
    evaluate.main(
        ["--data", str(data), "--out", str(out), "--compare", "srt=srt:tiny-random", "rag=rag:tiny-random"]
        + ["cuemem=cuemem:tiny-random", "full=full:tiny-random", "rag-window=rag:tiny-random"]
        + [
            "--variant-options",
            'rag-window={"memory": "window"}',
            "--rag-k",
            "2",
            "--max-prompt-tokens",
            "400",
        ]
        + ["--max-new-tokens", "4", "--max-new-tokens-direct", "4", "--latency-per-bucket", "0"]
        + ["--attention-examples", "0", "--bootstrap", "1000", "--quiet"]
    )
    rows = {
        name: json.loads((out / f"{name}.jsonl").read_text().splitlines()[0])
        for name in ("srt", "rag", "cuemem", "full", "rag-window")
    }
    assert "Q1" in rows["rag"]["recalled"] and rows["rag"]["evidence_recall"] == 1.0
    assert "Q1" in rows["cuemem"]["recalled"] and rows["cuemem"]["evidence_recall"] == 1.0
    assert rows["rag-window"]["evidence_recall"] == 0.0  # the window holds none of the evidence
    assert rows["srt"]["gold_recall"] == [] and rows["rag"]["gold_recall"] == ["Q1"]
    # full reads the newest rounds that fit the budget, so the planted first round is not among them
    assert 0 < rows["full"]["input_tokens"] <= 400
    summary = json.loads((out / "summary.json").read_text())
    assert summary["variants"]["rag"]["options"]["memory"] == "conversation"
    assert "memory" not in summary["variants"]["rag-window"]["options"]
    with pytest.raises(SystemExit, match="no such file"):
        evaluate.main(
            ["--data", str(data), "--out", str(out), "--conversations", str(tmp_path / "none.jsonl")]
        )


def test_a_bad_conversations_line_is_named_by_file_line_and_field(tmp_path):
    path = tmp_path / "conversations.jsonl"
    path.write_text(
        '{"conversation_id": "a", "rounds": [], "dia_labels": {}}\n'
        '{"conversation_id": "b", "rounds": [{"user": 1}]}\n'
    )
    with pytest.raises(DataError, match=r"conversations.jsonl:2: field 'rounds'"):
        evaluate.read_conversations(path)


def test_make_locomo_heldout_scores_every_variant_on_a_new_file(tmp_path):
    """`make locomo-heldout HELDOUT=file` on conversations no model saw: the whole file becomes one
    test split and every variant of `make locomo` answers every question (tiny random stand-ins for
    the checkpoints and the base model, so the test runs the real targets without real weights)."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from test_stage0_sources import locomo_ceiling_fixture

    from srt.loading import load_model_and_tokenizer

    heldout = locomo_ceiling_fixture(tmp_path / "new.json")
    run = tmp_path / "locomo"
    model, tokenizer = load_model_and_tokenizer("tiny-random", dtype="float32")
    for name in ("sft-mix", "sft-syn", "sft-locomo", "sft-mix-nocot"):
        model.save_pretrained(run / name / "final", safe_serialization=True)
        tokenizer.save_pretrained(run / name / "final")
    flags = "--max-new-tokens 4 --max-new-tokens-direct 4 --latency-per-bucket 0 --attention-examples 0"
    flags += " --dtype float32"  # a subprocess: conftest.py's AVX2-only CPU does not reach it
    subprocess.run(
        [
            shutil.which("make"),
            "locomo-heldout",
            f"HELDOUT={heldout}",
            f"LOCOMO_RUN={run}",
            "BASE=tiny-random",
        ]
        + [f"PYTHON={sys.executable}", f"LOCOMO_EVAL={flags} --bootstrap 1000 --quiet", "W=12"],
        cwd=Path(evaluate.__file__).parent,
        check=True,
        capture_output=True,
    )
    questions = [json.loads(line) for line in (run / "heldout-data" / "test.jsonl").read_text().splitlines()]
    assert len(questions) == 4  # every question of the file, in the test split
    summary = json.loads((run / "heldout-eval" / "summary.json").read_text())
    assert set(summary["variants"]) == {"mix", "syn", "locomo", "nocot", "full", "rag", "cuemem"}
    for name in summary["variants"]:
        rows = (run / "heldout-eval" / f"{name}.jsonl").read_text().splitlines()
        assert sorted(json.loads(r)["id"] for r in rows) == sorted(q["id"] for q in questions)
    assert summary["variants"]["rag"]["options"]["memory"] == "conversation"
