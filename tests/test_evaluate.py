"""Tests for evaluate.py (paper §4): metrics against hand-computed values, the baselines'
selections, the taxonomy, the stratified limit, the attention share, and an end-to-end --compare
run on the tiny random model (with --resume)."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import evaluate  # noqa: E402
import metrics  # noqa: E402
import report  # noqa: E402
import reward  # noqa: E402
from data_io import bucket_of  # noqa: E402
from modeling import load_model_and_tokenizer  # noqa: E402
from stage0_build import render_prompt  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
FACT = "The Chakra Balancing service costs $180 per session."
FILLER = ["Is parking free on weekends?", "Yes, parking is free for spa guests.",
          "What time do you open on Monday?", "We open at 9:30 am on Monday.",
          "Do you sell gift cards?", "Yes, gift cards start at $25."]


def make_record(index: int, t: int) -> dict:
    """A hand-made record at round t: the needed fact sits in A1, the rest is filler."""
    history = []
    for i in range(1, t):
        q, a = ("I am an Apex Tier member.", FACT) if i == 1 else (FILLER[(2 * i) % 6], FILLER[(2 * i + 1) % 6])
        history += [{"label": f"Q{i}", "speaker": "user", "text": q},
                    {"label": f"A{i}", "speaker": "assistant", "text": a}]
    return {"id": f"hand-{index:03d}-t{t:02d}", "source": "jsonl", "history": history,
            "query": "How much does the Chakra Balancing service cost?", "query_turn": t,
            "recall": ["A1"], "answer": "$180", "answer_keys": ["$180"], "pruned": ["A1"],
            "reasoning": f"1. Analyze Query: the price.\n2. Recall History: <HIS>A1: {FACT}</HIS>\n"
                         "3. Reasoning: the service is $180.",
            "meta": {"num_turns": t, "bucket": bucket_of(t)}}


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
    assert metrics.f1_score("the", "") == 1.0   # both normalize to nothing
    assert metrics.f1_score("the", "cat") == 0.0


def test_accuracy_keys_and_reference():
    record = {"answer": "Yes, it is $180.", "answer_keys": ["$180", "yes"]}
    assert metrics.accuracy("Yes. The price is $180.", record) == 1.0
    assert metrics.accuracy("The price is $180.", record) == 0.0          # 'yes' missing
    assert metrics.accuracy("yesterday it was $180", record) == 0.0        # whole tokens only
    no_keys = {"answer": "On Friday at 3 pm", "answer_keys": []}
    assert metrics.accuracy("It is on Friday at 3 pm.", no_keys) == 1.0
    assert metrics.accuracy("Fridays at 3 pm", no_keys) == 0.0


def test_final_answer_per_method():
    chain = "<think>\n1. Analyze Query: x\n</think>\nFinal answer: $180"
    assert metrics.final_answer("srt", chain) == "$180"
    assert metrics.final_answer("full", "  It costs $180.\n") == "It costs $180."
    assert metrics.final_answer("full", "Final answer: $180") == "$180"
    assert metrics.final_answer("srt", "<think>no answer line</think>") == ""


@pytest.mark.parametrize("completion", [
    "<think>\n1. x\n</think>\nFinal answer: $180", "FINAL ANSWER:  yes \n", "Final answer: a\nfinal answer: b",
    "Final answer: early</think>\nno mark after the think block", "<think>Final answer: inside</think>",
    "</think>Final answer:", "no mark at all", "Final answer: x </think> Final answer: y"])
def test_metrics_read_the_answer_span_reward_scores(completion):
    # metrics.py (a library module) may not import reward.py; the two must still agree (Eq. (7)).
    assert metrics.answer_text(completion) == reward.parse_completion(completion).final_answer


def test_metrics_jaccard_is_the_eq6_iou():
    for a, b in [([], []), (["Q1"], []), (["Q1", "A2"], ["A2", "Q3"]), (["Q1", "?x"], ["Q1"])]:
        assert metrics.jaccard(a, b) == reward.jaccard(a, b)


# ---------------------------------------------------------------------------------------------
# Recall metrics and the error taxonomy
# ---------------------------------------------------------------------------------------------
def test_recall_metrics_hand_computed():
    m = metrics.recall_metrics(["Q1", "A2", "A5"], ["Q1", "A2", "Q3"])
    assert m == pytest.approx({"precision": 2 / 3, "recall": 2 / 3, "jaccard": 0.5})
    assert metrics.recall_metrics([], []) == {"precision": 1.0, "recall": 1.0, "jaccard": 1.0}
    assert metrics.recall_metrics([], ["A1"]) == {"precision": 1.0, "recall": 0.0, "jaccard": 0.0}


@pytest.mark.parametrize("recalled, gold, kind", [
    (["A1", "Q2"], ["Q2", "A1"], "Failure Answer"),      # H^ = H*
    (["A1", "Q2", "A3"], ["A1", "Q2"], "Over Recall"),   # H* proper subset of H^
    (["A1", "A4"], ["A1", "Q2"], "Wrong Recall"),        # something outside H*
    (["A1"], ["A1", "Q2"], "Missing Recall"),            # proper subset of H*
])
def test_error_taxonomy(recalled, gold, kind):
    assert metrics.error_type(recalled, gold) == kind


def test_score_prediction_counts_hallucinated_tag():
    record = make_record(0, 4)
    completion = ("<think>\n1. Analyze Query: price.\n2. Recall History: <HIS>A1: " + FACT + "</HIS>\n"
                  "<HIS>Q9: my dog likes purple submarines</HIS>\n3. Reasoning: so.\n</think>\nFinal answer: $200")
    info = reward.compute_rewards([completion], [record])[0]
    row = evaluate.score_prediction("srt", record, completion, None, info)
    assert "A1" in row["recalled"] and len(row["recalled"]) == 2   # A1 + one unmatched element
    assert row["precision"] == 0.5 and row["recall"] == 1.0 and row["jaccard"] == 0.5
    assert row["jaccard"] == pytest.approx(info["jaccard"])        # the same H^ as Eq. (6)
    assert row["accuracy"] == 0.0 and row["error_type"] == "Over Recall"
    assert row["format_valid"] == 1.0


# ---------------------------------------------------------------------------------------------
# Baselines: recency and rag select the right turns
# ---------------------------------------------------------------------------------------------
def test_recency_keeps_last_rounds():
    record = make_record(0, 6)   # history rounds 1..5
    assert evaluate.recency_turns(record, 2) == ["Q4", "A4", "Q5", "A5"]
    assert evaluate.recency_turns(record, 0) == []
    messages, recalled = evaluate.method_input("recency", record, {"recency_k": 1})
    assert recalled == ["Q5", "A5"]
    assert FACT not in messages[1]["content"] and "Q5:" in messages[1]["content"]


def test_rag_finds_planted_turn_in_chronological_order():
    record = make_record(0, 20)   # the fact sits in A1, 19 rounds back
    assert evaluate.rag_turns(record, 1) == ["A1"]
    top3 = evaluate.rag_turns(record, 3)
    order = [t["label"] for t in record["history"]]
    assert "A1" in top3 and top3 == sorted(top3, key=order.index)
    messages, recalled = evaluate.method_input("rag", record, {"rag_k": 1})
    assert recalled == ["A1"] and FACT in messages[1]["content"]
    assert FILLER[0] not in messages[1]["content"]


def test_stratified_limit_represents_long_buckets():
    records = [make_record(i, 8) for i in range(20)] + [make_record(20 + i, 32) for i in range(2)]
    chosen = evaluate.select_examples(records, limit=4, seed=0)
    assert [bucket_of(r["query_turn"]) for r in chosen].count(32) == 2
    assert len(chosen) == 4
    assert chosen == evaluate.select_examples(records, limit=4, seed=0)            # deterministic
    assert [records.index(r) for r in chosen] == sorted(records.index(r) for r in chosen)  # file order
    assert evaluate.select_examples(records, limit=None) == records


# ---------------------------------------------------------------------------------------------
# Aggregation and Table 3
# ---------------------------------------------------------------------------------------------
def test_describe_and_table3_percentages():
    assert report.describe([1, 2, 3, 4]) == {"mean": 2.5, "p50": 2.5, "p90": pytest.approx(3.7), "n": 4}
    kinds = ["Missing Recall", "Missing Recall", "Wrong Recall", "Failure Answer", None]
    rows = [{"num_turns": 8, "bucket": 8, "error_type": k, "f1": 0.0, "accuracy": float(k is None),
             "latency_s": 1.0, "input_tokens": 10, "generated_tokens": 5} for k in kinds]
    variant = {"name": "grpo", "method": "srt", "model": "m"}
    summary = {"srt_variant": "grpo", "variants": {"grpo": report.summarize_variant(variant, rows, (8, 12))}}
    table = report.table3(summary)
    assert "| Missing Recall | 50.0% | - | - | - |" in table
    assert "| Wrong Recall | 25.0% |" in table and "| Failure Answer | 25.0% |" in table
    assert "| Over Recall | 0.0% |" in table and "| wrong answers (n) | 4 | 0 | 0 | 0 |" in table


# ---------------------------------------------------------------------------------------------
# Configuration: argparse defaults < --preset < explicit flags
# ---------------------------------------------------------------------------------------------
def test_preset_then_flags():
    args = evaluate.resolve_config(["--preset", "cpu-demo", "--batch-size", "2", "--method", "full"])
    assert (args.limit, args.batch_size, args.max_new_tokens) == (32, 2, 160)
    assert args.variants == [{"name": "full", "method": "full", "model": "smollm2-135m", "batch_size": 2}]
    assert evaluate.resolve_config([]).limit is None
    with pytest.raises(SystemExit, match="--batch-size"):
        evaluate.resolve_config(["--batch-size", "0"])


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
    spans = evaluate.turn_spans(record, prompt, completion)
    assert len(spans) == len(record["history"]) and len(spans[1]) == 2   # A1: prompt line + its tag
    before = model.config._attn_implementation
    share = evaluate.attention_share(model, tokenizer, prompt, completion, spans)
    assert model.config._attn_implementation == before
    assert share.shape == (len(record["history"]),)
    assert np.all(share >= 0) and np.all(share <= 1) and share.sum() <= 1 + 1e-6
    # Softmax rows sum to one: a span over the whole text takes all the mass, two halves split it.
    text = prompt + completion
    whole = evaluate.attention_share(model, tokenizer, prompt, completion, [[(0, len(text))]])
    halves = evaluate.attention_share(model, tokenizer, prompt, completion,
                                      [[(0, len(prompt) // 2)], [(len(prompt) // 2, len(text))]])
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
    import copy
    import torch
    stopper = copy.deepcopy(model)
    stopper.lm_head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=True)
    torch.nn.init.zeros_(stopper.lm_head.weight)
    with torch.no_grad():
        stopper.lm_head.bias.copy_(torch.nn.functional.one_hot(
            torch.tensor(tokenizer.convert_tokens_to_ids("<|im_end|>")), model.config.vocab_size).float())
    stopped = evaluate.generate_batch(stopper, tokenizer, prompts, max_new_tokens=8)
    assert [(r["text"], r["generated_tokens"]) for r in stopped] == [("", 1), ("", 1)]


# ---------------------------------------------------------------------------------------------
# End to end: --compare on the tiny model, report, summary, plots, --resume
# ---------------------------------------------------------------------------------------------
COMPARE = ["full=full:tiny-random", "recent=recency:tiny-random", "rag=rag:tiny-random",
           "cm=cuemem:tiny-random", "grpo=srt:tiny-random", "base-srtp=srt-p:tiny-random"]
FAST = ["--max-new-tokens", "6", "--max-new-tokens-direct", "3", "--batch-size", "2", "--quiet"]


@pytest.fixture(scope="module")
def compare_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    data = write_records(root / "test.jsonl", [make_record(i, t) for i, t in enumerate([8, 14, 24, 31])])
    out = root / "out"
    assert evaluate.main(["--data", str(data), "--out", str(out), "--compare", *COMPARE,
                          "--table2", "SRT=grpo,w/o SFT=base-srtp", "--attention-examples", "1", *FAST]) is None
    return data, out, json.loads((out / "summary.json").read_text())


def test_compare_writes_report_and_summary(compare_run):
    _, out, summary = compare_run
    saved = json.loads((out / "summary.json").read_text())
    assert set(saved["variants"]) == {c.split("=")[0] for c in COMPARE}
    assert saved["srt_variant"] == "grpo" and saved["table2"] == {"SRT": "grpo", "w/o SFT": "base-srtp"}
    assert saved["variants"]["full"]["jaccard"] is None                 # no recalled set
    assert saved["variants"]["grpo"]["format_valid"] is not None
    assert saved["variants"]["grpo"]["latency_s"]["n"] == 4
    for name in saved["variants"]:
        rows = [json.loads(line) for line in (out / f"{name}.jsonl").read_text().splitlines()]
        assert len(rows) == 4 and all(r["latency_s"] > 0 for r in rows)
    report = (out / "report.md").read_text()
    for heading in ("## Table 1", "## Table 2", "## Table 3", "## F1 by dialogue length",
                    "## Recall Jaccard by dialogue length"):
        assert heading in report
    assert "| SRT | grpo |" in report and "| w/o SFT | base-srtp |" in report
    assert all(f"| {kind} |" in report for kind in metrics.ERROR_TYPES)
    assert "| Variant | 8 | 12 | 16 | 20 | 24 | 28 | 32 | >=24 |" in report
    assert json.loads((out / "config.json").read_text())["variants"][0]["name"] == "full"
    assert summary["num_examples"] == 4


def test_every_plot_is_a_png(compare_run):
    _, out, summary = compare_run
    assert sorted(summary["plots"]) == ["attention.png", "error_types.png", "f1_by_length.png"]
    for name in summary["plots"]:
        data = (out / name).read_bytes()
        assert len(data) > 1000 and data.startswith(PNG_SIGNATURE)
    attention = summary["attention"][0]
    assert attention["num_turns"] == 31
    assert all(0 <= v <= 1 for v in attention["no_recall"] + attention["self_recall"])


def test_resume_skips_written_examples(compare_run, tmp_path, monkeypatch):
    data, out, _ = compare_run
    rows = (out / "full.jsonl").read_text().splitlines()
    kept = [json.loads(line) for line in rows[:2]]
    kept[0]["completion"] = "MARKER"  # proves the written row is kept, not recomputed
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    (resumed / "full.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept) + '{"id": "cut sho')
    prompts = []
    real = evaluate.generate_batch

    def counting(model, tokenizer, batch, *args, **kwargs):
        prompts.extend(batch)
        return real(model, tokenizer, batch, *args, **kwargs)
    monkeypatch.setattr(evaluate, "generate_batch", counting)
    evaluate.main(["--method", "full", "--model", "tiny-random", "--data", str(data), "--out", str(resumed),
                   "--resume", "--attention-examples", "0", *FAST])
    assert len(prompts) == 2                                   # only the two unwritten examples
    final = [json.loads(line) for line in (resumed / "full.jsonl").read_text().splitlines()]
    assert len(final) == 4 and len({r["id"] for r in final}) == 4
    assert [r["completion"] for r in final if r["id"] == kept[0]["id"]] == ["MARKER"]


def test_bad_compare_spec_is_one_line_error(tmp_path):
    data = write_records(tmp_path / "d.jsonl", [make_record(0, 8)])
    with pytest.raises(SystemExit, match="NAME=METHOD:MODEL"):
        evaluate.main(["--data", str(data), "--out", str(tmp_path / "o"), "--compare", "x=nope:tiny-random"])
    (tmp_path / "bad.jsonl").write_text('{"id": 3}\n')
    with pytest.raises(SystemExit, match="bad.jsonl:1"):
        evaluate.main(["--data", str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "o")])


def test_srt_p_through_an_openai_compatible_api(tmp_path, monkeypatch):
    """SRT-P on a 'closed model' (§4.8): a local stand-in for /chat/completions that answers with a
    recall chain; the request must carry the SRT-P system prompt and the key from --api-key-env."""
    import http.server
    import threading
    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append((self.path, self.headers.get("Authorization"), body))
            chain = f"<think>\n2. Recall History: <HIS>A1: {FACT}</HIS>\n3. Reasoning: so.\n</think>\nFinal answer: $180"
            reply = json.dumps({"choices": [{"message": {"content": chain}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("FAKE_KEY", "sk-test")
    data = write_records(tmp_path / "d.jsonl", [make_record(0, 8), make_record(1, 16)])
    try:
        evaluate.main(["--method", "srt-p", "--api-base", f"http://127.0.0.1:{server.server_port}/v1",
                       "--api-model", "closed-model", "--api-key-env", "FAKE_KEY", "--data", str(data),
                       "--out", str(tmp_path / "o"), "--quiet"])
    finally:
        server.shutdown()
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert len(seen) == 2 and seen[0][0] == "/v1/chat/completions" and seen[0][1] == "Bearer sk-test"
    assert seen[0][2]["model"] == "closed-model" and seen[0][2]["messages"][0]["content"] == evaluate.SRTP_SYSTEM_PROMPT
    s = summary["variants"]["srt-p"]
    assert s["model"] == "api:closed-model" and s["accuracy"] == 1.0 and s["jaccard"] == 1.0
    assert s["format_valid"] == 1.0 and s["input_tokens"] is None
