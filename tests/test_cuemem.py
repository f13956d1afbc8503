"""Tests for cuemem.py (the CueMem baseline): the turn graph on hand-built dialogues (with a
bag-of-words embedder whose cosines are computed by hand), retrieval of planted evidence with the
real embedder and rule extractor, incremental = batch construction, forgetting, the LLM
extractor's parser on messy output, the answer prompt, the metrics and the CLI."""

import json
import math
import re
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cuemem  # noqa: E402
from cuemem import CueMemory, Triple  # noqa: E402
from srt.data.synthetic import generate_synthetic  # noqa: E402
from srt.data_io import bucket_of  # noqa: E402
from srt.metrics import recall_metrics  # noqa: E402
from stage0_build import utterances  # noqa: E402


# ---------------------------------------------------------------------------------------------
# Helpers: a bag-of-words embedder (cosine = |A ∩ B| / sqrt(|A| |B|) for word sets) and a
# table-driven extractor, so graph tests do not depend on a neural model's geometry.
# ---------------------------------------------------------------------------------------------
class BagOfWords:
    def __init__(self, dim=256):
        self.dim, self.index = dim, {}

    def __call__(self, texts):
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for row, text in enumerate(texts):
            for word in set(text.lower().split()):
                out[row, self.index.setdefault(word, len(self.index))] = 1.0
        return out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-9)


def table_extractor(table):
    return lambda text, speaker: [Triple(*t) for t in table.get(text, [])]


def history_of(texts):
    """[(Q1 text, A1 text), ...] -> stage0 history."""
    history = []
    for i, (q, a) in enumerate(texts, 1):
        history += [
            {"label": f"Q{i}", "speaker": "user", "text": q},
            {"label": f"A{i}", "speaker": "assistant", "text": a},
        ]
    return history


def make_record(rounds, query, recall, index=0):
    t = len(rounds) + 1
    return {
        "id": f"hand-{index}",
        "source": "jsonl",
        "history": history_of(rounds),
        "query": query,
        "query_turn": t,
        "recall": recall,
        "reasoning": "",
        "answer": "",
        "pruned": [],
        "meta": {"num_turns": t, "bucket": bucket_of(t)},
    }


def records_of(dialogue):
    """Stage0-style records of one generated dialogue (every query round; no Eq. (2) filter)."""
    utts, records = utterances(dialogue), []
    for t, rnd in enumerate(dialogue["rounds"], 1):
        if "gold" in rnd:
            history = [{k: u[k] for k in ("label", "speaker", "text")} for u in utts[: 2 * (t - 1)]]
            records.append(
                {
                    "id": f"{dialogue['id']}-t{t:02d}",
                    "source": "synthetic",
                    "history": history,
                    "query": rnd["user"],
                    "query_turn": t,
                    "recall": rnd["gold"]["recall"],
                    "reasoning": "",
                    "answer": rnd["assistant"],
                    "pruned": [],
                    "meta": {"num_turns": t, "bucket": bucket_of(t)},
                }
            )
    return records


ORDER = ("user", "order number", "48213")
TOY = {  # text -> triples; the cue texts below are what the bag-of-words embedder sees
    "My order number is 48213.": [ORDER],  # "user order number 48213"
    "Order number 48213, noted.": [ORDER],  # same cue, adjacent turn
    "Order 48213 ships Monday.": [("user order number", "48213", "ships")],  # 5 words, 4 shared
    "Also add a lamp.": [("user", "buys", "lamp")],  # shares only "user"
}
TOY_ROUNDS = [
    ("My order number is 48213.", "Order number 48213, noted."),
    ("Nice weather today.", "Indeed."),
    ("When does it ship?", "Order 48213 ships Monday."),
    ("Also add a lamp.", "Done."),
]


def toy_memory(**options):
    return CueMemory.build(
        history_of(TOY_ROUNDS), extractor=table_extractor(TOY), embed_fn=BagOfWords(), **options
    )


