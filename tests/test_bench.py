"""bench/ without TRL: the reward wrapper TRL would call, the checks that refuse a GRPO ratio
(precision read from the computation, torch versions, equal work), the median and spread by hand,
the Markdown rows, the one-line argument errors, tiny-random smokes of the evaluation latency and
sampler mismatch benchmarks, and grpo_seeds.py's verdicts. The GRPO comparison itself
(grpo_workers.py's two training subprocesses, TRL in its own venv) is run by hand: see
bench/README.md."""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from records import hand_record

from reward import compute_rewards
from srt.data_io import write_jsonl

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))  # the benchmarks import their shared bench/measure.py


def load(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = load("grpo_vs_trl")
workers = load("grpo_workers")
measure = load("measure")
eval_bench = load("eval_latency")

pytestmark = pytest.mark.usefixtures("one_thread")


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
    reward = workers.make_trl_reward(fake_reward, log=log)
    prompts = ["prompt a", "prompt a", "prompt b", "prompt b"]
    records = [json.dumps(a), json.dumps(a), json.dumps(b), json.dumps(b)]
    out = reward(
        prompts=prompts,
        completions=["x", "xx", "xxx", "xxxx"],
        record=records,
        completion_ids=[[1], [1, 2], [1, 2, 3], [1, 2, 3, 4]],
        trainer_state=None,
    )
    assert out == [0.1, 0.2, 0.3, None]  # a NaN total goes back to TRL as None
    examples = seen[0]
    assert examples[0] == a and examples[2] == b
    assert examples[0] is examples[1] and examples[2] is examples[3]  # one decoded record per group
    assert log[0]["prompts"] == [bench.digest("prompt a"), bench.digest("prompt b")]
    assert log[0]["completion_lengths"] == [1, 2, 3, 4] and log[0]["seconds"] >= 0


def test_trl_reward_wrapper_gives_compute_rewards_totals():
    """The real reward, on completions that need no sentence embedder (no final answer)."""
    record = hand_record(3, recall=("Q1", "A2"))
    text = {t["label"]: t["text"] for t in record["history"]}
    completions = [
        f"<think>\n<HIS>Q1: {text['Q1']}</HIS>\n<HIS>A2: {text['A2']}</HIS>\n</think>",
        f"<think>\n<HIS>A4: {text['A4']}</HIS>\n</think>",
    ]
    expected = [s["total"] for s in compute_rewards(completions, [record, record])]
    got = workers.make_trl_reward()(
        prompts=["p", "p"], completions=completions, record=[json.dumps(record)] * 2
    )
    assert got == pytest.approx(expected)


# ---------------------------------------------------------------------------------------------
# Precision: read from the computation, compared, refused
# ---------------------------------------------------------------------------------------------
def observed(generate="float32", logprobs="float32", loss="float32"):
    seen = {"generate": generate, "logprobs": logprobs, "loss": loss}
    return {phase: {"matmul": [dtype], "layer_output": ["float32"]} for phase, dtype in seen.items() if dtype}


def run_report(lengths, prompts, torch="2.13.0", dtypes=None, updates=2, **extra):
    """A side's report: one step per entry of `lengths` (each a list of completion lengths)."""
    steps = [
        {"step": i + 1, "seconds": 10.0 + i, "completion_lengths": rows, "prompts": p, "updates": updates}
        for i, (rows, p) in enumerate(zip(lengths, prompts))
    ]
    return {
        "steps": steps,
        "observed": dtypes or observed(),
        "versions": {"torch": torch},
        "stop_ids": [2],
        "embedder_loaded": True,
        **extra,
    }


SPEC = {
    "max_new_tokens": 4,
    "prompts_per_step": 1,
    "num_generations": 2,
    "steps": 2,
    "updates_per_step": 2,
    "expected_prompts": [["a"], ["b"]],
}


def test_precision_check_passes_when_both_sides_computed_alike():
    ours = run_report([[4, 4], [4, 4]], [["a"], ["b"]])
    trl = run_report([[4, 4], [4, 4]], [["a"], ["b"]])
    assert bench.precision_problems(ours, trl, "fp32") == []
    bf16 = observed("bfloat16", "bfloat16", "bfloat16")
    assert bench.precision_problems(dict(ours, observed=bf16), dict(trl, observed=bf16), "bf16") == []


@pytest.mark.parametrize(
    "trl_dtypes, message",
    [
        (observed(loss="bfloat16"), "loss: ours computed in float32, TRL in bfloat16"),
        (observed(generate="bfloat16"), "generate: ours computed in float32, TRL in bfloat16"),
        (observed(logprobs="bfloat16"), "logprobs: ours computed in float32, TRL in bfloat16"),
        (observed(generate=None), "generate: precision not observed on TRL"),
    ],
)
def test_precision_check_refuses_differing_or_unobserved_dtypes(trl_dtypes, message):
    ours = run_report([[4, 4]], [["a"]])
    trl = run_report([[4, 4]], [["a"]], dtypes=trl_dtypes)
    assert message in bench.precision_problems(ours, trl, "fp32")


def test_precision_check_refuses_the_wrong_precision_on_both_sides_and_differing_torch():
    ours = run_report([[4, 4]], [["a"]])
    trl = run_report([[4, 4]], [["a"]], torch="2.14.1")
    problems = bench.precision_problems(ours, trl, "bf16")
    assert any(p.startswith("torch differs: ours 2.13.0, TRL venv 2.14.1") for p in problems)
    assert "loss: both computed in float32, not the bfloat16 asked for" in problems


def test_a_refused_comparison_prints_no_ratio():
    """The refusal itself: with differing dtypes every ratio is None and the table says refused."""
    spec = dict(SPEC)
    ours = [run_report([[4, 4], [4, 4]], [["a"], ["b"]], peak_rss_gib=1.0)]
    fair = [run_report([[4, 4], [4, 4]], [["a"], ["b"]], peak_rss_gib=2.0)]
    unfair = [
        run_report(
            [[4, 4], [4, 4]],
            [["a"], ["b"]],
            peak_rss_gib=2.0,
            dtypes=observed("bfloat16", "bfloat16", "bfloat16"),
        )
    ]
    ok = bench.compare_precision(ours, fair, spec, "fp32", warmup=1)
    assert (
        ok["problems"] == [] and "| peak RSS, GiB (embedder loaded on both) | 1 | 2 | 0.50 |" in ok["table"]
    )
    refused = bench.compare_precision(ours, unfair, spec, "fp32", warmup=1)
    assert refused["problems"] and all(r["ratio"] is None for r in refused["rows"])
    assert "refused" in refused["table"] and "0.50" not in refused["table"]
    other_torch = bench.compare_precision(
        ours, [dict(fair[0], versions={"torch": "2.14.1"})], spec, "fp32", 1
    )
    assert all(r["ratio"] is None for r in other_torch["rows"]) and "refused" in other_torch["table"]


def test_hooks_read_the_dtype_of_the_computation_not_a_flag():
    """Under bf16 autocast the matmuls run in bf16 while the residual stream (the layer's output)
    stays fp32: the matmul dtype is the one that tells the precision."""
    import torch

    from srt.loading import load_model_and_tokenizer

    model, _ = load_model_and_tokenizer("tiny-random", dtype="float32")
    inst = workers.Instruments()
    inst.hook_precision(model, "policy")
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        model(input_ids=ids)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=ids).logits.sum().backward()
    inst.generating.on = True
    with torch.no_grad():
        model(input_ids=ids)
    inst.generating.on = False
    assert inst.observed() == {
        "logprobs": {"matmul": ["float32"], "layer_output": ["float32"]},
        "loss": {"matmul": ["bfloat16"], "layer_output": ["float32"]},
        "generate": {"matmul": ["float32"], "layer_output": ["float32"]},
    }


