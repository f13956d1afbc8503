"""Tests for evaluate.py, metrics.py and report.py (paper §4): metrics and paired statistics
against hand-computed values, the key matcher, recall on non-empty H* and silence on empty H*,
the baselines' selections, the taxonomy with "Truncated", the stratified limit, the attention
share on prompt lines, batch-1 latency apart from offline work, a fingerprinted --resume, and an
end-to-end --compare run on the tiny random model."""

import copy
import json
import re
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cuemem  # noqa: E402
import evaluate  # noqa: E402
import reward  # noqa: E402
from srt import (
    attention_analysis,  # noqa: E402
    generation,  # noqa: E402
    metrics,  # noqa: E402
    report,  # noqa: E402
)
from srt import completion as completion_format  # noqa: E402
from srt.data_io import bucket_of  # noqa: E402
from srt.loading import load_model_and_tokenizer  # noqa: E402
from srt.prompt import render_prompt  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
FACT = "The Chakra Balancing service costs $180 per session."
FILLER = [
    "Is parking free on weekends?",
    "Yes, parking is free for spa guests.",
    "What time do you open on Monday?",
    "We open at 9:30 am on Monday.",
    "Do you sell gift cards?",
    "Yes, gift cards start at $25.",
]


def make_record(index: int, t: int, query_type: str = "single") -> dict:
    """A hand-made record at round t: the needed fact sits in A1, the rest is filler."""
    history = []
    for i in range(1, t):
        q, a = (
            ("I am an Apex Tier member.", FACT) if i == 1 else (FILLER[(2 * i) % 6], FILLER[(2 * i + 1) % 6])
        )
        history += [
            {"label": f"Q{i}", "speaker": "user", "text": q},
            {"label": f"A{i}", "speaker": "assistant", "text": a},
        ]
    return {
        "id": f"hand-{index:03d}-t{t:02d}",
        "source": "jsonl",
        "history": history,
        "query": "How much does the Chakra Balancing service cost?",
        "query_turn": t,
        "recall": ["A1"],
        "answer": "$180",
        "answer_keys": ["$180"],
        "pruned": ["A1"],
        "reasoning": f"1. Analyze Query: the price.\n2. Recall History: <HIS>A1: {FACT}</HIS>\n"
        "3. Reasoning: the service is $180.",
        "meta": {"num_turns": t, "bucket": bucket_of(t), "query_type": query_type},
    }