# ---------------------------------------------------------------------------------------------
# §4.2 the turn graph
# ---------------------------------------------------------------------------------------------
def test_temporal_window_neighbours():
    memory = toy_memory(window=1)
    assert memory.temporal_neighbours("A2") == [
        "Q2",
        "Q3",
    ]  # utterance nodes: A_i sits between Q_i and Q_{i+1}
    assert memory.temporal_neighbours("Q1") == ["A1"]
    assert memory.temporal_neighbours("A4") == ["Q4"]
    assert toy_memory(window=2).temporal_neighbours("A2") == ["A1", "Q2", "Q3", "A3"]


def test_graph_edges_hand_computed():
    memory = toy_memory(window=1, links_per_cue=2, link_threshold=0.6)
    labels = ["Q1", "A1", "Q2", "A2", "Q3", "A3", "Q4", "A4"]
    temporal = {("temporal", a, b) for a, b in zip(labels, labels[1:])}
    # Q1's and A1's cue "user order number 48213" vs A3's "user order number 48213 ships":
    # 4 shared words -> 4 / sqrt(4 * 5) = 0.894 >= 0.6. Q1-A1 are identical (cosine 1) but adjacent,
    # so not a non-local link. Q4's "user buys lamp": 1 / sqrt(3 * 4) = 0.289 < 0.6 -> no link.
    assert memory.edges() == temporal | {("semantic", "Q1", "A3"), ("semantic", "A1", "A3")}
    assert memory.semantic_neighbours("A3") == pytest.approx(
        {"Q1": 4 / math.sqrt(20), "A1": 4 / math.sqrt(20)}
    )
    assert memory.semantic_neighbours("Q4") == {}
    # Raising the threshold above 0.894 removes the semantic links, not the temporal ones.
    assert toy_memory(link_threshold=0.9).edges() == temporal


def test_links_per_cue_keeps_the_nearest_and_the_older_on_ties():
    memory = toy_memory(links_per_cue=1)
    a3 = next(c for c in memory.cues if c.label == "A3")
    q1 = next(c for c in memory.cues if c.label == "Q1")
    assert [other for _, other in memory.neighbours[a3.cue_id]] == [q1.cue_id]  # tie at 0.894: older cue
    # The link A1-A3 survives through A1's own list: kNN lists are unioned into undirected links.
    assert ("semantic", "A1", "A3") in memory.edges()


def test_semantic_link_between_distant_turns_with_real_embedder():
    rounds = [
        ("How much is the Chakra Balancing?", "The Chakra Balancing service is $180."),
        ("Nice weather today.", "It really is, enjoy it!"),
        ("Hold on one second.", "Of course."),
        ("Do you have parking?", "Yes, free parking for guests."),
        ("Sorry, my internet is slow.", "No worries, take your time."),
        ("Who does it?", "Lena performs the Chakra Balancing on weekends."),
    ]
    memory = CueMemory.build(history_of(rounds))
    semantic = {(a, b) for kind, a, b in memory.edges() if kind == "semantic"}
    assert ("A1", "A6") in semantic  # same entity, five rounds apart
    assert not any("A2" in pair or "A3" in pair for pair in semantic)  # small talk links to nothing


# ---------------------------------------------------------------------------------------------
# §4.1 the rule extractor
# ---------------------------------------------------------------------------------------------
def test_rule_extractor_catches_customer_service_facts():
    def texts(text, speaker="assistant"):
        return [t.text for t in cuemem.rule_extract(text, speaker)]

    assert "Chakra Balancing service is $180" in texts("The Chakra Balancing service is $180.")
    assert "Chakra Balancing service price $180" in texts("The Chakra Balancing service is $180.")
    order = texts("My order number is #48213 and the confirmation code is KX72PQ.", "user")
    assert "user order number #48213" in order and any(t.endswith("code KX72PQ") for t in order)
    assert "user account number ends in 3808" in texts("Hi, my account number ends in 3808.", "user")
    booking = texts("Your appointment is set for Friday at 3 pm.")
    assert "user appointment set for Friday at 3 pm" in booking  # 'your' said by the assistant: the user's
    assert any(t.endswith("date Friday") for t in booking) and any(t.endswith("time 3 pm") for t in booking)
    assert "Lena works at the Uptown branch" in texts("Lena works at the Uptown branch.")
    assert any(t.startswith("Uptown mentioned with") for t in texts("It's valid at our Uptown branch."))
    assert texts("Thanks!") == [] and texts("Of course.") == []
    assert texts("Which branch is that?", "user") == []  # questions state no fact
    assert any(t.endswith("quantity 3 nights") for t in texts("Can I book 3 nights?", "user"))