def test_suppressed_stop_tokens_reach_our_generate_and_every_row_runs_to_the_cap(monkeypatch):
    """Ours is forced to full length through the model's generation_config (generation.generate
    leaves suppress_tokens unset, so transformers takes the model's value; our decode loop reads
    it too); the wrapper around both counts the tokens."""
    import torch
    from transformers.generation.logits_process import SuppressTokensLogitsProcessor
    from transformers.generation.utils import GenerationMixin

    from srt import decode
    from srt.generation import generate, stop_token_ids
    from srt.loading import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer("tiny-random", dtype="float32")
    stops = stop_token_ids(model, tokenizer)
    model.generation_config.suppress_tokens = stops
    seen = []
    original = SuppressTokensLogitsProcessor.__call__

    def spy(self, input_ids, scores):
        out = original(self, input_ids, scores)
        seen.append(out[:, stops])
        return out

    monkeypatch.setattr(SuppressTokensLogitsProcessor, "__call__", spy)
    monkeypatch.setattr(GenerationMixin, "generate", GenerationMixin.generate)  # restored after the test
    monkeypatch.setattr(decode, "decode", decode.decode)
    inst = workers.Instruments()
    inst.stop_ids = stops
    inst.wrap_generate()
    for engine in ("hf", "ours"):
        torch.manual_seed(0)
        out = generate(model, tokenizer, ["hello there"], max_new_tokens=5, num_generations=3, engine=engine)
        assert out["generated_tokens"] == [5, 5, 5]
        call = inst.generate_calls[-1]
        assert call["lengths"] == [5, 5, 5] and call["rows"] == 3 and call["new_width"] == 5
    assert len(inst.generate_calls) == 2
    assert len(seen) == 5 and all(torch.isinf(s).all() and (s < 0).all() for s in seen)  # hf's processor


# ---------------------------------------------------------------------------------------------
# Equal work
# ---------------------------------------------------------------------------------------------
def test_equal_work_passes_on_forced_lengths_same_prompts_same_updates():
    ours = run_report([[4, 4], [4, 4]], [["a"], ["b"]])
    trl = run_report([[4, 4], [4, 4]], [["a"], ["b"]], prompt_tokens_identical=True)
    assert bench.equal_work_problems(ours, trl, SPEC) == []


def test_equal_work_flags_unequal_completion_lengths():
    ours = run_report([[4, 4], [4, 4]], [["a"], ["b"]])
    trl = run_report([[4, 4], [4, 3]], [["a"], ["b"]])
    problems = bench.equal_work_problems(ours, trl, SPEC)
    assert problems == ["TRL step 2: 1 of 2 completions are not 4 tokens long (lengths [3])"]
    assert bench.compare_precision([ours], [trl], SPEC, "fp32", 1)["problems"] == problems


def test_equal_work_flags_prompt_order_missing_rows_self_reports_and_updates():
    ours = run_report([[4, 4], [4]], [["b"], ["a"]])
    ours["steps"][0]["reported_completion_length"] = 3.5
    trl = run_report([[4, 4], [4, 4]], [["a"], ["b"]], updates=1, prompt_tokens_identical=False)
    trl["steps"][0]["reported_completion_lengths"] = [4, 2]
    problems = bench.equal_work_problems(ours, trl, SPEC)
    assert "ours: did not train on the expected prompts in the expected order" in problems
    assert "ours step 2: 1 completions counted, 2 expected" in problems
    assert "ours step 1: reports a mean completion length of 3.5, not 4" in problems
    assert "TRL step 1: the side's own token counts differ from the generate count" in problems
    assert "TRL step 1: 1 optimizer updates, 2 expected" in problems
    assert any("tokenizes the prompts differently" in p for p in problems)