def write_records(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


# ---------------------------------------------------------------------------------------------
# Answer metrics
# ---------------------------------------------------------------------------------------------
def test_normalize_answer_squad_rules():
    assert metrics.normalize_answer("The Price, is $180!") == "price is 180"
    assert metrics.normalize_answer("  An apple  a  day ") == "apple day"
    assert metrics.normalize_answer("theater") == "theater"  # articles only as whole words


def test_f1_hand_computed():
    # pred {cat, sat} vs ref {cat, sat, down}: P = 1, R = 2/3 -> F1 = 0.8
    assert metrics.f1_score("The cat sat", "a cat sat down") == pytest.approx(0.8)
    # bags with repeats: common = min(2,1) + min(1,2) = 2, P = R = 2/3
    assert metrics.f1_score("yes yes no", "yes no no") == pytest.approx(2 / 3)
    assert metrics.f1_score("$180.", "180") == 1.0
    assert metrics.f1_score("blue", "red") == 0.0
    assert metrics.f1_score("the", "") == 1.0  # both normalize to nothing
    assert metrics.f1_score("the", "cat") == 0.0


def test_accuracy_keys_and_reference():
    record = {"answer": "Yes, it is $180.", "answer_keys": ["$180", "yes"]}
    assert metrics.accuracy("Yes. The price is $180.", record) == 1.0
    assert metrics.accuracy("The price is $180.", record) == 0.0  # 'yes' missing
    assert metrics.accuracy("yesterday it was $180", record) == 0.0  # whole tokens only
    assert metrics.accuracy("Yes, $180.00 in all.", record) == 1.0  # numbers normalised
    assert metrics.accuracy("Yes", record) == 0.0  # the price key is missing
    no_keys = {"answer": "On Friday at 3 pm", "answer_keys": []}
    assert metrics.accuracy("It is on Friday at 3 pm.", no_keys) == 1.0
    assert metrics.accuracy("Fridays at 3 pm", no_keys) == 0.0
    assert (
        metrics.accuracy("Room 12", {"answer": "x", "answer_keys": "Room 12"}) == 1.0
    )  # one string, one key


@pytest.mark.parametrize(
    "answer, keys, expected",
    [
        ("It comes to $180.00.", ["$180"], [True]),
        ("180", ["$180.00"], [True]),
        ("The Chakra Balancing is $180", ["180"], [True]),
        ("1,800 dollars", ["$1800"], [True]),
        ("That is $207 in total.", ["$20"], [False]),  # word boundaries: $20 is not in $207
        ("It is $20.50.", ["$20"], [False]),  # nor in $20.50
        ("You get 20% off.", ["$20"], [False]),  # a percentage is not a price
        ("Yes.", ["yes"], [True]),
        ("I asked yesterday.", ["yes"], [False]),  # 'yes' as a word, not inside 'yesterday'
        ("Yes or no, it depends.", ["yes"], [False]),  # a hedge states neither
        ("Seat 21E, booking reference NU9MH3.", ["21E", "NU9MH3"], [True, True]),
        ("See A5 for it.", ["5"], [False]),  # the digits of a label are no number
        ("", ["$180"], [False]),
    ],
)
def test_keys_present_normalises_numbers_on_word_boundaries(answer, keys, expected):
    assert metrics.keys_present(answer, keys) == expected


def test_f1_and_key_f1_credit_a_terse_correct_answer():
    assert metrics.normalize_answer("It is $12.50, or 1,800 in all.") == "it is 12.5 or 1800 in all"
    assert metrics.f1_score("$180.00", "180") == 1.0  # SQuAD alone would compare "18000"
    record = {
        "answer": "Yes. The Chakra Balancing is $180, which is over $150, so your discount applies.",
        "answer_keys": ["yes", "$180"],
    }
    # The reference normalises to 13 tokens ("the" drops); "$180" shares 1: P = 1, R = 1/13 -> 2/14.
    assert metrics.f1_score("$180", record["answer"]) == pytest.approx(2 / 14)
    # Against the keys "yes 180": "$180" has P = 1, R = 1/2 -> 2/3; "Yes, $180" has both -> 1.
    assert metrics.key_f1("$180", record) == pytest.approx(2 / 3)
    assert metrics.key_f1("Yes, $180.00", record) == 1.0
    # A long correct answer keeps full accuracy but pays key-F1 precision: 2 of its 5 tokens.
    assert metrics.accuracy("yes the price is 180 dollars", record) == 1.0
    assert metrics.key_f1("yes the price is 180 dollars", record) == pytest.approx(
        2 * (2 / 5) * 1 / (2 / 5 + 1)
    )


def test_final_answer_per_method():
    chain = "<think>\n1. Analyze Query: x\n</think>\nFinal answer: $180"
    assert metrics.final_answer("srt", chain) == "$180"
    assert metrics.final_answer("full", "  It costs $180.\n") == "It costs $180."
    assert metrics.final_answer("full", "Final answer: $180") == "$180"
    assert metrics.final_answer("srt", "<think>no answer line</think>") == ""


def test_direct_answers_are_their_first_line_and_a_transcript_continuation_is_no_answer():
    """Regression: the base model under the full-history prompt went on writing the transcript
    ("A7: You're in seat 13D.\nQ8: ...") to the 128-token cap (cut off 89.6%) and its whole output
    was scored as the answer. A direct answer is now its first line of content."""
    assert (
        metrics.final_answer("full", "A7: You're in seat 13D.\nQ8: I'm in seat 13D.") == "You're in seat 13D."
    )
    assert metrics.final_answer("rag", "Yes, it is fine.\n\nCurrent query (Q10): x") == "Yes, it is fine."
    assert metrics.final_answer("full", "A6:\nQ6: I'm sorry, I'm not sure.") == ""  # the user's next turn
    assert metrics.final_answer("full", "Final answer: $180\nQ9: thanks") == "$180"
    # A self-recall chain keeps every line: its answer follows 'Final answer:' wherever it is.
    chain = "<think>\n2. Recall History: <HIS>A1: $180</HIS>\n</think>\nFinal answer: $180"
    assert metrics.final_answer("srt", chain) == "$180"
    # Completeness drives the stop: a label alone or an unfinished line does not end generation.
    assert metrics.answer_line("A6:\n") == ("", False)
    assert metrics.answer_line("It costs $1") == ("It costs $1", False)
    assert metrics.answer_line("It costs $180.\n") == ("It costs $180.", True)
    assert (
        evaluate.direct_answer_done("A7:\n") is False
        and evaluate.direct_answer_done("A7: Seat 13D\n") is True
    )


def test_generate_stops_a_row_where_stop_when_first_holds(tiny):
    """generation.generate(stop_when=...) ends each row at the first prefix that satisfies the
    predicate and masks the pads after it; rows are independent, and without it the same greedy
    rows run to the cap."""
    model, tokenizer = tiny
    prompts = ["Q1: I need the Chakra Balancing service.", "Q1: hi"]
    free = generation.generate(model, tokenizer, prompts, max_new_tokens=16, greedy=True)
    assert free["generated_tokens"] == [16, 16]  # a random model never emits a stop token this soon
    target = [
        len(tokenizer.decode(free["completion_ids"][i, :5], skip_special_tokens=True)) for i in range(2)
    ]
    stopped = generation.generate(
        model,
        tokenizer,
        prompts,
        max_new_tokens=16,
        greedy=True,
        stop_when=lambda text: len(text) >= min(target),
    )
    for i in range(2):
        n = stopped["generated_tokens"][i]
        prefix = tokenizer.decode(free["completion_ids"][i, :n], skip_special_tokens=True)
        shorter = tokenizer.decode(free["completion_ids"][i, : n - 1], skip_special_tokens=True)
        assert len(prefix) >= min(target) > len(shorter)  # the first prefix that satisfies it
        assert torch.equal(
            stopped["completion_ids"][i, :n], free["completion_ids"][i, :n]
        )  # same greedy path
        assert stopped["completion_mask"][i].sum() == n and stopped["texts"][i] == prefix


@pytest.mark.parametrize(
    "completion",
    [
        "<think>\n1. x\n</think>\nFinal answer: $180",
        "FINAL ANSWER:  yes \n",
        "Final answer: a\nfinal answer: b",
        "Final answer: early</think>\nno mark after the think block",
        "<think>Final answer: inside</think>",
        "</think>Final answer:",
        "no mark at all",
        "Final answer: x </think> Final answer: y",
    ],
)
def test_metrics_read_the_answer_span_reward_scores(completion):
    # metrics.py (a library module) may not import reward.py; the two must still agree (Eq. (7)).
    assert metrics.answer_text(completion) == completion_format.parse_completion(completion).final_answer


def test_metrics_jaccard_is_the_eq6_iou_by_hand():
    assert metrics.jaccard([], []) == 1.0  # both empty: Eq. (6) pays full credit
    assert metrics.jaccard(["Q1"], []) == 0.0
    assert metrics.jaccard(["Q1", "A2"], ["A2", "Q3"]) == pytest.approx(1 / 3)
    assert metrics.jaccard(["Q1", "Q1", "A2"], ["A2", "Q1"]) == 1.0  # sets: a repeat adds nothing


# ---------------------------------------------------------------------------------------------
# Recall metrics and the error taxonomy
# ---------------------------------------------------------------------------------------------
def test_recall_metrics_hand_computed():
    m = metrics.recall_metrics(["Q1", "A2", "A5"], ["Q1", "A2", "Q3"])
    assert m == pytest.approx({"precision": 2 / 3, "recall": 2 / 3, "jaccard": 0.5})
    assert metrics.recall_metrics([], []) == {"precision": 1.0, "recall": 1.0, "jaccard": 1.0}
    assert metrics.recall_metrics([], ["A1"]) == {"precision": 1.0, "recall": 0.0, "jaccard": 0.0}


def test_recall_metrics_only_on_nonempty_gold_and_silence_on_empty():
    record = make_record(0, 6)
    empty = {**record, "recall": []}
    tagged = f"<think>\n2. Recall History: <HIS>A1: {FACT}</HIS>\n</think>\nFinal answer: $180"
    quiet = "<think>\n2. Recall History: No earlier turn is needed.\n</think>\nFinal answer: $180"
    rows = {}
    for name, rec, completion in [
        ("tag-gold", record, tagged),
        ("quiet-gold", record, quiet),
        ("tag-empty", empty, tagged),
        ("quiet-empty", empty, quiet),
    ]:
        info = reward.compute_rewards([completion], [rec])[0]
        rows[name] = evaluate.score_prediction("srt", rec, completion, None, info)
    assert rows["tag-gold"]["recall"] == 1.0 and rows["quiet-gold"]["recall"] == 0.0
    assert rows["tag-gold"]["silent"] is None
    # Empty H*: no precision / recall / Jaccard at all (they would be 1.0 for any silent answer) ...
    for name in ("tag-empty", "quiet-empty"):
        assert (
            rows[name]["precision"] is None and rows[name]["recall"] is None and rows[name]["jaccard"] is None
        )
    # ... but silence: the quiet answer recalled nothing, the tagged one recalled A1.
    assert rows["quiet-empty"]["silent"] == 1.0 and rows["tag-empty"]["silent"] == 0.0
    # A fixed-k retriever on an empty H*: neither recall metrics nor silence.
    rag = evaluate.score_prediction("rag", empty, "Final answer: $180", ["A1", "A2"])
    assert rag["jaccard"] is None and rag["silent"] is None
    summary = report.mean_metrics([{**r, "truncated": False} for r in rows.values()])
    assert summary["recall"] == 0.5 and summary["n_recall"] == 2  # the two non-empty queries
    assert summary["silent"] == 0.5 and summary["n_silent"] == 2  # the two empty ones


def test_truncated_completion_lands_in_truncated():
    record = make_record(0, 6)
    cut = f"<think>\n1. Analyze Query: the price.\n2. Recall History: <HIS>A1: {FACT}</HIS>\n3. Reason"
    info = reward.compute_rewards([cut], [record])[0]
    row = evaluate.score_prediction("srt", record, cut, None, info, truncated=True)
    assert row["accuracy"] == 0.0 and row["error_type"] == "Truncated"
    # The same chain had it stopped (not cut off): H^ = H* and no answer -> Failure Answer.
    assert evaluate.score_prediction("srt", record, cut, None, info)["error_type"] == "Failure Answer"
    assert metrics.error_type(["A1"], ["A1"], truncated=True) == "Truncated"


@pytest.mark.parametrize(
    "recalled, gold, kind",
    [
        (["A1", "Q2"], ["Q2", "A1"], "Failure Answer"),  # H^ = H*
        (["A1", "Q2", "A3"], ["A1", "Q2"], "Over Recall"),  # H* proper subset of H^
        (["A1", "A4"], ["A1", "Q2"], "Wrong Recall"),  # something outside H*
        (["A1"], ["A1", "Q2"], "Missing Recall"),  # proper subset of H*
    ],
)
def test_error_taxonomy(recalled, gold, kind):
    assert metrics.error_type(recalled, gold) == kind


def test_error_taxonomy_tells_a_wrong_label_from_a_garbled_copy():
    """The tags named A1 and Q2 (H*), but Q2's copy matched no turn ("?..." in H^): the choice was
    right, the copy failed. A tag that names A4 is a wrong choice whatever its text."""
    assert metrics.error_type(["A1", "?q2 garbled"], ["A1", "Q2"], labels=["A1", "Q2"]) == "Garbled Copy"
    assert metrics.error_type(["A1", "?q2 garbled"], ["A1", "Q2"], labels=["A1", "A4"]) == "Wrong Recall"
    assert metrics.error_type(["A1", "A4"], ["A1", "Q2"], labels=["A1", "Q2"]) == "Wrong Recall"
    assert metrics.error_type(["A1"], ["A1", "Q2"], labels=["A1"]) == "Missing Recall"


def test_score_prediction_counts_hallucinated_tag():
    record = make_record(0, 4)
    completion = (
        "<think>\n1. Analyze Query: price.\n2. Recall History: <HIS>A1: " + FACT + "</HIS>\n"
        "<HIS>Q9: my dog likes purple submarines</HIS>\n3. Reasoning: so.\n</think>\nFinal answer: $200"
    )
    info = reward.compute_rewards([completion], [record])[0]
    row = evaluate.score_prediction("srt", record, completion, None, info)
    assert "A1" in row["recalled"] and len(row["recalled"]) == 2  # A1 + one unmatched element
    assert row["precision"] == 0.5 and row["recall"] == 1.0 and row["jaccard"] == 0.5
    assert row["jaccard"] == pytest.approx(info["jaccard"])  # the same H^ as Eq. (6)
    assert row["accuracy"] == 0.0 and row["error_type"] == "Over Recall"
    assert row["format_valid"] == 1.0


# ---------------------------------------------------------------------------------------------
# Baselines: recency and rag select the right turns
# ---------------------------------------------------------------------------------------------
def test_recency_keeps_last_rounds():
    record = make_record(0, 6)  # history rounds 1..5
    assert evaluate.recency_turns(record, 2) == ["Q4", "A4", "Q5", "A5"]
    assert evaluate.recency_turns(record, 0) == []
    messages, recalled = evaluate.method_input("recency", record, {"recency_k": 1})
    assert recalled == ["Q5", "A5"]
    assert FACT not in messages[1]["content"] and "Q5:" in messages[1]["content"]


def test_rag_finds_planted_turn_in_chronological_order():
    record = make_record(0, 20)  # the fact sits in A1, 19 rounds back
    assert evaluate.rag_turns(record, 1) == ["A1"]
    top3 = evaluate.rag_turns(record, 3)
    order = [t["label"] for t in record["history"]]
    assert "A1" in top3 and top3 == sorted(top3, key=order.index)
    messages, recalled = evaluate.method_input("rag", record, {"rag_k": 1})
    assert recalled == ["A1"] and FACT in messages[1]["content"]
    assert FILLER[0] not in messages[1]["content"]


def test_a_smaller_limit_picks_a_subset_so_variants_pair():
    records = [make_record(i, t) for i, t in enumerate([8, 12, 16, 20, 24, 28, 32] * 6)]
    small, large = evaluate.select_examples(records, 8, seed=1), evaluate.select_examples(records, 20, seed=1)
    assert {r["id"] for r in small} < {r["id"] for r in large}


def test_every_method_gets_the_recency_rule():
    record = make_record(0, 6)
    options = {"recency_k": 2, "rag_k": 2, "cuemem": {}}
    for method in ("full", "recency", "rag", "srt", "srt-p"):
        messages, _ = evaluate.method_input(method, record, options)
        assert "newer information overrides older" in messages[0]["content"], method
    messages, _ = evaluate.method_input("cuemem", record, options)
    assert cuemem.PRIORITY_INSTRUCTION.strip() in messages[0]["content"]


def test_stratified_limit_represents_long_buckets():
    records = [make_record(i, 8) for i in range(20)] + [make_record(20 + i, 32) for i in range(2)]
    chosen = evaluate.select_examples(records, limit=4, seed=0)
    assert [bucket_of(r["query_turn"]) for r in chosen].count(32) == 2
    assert len(chosen) == 4
    assert chosen == evaluate.select_examples(records, limit=4, seed=0)  # deterministic
    assert [records.index(r) for r in chosen] == sorted(records.index(r) for r in chosen)  # file order
    assert evaluate.select_examples(records, limit=None) == records


# ---------------------------------------------------------------------------------------------
# Aggregation and Table 3
# ---------------------------------------------------------------------------------------------
def test_describe_and_table3_percentages():
    assert report.describe([1, 2, 3, 4]) == {
        "mean": 2.5,
        "p50": 2.5,
        "p90": pytest.approx(3.7),
        "min": 1.0,
        "max": 4.0,
        "n": 4,
    }
    kinds = ["Missing Recall", "Missing Recall", "Wrong Recall", "Failure Answer", "Truncated", None]
    rows = [
        {
            "num_turns": 8,
            "bucket": 8,
            "error_type": k,
            "f1": 0.0,
            "accuracy": float(k is None),
            "input_tokens": 10,
            "generated_tokens": 5,
        }
        for k in kinds
    ]
    variant = {"name": "grpo", "method": "srt", "model": "m"}
    summary = {
        "srt_variant": "grpo",
        "variants": {"grpo": report.summarize_variant(variant, rows, [], (8, 12))},
    }
    table = report.table3(summary)
    assert "| Missing Recall | 40.0% | - | - | - |" in table
    assert "| Wrong Recall | 20.0% |" in table and "| Failure Answer | 20.0% |" in table
    assert "| Truncated | 20.0% |" in table  # its own row, not inside Failure Answer
    assert "| Over Recall | 0.0% |" in table and "| wrong answers (n) | 5 | 0 | 0 | 0 |" in table


# ---------------------------------------------------------------------------------------------
# Paired statistics against SRT (Table 2's intervals)
# ---------------------------------------------------------------------------------------------
def test_paired_bootstrap_hand_checkable():
    # Every paired difference is +1: every resample's mean is 1, the interval is [1, 1].
    assert metrics.paired_bootstrap([0, 0, 0], [1, 1, 1]) == {
        "diff": 1.0,
        "low": 1.0,
        "high": 1.0,
        "n": 3,
        "resamples": 2000,
    }
    # d = (0, 0, 0, 1): a resample's mean is K/4 with K ~ Binomial(4, 1/4). P(K = 0) = 0.316 > 2.5%,
    # so the low end is 0; P(K <= 2) = 0.949 < 97.5% <= P(K <= 3) = 0.996, so the high end is 3/4.
    c = metrics.paired_bootstrap([1, 1, 1, 1], [1, 1, 1, 2], resamples=4000, seed=3)
    assert c["diff"] == 0.25 and c["low"] == 0.0 and c["high"] == 0.75
    # The sign is b - a, and the same seed gives the same interval.
    assert metrics.paired_bootstrap([1, 1, 1, 2], [1, 1, 1, 1], resamples=4000, seed=3)["low"] == -0.75
    x, y = np.random.default_rng(0).random(30), np.random.default_rng(1).random(30)
    assert metrics.paired_bootstrap(x, y, seed=7) == metrics.paired_bootstrap(x, y, seed=7)
    assert metrics.paired_bootstrap([], [])["diff"] is None


def test_mcnemar_exact_hand_computed():
    # 5 discordant pairs all one way: p = 2 * (1/2)^5 = 0.0625.
    assert metrics.mcnemar_exact([1, 1, 1, 1, 1, 0], [0, 0, 0, 0, 0, 0]) == {
        "a_only": 5,
        "b_only": 0,
        "p": 0.0625,
    }
    # 9 against 1: p = 2 * (C(10,0) + C(10,1)) / 2^10 = 22 / 1024; concordant pairs do not count.
    a, b = [1] * 9 + [0] + [1, 0], [0] * 9 + [1] + [1, 0]
    assert metrics.mcnemar_exact(a, b)["p"] == pytest.approx(22 / 1024)
    assert metrics.mcnemar_exact(b, a)["p"] == pytest.approx(22 / 1024)  # two-sided
    assert metrics.mcnemar_exact([1, 0], [1, 0])["p"] == 1.0  # no discordant pair


def test_compare_variants_pairs_by_query_id():
    def rows(acc, rec):
        return [
            {"id": f"q{i}", "accuracy": a, "f1": a, "key_f1": a, "recall": r, "jaccard": r}
            for i, (a, r) in enumerate(zip(acc, rec))
        ]

    srt = rows([1, 1, 1, 1], [1.0, 0.5, None, 1.0])
    other = rows([0, 1, 1, 1], [0.0, 0.5, None, 1.0])[::-1]  # another order: paired by id
    short = rows([0, 0], [None, None])  # a variant run on fewer queries
    out = report.compare_variants({"grpo": srt, "sft": other, "rag": short}, "grpo", resamples=1000)
    assert set(out) == {"sft", "rag"}
    assert out["sft"]["n"] == 4 and out["sft"]["accuracy"]["diff"] == -0.25
    assert out["sft"]["mcnemar"] == {"a_only": 1, "b_only": 0, "p": 1.0}
    assert out["sft"]["recall"]["n"] == 3 and out["sft"]["recall"]["diff"] == pytest.approx(-1 / 3)
    assert out["rag"]["n"] == 2 and out["rag"]["accuracy"]["diff"] == -1.0
    assert out["rag"]["recall"]["diff"] is None


def test_breakdowns_by_query_type_size_and_distance():
    records = [
        make_record(0, 8, "single"),
        make_record(1, 30, "single"),
        make_record(2, 12, "pair"),
        {**make_record(3, 16, "none"), "recall": []},
    ]
    facts = [evaluate.record_facts(r) for r in records]
    assert [f["distance"] for f in facts] == [7, 29, 11, None]  # query_turn - round of A1
    assert [f["distance_bin"] for f in facts] == ["5-9", "20+", "10-19", "none"]
    rows = [
        {**f, "accuracy": a, "f1": a, "error_type": None, "input_tokens": 1, "generated_tokens": 1}
        for f, a in zip(facts, [1.0, 0.0, 1.0, 1.0])
    ]
    s = report.summarize_variant({"method": "full", "model": "m"}, rows, [], (8, 16, 24, 32))
    assert s["by_query_type"]["single"]["accuracy"] == 0.5 and s["by_query_type"]["single"]["n"] == 2
    assert s["by_query_type"]["pair"]["accuracy"] == 1.0
    assert s["by_h_size"]["0"]["n"] == 1 and s["by_h_size"]["1"]["accuracy"] == pytest.approx(2 / 3)
    assert list(s["by_distance_bin"]) == ["none", "5-9", "10-19", "20+"]
    assert s["by_distance_bin"]["20+"]["accuracy"] == 0.0


# ---------------------------------------------------------------------------------------------
# Configuration: argparse defaults < --preset < explicit flags
# ---------------------------------------------------------------------------------------------
def test_preset_then_flags(capsys):
    args = evaluate.resolve_config(["--preset", "cpu-table2", "--batch-size", "2", "--method", "full"])
    assert (args.limit, args.batch_size, args.max_new_tokens, args.latency_per_bucket) == (96, 2, 256, 1)
    assert [(v["name"], v["method"], v["batch_size"]) for v in args.variants] == [("full", "full", 2)]
    assert args.variants[0]["options"]["max_new_tokens"] == args.max_new_tokens_direct
    assert evaluate.resolve_config([]).limit is None
    for flag, value, says in (
        ("--batch-size", "0", "must be >= 1"),
        ("--bootstrap", "100", "must be >= 1000"),
    ):
        with pytest.raises(SystemExit):
            evaluate.resolve_config([flag, value])
        assert f"argument {flag}: {says}, got {value}" in capsys.readouterr().err
    args = evaluate.resolve_config(
        [
            "--compare",
            "cm=cuemem:tiny-random",
            "cap=cuemem:tiny-random",
            "--variant-options",
            'cap={"cuemem": {"capacity": 4}, "limit": 8}',
        ]
    )
    cm, cap = args.variants
    assert cap["options"]["cuemem"] == {"extractor": "rule", "capacity": 4} and cap["options"]["limit"] == 8
    assert cm["options"]["cuemem"] == {"extractor": "rule"} and cm["options"]["limit"] is None
    with pytest.raises(SystemExit, match="variant-options"):
        evaluate.resolve_config(
            ["--compare", "cm=cuemem:tiny-random", "--variant-options", 'nope={"limit": 2}']
        )


# ---------------------------------------------------------------------------------------------
# §4.6 attention share
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    return load_model_and_tokenizer("tiny-random")


def test_attention_share_in_unit_interval(tiny):
    model, tokenizer = tiny
    record = make_record(0, 6)
    prompt = render_prompt(tokenizer, record)
    completion = f"<think>\n2. Recall History: <HIS>A1: {FACT}</HIS>\n</think>\nFinal answer: $180"
    spans = attention_analysis.turn_spans(record, prompt, completion)
    assert len(spans) == len(record["history"]) and len(spans[1]) == 1  # §4.6: A1's prompt line alone
    line = prompt.index(f"A1: {FACT}")
    assert spans[1] == [(line, line + len(f"A1: {FACT}"))]
    with_copy = attention_analysis.turn_spans(record, prompt, completion, copies=True)[1]
    assert len(with_copy) == 2 and with_copy[1][0] >= len(prompt)  # the <HIS> copy, when asked
    before = model.config._attn_implementation
    share = attention_analysis.attention_share(model, tokenizer, prompt, completion, spans)
    assert model.config._attn_implementation == before
    assert share.shape == (len(record["history"]),)
    assert np.all(share >= 0) and np.all(share <= 1) and share.sum() <= 1 + 1e-6
    # Softmax rows sum to one: a span over the whole text takes all the mass, two halves split it.
    text = prompt + completion
    whole = attention_analysis.attention_share(model, tokenizer, prompt, completion, [[(0, len(text))]])
    halves = attention_analysis.attention_share(
        model, tokenizer, prompt, completion, [[(0, len(prompt) // 2)], [(len(prompt) // 2, len(text))]]
    )
    assert whole[0] == pytest.approx(1.0, abs=1e-5)
    assert halves.sum() == pytest.approx(1.0, abs=1e-5) and np.all(halves > 0)


def test_generate_batch_is_greedy_and_counts_to_the_first_stop(tiny):
    model, tokenizer = tiny
    prompts = [render_prompt(tokenizer, make_record(0, 4)), render_prompt(tokenizer, make_record(1, 9))]
    batch = evaluate.generate_batch(model, tokenizer, prompts, max_new_tokens=8)
    assert batch == evaluate.generate_batch(model, tokenizer, prompts, max_new_tokens=8)  # greedy
    for row, prompt in zip(batch, prompts):
        assert row["input_tokens"] == len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        assert 1 <= row["generated_tokens"] <= 8
    # A head that always writes <|im_end|>: the answer stops at once, and the stop token counts.
    import torch

    stopper = copy.deepcopy(model)
    stopper.lm_head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=True)
    torch.nn.init.zeros_(stopper.lm_head.weight)
    with torch.no_grad():
        stopper.lm_head.bias.copy_(
            torch.nn.functional.one_hot(
                torch.tensor(tokenizer.convert_tokens_to_ids("<|im_end|>")), model.config.vocab_size
            ).float()
        )
    stopped = evaluate.generate_batch(stopper, tokenizer, prompts, max_new_tokens=8)
    assert [(r["text"], r["generated_tokens"], r["truncated"]) for r in stopped] == [
        ("", 1, False),
        ("", 1, False),
    ]
    # A head that never writes a stop token: every completion runs into the cap and is truncated.
    with torch.no_grad():
        stopper.lm_head.bias.copy_(
            torch.nn.functional.one_hot(
                torch.tensor(tokenizer.convert_tokens_to_ids("a")), model.config.vocab_size
            ).float()
        )
    endless = evaluate.generate_batch(stopper, tokenizer, prompts, max_new_tokens=8)
    assert [(r["generated_tokens"], r["truncated"]) for r in endless] == [(8, True), (8, True)]


# ---------------------------------------------------------------------------------------------
# End to end: --compare on the tiny model, report, summary, plots, --resume
# ---------------------------------------------------------------------------------------------
COMPARE = [
    "full=full:tiny-random",
    "recent=recency:tiny-random",
    "rag=rag:tiny-random",
    "cm=cuemem:tiny-random",
    "cmcap=cuemem:tiny-random",
    "grpo=srt:tiny-random",
    "grpo-copy=srt:tiny-random",
    "base-srtp=srt-p:tiny-random",
]
FAST = ["--max-new-tokens", "6", "--max-new-tokens-direct", "3", "--batch-size", "2", "--quiet"]
LENGTHS = [8, 14, 24, 31]  # Fig. 4 buckets 8, 12 (14 ties to the shorter), 24, 32


@pytest.fixture(scope="module")
def compare_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    data = write_records(root / "test.jsonl", [make_record(i, t) for i, t in enumerate(LENGTHS)])
    out = root / "out"
    assert (
        evaluate.main(
            [
                "--data",
                str(data),
                "--out",
                str(out),
                "--compare",
                *COMPARE,
                "--variant-options",
                'cmcap={"cuemem": {"capacity": 4}}',
                'grpo-copy={"recall": "copy"}',
                "--pairs",
                "grpo:grpo-copy",
                "--bootstrap",
                "1000",
                "--table2",
                "SRT=grpo,w/o SFT=base-srtp,Full history=full",
                "--attention-examples",
                "1",
                *FAST,
            ]
        )
        is None
    )
    return data, out, json.loads((out / "summary.json").read_text())


def read_lines(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_compare_writes_report_and_summary(compare_run):
    _, out, summary = compare_run
    saved = json.loads((out / "summary.json").read_text())
    assert set(saved["variants"]) == {c.split("=")[0] for c in COMPARE}
    assert saved["srt_variant"] == "grpo"
    assert saved["table2"] == {"SRT": "grpo", "w/o SFT": "base-srtp", "Full history": "full"}
    assert saved["variants"]["full"]["jaccard"] is None  # no recalled set
    assert saved["variants"]["grpo"]["format_valid"] is not None
    # Every variant paired against SRT on the same 4 queries, with intervals and McNemar.
    assert set(saved["comparisons"]) == set(saved["variants"]) - {"grpo"}
    for c in saved["comparisons"].values():
        assert c["n"] == 4 and c["accuracy"]["resamples"] == 1000
        assert c["accuracy"]["low"] <= c["accuracy"]["diff"] <= c["accuracy"]["high"]
        assert 0 <= c["mcnemar"]["p"] <= 1
    for name in saved["variants"]:
        rows = read_lines(out / f"{name}.jsonl")
        assert len(rows) == 4 and all(r["generate_share_s"] > 0 and r["key"] for r in rows)
        assert saved["variants"][name]["throughput"]["batch_size"] == 2
    text = (out / "report.md").read_text()
    for heading in (
        "## Table 1",
        "## Table 2",
        "## Table 3",
        "## F1 by dialogue length",
        "## Accuracy by query type",
        "## Accuracy by |H*|",
        "## Accuracy by recall distance",
        "## Latency by dialogue length",
        "## Every variant against SRT",
    ):
        assert heading in text
    assert "| SRT | grpo | 4 |" in text and "| w/o SFT | base-srtp | 4 |" in text
    assert re.search(r"\| Full history \| full \| 4 \|[^\n]*\[[-+]\d+\.\d, [-+]\d+\.\d\]", text)
    assert all(f"| {kind} |" in text for kind in metrics.ERROR_TYPES)
    assert "| Variant | 8 | 12 | 16 | 20 | 24 | 28 | 32 | >=24 |" in text
    assert json.loads((out / "config.json").read_text())["variants"][0]["name"] == "full"
    assert summary["num_examples"] == 4


def test_a_copy_mode_variant_counts_its_tokens_and_pairs_with_its_free_twin(compare_run):
    """recall "copy" is a per-variant option: its rows say what the model decoded and what the
    program copied (the tiny model names no turn: nothing), its key differs from the free twin's,
    and --pairs compares the two with paired intervals, decoded tokens and latency."""
    _, out, summary = compare_run
    free, copy = read_lines(out / "grpo.jsonl"), read_lines(out / "grpo-copy.jsonl")
    assert all(r["copied_tokens"] == 0 and r["expanded"] == [] for r in copy)
    assert all(r["decoded_tokens"] == r["generated_tokens"] for r in free + copy)
    assert free[0]["key"] != copy[0]["key"]
    assert summary["variants"]["grpo-copy"]["options"]["recall"] == "copy"
    pair = summary["pairs"]["grpo-copy vs grpo"]
    assert pair["n"] == 4 and pair["decoded_tokens"]["diff"] is not None and "label_jaccard" in pair
    assert "## Pairs (--pairs A:B)" in (out / "report.md").read_text()
    with pytest.raises(SystemExit, match="--pairs names nope"):
        evaluate.resolve_config(["--compare", "a=srt:tiny-random", "--pairs", "a:nope"])


def test_latency_is_measured_at_batch_one_per_bucket(compare_run):
    _, out, summary = compare_run
    for name, s in summary["variants"].items():
        rows = read_lines(out / f"{name}.latency.jsonl")
        assert sorted(r["fine_bucket"] for r in rows) == [8, 12, 24, 32], name
        assert all(r["batch_size"] == 1 and r["latency_s"] > 0 for r in rows)
        assert s["latency_s"]["n"] == 4
        present = {k for k, v in s["latency_by_bucket"].items() if v["latency_s"] is not None}
        assert present == {"8", "12", "24", "32"}
        assert (
            s["latency_by_bucket"]["32"]["input_tokens"]["mean"]
            > s["latency_by_bucket"]["8"]["input_tokens"]["mean"]
        )
    assert (
        summary["variants"]["rag"]["offline_s"]["n"] == 4 and summary["variants"]["full"]["offline_s"] is None
    )


def test_capacity_row_forgets_old_turns(compare_run):
    _, out, summary = compare_run
    for row in read_lines(out / "cmcap.jsonl"):
        record = make_record(0, row["num_turns"])
        newest = [t["label"] for t in record["history"]][-4:]
        assert set(row["recalled"]) <= set(newest)  # only the 4 newest utterances remain
    assert summary["variants"]["cmcap"]["recall"] == 0.0  # the fact in A1 is forgotten
    assert summary["variants"]["cmcap"]["options"]["cuemem"]["capacity"] == 4
    assert "capacity" in (out / "report.md").read_text()


def test_every_plot_is_a_png(compare_run):
    _, out, summary = compare_run
    assert sorted(summary["plots"]) == [
        "attention.png",
        "error_types.png",
        "f1_by_length.png",
        "latency_by_length.png",
    ]
    for name in summary["plots"]:
        data = (out / name).read_bytes()
        assert len(data) > 1000 and data.startswith(PNG_SIGNATURE)
    entry = summary["attention"][0]
    assert entry["num_turns"] == 31
    assert all(0 <= v <= 1 for v in entry["no_recall"] + entry["self_recall"])


def counting_generate(monkeypatch):
    calls = []
    real = evaluate.generate_batch

    def counting(model, tokenizer, batch, *args, **kwargs):
        calls.append(len(batch))
        return real(model, tokenizer, batch, *args, **kwargs)

    monkeypatch.setattr(evaluate, "generate_batch", counting)
    return calls


def test_resume_skips_written_examples(compare_run, tmp_path, monkeypatch):
    data, out, _ = compare_run
    kept = read_lines(out / "full.jsonl")[:2]
    kept[0]["completion"] = "MARKER"  # proves the written row is kept, not recomputed
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    (resumed / "full.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept) + '{"id": "cut sho')
    (resumed / "config.json").write_text((out / "config.json").read_text())  # a killed run wrote it first
    calls = counting_generate(monkeypatch)
    evaluate.main(
        [
            "--method",
            "full",
            "--model",
            "tiny-random",
            "--data",
            str(data),
            "--out",
            str(resumed),
            "--resume",
            "--attention-examples",
            "0",
            "--latency-per-bucket",
            "0",
            *FAST,
        ]
    )
    assert calls == [1, 2]  # a warm-up, then the two unwritten examples
    final = read_lines(resumed / "full.jsonl")
    assert len(final) == 4 and len({r["id"] for r in final}) == 4
    assert [r["completion"] for r in final if r["id"] == kept[0]["id"]] == ["MARKER"]


def test_resume_never_reuses_rows_of_another_checkpoint(tmp_path, monkeypatch, tiny):
    """Rows are keyed by the checkpoint's fingerprint: retraining the checkpoint in place (same
    folder, same query ids) must regenerate every row."""
    import torch

    model, tokenizer = tiny
    folder = tmp_path / "ckpt"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    data = write_records(tmp_path / "d.jsonl", [make_record(i, t) for i, t in enumerate(LENGTHS)])
    argv = [
        "--method",
        "full",
        "--model",
        str(folder),
        "--data",
        str(data),
        "--out",
        str(tmp_path / "o"),
        "--attention-examples",
        "0",
        "--latency-per-bucket",
        "0",
        *FAST,
    ]
    evaluate.main(argv)
    path = tmp_path / "o" / "full.jsonl"
    rows = read_lines(path)
    path.write_text("".join(json.dumps({**r, "completion": "MARKER"}) + "\n" for r in rows))
    calls = counting_generate(monkeypatch)
    evaluate.main(argv + ["--resume"])  # same checkpoint: everything reused
    assert calls == [] and all(r["completion"] == "MARKER" for r in read_lines(path))
    retrained = copy.deepcopy(model)
    with torch.no_grad():
        retrained.lm_head.weight.add_(0.01)
    retrained.save_pretrained(folder)  # "retrained" in place
    evaluate.main(argv + ["--resume"])
    assert calls == [1, 2, 2]  # warm-up + all four queries again
    final = read_lines(path)
    assert len(final) == 4 and not any(r["completion"] == "MARKER" for r in final)
    assert len({r["key"] for r in final}) == 1 and final[0]["key"] != rows[0]["key"]
    # A record whose content changed under the same id is redone too; the others are kept.
    changed = [make_record(i, t) for i, t in enumerate(LENGTHS)]
    changed[0]["answer"] = "$181"
    write_records(data, changed)
    calls.clear()
    evaluate.main(argv + ["--resume"])
    assert calls == [1, 1]


def test_offline_work_is_timed_beside_the_latency(tmp_path, monkeypatch):
    """RAG's history embedding is offline: a slow index build shows in offline_s, never in
    latency_s. The build 'takes' 100 s on a clock that only evaluate.py reads, so the check does not
    depend on how loaded the machine is."""
    import types

    real_state, real_clock, skew = evaluate.offline_state, time.perf_counter, [0.0]

    def slow(method, record, options):
        skew[0] += 100.0
        return real_state(method, record, options)

    monkeypatch.setattr(evaluate, "offline_state", slow)
    monkeypatch.setattr(evaluate, "time", types.SimpleNamespace(perf_counter=lambda: real_clock() + skew[0]))
    data = write_records(tmp_path / "d.jsonl", [make_record(0, 8), make_record(1, 24)])
    evaluate.main(
        [
            "--method",
            "rag",
            "--model",
            "tiny-random",
            "--data",
            str(data),
            "--out",
            str(tmp_path / "o"),
            "--attention-examples",
            "0",
            *FAST,
        ]
    )
    timed = read_lines(tmp_path / "o" / "rag.latency.jsonl")
    assert len(timed) == 2
    assert all(r["offline_s"] >= 100 and 0 < r["latency_s"] < 100 for r in timed)
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())["variants"]["rag"]
    assert summary["offline_s"]["mean"] >= 100 and summary["latency_s"]["mean"] < 100
    assert all(r["offline_s"] >= 100 and r["build_s"] < 100 for r in read_lines(tmp_path / "o" / "rag.jsonl"))


def test_bad_compare_spec_is_one_line_error(tmp_path):
    data = write_records(tmp_path / "d.jsonl", [make_record(0, 8)])
    with pytest.raises(SystemExit, match="NAME=METHOD:MODEL"):
        evaluate.main(["--data", str(data), "--out", str(tmp_path / "o"), "--compare", "x=nope:tiny-random"])
    (tmp_path / "bad.jsonl").write_text('{"id": 3}\n')
    with pytest.raises(SystemExit, match="bad.jsonl:1"):
        evaluate.main(["--data", str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "o")])


class FakeChatAPI:
    """A local stand-in for an OpenAI-compatible /chat/completions: reply(body) -> the content."""

    def __init__(self, reply):
        import http.server
        import threading

        self.seen = []
        api = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                api.seen.append((self.path, self.headers.get("Authorization"), body))
                out = json.dumps({"choices": [{"message": {"content": reply(body)}}]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.base = f"http://127.0.0.1:{self.server.server_port}/v1"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.server.shutdown()


def test_srt_p_through_an_openai_compatible_api(tmp_path, monkeypatch):
    """SRT-P on a 'closed model' (§4.8): a local stand-in for /chat/completions that answers with a
    recall chain; the request must carry the SRT-P system prompt and the key from --api-key-env."""
    chain = (
        f"<think>\n2. Recall History: <HIS>A1: {FACT}</HIS>\n3. Reasoning: so.\n</think>\nFinal answer: $180"
    )
    monkeypatch.setenv("FAKE_KEY", "sk-test")
    data = write_records(tmp_path / "d.jsonl", [make_record(0, 8), make_record(1, 16)])
    with FakeChatAPI(lambda body: chain) as api:
        evaluate.main(
            [
                "--method",
                "srt-p",
                "--latency-per-bucket",
                "0",
                "--api-base",
                api.base,
                "--api-model",
                "closed-model",
                "--api-key-env",
                "FAKE_KEY",
                "--data",
                str(data),
                "--out",
                str(tmp_path / "o"),
                "--quiet",
            ]
        )
    seen = api.seen
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert len(seen) == 2 and seen[0][0] == "/v1/chat/completions" and seen[0][1] == "Bearer sk-test"
    assert (
        seen[0][2]["model"] == "closed-model"
        and seen[0][2]["messages"][0]["content"] == evaluate.SRTP_SYSTEM_PROMPT
    )
    s = summary["variants"]["srt-p"]
    assert s["model"] == "api:closed-model" and s["accuracy"] == 1.0 and s["jaccard"] == 1.0
    assert s["format_valid"] == 1.0 and s["input_tokens"] is None and s["truncated"] is None


def test_cuemem_llm_extractor_through_an_api(tmp_path):
    """--cuemem-extractor llm with an OpenAI-compatible endpoint: one extraction request per
    distinct utterance, and the triples it returns are the cues CueMem retrieves by."""

    def reply(body):
        utterance = body["messages"][-1]["content"]
        return '[["Chakra Balancing service", "price", "$180"]]' if "$180" in utterance else "[]"

    data = write_records(tmp_path / "d.jsonl", [make_record(0, 8), make_record(1, 24)])
    with FakeChatAPI(reply) as api:
        evaluate.main(
            [
                "--method",
                "cuemem",
                "--model",
                "tiny-random",
                "--cuemem-extractor",
                "llm",
                "--cuemem-api-base",
                api.base,
                "--cuemem-api-model",
                "extractor",
                "--data",
                str(data),
                "--out",
                str(tmp_path / "o"),
                "--attention-examples",
                "0",
                "--latency-per-bucket",
                "0",
                *FAST,
            ]
        )
    assert api.seen and all(
        b["messages"][0]["content"] == cuemem.EXTRACT_SYSTEM_PROMPT for _, _, b in api.seen
    )
    texts = {b["messages"][-1]["content"] for _, _, b in api.seen}
    assert len(texts) == len(api.seen)  # cached: each utterance asked once
    rows = read_lines(tmp_path / "o" / "cuemem.jsonl")
    # A1 holds the only cue; the turn graph adds its temporal neighbours (window 1).
    assert [r["recalled"] for r in rows] == [["Q1", "A1", "Q2"], ["Q1", "A1", "Q2"]]


def test_cuemem_llm_extractor_with_a_local_model(tmp_path, monkeypatch):
    """The same through the answer model itself (generation.generate); the JSON spelling
    --cuemem-options '{"extractor": "llm"}' works too (it used to hand a string where a callable goes)."""
    calls, outputs = [], []
    real = cuemem.hf_generate_fn

    def spying(model, tokenizer, max_new_tokens=64, autocast_dtype=None):
        inner = real(model, tokenizer, max_new_tokens, autocast_dtype)  # the loaded answer model
        return lambda messages: calls.append(messages) or outputs.append(inner(messages)) or outputs[-1]

    monkeypatch.setattr(cuemem, "hf_generate_fn", spying)
    data = write_records(tmp_path / "d.jsonl", [make_record(0, 8)])
    evaluate.main(
        [
            "--method",
            "cuemem",
            "--model",
            "tiny-random",
            "--cuemem-options",
            '{"extractor": "llm"}',
            "--data",
            str(data),
            "--out",
            str(tmp_path / "o"),
            "--attention-examples",
            "0",
            "--latency-per-bucket",
            "0",
            *FAST,
        ]
    )
    assert calls and calls[0][0]["content"] == cuemem.EXTRACT_SYSTEM_PROMPT
    assert len(outputs) == len(calls) and all(isinstance(o, str) for o in outputs)
    assert len(read_lines(tmp_path / "o" / "cuemem.jsonl")) == 1


def test_no_history_option_empties_what_every_method_sees():
    """Table 2's floor: the same model asked with an empty history, whatever the method."""
    record = make_record(0, 6)
    options = {"recency_k": 2, "rag_k": 2, "cuemem": {}, "history": "none"}
    for method in ("full", "recency", "rag", "srt", "srt-p"):
        messages, recalled = evaluate.method_input(method, record, options)
        assert "Dialogue history:\n(empty)" in messages[1]["content"], method
        assert all(t["text"] not in messages[1]["content"] for t in record["history"]), method
        assert not recalled
    shown, _ = evaluate.method_input("srt", record, {**options, "history": "full"})
    assert record["history"][0]["text"] in shown[1]["content"]


def test_comparisons_and_the_headline_read_only_queries_that_need_recall():
    """A 'none' query (empty H*) is reported apart: a variant that is right on those alone gains
    nothing in Table 2's headline nor in its paired interval."""

    def row(i, acc, needs):
        return {"id": f"q{i}", "accuracy": acc, "f1": acc, "key_f1": acc, "recall": None, "jaccard": None,
                "needs_recall": needs, "answer_tokens": 3 + i, "several_candidates": 0.0, "num_turns": 8,
                "bucket": 8, "input_tokens": 10, "generated_tokens": 5}  # fmt: skip

    srt = [row(0, 1, True), row(1, 0, True), row(2, 0, False), row(3, 0, False)]
    lookup = [row(0, 1, True), row(1, 0, True), row(2, 1, False), row(3, 1, False)]
    out = report.compare_variants({"srt": srt, "lookup": lookup}, "srt", resamples=200)
    assert out["lookup"]["n"] == 2 and out["lookup"]["accuracy"]["diff"] == 0.0
    variant = {"method": "srt", "model": "m"}
    summary = report.summarize_variant(variant, lookup, [], [8, 16, 24, 32])
    assert summary["needs_recall"]["accuracy"] == 0.5 and summary["no_recall"]["accuracy"] == 1.0
    assert summary["answer_tokens"]["p50"] == 4.5
    table = report.table2(
        {"table2": {"SRT": "srt", "No history": "lookup"}, "comparisons": out,
         "variants": {"srt": report.summarize_variant(variant, srt, [], [8, 16, 24, 32]), "lookup": summary}}
    )  # fmt: skip
    assert "| No history | lookup | 2 | 50.0 |" in table and "| 100.0 (2) | 4 | 0.0 |" in table


def test_latency_spread_tells_a_busy_machine_from_a_steady_one_and_needs_eight_requests():
    """The lesson times 8 batch-1 requests a variant (4 in each of its two Fig. 4 buckets): per
    generated token, a steady machine gives a spread near 1, a neighbour's load a wide one; with
    fewer than 8 requests the report says it cannot tell."""
    assert evaluate.resolve_config(["--preset", "cpu-lesson"]).latency_per_bucket == 4

    def summary(latencies):
        rows = [
            {"latency_s": s, "generated_tokens": 100, "input_tokens": 1, "num_turns": 8} for s in latencies
        ]
        return {
            "variants": {"srt": report.summarize_variant({"method": "srt", "model": "m"}, [], rows, (8, 12))}
        }

    steady = report.latency_spread(summary([2.0, 2.1, 2.0, 2.05, 2.0, 2.1, 2.02, 2.0]))
    assert "srt 20 ms (x1.05, n 8)" in steady and "busy" in steady and "cannot" not in steady
    busy = report.latency_spread(summary([2.0, 6.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]))
    assert "(x3.00, n 8)" in busy
    assert "cannot tell" in report.latency_spread(summary([2.0, 2.0]))
    assert report.latency_spread({"variants": {"full": {"latency_ms_per_token": None}}}) == ""