# ---------------------------------------------------------------------------------------------
# §4.3 retrieval of planted evidence
# ---------------------------------------------------------------------------------------------
DISTRACTORS = [
    ("Thanks, that's helpful.", "You're welcome!"),
    ("How's your day going?", "Busy but good."),
    ("Do you sell gift cards?", "Yes, gift cards are available at the front desk."),
    ("Is there parking nearby?", "Yes, every branch has free parking."),
    ("Sorry, my internet is slow today.", "No worries, take your time."),
    ("What are your opening hours?", "We are open from 9 am to 8 pm every day."),
]


def test_retrieval_finds_planted_evidence():
    filler = [DISTRACTORS[i % len(DISTRACTORS)] for i in range(16)]
    order = make_record(
        [("Hi, I'm calling about a delivery.", "Sure. I found it: your order number is 48213.")]
        + [("I also want a desk lamp.", "The desk lamp costs $45.")]
        + filler
        + [("Where is it going?", "It ships to 12 Cedar Street, Denver.")],
        "What was my order number again?",
        ["A1"],
    )
    prices = make_record(
        [("How much is the Chakra Balancing?", "The Chakra Balancing is $180.")]
        + filler[:5]
        + [("And the Hot Stone Therapy?", "The Hot Stone Therapy costs $95.")]
        + filler[5:12],
        "Remind me, how much was the Chakra Balancing?",
        ["A1"],
    )
    update = make_record(
        [("Please book me for Monday at 3 pm.", "Your appointment is set for Monday at 3 pm.")]
        + filler[:9]
        + [("Can I switch to Friday at 10 am instead?", "Done, your appointment is now Friday at 10 am.")]
        + filler[9:12],
        "When is my appointment now?",
        ["A11"],
    )
    pair = make_record(
        filler[:2]
        + [("Who performs the Deep Tissue Massage?", "Marco performs the Deep Tissue Massage.")]
        + filler[2:10]
        + [("Where can I find Marco?", "Marco works at the Riverside branch.")]
        + filler[10:14],
        "Who am I seeing for the Deep Tissue Massage, and at which branch?",
        ["A3", "A12"],
    )
    for record in (order, prices, update, pair):
        evidence = cuemem.cuemem_evidence(record)
        assert set(record["recall"]) <= set(evidence), (record["query"], evidence)
        assert len(evidence) <= cuemem.MAX_EVIDENCE
        positions = [int(label[1:]) * 2 + (label[0] == "A") for label in evidence]
        assert positions == sorted(positions)  # chronological order


def test_generated_records_recall_and_token_budget():
    records = [r for d in generate_synthetic(20, seed=0) for r in records_of(d)]
    with_gold = [r for r in records if r["recall"]]
    assert len(with_gold) >= 50
    count = cuemem.TokenCounter()
    recalls, tokens, full = [], 0, 0
    for r in records:
        evidence = cuemem.cuemem_evidence(r)
        if r["recall"]:
            recalls.append(recall_metrics(evidence, r["recall"])["recall"])
        tokens += count(cuemem.build_answer_messages(r, evidence))
        full += count(cuemem.build_answer_messages(r, [t["label"] for t in r["history"]]))
    assert np.mean(recalls) >= 0.8
    assert tokens / full <= 0.30