def test_split_steps_assigns_events_to_step_windows():
    inst = workers.Instruments()
    inst.generate_calls = [
        {"start": 1.0, "seconds": 2.0, "rows": 2, "prompt_width": 9, "new_width": 4, "lengths": [4, 4]},
        {"start": 11.0, "seconds": 3.0, "rows": 2, "prompt_width": 9, "new_width": 4, "lengths": [4, 3]},
    ]
    inst.timed = [
        {"start": 3.5, "seconds": 1.0, "kind": "old_logprobs"},
        {"start": 4.5, "seconds": 0.5, "kind": "ref_logprobs"},
        {"start": 5.0, "seconds": 1.5, "kind": "loss_forward"},
        {"start": 6.0, "seconds": 1.5, "kind": "loss_forward"},
    ]
    steps = [
        {"step": 1, "t0": 0.5, "t1": 9.0, "seconds": 9.0, "generate_s": 2.5, "score_s": 0.5},
        {"step": 2, "t0": 10.0, "t1": 20.0, "seconds": 8.0, "generate_s": 3.5, "score_s": 0.5},
    ]
    workers.split_steps(steps, inst)
    first, second = steps
    assert (
        first["decode_s"] == 2.0
        and first["completion_lengths"] == [4, 4]
        and first["longest_completion"] == 4
    )
    assert (
        first["old_logprobs_s"] == 1.0 and first["ref_logprobs_s"] == 0.5 and first["loss_forward_s"] == 3.0
    )
    assert first["rest_s"] == pytest.approx(9.0 - 2.5 - 0.5 - 1.0 - 0.5 - 3.0)
    assert second["completion_lengths"] == [4, 3] and second["completion_length"] == 3.5
    assert second["loss_forward_s"] == 0 and second["rest_s"] == pytest.approx(4.0)


# ---------------------------------------------------------------------------------------------
# Median and spread, by hand; the pooled summary; Markdown rows
# ---------------------------------------------------------------------------------------------
def test_describe_median_quartiles_and_range_by_hand():
    # sorted 1, 2, 3, 10: median (2 + 3) / 2; quartiles at positions 0.75 and 2.25 of 0..3
    assert measure.describe([3, 1, None, 2, 10, float("nan")]) == {
        "median": 2.5,
        "min": 1.0,
        "max": 10.0,
        "q1": 1.75,
        "q3": 4.75,
        "n": 4,
    }
    assert measure.describe([7]) == {"median": 7.0, "min": 7.0, "max": 7.0, "q1": 7.0, "q3": 7.0, "n": 1}
    assert measure.describe([None]) is None


def test_summary_pools_the_measured_steps_of_every_run():
    def run(seconds, rss):
        return {
            "steps": [
                {"step": i + 1, "seconds": s, "updates": 2, "completion_lengths": [4, 4]}
                for i, s in enumerate(seconds)
            ],
            "peak_rss_gib": rss,
        }

    s = bench.summarize([run([100.0, 6.0, 8.0], 1.0), run([90.0, 10.0, 4.0], 3.0)], warmup=1)
    assert s["measured_steps"] == 4 and s["runs"] == 2
    assert s["seconds"]["median"] == 7.0 and (s["seconds"]["min"], s["seconds"]["max"]) == (4.0, 10.0)
    assert s["seconds_per_update"]["median"] == 3.5
    assert s["completion_length"]["median"] == 4 and s["completion_length"]["n"] == 8
    assert s["peak_rss_gib"]["median"] == 2.0 and s["decode_s"] is None


def test_markdown_rows():
    rows = bench.ratio_rows({"seconds": measure.describe([5, 6, 7])}, {"seconds": measure.describe([8])}, [])
    table = bench.render_table(rows, refused=False)
    assert table.splitlines()[:2] == [
        "| median (min-max) | ours | TRL | ours / TRL |",
        "|---|---:|---:|---:|",
    ]
    assert "| GRPO step, s | 6 (5-7) | 8 | 0.75 |" in table
    assert measure.markdown_table(["a", "b"], [["x", 1234.5], ["y", None]]).splitlines() == [
        "| a | b |",
        "|---|---:|",
        "| x | 1234 |",
        "| y | n/a |",
    ]
    assert (
        measure.fmt_stat(None) == "n/a"
        and measure.fmt_stat(measure.describe([0.5, 0.25])) == "0.375 (0.25-0.5)"
    )


def test_machine_record_names_the_cpu_its_vector_isa_and_its_bf16_units():
    """The name "AMD EPYC" alone covered two machine kinds whose steps differed about 2x (AVX2
    against AVX512): the record and its one-line form carry the ISA that ATen's kernels run."""
    info = measure.machine()
    assert info["cpu"] and info["torch"] and info["torch_threads"] >= 1
    assert isinstance(info["fast_bf16"], bool) and isinstance(info["avx512f"], bool)
    assert info["vector_isa"] == torch.backends.cpu.get_cpu_capability()
    line = measure.machine_line(info)
    assert info["cpu"] in line and f"({info['vector_isa']})" in line


