"""Stage 1 (§3.3): the loader, Eq. (3) masking and loss, the two phases, truncation, resume, DDP.
Everything runs on the tiny random Llama; records are built by hand."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import AVX2_FLAGS
from records import hand_record
from safetensors.torch import load_file

import stage1_sft
from srt import attention_kernel, loading, precision
from srt.data_io import write_jsonl
from srt.loading import load_model_and_tokenizer
from srt.prompt import format_target, render_prompt
from stage1_sft import IGNORE_INDEX, build_example, collate, sft_loss_sums

REPO = Path(__file__).resolve().parents[1]


def make_record(i: int, rounds: int = 6, recall=("Q1", "A2"), pruned_extra=("Q4",)) -> dict:
    return hand_record(i, rounds, recall, pruned_extra)


pytestmark = pytest.mark.usefixtures("one_thread")


def write_records(tmp_path, records) -> str:
    path = tmp_path / "train.jsonl"
    write_jsonl(path, records)
    return str(path)


def run_args(data, out, *extra):
    return stage1_sft.parse_args(
        [
            "--model",
            "tiny-random",
            "--data",
            data,
            "--out",
            str(out),
            "--dtype",
            "float32",
            "--warmup-steps",
            "0",
            "--log-every",
            "1",
            *extra,
        ]
    )


def read_metrics(out):
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------------------------------------- loader
def test_tiny_random_is_deterministic_byte_level_and_chatml(tiny):
    model, tok = tiny
    model2, tok2 = load_model_and_tokenizer("tiny-random")
    for (name, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(a, b), name
    text = "naïve 日本語 🙂 <HIS>Q1: $180</HIS>"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text  # byte-level: nothing lost
    assert tok2(text)["input_ids"] == tok(text)["input_ids"]
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert im_end in model.generation_config.eos_token_id and tok.pad_token is not None
    prompt = render_prompt(tok, make_record(0))
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")
    assert tok.convert_ids_to_tokens(tok(prompt)["input_ids"])[0] == "<|im_start|>"


# ---------------------------------------------------------------------------------------------- Eq. (3)
def test_labels_mask_exactly_the_prompt_and_loss_is_hand_nll(tiny):
    model, tok = tiny
    records = [make_record(1), make_record(2, rounds=4, recall=("A1",), pruned_extra=())]
    examples = [build_example(tok, r, phase=2, max_length=2048) for r in records]
    for rec, ex in zip(records, examples):
        n_prompt = len(tok(render_prompt(tok, rec), add_special_tokens=False)["input_ids"])
        assert ex["labels"][:n_prompt] == [IGNORE_INDEX] * n_prompt
        assert ex["labels"][n_prompt:] == ex["input_ids"][n_prompt:]
        assert tok.decode(ex["input_ids"][n_prompt:]) == format_target(rec) + "<|im_end|>"
        first_answer = ex["answer_mask"].index(1)
        assert tok.decode(ex["input_ids"][first_answer:]) == f"Final answer: {rec['answer']}<|im_end|>"
        assert all(ex["answer_mask"][first_answer:]) and not any(ex["answer_mask"][:first_answer])

    batch = collate(examples, tok.pad_token_id)
    assert batch["attention_mask"].sum().item() == sum(len(e["input_ids"]) for e in examples)  # padded
    with torch.no_grad():
        got = sft_loss_sums(model, batch)
        # By hand: log_softmax = x - max - log(sum(exp(x - max))), one unpadded sequence at a time.
        nll = {"all": 0.0, "reasoning": 0.0, "answer": 0.0}
        counts = {"all": 0, "reasoning": 0, "answer": 0}
        for ex in examples:
            logits = model(input_ids=torch.tensor([ex["input_ids"]])).logits[0].double()
            top = logits.max(-1, keepdim=True).values
            logp = logits - top - (logits - top).exp().sum(-1, keepdim=True).log()
            for k in range(1, len(ex["input_ids"])):
                if ex["labels"][k] == IGNORE_INDEX:
                    continue
                token_nll = -logp[k - 1, ex["input_ids"][k]].item()
                part = "answer" if ex["answer_mask"][k] else "reasoning"
                for key in ("all", part):
                    nll[key] += token_nll
                    counts[key] += 1
    assert (
        got["tokens"].item()
        == counts["all"]
        == sum(len(e["input_ids"]) - e["labels"].count(IGNORE_INDEX) for e in examples)
    )
    assert (
        got["answer_tokens"].item() == counts["answer"]
        and got["reasoning_tokens"].item() == counts["reasoning"]
    )
    assert got["nll"].item() == pytest.approx(nll["all"], rel=1e-5)
    assert got["reasoning_nll"].item() == pytest.approx(nll["reasoning"], rel=1e-5)
    assert got["answer_nll"].item() == pytest.approx(nll["answer"], rel=1e-5)
    assert got["nll"].item() / counts["all"] > 5.0  # a random model over ~700 tokens: about ln(700)

    no_cot = build_example(tok, records[0], phase=2, max_length=2048, target="answer")
    n_prompt = no_cot["labels"].count(IGNORE_INDEX)
    assert tok.decode(no_cot["input_ids"][n_prompt:]) == f"Final answer: {records[0]['answer']}<|im_end|>"
    assert no_cot["answer_mask"][n_prompt:] == [1] * (len(no_cot["input_ids"]) - n_prompt)


# ---------------------------------------------------------------------------------------------- phases
def test_phase1_sees_pruned_history_and_phase2_the_full_one(tmp_path, tiny):
    _, tok = tiny
    records = [make_record(i) for i in range(4)]
    args = run_args(
        write_records(tmp_path, records), tmp_path / "out", "--max-steps", "4", "--batch-size", "2"
    )
    plan = stage1_sft.phase_plan(argparse_ns(args, world_size=1), {1: 4, 2: 4})
    assert plan == [(1, 2), (2, 2)]
    for phase in (1, 2):
        data = stage1_sft.PhaseData(tok, records, phase, 2048, "full", seed=0, global_batch=2)
        seen = [data.example(i) for i in data.batch_indices(0) + data.batch_indices(1)]
        assert sorted(e["id"] for e in seen) == sorted(r["id"] for r in records)  # one epoch = every record
        for ex in seen:
            rec = next(r for r in records if r["id"] == ex["id"])
            prompt = tok.decode(ex["input_ids"][: ex["labels"].count(IGNORE_INDEX)])
            assert prompt == ex["prompt"]
            for turn in rec["history"]:
                shown = f"{turn['label']}: {turn['text']}" in prompt
                assert shown == (phase == 2 or turn["label"] in rec["pruned"]), (phase, turn["label"])
    stage1_sft.train(args)
    assert [m["phase"] for m in read_metrics(tmp_path / "out")] == [1, 1, 2, 2]


def argparse_ns(args, **extra):
    return type(args)(**{**vars(args), **extra})


# ---------------------------------------------------------------------------------------------- truncation
def test_truncation_drops_the_oldest_turns_whatever_they_are_and_never_the_query_or_target(tiny):
    _, tok = tiny
    rec = make_record(5, rounds=12, recall=("A9", "Q10"))
    full = build_example(tok, rec, phase=2, max_length=100_000)
    assert full["dropped"] == 0
    for max_length in (len(full["input_ids"]) - 40, len(full["input_ids"]) - 150):
        ex = build_example(tok, rec, phase=2, max_length=max_length)
        assert len(ex["input_ids"]) <= max_length and ex["dropped"] > 0
        n_prompt = ex["labels"].count(IGNORE_INDEX)
        assert tok.decode(ex["input_ids"][n_prompt:]) == format_target(rec) + "<|im_end|>"
        assert ex["prompt"].rstrip().endswith(f"{rec['query']}<|im_end|>\n<|im_start|>assistant")
        shown = [t for t in rec["history"] if f"{t['label']}: {t['text']}\n" in ex["prompt"] + "\n"]
        assert shown == rec["history"][ex["dropped"] :]  # a suffix: no old turn survives for being gold
        # Minimal: keeping one more (the newest dropped) turn would not fit.
        back = rec["history"][ex["dropped"] - 1 :]
        target_len = len(ex["input_ids"]) - n_prompt
        assert (
            len(tok(render_prompt(tok, rec, history=back), add_special_tokens=False)["input_ids"])
            + target_len
            > max_length
        )
    # The same dialogue with an old gold turn: cutting it would leave a target that cites a turn the
    # prompt lost, so the record is dropped instead of its gold turn protected.
    old_gold = make_record(5, rounds=12, recall=("Q1", "A9"))
    assert build_example(tok, old_gold, phase=2, max_length=len(full["input_ids"]) - 40) is None
    assert build_example(tok, old_gold, phase=2, max_length=100_000) is not None
    # Every control drops it too, though its target cites nothing: all targets train on the same records.
    for target in ("answer", "recall-only"):
        assert (
            build_example(tok, old_gold, phase=2, max_length=len(full["input_ids"]) - 40, target=target)
            is None
        )
    # Not even the H* turns fit: no example, and PhaseData substitutes the next record and counts it.
    assert (
        build_example(tok, rec, phase=2, max_length=len(full["input_ids"]) - len(full["prompt"]) // 2) is None
    )
    small = make_record(6, rounds=3, recall=("Q1",), pruned_extra=())
    limit = len(build_example(tok, small, phase=2, max_length=100_000)["input_ids"])
    data = stage1_sft.PhaseData(tok, [rec, small], 2, limit, "full", seed=0, global_batch=2)
    assert [data.example(i)["id"] for i in data.batch_indices(0)] == [small["id"]] * 2 and data.skipped == {0}


# ---------------------------------------------------------------------------------------------- learning
def test_tiny_model_overfits_a_handful_of_records(tmp_path):
    data = write_records(tmp_path, [make_record(i) for i in range(2)])
    stage1_sft.train(
        run_args(
            data, tmp_path / "out", "--phase", "2", "--max-steps", "30", "--lr", "5e-3", "--batch-size", "2"
        )
    )
    losses = [m["loss"] for m in read_metrics(tmp_path / "out")]
    assert len(losses) == 30 and losses[-1] < losses[0] / 5
    metrics = read_metrics(tmp_path / "out")[-1]
    assert metrics["loss_reasoning"] is not None and metrics["loss_answer"] is not None
    model, tok = load_model_and_tokenizer("tiny-random")
    reloaded, reloaded_tok = load_model_and_tokenizer(str(tmp_path / "out" / "final"))
    assert (tmp_path / "out" / "final" / "model.safetensors").exists()
    prompt = render_prompt(tok, make_record(0))
    assert render_prompt(reloaded_tok, make_record(0)) == prompt
    assert reloaded_tok(prompt)["input_ids"] == tok(prompt)["input_ids"]
    assert reloaded.generation_config.eos_token_id == model.generation_config.eos_token_id
    assert not torch.equal(reloaded.lm_head.weight, model.lm_head.weight)  # the trained weights
    # The optional end-of-run check generates from left-padded prompts of different lengths.
    held_out = [make_record(7, rounds=2, recall=("Q1",)), make_record(8, rounds=6)]
    eval_path = tmp_path / "dev.jsonl"
    write_jsonl(eval_path, held_out)
    args = run_args(
        data,
        tmp_path / "out",
        "--eval-data",
        str(eval_path),
        "--eval-limit",
        "2",
        "--eval-max-new-tokens",
        "6",
    )
    result = stage1_sft.evaluate_format(reloaded, reloaded_tok, args, "cpu", None)
    assert result["n"] == 2 and json.loads((tmp_path / "out" / "eval_format.json").read_text()) == result
    from srt.completion import is_valid_format

    for rec, sample in zip(held_out, result["samples"]):
        ids = reloaded_tok(render_prompt(reloaded_tok, rec), return_tensors="pt", add_special_tokens=False)
        alone = reloaded.generate(**ids, max_new_tokens=6, do_sample=False)[0, ids["input_ids"].shape[1] :]
        assert sample["completion"] == reloaded_tok.decode(
            alone, skip_special_tokens=True
        )  # padding is harmless
        assert sample["valid"] == is_valid_format(sample["completion"])
    assert json.loads((tmp_path / "out" / "config.json").read_text())["lr"] == 5e-3


def test_snapshots_are_the_model_of_their_step_and_leave_the_run_unchanged(tmp_path):
    """--snapshot-every 2 on a 4-step run keeps step 2's model, the weights of a 2-step run on the same
    batches (phase 1 only in both), and the final weights equal a run without snapshots."""
    data = write_records(tmp_path, [make_record(i, rounds=3 + i % 3) for i in range(6)])
    common = ["--batch-size", "2", "--lr", "3e-3", "--phase1-fraction", "1.0"]
    with_snapshots = stage1_sft.train(
        run_args(data, tmp_path / "a", *common, "--max-steps", "4", "--snapshot-every", "2")
    )
    without = stage1_sft.train(run_args(data, tmp_path / "b", *common, "--max-steps", "4"))
    stage1_sft.train(run_args(data, tmp_path / "c", *common, "--max-steps", "2"))
    for a, b in zip(with_snapshots.state_dict().values(), without.state_dict().values()):
        assert torch.equal(a, b)
    assert sorted(p.name for p in (tmp_path / "a" / "snapshots").iterdir()) == ["step-2"]
    snapshot = load_file(str(tmp_path / "a" / "snapshots" / "step-2" / "model.safetensors"))
    two = load_file(str(tmp_path / "c" / "final" / "model.safetensors"))
    four = load_file(str(tmp_path / "a" / "final" / "model.safetensors"))
    assert snapshot.keys() == two.keys()
    for name in snapshot:
        torch.testing.assert_close(snapshot[name], two[name], rtol=1e-5, atol=1e-6, msg=name)
    assert any(not torch.equal(snapshot[name], four[name]) for name in snapshot)


# ---------------------------------------------------------------------------------------------- resume
def test_weights_loaded_from_disk_sit_in_fresh_aligned_memory(tmp_path):
    """Regression: weights read from safetensors sat at unaligned addresses of the file's mapping
    (data_ptr % 64 == 40), where the CPU's matmul sums in another order, so a resumed GRPO run drifted
    from the uninterrupted one by 3e-6 after three steps. The allocator aligns fresh memory to 64."""
    model, tokenizer = load_model_and_tokenizer("tiny-random", dtype="float32")
    model.save_pretrained(tmp_path / "m", safe_serialization=True)
    tokenizer.save_pretrained(tmp_path / "m")
    loaded, _ = load_model_and_tokenizer(str(tmp_path / "m"), dtype="float32")
    assert all(p.data_ptr() % 64 == 0 for p in loaded.parameters())
    for a, b in zip(model.state_dict().values(), loaded.state_dict().values()):
        assert torch.equal(a, b)


def test_killed_run_resumes_to_the_uninterrupted_result(tmp_path):
    """SIGKILL a real run once it has written a mid-run checkpoint; --resume must then reach the
    same weights and the same metrics lines as a run that was never interrupted."""
    data = write_records(tmp_path, [make_record(i, rounds=3 + i % 3) for i in range(6)])
    common = [
        "--max-steps",
        "40",
        "--phase1-fraction",
        "0.5",
        "--batch-size",
        "2",
        "--grad-accum",
        "2",
        "--warmup-steps",
        "3",
        "--lr",
        "3e-3",
        "--save-every",
        "2",
    ]
    whole = stage1_sft.train(run_args(data, tmp_path / "a", *common))

    args = [
        "--model",
        "tiny-random",
        "--data",
        data,
        "--out",
        str(tmp_path / "b"),
        "--dtype",
        "float32",
        "--log-every",
        "1",
        *common,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.Popen(
        [sys.executable, str(REPO / "stage1_sft.py"), *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    state_file = tmp_path / "b" / "checkpoint" / "trainer_state.json"
    deadline = time.time() + 120
    while time.time() < deadline and run.poll() is None:
        if state_file.exists() and json.loads(state_file.read_text())["step"] >= 4:
            run.kill()
            break
        time.sleep(0.005)
    run.wait()
    killed_at = json.loads(state_file.read_text())["step"]
    assert run.returncode != 0 and killed_at < 40, "the run finished before it could be killed"

    resumed = stage1_sft.train(run_args(data, tmp_path / "b", *common, "--resume"))
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    assert [m["step"] for m in read_metrics(tmp_path / "b")] == list(range(1, 41))
    assert [m["loss"] for m in read_metrics(tmp_path / "b")] == pytest.approx(
        [m["loss"] for m in read_metrics(tmp_path / "a")], rel=1e-5
    )
    # Regression: --resume on a finished run re-saved final/ (for checkpoints above 2 GiB, which
    # evaluate.py keys by modification time, a new model). A finished run is now left untouched.
    final = tmp_path / "b" / "final" / "model.safetensors"
    before = (final.stat().st_mtime_ns, (tmp_path / "b" / "metrics.jsonl").read_text())
    again = stage1_sft.train(run_args(data, tmp_path / "b", *common, "--resume"))
    assert (final.stat().st_mtime_ns, (tmp_path / "b" / "metrics.jsonl").read_text()) == before
    for a, b in zip(resumed.state_dict().values(), again.state_dict().values()):
        assert torch.equal(a, b)
    with pytest.raises(SystemExit, match="different settings.*batch_size"):
        stage1_sft.train(run_args(data, tmp_path / "b", *common, "--resume", "--batch-size", "3"))


def test_time_budget_stops_cleanly_and_bad_data_is_one_line_error(tmp_path):
    data = write_records(tmp_path, [make_record(i) for i in range(2)])
    stage1_sft.train(run_args(data, tmp_path / "out", "--max-steps", "5", "--time-budget-minutes", "0.5"))
    assert (tmp_path / "out" / "final" / "config.json").exists() and read_metrics(tmp_path / "out") == []
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({**make_record(0), "query": 3}) + "\n")
    with pytest.raises(SystemExit, match=r"bad.jsonl:1: field 'query' must be str"):
        stage1_sft.main(["--model", "tiny-random", "--data", str(bad), "--out", str(tmp_path / "x")])


# ---------------------------------------------------------------------------------------------- DDP
DDP_SCRIPT = """
import sys, torch, torch.distributed as dist
from safetensors.torch import save_file
import stage1_sft
model = stage1_sft.train(stage1_sft.parse_args(sys.argv[2:]))
rank = dist.get_rank() if dist.is_initialized() else 0
weights = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
save_file(weights, f"{sys.argv[1]}/rank{rank}.safetensors")
"""


def test_torchrun_two_ranks_equal_single_process_on_same_global_batch(tmp_path, monkeypatch):
    """DDP over gloo on CPUs, both sides: a one-GPU machine has no second GPU for rank 1, and a CPU
    and a GPU step differ by more than the tolerance below."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the one-process side
    data = write_records(tmp_path, [make_record(i, rounds=3 + i) for i in range(4)])
    script = tmp_path / "ddp_step.py"
    script.write_text(DDP_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    common = [
        "--model",
        "tiny-random",
        "--data",
        data,
        "--dtype",
        "float32",
        "--phase",
        "2",
        "--max-steps",
        "1",
        "--lr",
        "1e-2",
        "--warmup-steps",
        "0",
    ]
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(script),
            str(tmp_path),
            *common,
            "--out",
            str(tmp_path / "ddp"),
            "--batch-size",
            "1",
            "--grad-accum",
            "2",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rank0, rank1 = load_file(tmp_path / "rank0.safetensors"), load_file(tmp_path / "rank1.safetensors")
    single = stage1_sft.train(
        run_args(
            data, tmp_path / "single", "--phase", "2", "--max-steps", "1", "--lr", "1e-2", "--batch-size", "4"
        )
    )
    initial, _ = load_model_and_tokenizer("tiny-random")
    moved = 0
    for name, value in single.state_dict().items():
        assert torch.equal(rank0[name], rank1[name]), name
        # Adam's first step moves each weight by about lr = 1e-2: the updates agree to 1e-3 of that.
        before = initial.state_dict()[name]
        torch.testing.assert_close(rank0[name] - before, value - before, rtol=0, atol=1e-5, msg=name)
        moved += (value - before).abs().max().item() > 1e-3
    assert moved > 10  # the step really changed the weights
    ddp, alone = read_metrics(tmp_path / "ddp")[0], read_metrics(tmp_path / "single")[0]
    assert ddp["loss"] == pytest.approx(alone["loss"], rel=1e-5)
    assert ddp["grad_norm"] == pytest.approx(
        alone["grad_norm"], rel=1e-4
    )  # same gradient scale, not just sign


def test_activation_checkpointing_is_enabled_without_the_deprecated_call():
    import warnings

    model, _ = load_model_and_tokenizer("tiny-random", dtype="float32")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # gradient_checkpointing_enable warns: gone in v6
        loading.enable_activation_checkpointing(model)
    assert model.is_activation_checkpointing


def test_a_rank_without_its_own_gpu_stops_with_one_line(monkeypatch):
    """torchrun --nproc_per_node=2 on a one-GPU machine: rank 1 must not ask for a missing cuda:1."""
    from srt.distributed import setup_distributed

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(SystemExit, match="LOCAL_RANK 1 needs 2 GPUs; 1 visible"):
        setup_distributed()


AVX2 = " ".join(sorted(AVX2_FLAGS))
AVX512 = AVX2 + " avx512f avx512dq avx512cd avx512bw avx512vl avx512_vnni"  # no bf16 instructions


@pytest.mark.parametrize(
    "flags, autocast",
    [
        (AVX512 + " avx512_bf16", torch.bfloat16),  # AMD Zen 4/5, Intel Cooper Lake
        (AVX512 + " avx512_bf16 amx_bf16 amx_tile amx_int8", torch.bfloat16),  # Sapphire Rapids
        (AVX512 + " amx_bf16 amx_tile", torch.bfloat16),  # AMX alone is enough
        (AVX512, None),  # AVX-512 without bf16: converted in software, slower than fp32
        (AVX2, None),
    ],
    ids=["avx512_bf16", "amx", "amx-only", "avx512", "avx2"],
)
def test_auto_dtype_autocasts_bf16_only_where_the_cpu_has_bf16_units(monkeypatch, flags, autocast):
    """--dtype auto on a CPU: bf16 autocast over fp32 weights where the flags Linux lists show AMX or
    AVX512-BF16, plain fp32 elsewhere; float32 and bfloat16 never autocast, whatever the CPU."""
    monkeypatch.setattr(precision, "cpu_flags", lambda: set(flags.split()))
    assert precision.cpu_has_fast_bf16() is (autocast is not None)
    assert precision.resolve_dtype("auto", "cpu") == (torch.float32, autocast)
    assert precision.resolve_dtype("auto", None) == (torch.float32, autocast)  # no device: the CPU
    assert precision.resolve_dtype("float32", "cpu") == (torch.float32, None)
    assert precision.resolve_dtype("bfloat16", "cpu") == (torch.bfloat16, None)
    assert precision.resolve_dtype("auto", "cuda") == (torch.float32, torch.bfloat16)  # any GPU
    assert precision.resolve_dtype("float32", "cuda") == (torch.float32, None)


def test_attention_flag_trains_with_bf16_eager_and_gives_the_model_back_on_sdpa(monkeypatch, tmp_path):
    """--attention bf16_eager trains with attention_kernel.bf16_eager_attention (faster on a bf16 CPU,
    bench/README.md), the default with SDPA; either way the model comes back with the kernel it was
    loaded with (generation, saving). The kernel seen by each step's loss is read from inside
    sft_loss_sums."""
    seen = []
    real_sums = stage1_sft.sft_loss_sums

    def spy(model, batch, autocast_dtype=None):
        seen.append(model.config._attn_implementation)
        return real_sums(model, batch, autocast_dtype)

    monkeypatch.setattr(stage1_sft, "sft_loss_sums", spy)
    data = write_records(tmp_path, [make_record(i, rounds=3 + i) for i in range(2)])
    common = ("--phase", "2", "--max-steps", "1", "--batch-size", "2")
    default = stage1_sft.train(run_args(data, tmp_path / "sdpa", *common))
    chosen = stage1_sft.train(run_args(data, tmp_path / "bf16", *common, "--attention", "bf16_eager"))
    assert seen == ["sdpa", "bf16_eager"]
    assert default.config._attn_implementation == chosen.config._attn_implementation == "sdpa"
    assert "eager" not in (tmp_path / "bf16" / "final" / "config.json").read_text()
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["attention"] == "bf16_eager"


def test_bf16_eager_attention_is_softmax_qk_v_by_hand():
    """The kernel against softmax(Q K^T / sqrt(d) + mask) V written out in float64, with 6 heads
    sharing 2 key/value heads (head h reads key/value head h // 3), a causal mask, a row whose last
    key is padding, and a query with no key to attend (left padding): uniform over the keys, as
    eager gives it, not NaN. fp32 against float64: 1e-5."""
    torch.manual_seed(0)
    rows, heads, kv_heads, tokens, dim = 2, 6, 2, 5, 8
    query = torch.randn(rows, heads, tokens, dim)
    key, value = torch.randn(rows, kv_heads, tokens, dim), torch.randn(rows, kv_heads, tokens, dim)
    allowed = torch.ones(tokens, tokens).tril().bool().expand(rows, 1, tokens, tokens).clone()
    allowed[0, :, :, 4] = False  # row 0: its last token is padding
    allowed[1, :, 0, :] = False  # row 1: a query with nothing to attend
    module = torch.nn.Module()
    module.num_key_value_groups, module.training = 3, False
    out, _ = attention_kernel.bf16_eager_attention(module, query, key, value, allowed, dim**-0.5)
    assert out.shape == (rows, tokens, heads, dim)
    for r in range(rows):
        for h in range(heads):
            q, k, v = query[r, h].double(), key[r, h // 3].double(), value[r, h // 3].double()
            scores = (q @ k.T * dim**-0.5).masked_fill(~allowed[r, 0], float("-inf"))
            expected = scores.softmax(-1) @ v
            if r == 1:
                expected[0] = v.mean(0)
            torch.testing.assert_close(out[r, :, h].double(), expected, rtol=0, atol=1e-5)


def test_every_attention_kernel_gives_one_loss_on_a_padded_batch(tiny):
    """SDPA, eager and bf16_eager compute one function: Eq. (3)'s sums over a right-padded
    micro-batch agree to fp32 rounding (rel 1e-5: a few hundred terms summed in another order), and
    under bf16 autocast to bf16's (8 significant bits: a logit off by a few 1e-3 relative moves a
    mean token loss of about ln(vocab) by far less than rel 1e-2). A mask read the wrong way round,
    or none (every token attending to the ones after it), moves the loss by the whole attention
    pattern."""
    model, tok = tiny
    records = [make_record(1), make_record(2, rounds=4, recall=("A1",), pruned_extra=())]
    batch = collate([build_example(tok, r, phase=2, max_length=2048) for r in records], tok.pad_token_id)
    assert batch["attention_mask"].eq(0).any()  # padded
    sums = {}
    try:
        for kind in ("sdpa", "eager", attention_kernel.register_bf16_eager()):
            model.set_attn_implementation(kind)
            with torch.no_grad():
                sums[kind, None] = sft_loss_sums(model, batch)["nll"].item()
                sums[kind, torch.bfloat16] = sft_loss_sums(model, batch, torch.bfloat16)["nll"].item()
    finally:
        model.set_attn_implementation("sdpa")
    for kind in ("eager", "bf16_eager"):
        assert sums[kind, None] == pytest.approx(sums["sdpa", None], rel=1e-5)
        assert sums[kind, torch.bfloat16] == pytest.approx(sums["sdpa", None], rel=1e-2)
    assert sums["sdpa", torch.bfloat16] == pytest.approx(sums["sdpa", None], rel=1e-2)


def test_cpu_flags_are_read_from_proc_cpuinfo_and_torch_decides_without_them(monkeypatch, tmp_path):
    """The probe reads the "flags" line (on Linux); where there is none it falls back on torch's AMX
    probe. The tests themselves run as on an AVX2-only CPU (conftest.py), so that `--dtype auto` is
    fp32 in every test on every machine."""
    from conftest import REAL_CPU_FLAGS

    assert precision.cpu_flags() == AVX2_FLAGS and not precision.cpu_has_fast_bf16()
    monkeypatch.setattr(precision, "cpu_flags", REAL_CPU_FLAGS)
    real_path = precision.Path
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16\nbugs\t\t: none\n")
    monkeypatch.setattr(precision, "Path", lambda p: cpuinfo if p == "/proc/cpuinfo" else real_path(p))
    assert precision.cpu_flags() == {"fpu", "avx2", "avx512_bf16"} and precision.cpu_has_fast_bf16()
    monkeypatch.setattr(precision, "Path", lambda p: tmp_path / "none")  # no /proc/cpuinfo
    assert precision.cpu_flags() == set()
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    assert precision.cpu_has_fast_bf16() is True
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    assert precision.cpu_has_fast_bf16() is False


def test_cpu_long_preset_doubles_the_demo_steps_and_keeps_its_phase_split():
    demo, long = (stage1_sft.parse_args(["--preset", name]) for name in ("cpu-table2", "cpu-long"))
    assert (demo.max_steps, long.max_steps) == (64, 128)
    assert (long.lr, long.batch_size, long.phase1_fraction, long.max_length) == (
        demo.lr,
        demo.batch_size,
        0.4,
        1536,
    )
    assert stage1_sft.parse_args(["--preset", "cpu-long", "--max-steps", "7"]).max_steps == 7


def test_micro_batches_give_the_whole_batchs_loss_and_gradient(tmp_path):
    """The demo trains its global batch of 4 as 2 micro-batches of 2 (less memory, same update):
    Eq. (3) is normalised by the target tokens of the whole global batch, so the accumulated
    gradient equals the one of 4 rows at once. Compared at lr 0 (the weights never move) on the
    logged loss and gradient norm of every step: fp32 sums of a few thousand terms in another
    order agree to about 1e-6 relative; rel 1e-4 leaves room for any CPU's kernels. A wrong
    normalisation (each micro-batch by its own tokens: a sum of two means, or their mean with
    unequal token counts, as here, rounds 3 to 6) is off by a factor of order 2."""
    data = write_records(tmp_path, [make_record(i, rounds=3 + i) for i in range(4)])
    common = ("--phase", "2", "--max-steps", "2", "--lr", "0", "--warmup-steps", "0")
    stage1_sft.train(run_args(data, tmp_path / "whole", *common, "--batch-size", "4", "--grad-accum", "1"))
    stage1_sft.train(run_args(data, tmp_path / "micro", *common, "--batch-size", "2", "--grad-accum", "2"))
    whole, micro = read_metrics(tmp_path / "whole"), read_metrics(tmp_path / "micro")
    assert len(whole) == len(micro) == 2
    for a, b in zip(whole, micro):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4) and a["grad_norm"] > 0
    demo = stage1_sft.parse_args(["--preset", "cpu-table2"])
    assert (demo.batch_size, demo.grad_accum) == (2, 2)  # the global batch of 4, in two parts


def test_numeric_flags_are_range_checked_with_one_line_naming_the_flag(capsys):
    """--lr -1 used to end in a torch traceback."""
    numeric = [a.option_strings for a in stage1_sft.build_parser()._actions if a.type in (int, float)]
    assert not numeric
    for flag, value in (
        ("--lr", "-1"),
        ("--batch-size", "0"),
        ("--phase1-fraction", "1.5"),
        ("--max-length", "0"),
    ):
        with pytest.raises(SystemExit):
            stage1_sft.parse_args([flag, value])
        assert f"argument {flag}: must be" in capsys.readouterr().err.splitlines()[-1]


def test_every_target_trains_on_the_same_records_in_the_same_batches(tiny):
    """Table 2's controls (w/o CoT, recall-only) must differ from SRT in what they learn to write
    and in nothing else: the same records, in the same order, in the same batches, behind the same
    prompts. Length grouping used to sort on prompt + target, so the answer-only control formed
    other batches (2 of 64 steps alike in the demo)."""
    tok = tiny[1]
    records = [make_record(i, rounds=3 + i % 7, recall=("Q1",) if i % 3 else ()) for i in range(40)]
    plans = {}
    for target in stage1_sft.TARGETS:
        data = stage1_sft.PhaseData(tok, records, 2, 1024, target, seed=3, global_batch=4, group_batches=4)
        steps = [data.batch_indices(step) for step in range(25)]  # more than one epoch of 10 batches
        plans[target] = [[(data.example(i)["id"], data.example(i)["prompt"]) for i in step] for step in steps]
    assert plans["full"] == plans["answer"] == plans["recall-only"]
    assert len({i for step in plans["full"] for i, _ in step}) == 40


def test_recall_only_target_keeps_the_his_tags_and_nothing_else_of_the_chain():
    from srt.prompt import NO_RECALL

    record = make_record(0, recall=("Q1", "A2"))
    target = format_target(record, recall_only=True)
    think = target.split("<think>\n")[1].split("\n</think>")[0]
    text = {t["label"]: t["text"] for t in record["history"]}
    assert think.splitlines() == [f"<HIS>Q1: {text['Q1']}</HIS>", f"<HIS>A2: {text['A2']}</HIS>"]
    assert target.endswith(f"</think>\nFinal answer: {record['answer']}")
    assert "Analyze" not in target and "Reasoning" not in target
    none_needed = make_record(1, recall=())
    assert format_target(none_needed, recall_only=True).startswith(f"<think>\n{NO_RECALL}\n</think>")
    assert stage1_sft.parse_args(["--no-cot"]).target == "answer"


def test_summary_states_the_answer_tokens_share_of_each_target(tmp_path):
    """Eq. (3) divides by the target tokens: an answer token weighs 1 / (target tokens), so the
    share tells how much more an answer token counts in a control than in SRT."""
    data = write_records(tmp_path, [make_record(i) for i in range(4)])
    shares = {}
    for target in ("full", "answer", "recall-only"):
        stage1_sft.train(run_args(data, tmp_path / target, "--max-steps", "1", "--target", target))
        shares[target] = json.loads((tmp_path / target / "summary.json").read_text())["answer_token_share"]
    assert shares["answer"] == 1.0 and 0 < shares["full"] < shares["recall-only"] < 1


def test_adamw_is_the_fused_kernel_with_the_loops_update():
    """srt.training.adamw: §4.1's AdamW in torch's fused kernel on a CPU (0.09 s a step on
    SmolLM2 against 0.31 s for the default loop, bench/sft_step.py), the same update as the loop to
    rounding: three steps with weight decay from equal weights and gradients agree to 1e-6 relative
    (fp32; one fused expression against a few separate ops: a few ulps a step). Swapped lr and
    weight decay, or decay left out, would be off by 1e-3 or more. FSDP's sharded parameters
    keep the loop."""
    from srt.training import adamw

    torch.manual_seed(0)
    start = [torch.randn(64, 32), torch.randn(32)]
    grads = [[torch.randn_like(p) for p in start] for _ in range(3)]
    params = {kind: [p.clone().requires_grad_() for p in start] for kind in ("ours", "loop")}
    ours = adamw(params["ours"], 1e-2, 0.1)
    loop = torch.optim.AdamW(params["loop"], lr=1e-2, weight_decay=0.1, foreach=False)
    assert (
        ours.defaults["fused"]
        and not adamw([torch.zeros(2, requires_grad=True)], 1e-3, 0.0, fsdp=True).defaults["fused"]
    )
    for step_grads in grads:
        for kind, optimizer in (("ours", ours), ("loop", loop)):
            for p, grad in zip(params[kind], step_grads):
                p.grad = grad.clone()
            optimizer.step()
    for a, b, p0 in zip(params["ours"], params["loop"], start):
        assert (a - p0).abs().max() > 1e-2  # the weights moved
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_a_second_run_in_one_process_checks_out_on_every_rank_before_any_rank_writes(tmp_path, monkeypatch):
    """torchrun made the ranks meet once (init_process_group); a second run in the same process (a
    test's driver, a notebook) must meet again after its --out checks, or a rank done early writes
    config.json before a slower rank checks --out, which then refuses it as an earlier run."""
    from srt import run as harness

    order = []
    monkeypatch.setattr(harness, "claim_out", lambda *a, **k: order.append("claim_out"))
    monkeypatch.setattr(harness, "setup_distributed", lambda *a, **k: (0, 2, 0, torch.device("cpu")))
    monkeypatch.setattr(harness.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(harness.dist, "barrier", lambda *a, **k: order.append("barrier"))
    cfg = run_args(write_records(tmp_path, [make_record(0)]), tmp_path / "out")
    run = harness.Run(cfg, "stage1_sft.py", stage1_sft.build_parser())
    assert order == ["claim_out", "barrier"] and run.world_size == 2
    assert not (tmp_path / "out").exists()  # nothing written before every rank has met