def test_no_graph_returns_anchors_only():
    memory = toy_memory()
    # Query shares 3 words with Q1/A1's cue, 3 with A3's: the anchors are Q1, A1, A3.
    anchors = memory.query(
        "order number 48213", top_k=3, use_graph=False, max_evidence=None, min_relative_score=0
    )
    assert [label for label, _ in anchors] == ["Q1", "A1", "A3"]
    assert [round(s, 4) for _, s in anchors] == [round(3 / math.sqrt(12), 4)] * 2 + [
        round(3 / math.sqrt(15), 4)
    ]
    # With the graph, the one-hop neighbours join: temporal (Q3, Q4, Q2) with decay, scores hand-computed.
    expanded = dict(
        memory.query(
            "order number 48213", top_k=3, max_evidence=None, min_relative_score=0, temporal_decay=0.5
        )
    )
    assert set(expanded) == {"Q1", "A1", "Q2", "Q3", "A3", "Q4"}
    assert expanded["Q2"] == pytest.approx(0.5 * 3 / math.sqrt(12))  # neighbour of A1
    assert expanded["Q4"] == pytest.approx(0.5 * 3 / math.sqrt(15))  # neighbour of A3
    # The cap keeps the best-scoring utterances (ties: earlier first), returned in dialogue order.
    capped = memory.query(
        "order number 48213", top_k=3, max_evidence=2, min_relative_score=0, temporal_decay=0.5
    )
    assert [label for label, _ in capped] == ["Q1", "A1"]


# ---------------------------------------------------------------------------------------------
# §4.4 incremental construction and forgetting
# ---------------------------------------------------------------------------------------------
def graph_state(memory):
    cues = [(c.cue_id, c.label, c.triple.text) for c in memory.cues]
    return cues, memory.edges(), {k: [o for _, o in v] for k, v in memory.neighbours.items()}


def test_incremental_equals_batch_on_a_generated_dialogue():
    dialogue = max(generate_synthetic(6, seed=5), key=lambda d: len(d["rounds"]))
    history = [{k: u[k] for k in ("label", "speaker", "text")} for u in utterances(dialogue)]
    batch = CueMemory.build(history)
    incremental = CueMemory()
    for u in history:
        incremental.add_turn(u["label"], u["speaker"], u["text"], int(u["label"][1:]))
    assert graph_state(incremental) == graph_state(batch)
    assert any(kind == "semantic" for kind, _, _ in batch.edges())  # the comparison covers semantic links
    query = dialogue["rounds"][-1]["user"]
    got, expected = incremental.query(query), batch.query(query)
    assert [label for label, _ in got] == [label for label, _ in expected]  # same evidence, same order
    assert [score for _, score in got] == pytest.approx([score for _, score in expected])
    with pytest.raises(ValueError):
        incremental.add_turn("Q1", "user", "again", 1)


def test_forget_capacity_removes_oldest_with_cues_and_edges():
    memory = toy_memory()
    removed = memory.forget(capacity=5)
    assert removed == ["Q1", "A1", "Q2"]
    assert list(memory.turns) == ["A2", "Q3", "A3", "Q4", "A4"]
    assert all(c.label not in removed for c in memory.cues)
    assert all(a not in removed and b not in removed for _, a, b in memory.edges())
    assert memory.vectors.shape[0] == len(memory.cues)
    # What remains is what a batch build of the remaining turns makes.
    rest = CueMemory.build(history_of(TOY_ROUNDS)[3:], extractor=table_extractor(TOY), embed_fn=BagOfWords())
    assert memory.edges() == rest.edges()


def test_forget_repairs_neighbour_lists():
    table = {"one": [("a", "b", "c d")], "three": [("a", "b", "c d")], "five": [("a", "b", "c e")]}
    rounds = [("one", "-"), ("-", "-"), ("three", "-"), ("-", "-"), ("five", "-")]
    memory = CueMemory.build(
        history_of(rounds),
        extractor=table_extractor(table),
        embed_fn=BagOfWords(),
        links_per_cue=1,
        link_threshold=0.6,
    )
    # "a b c e" vs "a b c d": 3 / 4 = 0.75 to both Q1 and Q3; the tie goes to the older Q1.
    assert memory.semantic_neighbours("Q5") == {"Q1": pytest.approx(0.75)}
    memory.forget(capacity=8)  # drops Q1, A1
    assert memory.semantic_neighbours("Q5") == {"Q3": pytest.approx(0.75)}  # the displaced link comes back
    assert memory.semantic_neighbours("Q3") == {"Q5": pytest.approx(0.75)}


def test_forget_by_age():
    memory = toy_memory()
    assert memory.forget(max_age=2, current_round=5) == ["Q1", "A1", "Q2", "A2"]  # rounds < 5 - 2
    assert memory.forget(max_age=0) == ["Q3", "A3"]  # default now = newest round in memory (4)
    assert list(memory.turns) == ["Q4", "A4"] and [c.label for c in memory.cues] == ["Q4"]
    assert memory.forget(capacity=10, max_age=5) == []