def test_machine_record_names_the_gpu_beside_the_cpu_not_in_its_place(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    info = measure.machine()
    assert info["gpu"] == "NVIDIA H200" and info["gpu_bf16"] is True
    from srt.precision import cpu_has_fast_bf16

    assert info["cpu"] == measure.cpu_model() and info["fast_bf16"] == cpu_has_fast_bf16()
    line = measure.machine_line(info)
    assert line.startswith("NVIDIA H200 (bf16); ") and f"{info['cpu']} ({info['vector_isa']})" in line


def test_a_workers_peak_memory_is_its_own_not_its_parents():
    """ru_maxrss survives fork and exec on Linux: a small child of a big parent would report the
    parent's peak. The peak the workers report must be the child's own."""
    import resource
    import subprocess

    parent_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # torch and a model loaded
    code = (
        f"import sys; sys.path.insert(0, {str(REPO / 'bench')!r}); import measure; "
        "print(measure.peak_rss_gib())"
    )
    child_gib = float(
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    )
    assert 0 < child_gib < parent_gib / 2


# ---------------------------------------------------------------------------------------------
# Argument checks: one line each, before any model, data or TRL is touched
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "1"], "more than --warmup"),
        (["--repeats", "0"], "--repeats must be at least 1"),
        (["-K", "1", "--sample-ratio", "1"], "-K must be at least 2"),
        (["-K", "3", "--sample-ratio", "2"], "equal minibatches"),
        (["-K", "2", "--sample-ratio", "2", "--data", "no/such/train.jsonl"], "--synthetic N"),
        (
            ["-K", "2", "--sample-ratio", "2", "--synthetic", "3", "--precisions", "fp16"],
            "--precisions 'fp16'",
        ),
        (
            ["-K", "2", "--sample-ratio", "2", "--synthetic", "3", "--trl-python", "no/such/python"],
            "not found",
        ),
    ],
)
def test_grpo_bad_arguments_stop_with_one_line(argv, message, tmp_path):
    with pytest.raises(SystemExit) as stop:
        bench.main(argv + ["--out", str(tmp_path)])
    assert message in str(stop.value) and "\n" not in str(stop.value)


def test_bf16_without_bf16_units_stops_with_one_line(monkeypatch):
    monkeypatch.setattr(measure, "bf16_available", lambda: False)
    assert measure.resolve_precisions("auto") == ["fp32"]
    with pytest.raises(SystemExit) as stop:
        measure.resolve_precisions("fp32,bf16")
    message = str(stop.value)
    assert "needs a GPU or a CPU with bf16 units (AMX or AVX512-BF16)" in message and "\n" not in message
    monkeypatch.setattr(measure, "bf16_available", lambda: True)
    assert measure.resolve_precisions("auto") == ["fp32", "bf16"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--methods", "full,oracle"], "--methods 'full,oracle'"),
        (["--per-bucket", "0"], "--per-bucket must be at least 1"),
        (["--data", "no/such.jsonl"], "--synthetic N"),
    ],
)
def test_eval_bad_arguments_stop_with_one_line(argv, message):
    with pytest.raises(SystemExit) as stop:
        eval_bench.main(argv)
    assert message in str(stop.value) and "\n" not in str(stop.value)