def test_forgetting_through_cuemem_evidence():
    record = make_record(TOY_ROUNDS, "order 48213", [])
    evidence = cuemem.cuemem_evidence(record, extractor=table_extractor(TOY), capacity=4, max_evidence=None)
    assert set(evidence) <= {"Q3", "A3", "Q4", "A4"}


# ---------------------------------------------------------------------------------------------
# §4.1 the LLM extractor's parser
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "output, expected",
    [
        (
            '```json\n[["user", "order number", "#48213"], ["Lena", "works at", "Uptown"]]\n```',
            [("user", "order number", "#48213"), ("Lena", "works at", "Uptown")],
        ),
        (
            "Here are the triples:\n1. (user, order number, #48213)\n2) (Lena, works at, Uptown branch)",
            [("user", "order number", "#48213"), ("Lena", "works at", "Uptown branch")],
        ),
        (
            '[{"subject": "Chakra Balancing", "relation": "costs", "object": "$180"}]',
            [("Chakra Balancing", "costs", "$180")],
        ),
        ('{"triples": [["a", "b", "c"]]}', [("a", "b", "c")]),
        ('Sure! [["a", "b", "c"], "oops", 5, ["x", "y"]] Hope this helps.', [("a", "b", "c")]),
        (
            "- user | prefers | window seat\n- this line is garbage\n* Lena; performs; Chakra Balancing",
            [("user", "prefers", "window seat"), ("Lena", "performs", "Chakra Balancing")],
        ),
        ('["user", "booked", "Friday 3 pm"]', [("user", "booked", "Friday 3 pm")]),
        (
            "(user, booked, Friday) and (user, paid, $45)",
            [("user", "booked", "Friday"), ("user", "paid", "$45")],
        ),
        ("I could not find any facts.", []),
        ("[]", []),
        ("", []),
        ('{"a": [', []),
        ("((((]]]}}}", []),
        ("[[1, 2]]", []),
    ],
)
def test_parse_triples_messy_output(output, expected):
    assert cuemem.parse_triples(output) == [Triple(*t) for t in expected]


def test_parse_triples_never_raises_on_odd_input():
    for junk in (None, 42, "```", "[" * 5000, '{"triples": 5}', "\x00\x01", "[[[]]]", '[{"s": 1}]'):
        assert isinstance(cuemem.parse_triples(junk), list)


def test_llm_extractor_builds_memory_and_caches():
    calls = []

    def fake_llm(messages):
        calls.append(messages)
        text = messages[-1]["content"]
        assert "Triples:" in text and messages[0]["role"] == "system"
        return '```\n[["user", "order number", "48213"]]\n```' if "48213" in text else "No facts here."

    extractor = cuemem.LLMExtractor(fake_llm)
    memory = CueMemory.build(
        history_of([("My order is 48213.", "Thanks."), ("Thanks.", "My order is 48213.")]),
        extractor=extractor,
        embed_fn=BagOfWords(),
    )
    assert [c.label for c in memory.cues] == ["Q1", "A2"]
    assert len(calls) == 4  # (user, "Thanks.") and (assistant, "Thanks.") differ; repeats hit the cache
    extractor("My order is 48213.", "user")
    assert len(calls) == 4


# ---------------------------------------------------------------------------------------------
# The answer step, the metrics, the CLI
# ---------------------------------------------------------------------------------------------
def test_build_answer_messages():
    record = make_record(TOY_ROUNDS, "When does order 48213 ship?", ["A3"])
    messages = cuemem.build_answer_messages(record, ["A3", "Q1"])
    assert [m["role"] for m in messages] == ["system", "user"]
    assert "more recent" in messages[0]["content"]
    user = messages[1]["content"]
    assert re.findall(r"^([QA]\d+): ", user, re.M) == ["Q1", "A3"]  # dialogue order, only the evidence
    assert "Q5" in user and "When does order 48213 ship?" in user and "Final answer:" in user
    assert (
        "more recent"
        not in cuemem.build_answer_messages(record, ["A3"], prioritize_recent=False)[0]["content"]
    )
    assert "(none)" in cuemem.build_answer_messages(record, [])[1]["content"]


def test_answer_calls_generate_with_evidence_only():
    memory = toy_memory()
    seen = []
    completion, labels = memory.answer(
        "order number 48213", lambda m: seen.append(m) or "Final answer: 48213", top_k=1, use_graph=False
    )
    assert labels == ["Q1"] and completion == "Final answer: 48213"
    assert "Q1: My order number is 48213." in seen[0][1]["content"]
    assert "Lamp" not in seen[0][1]["content"] and "Query (Q5)" in seen[0][1]["content"]


def write_records(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def cli_records():
    rounds = [("My order number is 48213.", "Thanks, I have it.")] + DISTRACTORS
    return [make_record(rounds[:n], "What was my order number again?", ["Q1"], index=n) for n in (4, 5, 6)]


def test_cli_retrieval_only_and_resume(tmp_path):
    data = write_records(tmp_path / "test.jsonl", cli_records())
    out = tmp_path / "out"
    assert (
        cuemem.main(
            [
                "--data",
                str(data),
                "--out",
                str(out),
                "--retrieval-only",
                "--model",
                "tiny-random",
                "--limit",
                "2",
            ]
        )
        is None
    )
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == ["hand-4", "hand-5"]
    assert all("Q1" in r["evidence"] and r["recall"] == 1.0 for r in rows)
    assert summary["n"] == 2 and summary["recall"] == 1.0
    assert 0 < summary["token_fraction"] < 1
    expected = sum(r["input_tokens"] for r in rows) / sum(r["full_input_tokens"] for r in rows)
    assert summary["token_fraction"] == pytest.approx(expected)
    assert json.loads((out / "config.json").read_text())["top_k"] == cuemem.TOP_K
    cuemem.main(
        ["--data", str(data), "--out", str(out), "--retrieval-only", "--model", "tiny-random", "--resume"]
    )
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == ["hand-4", "hand-5", "hand-6"] and summary["n"] == 3


def test_cli_bad_data_is_one_line_error(tmp_path):
    record = cli_records()[0]
    del record["query"]
    data = write_records(tmp_path / "bad.jsonl", [record])
    with pytest.raises(SystemExit) as e:
        cuemem.main(["--data", str(data), "--out", str(tmp_path / "o"), "--retrieval-only"])
    assert "bad.jsonl:1" in str(e.value) and "query" in str(e.value)


def test_cli_answers_with_tiny_random_and_compares_full(tmp_path):
    data = write_records(tmp_path / "test.jsonl", cli_records()[:1])
    out = tmp_path / "out"
    cuemem.main(
        [
            "--data",
            str(data),
            "--out",
            str(out),
            "--model",
            "tiny-random",
            "--compare-full",
            "--max-new-tokens",
            "3",
            "--no-priority",
        ]
    )
    summary = json.loads((out / "summary.json").read_text())
    row = json.loads((out / "predictions.jsonl").read_text())
    assert {"answer", "completion", "f1", "latency_s", "full_latency_s", "full_f1"} <= set(row)
    assert row["input_tokens"] < row["full_input_tokens"]
    assert summary["latency_fraction"] == pytest.approx(row["latency_s"] / row["full_latency_s"])
    assert 0.0 <= summary["f1"] <= 1.0


def test_preset_applies_and_flags_win(tmp_path):
    data = write_records(tmp_path / "test.jsonl", cli_records())
    out = tmp_path / "out"
    cuemem.main(
        ["--data", str(data), "--out", str(out), "--retrieval-only", "--preset", "cpu-table2", "--top-k", "3"]
    )
    config = json.loads((out / "config.json").read_text())
    assert (config["preset"], config["limit"], config["max_new_tokens"], config["top_k"]) == (
        "cpu-table2",
        50,
        48,
        3,
    )


def test_cuemem_imports_nothing_from_evaluate():
    """evaluate.py imports cuemem for its `cuemem` method; the reverse would be a cycle."""
    import ast

    tree = ast.parse(Path(cuemem.__file__).read_text())
    modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "evaluate" not in modules and "srt.metrics" in modules