def test_help_lists_the_flags(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--help"])
    text = capsys.readouterr().out
    for flag in (
        "--model",
        "--data",
        "--synthetic",
        "--steps",
        "--repeats",
        "--precisions",
        "-K",
        "--max-new-tokens",
        "--out",
        "--trl-python",
    ):
        assert flag in text
    assert "--worker" not in text


# ---------------------------------------------------------------------------------------------
# Smokes on the tiny random model (seconds)
# ---------------------------------------------------------------------------------------------
def records_file(tmp_path, rounds=(6, 6, 14, 14, 22, 30)):
    path = tmp_path / "records.jsonl"
    write_jsonl(path, [hand_record(i, rounds=r) for i, r in enumerate(rounds)])
    return str(path)


def test_eval_latency_smoke(tmp_path):
    out = tmp_path / "eval"
    eval_bench.main(
        [
            "--model",
            "tiny-random",
            "--data",
            records_file(tmp_path),
            "--out",
            str(out),
            "--methods",
            "full,recency,rag,cuemem,srt",
            "--per-bucket",
            "1",
            "--batch-size",
            "2",
            "--max-new-tokens",
            "3",
            "--max-new-tokens-direct",
            "2",
            "--dtype",
            "float32",
        ]
    )
    result = json.loads((out / "results.json").read_text())
    buckets = {r["bucket"] for r in result["requests"]}
    assert buckets == {8, 16, 24, 32}
    # one query per bucket, five methods (rag and cuemem: a regression, their options went stale once)
    assert len(result["requests"]) == 5 * 4
    assert all(
        r["latency_s"] > 0 and r["input_tokens"] > 0 and 1 <= r["generated_tokens"] <= 3
        for r in result["requests"]
    )
    rows = {(r["method"], r["bucket"]): r for r in result["rows"]}
    assert rows[("full", "all")]["input_vs_full"] == 1.0 and rows[("recency", 32)]["input_vs_full"] < 1.0
    assert rows[("srt", 8)]["batch_rows"] == 2 and rows[("srt", 32)]["batch_rows"] == 1
    assert "| recency | 32 | 1 |" in (out / "results.md").read_text()


def test_gpu_check_runs_from_data_and_a_shape_given_to_it(tmp_path):
    """bench/gpu_check.sh as a GPU machine without a registry runs it (here on a CPU): the stage-0
    data and a model's shape brought over, the shape given random weights, GRPO started from its own
    SFT's final/, every line printed as it comes with the seconds since its part began and no
    progress bar, the plan's peak in the summary."""
    data, work, shape = tmp_path / "data", tmp_path / "work", tmp_path / "shape"
    data.mkdir()
    write_jsonl(data / "train.jsonl", [hand_record(i, rounds=4 + i % 3) for i in range(8)])
    env = dict(os.environ, PYTHON=sys.executable, CPU_SMOKE="1", NGPU="1", DATA=str(data), WORK=str(work))
    script = ["bash", str(REPO / "bench" / "gpu_check.sh")]
    export = dict(env, MODEL="tiny-random", EXPORT_SHAPE=str(shape))
    subprocess.run(script, env=export, check=True, timeout=300)
    assert (shape / "config.json").exists() and not list(shape.glob("*.safetensors"))
    smoke = dict(env, SHAPE=str(shape), PARTS="train", MODES="fsdp", STEPS="2", K="2", NEW_TOKENS="4")
    smoke["DTYPE"] = "float32"  # the suite runs fp32 on every CPU (conftest.py)
    run = subprocess.run(script, env=smoke, capture_output=True, text=True, timeout=600)
    out = run.stdout
    assert run.returncode == 0, out[-3000:] + run.stderr[-3000:]
    assert "== sft_fsdp: done" in out and "== grpo_fsdp: done" in out, out[-3000:]
    assert re.search(r"^ +\d+s  done: 2 steps", out, re.M) and "it/s" not in out
    grpo_config = json.loads((work / "grpo_fsdp" / "config.json").read_text())
    assert grpo_config["model"] == str(work / "sft_fsdp" / "final")  # its own SFT's output
    summary = out.split("== summary", 1)[1]
    assert re.search(r"^grpo_fsdp +1 +[\d.]+ +\d+ +n/a +[\d.]+$", summary, re.M), summary
    assert "sft_plain    no metrics" in summary and (work / "logs" / "grpo_fsdp.log").exists()


def test_gpu_summary_checks_each_figure_against_its_target(tmp_path):
    gpu_summary = load("gpu_summary")
    for name, peak, generate_s in (("grpo_plain", 4.6, 3.0), ("grpo_fsdp", 3.75, 3.6)):
        (tmp_path / name).mkdir()
        write_jsonl(
            tmp_path / name / "metrics.jsonl",
            [{"step_s": 4.0, "tokens_per_s": 100.0, "peak_gpu_gb": peak, "generate_s": generate_s}] * 3,
        )
    (tmp_path / "logs").mkdir()
    plan = "   10s    peak = weights + moments + pi_ref + max(rollout, training)        {:.2f}\n"
    (tmp_path / "logs" / "grpo_plain.log").write_text(plan.format(4.3))  # 6.5% under: out of range
    (tmp_path / "logs" / "grpo_fsdp.log").write_text(plan.format(3.9))  # 4% over: in range
    (tmp_path / "logs" / "tests.log").write_text("  300s  2 failed, 400 passed in 290.1s\n")
    lines = gpu_summary.run_lines(tmp_path, "1")
    assert "-6.5% (OUT OF RANGE" in next(line for line in lines if line.startswith("grpo_plain"))
    assert "+4.0% (ok" in next(line for line in lines if line.startswith("grpo_fsdp"))
    assert "1.20x (ok: at most 1.3x" in gpu_summary.rollout_line(tmp_path)
    assert gpu_summary.tests_line(tmp_path) == "tests: 2 failed, 400 passed in 290.1s"
    assert gpu_summary.decode_line(tmp_path) == "decode loop: no rollout results"


def test_gpu_summary_answers_help_and_a_missing_folder_with_usage(capsys, tmp_path):
    gpu_summary = load("gpu_summary")
    with pytest.raises(SystemExit) as stop:
        gpu_summary.main(["--help"])
    assert stop.value.code == 0 and "WORK folder" in capsys.readouterr().out
    with pytest.raises(SystemExit) as stop:  # it used to end in an IndexError
        gpu_summary.main([])
    assert stop.value.code == 2 and "required: work, ranks" in capsys.readouterr().err
    gpu_summary.main([str(tmp_path), "1"])  # an empty WORK folder: every line says what is missing
    assert "decode loop: no rollout results" in capsys.readouterr().out


def _comparison(jaccard, f1, against="sft"):

    def interval(d):
        return {"diff": d[0], "low": d[1], "high": d[2], "n": 100, "resamples": 2000}

    return {"n": 120, "against": against, "jaccard": interval(jaccard), "f1": interval(f1)}


def test_grpo_seeds_passes_only_a_jaccard_gain_above_zero_with_f1_within_two_points(tmp_path):
    """The decision rule at its boundaries: an interval touching 0 is not a gain, and an F1 drop of
    2.1 points is more than 2."""
    variants = {name: {"jaccard": 0.1, "f1": 0.5, "silent": 0.4} for name in ("sft", "a", "b", "c", "d")}
    summary = {
        "variants": variants,
        "comparisons": {
            "a": _comparison((0.05, 0.01, 0.09), (-0.019, -0.05, 0.01)),  # passes
            "b": _comparison((0.05, 0.0, 0.09), (0.01, -0.02, 0.03)),  # interval touches 0
            "c": _comparison((0.05, 0.02, 0.09), (-0.021, -0.05, 0.01)),  # F1 down 2.1 points
            "d": _comparison((-0.05, -0.09, -0.01), (0.0, -0.02, 0.02)),  # recall got worse
        },
    }
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "summary.json").write_text(json.dumps(summary))
    run = tmp_path / "run"
    run.mkdir()
    write_jsonl(run / "probe.jsonl", [{"step": s, "jaccard_needed": 0.1 * s, "f1": 0.5} for s in (0, 10, 20)])
    write_jsonl(
        run / "metrics.jsonl", [{"step": s, "reward_recall_mean": -1.0 + 0.1 * s} for s in range(1, 21)]
    )
    grpo_seeds = load("grpo_seeds")
    result = grpo_seeds.main(
        [
            "--eval",
            str(tmp_path / "eval"),
            "--sft",
            "sft",
            "--out",
            str(tmp_path / "out"),
            "--curves",
            f"cosine={run}",
            f"keys={run}",
        ]
    )
    assert {r["variant"]: r["passes"] for r in result["rows"]} == {
        "a": True,
        "b": False,
        "c": False,
        "d": False,
    }
    assert (tmp_path / "out" / "curves.png").stat().st_size > 10_000
    assert (
        "| a | 120 (100) | 10.0 -> 10.0 | +5.0 [+1.0, +9.0] |"
        in (tmp_path / "out" / "results.md").read_text()
    )
    summary["comparisons"]["e"] = _comparison((0.05, 0.01, 0.09), (0.0, -0.01, 0.01), against="a")
    (tmp_path / "eval" / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(SystemExit, match="SRT=sft"):  # paired against another model: not the SFT start
        grpo_seeds.main(["--eval", str(tmp_path / "eval"), "--sft", "sft", "--out", str(tmp_path / "out")])


def test_grpo_seeds_counts_right_answers_whose_recall_missed_h_star_paired_by_query(tmp_path):
    """A right answer counts as 'without recall' only when its recall shares no turn with H*: a
    partial recall (Jaccard 0.5) does not count, a wrong answer does not count, and a query that
    needs no recall is left out. Queries are paired by id, whatever the file order."""

    def row(i, accuracy, jaccard, gold=("Q1",)):
        return {"id": f"q{i}", "accuracy": accuracy, "jaccard": jaccard, "gold_recall": list(gold)}

    sft = [row(0, 1.0, 0.0), row(1, 1.0, 0.5), row(2, 0.0, 0.0), row(3, 1.0, 1.0), row(4, 1.0, None, gold=())]
    grpo = [
        row(3, 1.0, 0.0),
        row(2, 1.0, 0.0),
        row(1, 1.0, 0.0),
        row(0, 0.0, 0.0),
        row(4, 1.0, None, gold=()),
    ]
    # per query q0..q3: sft 1, 0, 0, 0 (1 of 4); grpo 0, 1, 1, 1 (3 of 4); mean difference +0.5
    (tmp_path / "eval").mkdir()
    write_jsonl(tmp_path / "eval" / "sft.jsonl", sft)
    write_jsonl(tmp_path / "eval" / "a.jsonl", grpo)
    summary = {
        "variants": {
            "sft": {"jaccard": 0.3, "f1": 0.5, "accuracy": 0.8},
            "a": {"jaccard": 0.2, "f1": 0.6, "accuracy": 1.0},
        },
        "comparisons": {
            "a": dict(
                _comparison((-0.1, -0.3, 0.1), (0.1, 0.0, 0.2)),
                accuracy={"diff": 0.2, "low": -0.2, "high": 0.6, "n": 5},
            )
        },
    }
    (tmp_path / "eval" / "summary.json").write_text(json.dumps(summary))
    grpo_seeds = load("grpo_seeds")
    result = grpo_seeds.main(
        ["--eval", str(tmp_path / "eval"), "--sft", "sft", "--out", str(tmp_path / "out")]
    )
    bypass = result["rows"][0]["right_without_recall"]
    assert (bypass["sft"], bypass["grpo"], bypass["diff"], bypass["n"]) == (0.25, 0.75, 0.5, 4)
    # paired by id the differences are -1, +1, +1, +1 (an interval reaching below 0); paired by file
    # position they would be 0, +1, +1, 0, whose resampled means never go below 0
    assert bypass["low"] < 0 < 0.5 <= bypass["high"]
    assert (
        "| 80.0 -> 100.0 | +20.0 [-20.0, +60.0] | 25.0 -> 75.0 | +50.0 ["
        in (tmp_path / "out" / "results.md").read_text()
    )
    write_jsonl(tmp_path / "eval" / "a.jsonl", grpo[:3])  # one query missing: not the same dev items
    with pytest.raises(SystemExit, match="different queries"):
        grpo_seeds.main(["--eval", str(tmp_path / "eval"), "--sft", "sft", "--out", str(tmp_path / "out")])


# ---------------------------------------------------------------------------------------------
# sampler_mismatch.py: the rollout sampler against pi_old
# ---------------------------------------------------------------------------------------------
def test_sampler_mismatch_sees_the_bf16_gap_and_agrees_with_what_stage2_logs(tmp_path):
    """fp32: the sampler is the policy, the gap is rounding (~1e-6, summation order); bf16: the copy's
    gap is orders above it (a logit of ~10 moves by up to ~0.03 in bf16). What update logs is the
    mean over the same tokens, computed per minibatch rather than at once (another order of sums
    in bf16 autocast: 1e-2 of slack)."""
    out = tmp_path / "mismatch"
    load("sampler_mismatch").main(
        ["--model", "tiny-random", "--synthetic", "6", "--logit-scale", "12", "--steps", "1",
         "--max-new-tokens", "8", "--out", str(out)]
    )  # fmt: skip
    results = {r["sampler"]: r for r in json.loads((out / "results.json").read_text())["results"]}
    fp32, bf16 = results["fp32"], results["bf16"]
    assert fp32["tokens"] > 0 and bf16["tokens"] > 0
    assert fp32["mean_abs_gap"] < 1e-4 and bf16["mean_abs_gap"] > 10 * fp32["mean_abs_gap"]
    for r in (fp32, bf16):
        (logged,) = r["logged_per_step"]
        assert logged["sampler_log_ratio"] == pytest.approx(r["mean_log_ratio"], abs=1e-2)
        assert logged["sampler_kl"] >= 0
    assert "| bf16 |" in (out / "results.md").read_text()


# ------------------------------------------------------------------------------------ sft_tokens.py
def test_sft_tokens_counts_each_steps_rows_and_their_padding_by_hand():
    """Rows of 2, 4 and 6 rounds: each phase-2 step's rows, micro-batched by 2, padded to the
    longest of their pair; the padding share is counted against those lengths by hand, and a
    pruned (phase 1) row is shorter than its full (phase 2) one."""
    from srt.loading import load_model_and_tokenizer
    from stage1_sft import PhaseData, build_example, parse_args

    sft_tokens = load("sft_tokens")
    _, tokenizer = load_model_and_tokenizer("tiny-random", dtype="float32")
    records = [hand_record(i, rounds) for i, rounds in enumerate([3, 5, 7, 3, 5, 7, 4, 6])]
    cfg = parse_args(
        [
            "--data",
            "x.jsonl",
            "--max-steps",
            "4",
            "--phase1-fraction",
            "0.5",
            "--batch-size",
            "2",
            "--grad-accum",
            "2",
        ]
    )
    cfg.world_size = 1
    counted = sft_tokens.count(cfg, records, tokenizer)
    for phase in (1, 2):
        data = PhaseData(tokenizer, records, phase, cfg.max_length, "full", cfg.seed, 4)
        real = padded = 0
        for step in range(2):
            rows = [
                len(build_example(tokenizer, records[i], phase, cfg.max_length)["input_ids"])
                for i in data.batch_indices(step)
            ]
            for pair in (rows[:2], rows[2:]):
                real, padded = real + sum(pair), padded + 2 * max(pair)
        got = counted[f"phase {phase}"]
        assert (got["steps"], got["records"]) == (2, 8)
        assert got["tokens per step (mean)"] == round(real / 2, 1)
        assert got["padding share"] == round(1 - real / padded, 4)
    assert counted["phase 1"]["tokens per record (mean)"] < counted["phase 2"]["tokens per record (mean)"]


def test_prefix_tree_counts_each_distinct_prefix_once():
    sft_tokens = load("sft_tokens")
    # [1, 2, 3] and [1, 2, 4] share [1, 2]; [1, 5] shares [1]; [6] shares nothing: nodes 1, 2, 3, 4, 5, 6
    assert sft_tokens.prefix_tree_tokens([[1, 2, 3], [1, 2, 4], [1, 5], [6]]) == 6
    assert sft_tokens.prefix_tree_tokens([[1, 2, 3], [1, 2, 3]]) == 3  # a repeated record costs nothing
    assert sft_tokens.prefix_tree_tokens([]) == 0


def test_shared_prefix_saves_the_common_history_of_one_dialogues_records_only():
    """Turns 4 and 6 of one dialogue share the history of rounds 1-3; a record of another dialogue
    with the same shape shares nothing with them: the tree holds len(a) + len(b) - lcp(a, b) + len(c)."""
    from srt.loading import load_model_and_tokenizer
    from stage1_sft import build_example, parse_args

    sft_tokens = load("sft_tokens")
    _, tokenizer = load_model_and_tokenizer("tiny-random", dtype="float32")
    a, b, c = hand_record(0, rounds=4), hand_record(0, rounds=6), hand_record(1, rounds=5)
    for record, dialogue in ((a, "d0"), (b, "d0"), (c, "d1")):
        record["meta"]["dialogue_id"] = dialogue
    cfg = parse_args(["--data", "x.jsonl"])
    got = sft_tokens.shared_prefix(cfg, [a, b, c], tokenizer)
    ids = [build_example(tokenizer, r, 2, cfg.max_length)["input_ids"] for r in (a, b, c)]
    lcp = next(k for k, (x, y) in enumerate(zip(ids[0], ids[1])) if x != y)
    assert lcp > 0 and got["dialogues"] == 2
    assert got["tokens, one record at a time"] == sum(map(len, ids))
    assert got["tokens, one prefix tree per dialogue"] == len(ids[0]) + len(ids[1]) - lcp + len(ids[2])
    assert 0 < got["saved share"] < 0.5


# ------------------------------------------------------------------------------------ sft_step.py
def test_sft_step_times_every_side_on_the_same_batches_without_moving_the_weights(tmp_path):
    """Two optimizers x one attention on the tiny model, 2 timed steps: each side's step is its
    forward + backward plus its optimizer step, sample by sample; at learning rate 0 AdamW does
    its work and leaves the weights where they were, so every side saw the same model."""
    from srt.data_io import write_jsonl

    sft_step = load("sft_step")
    data = tmp_path / "train.jsonl"
    write_jsonl(data, [hand_record(i, rounds) for i, rounds in enumerate([3, 5, 7, 3, 5, 7, 4, 6])])
    loaded = {}
    real_load = sft_step.load_model_and_tokenizer

    def keep(*args, **kwargs):
        loaded["model"], tokenizer = real_load(*args, **kwargs)
        loaded["before"] = {k: v.clone() for k, v in loaded["model"].state_dict().items()}
        return loaded["model"], tokenizer

    sft_step.load_model_and_tokenizer = keep
    try:
        out = str(tmp_path / "out")
        sft_step.main(
            ["--model", "tiny-random", "--data", str(data), "--steps", "2", "--out", out]
            + ["--loss", "logsumexp", "cross-entropy"]
        )
    finally:
        sft_step.load_model_and_tokenizer = real_load
    for name, value in loaded["model"].state_dict().items():
        assert torch.equal(value, loaded["before"][name]), name
    results = json.loads((tmp_path / "out" / "cpu-lesson-phase2-full.json").read_text())["results"]
    assert list(results) == [
        f"AdamW {optimizer}, sdpa, {loss}"  # an AVX2 CPU (conftest.py): fp32, SDPA
        for loss in ("logsumexp", "cross-entropy")
        for optimizer in ("loop", "fused")
    ]
    for side in results.values():
        assert all(side[part]["n"] == 2 for part in ("step", "forward + backward", "optimizer"))
        assert side["step"]["min"] >= side["forward + backward"]["min"] > 0
        # stage 1's log-sum-exp and cross_entropy: one loss in fp32, up to summation order
        assert side["loss vs first side"] < 1e-5
        assert side["step vs first side"]["n"] == 2 and side["step vs first side"]["min"] > 0
    assert results["AdamW loop, sdpa, logsumexp"]["step vs first side"]["median"] == 1.0
    assert sft_step.logprobs.token_logprobs is sft_step.LOSSES["logsumexp"]  # put back


def test_sft_step_profile_accounts_for_the_step_by_kind_of_op(tmp_path):
    """--profile on the tiny model: every kind of op is a share of the profiled step and together
    they are the step's wall time (the rest is what no op holds); the weight products, which a
    forward and backward cannot skip, take time and report their GFLOP/s; op names land in the
    right kind, the ones no kind names in 'other'."""
    from srt.data_io import write_jsonl

    sft_step = load("sft_step")
    assert sft_step.op_kind("aten::addmm") == sft_step.WEIGHT_PRODUCTS
    assert sft_step.op_kind("aten::_to_copy") == "casts and copies"
    assert sft_step.op_kind("aten::_fused_adamw_") == "optimizer (AdamW)"
    assert sft_step.op_kind("aten::topk") == sft_step.OTHER_OPS  # not a cast for sharing "aten::to"
    data = tmp_path / "train.jsonl"
    write_jsonl(data, [hand_record(i, rounds) for i, rounds in enumerate([3, 5, 7, 3, 5, 7, 4, 6])])
    out = tmp_path / "out"
    sft_step.main(
        ["--model", "tiny-random", "--data", str(data), "--steps", "1", "--profile", "--out", str(out)]
    )
    profiled = json.loads((out / "profile-cpu-lesson-phase2-full.json").read_text())["profile"]
    seconds = profiled["seconds"]
    # the kinds account for the whole step: what no op holds is the rest of the wall time, never < 0
    assert seconds["no op (Python, data, waiting)"] >= 0 and sum(seconds.values()) >= profiled["step_s"] * (
        1 - 1e-9
    )
    assert seconds[sft_step.WEIGHT_PRODUCTS] > 0 and profiled["weight_product_gflops"] > 0
    assert seconds["optimizer (AdamW)"] > 0
    assert "| weight products (mm, addmm, bmm) |" in (out / "profile-cpu-lesson-phase2-full.md").read_text()


# ------------------------------------------------------------------------------------- precision.py
def test_precision_times_both_sides_of_every_part_alternated_on_equal_work(tmp_path):
    """bf16 autocast against fp32 on tiny-random, one repetition of each part: both sides timed,
    every rollout row and answer run to its cap (stop tokens suppressed), the ratios those of the
    medians and of the pairs, and the table written; what `--dtype auto` picks is recorded (fp32 under
    the tests' AVX2-only flags, conftest.py)."""
    data = tmp_path / "train.jsonl"
    write_jsonl(data, [hand_record(i, rounds) for i, rounds in enumerate([3, 5, 7, 3, 5, 7, 4, 6])])
    out = tmp_path / "out"
    argv = ["--model", "tiny-random", "--data", str(data), "--sft-steps", "1", "--repeats", "1", "-K", "2",
            "--max-new-tokens", "5", "--eval-batch", "2", "--eval-new-tokens", "3",
            "--out", str(out)]  # fmt: skip
    load("precision").main(argv)
    result = json.loads((out / "results.json").read_text())
    assert list(result["results"]) == ["sft", "rollout", "eval-b8", "eval-b1"]
    assert result["auto_autocast"] is None and result["machine"]["fast_bf16"] is False
    expected_tokens = {"rollout": 2 * 5, "eval-b8": 2 * 3, "eval-b1": 3}
    for part, r in result["results"].items():
        for side in ("fp32", "bf16"):
            assert r[side]["seconds"]["n"] == 1 and r[side]["samples"][0] > 0
        assert r["fp32"]["tokens"] == r["bf16"]["tokens"]  # equal work
        if part in expected_tokens:
            assert r["fp32"]["tokens"] == [expected_tokens[part]]
        assert r["ratio_of_medians"] == pytest.approx(r["bf16"]["samples"][0] / r["fp32"]["samples"][0])
        assert r["paired_ratio"]["median"] == pytest.approx(r["ratio_of_medians"])
    table = (out / "results.md").read_text()
    assert "| SFT step" in table and "| eval, batch 1" in table and "plain fp32" in table


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--repeats", "0"], "--repeats: must be >= 1"),
        (["--sft-steps", "0"], "--sft-steps: must be >= 1"),
        (["--eval-batch", "0"], "--eval-batch: must be >= 1"),
        (["--parts", "nope"], "invalid choice: 'nope'"),
        (["--data", "/no/such/train.jsonl"], "--data /no/such/train.jsonl not found"),
        (["--preset", "nope", "--data", "/no/such/train.jsonl"], "--preset nope: not a preset"),
    ],
)
def test_precision_bad_arguments_stop_with_one_line(argv, message, capsys):
    precision = load("precision")
    with pytest.raises(SystemExit) as stop:
        precision.main(argv)
    said = str(stop.value) if isinstance(stop.value.code, str) else capsys.readouterr().err
    assert message in said and "Traceback" not in said
