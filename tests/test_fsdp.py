"""FSDP (srt/distributed.py), micro-batched GRPO, chunked log-probs and the memory planner.

One torchrun launch (2 processes, gloo, CPU, fp32 so results compare exactly with one process)
runs every distributed check in FSDP_DRIVER and leaves its results in files; the tests below read
them. Why the comparisons are valid:

- stage 1: the global batch of a step is the same records whatever the rank count (PhaseData), and
  the loss is normalised by the global batch's target tokens, so 2 ranks x 1 row x 2 accumulation
  steps and 1 process x 4 rows must reach the same gradient, hence the same AdamW step.
- stage 2: sampling cannot be made rank-count independent (each rank draws from its own stream),
  so grpo_step is compared on fixed rollouts: `generate` is replaced by a table of completions per
  prompt, rank r holds prompt r, the single process both. With one backprop minibatch
  (--sample-ratio 1), Eq. (9)'s mean over the 2 x K completions equals the mean over ranks of each
  rank's mean over its K (FSDP averages gradients), so mu = 2 updates, the frozen sharded pi_ref's
  KL and the old log-probs must all agree. The FSDP side also micro-batches (2 rows), the single
  process does not.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from records import hand_record
from safetensors.torch import load_file

import stage1_sft
import stage2_grpo as g
from srt import memory_plan, modeling
from srt import rollouts as rollouts_module
from srt.data_io import write_jsonl
from srt.modeling import load_model_and_tokenizer, token_logprobs

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")

FSDP_DRIVER = r"""
import faulthandler, json, shutil, sys
faulthandler.dump_traceback_later(240, exit=True)  # a collective that never matches: fail with the stacks
from pathlib import Path
import torch, torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
import stage1_sft, stage2_grpo as g
from srt import distributed, modeling, rollouts
tmp = Path(sys.argv[1])
s1 = ["--model", "tiny-random", "--data", str(tmp / "sft.jsonl"), "--dtype", "float32", "--phase", "2",
      "--lr", "1e-2", "--warmup-steps", "0", "--batch-size", "1", "--grad-accum", "2", "--save-every", "1", "--fsdp",
      "--gradient-checkpointing"]
stage1_sft.train(stage1_sft.parse_args(s1 + ["--out", str(tmp / "s1_a"), "--max-steps", "2", "--eval-limit", "2",
                                             "--eval-data", str(tmp / "sft.jsonl"), "--eval-max-new-tokens", "3"]))
stage1_sft.train(stage1_sft.parse_args(s1 + ["--out", str(tmp / "s1_b"), "--max-steps", "1"]))
rank = dist.get_rank()
if rank == 0:
    shutil.copytree(tmp / "s1_b" / "final", tmp / "s1_b_step1")
dist.barrier()
stage1_sft.train(stage1_sft.parse_args(s1 + ["--out", str(tmp / "s1_b"), "--max-steps", "2", "--resume"]))
# SmolLM2 ties lm_head to the embeddings: one parameter in the root unit, two names in final/.
stage1_sft.train(stage1_sft.parse_args(s1[:1] + [str(tmp / "tied")] + s1[2:] + ["--out", str(tmp / "s1_tied"),
                                                                              "--max-steps", "1"]))

# Stage 2, grpo_step on fixed rollouts (see the test module's docstring).
exec(open(tmp / "fixed_rollouts.py").read())
rollouts.generate = fixed_generate
cfg = g.parse_args(["--model", "tiny-random", "--dtype", "float32", "-K", "4", "--sample-ratio", "1", "--mu", "2",
                    "--lr", "1e-2", "--beta", "0.04", "--micro-batch-size", "2", "--fsdp"])
policy, tok = modeling.load_model_and_tokenizer("tiny-random", dtype="float32")
ref, _ = modeling.load_model_and_tokenizer("tiny-random", dtype="float32")
ref.requires_grad_(False)
policy, ref = distributed.shard_model(policy, torch.device("cpu")), distributed.shard_model(ref, torch.device("cpu"))
optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=0.0)
result = g.grpo_step(policy, ref, tok, optimizer, [None], [PROMPTS[rank]], cfg, reward_fn=toy_reward)
full = get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
stats = g.gather_objects({k: result[k] for k in ("loss", "kl", "updates")}, 2)
if rank == 0:
    save_file({k: v.contiguous() for k, v in full.items()}, tmp / "grpo_fsdp.safetensors")

# Rollouts with the weights gathered once: the same greedy text as the plain model, and no
# all-gather while decoding (each unit gathers once on entry).
rollouts.generate = modeling.generate
count = [0]
real = dist.all_gather_single
def counting(*a, **k):
    count[0] += 1
    return real(*a, **k)
dist.all_gather_single = counting
model, tok = modeling.load_model_and_tokenizer("tiny-random", dtype="float32")
model = distributed.shard_model(model, torch.device("cpu"))
with distributed.full_weights(model):
    gathered = count[0]
    texts = modeling.generate(model, tok, ["Hello", "Q1: What time is it?"], 12, greedy=True)["texts"]
    decoding = count[0] - gathered
count[0] = 0
per_step = modeling.generate(model, tok, ["Hello"], 12, greedy=True)["texts"]
layer_by_layer = count[0]
dist.all_gather_single = real

# bf16 compute over fp32 masters (the GPU set-up), here on gloo: weights and gradients stay fp32.
model, tok = modeling.load_model_and_tokenizer("tiny-random", dtype="float32")
model = distributed.shard_model(model, torch.device("cpu"), torch.bfloat16)
logits = model(input_ids=torch.tensor([tok("Hello there, how are you?").input_ids])).logits
logits.float().logsumexp(-1).mean().backward()
mixed = {"logits": str(logits.dtype), "weights": sorted({str(p.dtype) for p in model.parameters()}),
         "grads": sorted({str(p.grad.dtype) for p in model.parameters()})}
with distributed.full_weights(model):
    mixed["gathered"] = sorted({str(p.dtype) for p in model.parameters()})
    mixed["text"] = modeling.generate(model, tok, ["Hello"], 4, greedy=True)["texts"]

# Stage 2's run under FSDP: sharded checkpoints, resume, final/ export, the evaluation path.
def length_reward(completions, examples):
    return [{"total": len(t) / 100.0} for t in completions]
s2 = ["--model", "tiny-random", "--data", str(tmp / "grpo.jsonl"), "--dtype", "float32", "-K", "4",
      "--max-new-tokens", "5", "--lr", "1e-2", "--warmup-steps", "0", "--sample-ratio", "2", "--save-every", "1",
      "--micro-batch-size", "1", "--seed", "3", "--fsdp", "--gradient-checkpointing", "--eval-data", str(tmp / "grpo.jsonl"),
      "--eval-limit", "2", "--eval-max-new-tokens", "3"]
g.train(g.parse_args(s2 + ["--out", str(tmp / "s2_a"), "--max-steps", "2"]), reward_fn=length_reward)
g.train(g.parse_args(s2 + ["--out", str(tmp / "s2_b"), "--max-steps", "1"]), reward_fn=length_reward)
g.train(g.parse_args(s2 + ["--out", str(tmp / "s2_b"), "--max-steps", "2", "--resume"]), reward_fn=length_reward)
if rank == 0:
    (tmp / "driver.json").write_text(json.dumps({"grpo_stats": stats, "greedy": texts, "decoding_gathers": decoding,
        "unit_gathers": gathered, "layer_by_layer_gathers": layer_by_layer, "per_step_text": per_step,
        "mixed": mixed}))
distributed.teardown_distributed()
"""

# Fixed rollouts: 2 prompts x K = 4 completions of 5 tokens, stop tokens at different places.
ROLLOUTS = r"""
import torch
from srt import modeling
PROMPTS = ["Hello", "Q1: What time is it?"]

def fixed_generate(model, tokenizer, prompts, num_generations=1, **_):
    stop = modeling.stop_token_ids(model, tokenizer)[0]
    parts = []
    for prompt in prompts:
        gen = torch.Generator().manual_seed(PROMPTS.index(prompt))
        prompt_ids = torch.randint(3, len(tokenizer), (1, 6), generator=gen).repeat(num_generations, 1)
        completion = torch.randint(3, len(tokenizer), (num_generations, 5), generator=gen)
        for k in range(num_generations):  # row k stops after k + 1 tokens (the last row never)
            if k + 1 < 5 and k < num_generations - 1:
                completion[k, k + 1] = stop
        parts.append((prompt_ids, completion))
    prompt_ids = torch.cat([p for p, _ in parts])
    completion_ids = torch.cat([c for _, c in parts])
    mask = modeling.completion_mask(completion_ids, [stop])
    return dict(prompt_ids=prompt_ids, prompt_mask=torch.ones_like(prompt_ids), completion_ids=completion_ids,
                completion_mask=mask, texts=[str(int(m.sum())) + "x" * int(c[0] % 7) for m, c in zip(mask, completion_ids)])

def toy_reward(completions, examples):
    return [{"total": float(len(t))} for t in completions]
"""


def write_tied_model(folder):
    """tiny-random with lm_head tied to the embeddings, as SmolLM2's, as a save_pretrained folder."""
    from transformers import LlamaForCausalLM

    model, tok = load_model_and_tokenizer("tiny-random", dtype="float32")
    config = model.config
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    tied = LlamaForCausalLM(config)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    tied.save_pretrained(folder)
    tok.save_pretrained(folder)


def sft_records():
    return [hand_record(i, 3 + i, ("Q1", "A2"), ("Q4",) if 3 + i >= 4 else ()) for i in range(4)]


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp")
    write_jsonl(tmp / "sft.jsonl", sft_records())
    write_jsonl(tmp / "grpo.jsonl", [hand_record(i, 4, ("A1",), (), price=10 + i) for i in range(4)])
    (tmp / "fixed_rollouts.py").write_text(ROLLOUTS)
    write_tied_model(tmp / "tied")
    (tmp / "driver.py").write_text(FSDP_DRIVER)
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(tmp / "driver.py"),
            str(tmp),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return tmp, json.loads((tmp / "driver.json").read_text()), proc.stdout


def dcp_state(folder, out):
    """A DCP checkpoint (sharded/) as one flat dict, read in this single process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(folder / "checkpoint" / "sharded"), str(out))
    state = torch.load(out, weights_only=True)
    flat = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(value, torch.Tensor):
            flat[prefix] = value

    walk("", state)
    return flat


def test_fsdp_sft_step_equals_one_process_on_the_same_global_batch(fsdp_run, tmp_path):
    tmp, _, stdout = fsdp_run
    assert "memory plan per GPU: stage 1 (SFT), tiny-random" in stdout and "FSDP over 2 GPU(s)" in stdout
    fsdp = load_file(tmp / "s1_b_step1" / "model.safetensors")  # an ordinary save_pretrained folder
    data = str(tmp / "sft.jsonl")
    single = stage1_sft.train(
        stage1_sft.parse_args(
            [
                "--model",
                "tiny-random",
                "--data",
                data,
                "--out",
                str(tmp_path / "one"),
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
                "--batch-size",
                "4",
            ]
        )
    )
    initial = load_model_and_tokenizer("tiny-random", dtype="float32")[0].state_dict()
    moved = 0
    for name, value in single.state_dict().items():
        # Adam's first step moves each weight by about lr = 1e-2: the updates agree to 1e-3 of that.
        torch.testing.assert_close(
            fsdp[name] - initial[name], value - initial[name], rtol=0, atol=1e-5, msg=name
        )
        moved += (value - initial[name]).abs().max().item() > 1e-3
    assert moved > 10


def test_tied_embeddings_under_fsdp_equal_one_process(fsdp_run, tmp_path):
    tmp, _, _ = fsdp_run
    single = stage1_sft.train(
        stage1_sft.parse_args(
            [
                "--model",
                str(tmp / "tied"),
                "--data",
                str(tmp / "sft.jsonl"),
                "--out",
                str(tmp_path / "one"),
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
                "--batch-size",
                "4",
            ]
        )
    )
    reloaded, _ = load_model_and_tokenizer(str(tmp / "s1_tied" / "final"))
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight  # still tied after the export
    initial = load_model_and_tokenizer(str(tmp / "tied"))[0].state_dict()
    for name, value in single.state_dict().items():
        # Adam's first step is lr * g / (|g| + 1e-8): where |g| is near 1e-8 the rounding of g (sums
        # in another order) shows; a few such coordinates, the rest agree to 1e-7.
        update = reloaded.state_dict()[name] - initial[name]
        torch.testing.assert_close(update, value - initial[name], rtol=0, atol=5e-5, msg=name)
        assert (update - (value - initial[name])).abs().mean() < 1e-7, name


def test_sharded_checkpoint_resumes_to_the_same_weights_and_adamw_state_and_exports_them(fsdp_run, tmp_path):
    tmp, _, _ = fsdp_run
    straight, resumed = dcp_state(tmp / "s1_a", tmp_path / "a.pt"), dcp_state(tmp / "s1_b", tmp_path / "b.pt")
    assert json.loads((tmp / "s1_b" / "checkpoint" / "trainer_state.json").read_text())["step"] == 2
    assert straight.keys() == resumed.keys()
    assert any("exp_avg_sq" in k for k in straight) and any(k.startswith("model.") for k in straight)
    for key in straight:
        torch.testing.assert_close(resumed[key], straight[key], rtol=1e-5, atol=1e-7, msg=key)
    for folder, state in (("s1_a", straight), ("s1_b", resumed)):
        final = load_file(tmp / folder / "final" / "model.safetensors")
        assert final.keys() == {k[len("model.") :] for k in state if k.startswith("model.")}
        for name, value in final.items():  # final/ holds exactly the checkpoint's weights
            assert torch.equal(value, state["model." + name]), name
    assert json.loads((tmp / "s1_a" / "eval_format.json").read_text())["n"] == 2  # rank 0 on gathered weights
    model, _ = load_model_and_tokenizer(str(tmp / "s1_a" / "final"))  # loads without FSDP
    assert not any(hasattr(p, "to_local") for p in model.parameters())
    # A sharded checkpoint is resumed with --fsdp only.
    with pytest.raises(SystemExit, match="written with --fsdp"):
        stage1_sft.train(
            stage1_sft.parse_args(
                [
                    "--model",
                    "tiny-random",
                    "--data",
                    str(tmp / "sft.jsonl"),
                    "--out",
                    str(tmp / "s1_a"),
                    "--dtype",
                    "float32",
                    "--phase",
                    "2",
                    "--lr",
                    "1e-2",
                    "--warmup-steps",
                    "0",
                    "--batch-size",
                    "1",
                    "--grad-accum",
                    "2",
                    "--max-steps",
                    "3",
                    "--resume",
                ]
            )
        )


def fixed_rollouts():
    namespace = {}
    exec(ROLLOUTS, namespace)
    return namespace


def test_fsdp_grpo_step_equals_one_process_on_fixed_rollouts(fsdp_run, monkeypatch):
    tmp, result, _ = fsdp_run
    rollouts = fixed_rollouts()
    monkeypatch.setattr(rollouts_module, "generate", rollouts["fixed_generate"])
    # FSDP runs each row's prompt in full (no prompt sharing through its hooks): so does the reference,
    # for the same sums in the same order (sharing itself is checked in test_stage2 to 1e-5).
    cfg = g.parse_args(
        [
            "--model",
            "tiny-random",
            "--dtype",
            "float32",
            "-K",
            "4",
            "--sample-ratio",
            "1",
            "--mu",
            "2",
            "--lr",
            "1e-2",
            "--beta",
            "0.04",
            "--no-share-prompts",
        ]
    )
    policy, tok = load_model_and_tokenizer("tiny-random", dtype="float32")
    ref, _ = load_model_and_tokenizer("tiny-random", dtype="float32")
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=0.0)
    single = g.grpo_step(
        policy, ref, tok, optimizer, [None, None], rollouts["PROMPTS"], cfg, reward_fn=rollouts["toy_reward"]
    )
    assert single["updates"] == 2 and [r["updates"] for r in result["grpo_stats"]] == [2, 2]
    fsdp = load_file(tmp / "grpo_fsdp.safetensors")
    initial = load_model_and_tokenizer("tiny-random", dtype="float32")[0].state_dict()
    for name, value in policy.state_dict().items():
        assert (value - initial[name]).abs().max() > 1e-3, name  # every tensor moved (two steps)
        # Two AdamW steps of about lr = 1e-2: the second divides by sqrt(v) of two gradients, which
        # magnifies rounding (fp32 sums in another order) on coordinates whose gradients nearly cancel.
        torch.testing.assert_close(
            fsdp[name] - initial[name], value - initial[name], rtol=0, atol=5e-5, msg=name
        )
        assert (fsdp[name] - value).abs().mean() < 1e-6, name
    # The global loss and KL are the means of the ranks' (equal numbers of completions each).
    assert sum(r["loss"] for r in result["grpo_stats"]) / 2 == pytest.approx(single["loss"], abs=1e-5)
    assert sum(r["kl"] for r in result["grpo_stats"]) / 2 == pytest.approx(single["kl"], rel=1e-3, abs=1e-9)


def test_rollouts_gather_the_weights_once_not_at_every_decode_step(fsdp_run, tiny):
    _, result, _ = fsdp_run
    model, tok = tiny
    assert result["unit_gathers"] == 3  # two decoder layers and the root, one all-gather each
    assert result["decoding_gathers"] == 0
    # What FSDP does without full_weights: the root once (it stays gathered after its forward),
    # each layer again at every one of the 12 decode steps.
    assert result["layer_by_layer_gathers"] == 1 + 2 * 12
    plain = modeling.generate(model, tok, ["Hello", "Q1: What time is it?"], 12, greedy=True)["texts"]
    assert result["greedy"] == plain and result["per_step_text"] == plain[:1]


def test_fsdp_grpo_run_resumes_and_exports_ordinary_weights(fsdp_run):
    tmp, _, _ = fsdp_run
    a, b = (
        load_file(tmp / "s2_a" / "final" / "model.safetensors"),
        load_file(tmp / "s2_b" / "final" / "model.safetensors"),
    )
    initial = load_model_and_tokenizer("tiny-random", dtype="float32")[0].state_dict()
    assert any(not torch.equal(a[k], initial[k]) for k in a)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)
    summary = json.loads((tmp / "s2_b" / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["world_size"] == 2 and summary["ranks_in_sync"] is None
    assert (tmp / "s2_a" / "checkpoint" / "sharded").is_dir()
    assert json.loads((tmp / "s2_a" / "eval_after.json").read_text())["n"] == 2  # one record per rank


def test_bf16_compute_over_fp32_masters_runs_on_gloo(fsdp_run):
    mixed = fsdp_run[1]["mixed"]
    assert mixed["logits"] == "torch.bfloat16" and mixed["gathered"] == ["torch.bfloat16"]
    assert mixed["weights"] == ["torch.float32"] and mixed["grads"] == ["torch.float32"]
    assert len(mixed["text"]) == 1


def test_probes_of_rank_slices_merge_into_the_whole(tiny):
    from srt.distributed import merge_probes

    model, tok = tiny
    records = [hand_record(i, 3, ("A1",), (), price=10 + i) for i in range(3)]
    reward = lambda completions, examples: [
        {"total": len(t) / 10, "format": float(len(t) % 2), "jaccard": 0.5} for t in completions
    ]
    probe = lambda rs: g.evaluate_policy(model, tok, rs, 4, 2, reward_fn=reward, progress=False)
    whole, merged = probe(records), merge_probes([probe(records[0::2]), probe(records[1::2]), probe([])])
    for key in ("total", "format", "jaccard"):
        assert merged[key] == pytest.approx(whole[key]), key
    assert (merged["n"], merged["skipped"], merged["gold_turns_cut"]) == (3, 0, 0) and len(
        merged["examples"]
    ) == 3


# ---------------------------------------------------------------------------------------------
# One process: micro-batches, chunked log-probs, the planner
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("loss_norm", ["seq", "token"])
def test_micro_batched_grpo_step_equals_the_unbatched_one(monkeypatch, loss_norm):
    rollouts = fixed_rollouts()
    monkeypatch.setattr(rollouts_module, "generate", rollouts["fixed_generate"])
    weights = {}
    for micro in ("0", "3"):  # 8 rows: one pass, or passes of 3, 3 and 2 rows
        cfg = g.parse_args(
            [
                "--model",
                "tiny-random",
                "--dtype",
                "float32",
                "-K",
                "4",
                "--sample-ratio",
                "1",
                "--mu",
                "2",
                "--lr",
                "1e-2",
                "--beta",
                "0.04",
                "--loss-norm",
                loss_norm,
                "--micro-batch-size",
                micro,
            ]
        )
        policy, tok = load_model_and_tokenizer("tiny-random", dtype="float32")
        ref, _ = load_model_and_tokenizer("tiny-random", dtype="float32")
        # SGD: the update is the gradient itself. (AdamW divides by sqrt(v), which turns float
        # rounding on coordinates whose gradient is near 0 into visible differences.)
        optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)
        result = g.grpo_step(
            policy,
            ref,
            tok,
            optimizer,
            [None, None],
            rollouts["PROMPTS"],
            cfg,
            reward_fn=rollouts["toy_reward"],
        )
        weights[micro] = (policy.state_dict(), result)
    (unbatched, a), (batched, b) = weights["0"], weights["3"]
    initial = load_model_and_tokenizer("tiny-random", dtype="float32")[0].state_dict()
    for name in unbatched:
        assert (unbatched[name] - initial[name]).abs().max() > 1e-4, name
        torch.testing.assert_close(batched[name], unbatched[name], rtol=0, atol=1e-6, msg=name)
    for key in ("loss", "grad_norm", "kl", "entropy", "ratio"):
        assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-7), key


def test_chunked_logprobs_equal_the_plain_ones_with_their_gradient():
    torch.manual_seed(0)
    logits = (torch.randn(3, 7, 50) * 3).requires_grad_()
    targets = torch.randint(0, 50, (3, 7))
    logp, entropy = token_logprobs(logits, targets, temperature=0.7, chunk_size=3, with_entropy=True)
    plain_all = (logits.double() / 0.7).log_softmax(-1)
    plain = plain_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(logp.double(), plain, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy.double(), -(plain_all.exp() * plain_all).sum(-1), rtol=0, atol=1e-5)
    weights = torch.randn(3, 7)
    (grad,) = torch.autograd.grad((logp * weights).sum(), logits)
    (plain_grad,) = torch.autograd.grad((plain * weights.double()).sum(), logits)
    torch.testing.assert_close(grad, plain_grad.float(), rtol=0, atol=1e-5)
    assert token_logprobs(logits.bfloat16(), targets)[0].dtype == torch.float32


def test_planner_against_a_hand_computation(tmp_path):
    shape = memory_plan.Shape(hidden=8, layers=2, heads=2, kv_heads=1, intermediate=16, vocab=32, tied=False)
    # A layer: q 8x8, k and v 8x4 (1 KV head of dim 4), o 8x8, MLP 3 x 8x16, 2 norms of 8.
    layer = 64 + 32 + 32 + 64 + 3 * 128 + 16
    assert shape.layer_parameters() == layer == 592
    assert shape.root_parameters() == 2 * 32 * 8 + 8 == 520 and shape.parameters() == 2 * 592 + 520 == 1704
    run = memory_plan.Run(
        "grpo",
        world_size=2,
        fsdp=True,
        dtype="auto",
        gradient_checkpointing=True,
        micro_rows=2,
        tokens=10,
        loss_positions=4,
        rollouts=6,
        with_reference=True,
    )
    p = memory_plan.plan(shape, run)
    P = 1704
    assert p["weights"] == p["gradients"] == 4 * P / 2 and p["adamw"] == 8 * P / 2 and p["ddp_buckets"] == 0
    assert p["reference"] == 2 * P / 2 and p["rollout_weights"] == 2 * P
    assert p["compute_copies"] == 2 * (520 + 2 * 592)
    assert p["kv_cache"] == 6 * 10 * 2 * 2 * 1 * 4 * 2  # rollouts x tokens x layers x K,V x kv_dim x bf16
    per_token_layer = 8 * 8 + 2 * 4 + 4 * 16  # 136 numbers a token a layer
    assert p["activations"] == 2 * 2 * 10 * (2 * 8 + per_token_layer)
    assert p["logits"] == 2 * 32 * (2 * 2 * 4 + 2 * 4 * 256)
    assert p["peak"] == p["weights"] + p["adamw"] + p["reference"] + max(
        p["kv_cache"] + p["rollout_weights"] + 6 * 32 * 4,
        p["gradients"] + p["compute_copies"] + p["activations"] + p["logits"],
    )
    ddp = memory_plan.plan(shape, memory_plan.Run("sft", 2, False, "auto", False, 2, 10, 10))
    assert ddp["weights"] == 4 * P and ddp["ddp_buckets"] == 4 * P and ddp["compute_copies"] == 2 * P
    assert ddp["activations"] == 2 * 2 * 10 * 2 * per_token_layer and "kv_cache" not in ddp
    # Published shapes: Qwen2.5-7B has 7.62 B parameters, SmolLM2-135M 135 M (tied embeddings).
    assert memory_plan.QWEN25_7B.parameters() == 7_615_616_512
    assert memory_plan.SMOLLM2_135M.parameters() == 134_515_008
    # A local folder's config.json, offline (Qwen2.5-7B-Instruct's, as published).
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "qwen2",
                "hidden_size": 3584,
                "num_hidden_layers": 28,
                "num_attention_heads": 28,
                "num_key_value_heads": 4,
                "intermediate_size": 18944,
                "vocab_size": 152064,
                "tie_word_embeddings": False,
            }
        )
    )
    assert memory_plan.model_shape(str(tmp_path)) == memory_plan.QWEN25_7B


def test_resume_check_covers_every_setting_of_the_objective():
    assert {
        "num_generations",
        "sample_ratio",
        "mu",
        "lr",
        "beta",
        "temperature",
        "top_p",
        "clip_eps",
        "loss_norm",
        "max_new_tokens",
        "max_prompt_length",
        "weight_decay",
        "max_grad_norm",
    } <= set(g.RESUME_MUST_MATCH)
    assert {"lr", "weight_decay", "max_grad_norm", "max_length", "no_cot", "batch_size", "grad_accum"} <= set(
        stage1_sft.RESUME_MUST_MATCH
    )
    for module in (g, stage1_sft):  # the same update computed in parts or in shards: free to change
        assert not {"micro_batch_size", "fsdp", "gradient_checkpointing", "dtype"} & set(
            module.RESUME_MUST_MATCH
        )


def test_dry_run_of_the_paper_configuration_fits_with_fsdp_and_warns_without(capsys):
    g.main(
        [
            "--preset",
            "paper",
            "--model",
            "Qwen/Qwen2.5-7B-Instruct",
            "--fsdp",
            "--dry-run",
            "--world-size",
            "8",
        ]
    )
    out = capsys.readouterr().out
    assert (
        "7.62 B parameters" in out and "FSDP over 8 GPU(s)" in out and "fits:" in out and "WARNING" not in out
    )
    g.main(["--preset", "paper", "--model", "Qwen/Qwen2.5-7B-Instruct", "--dry-run", "--world-size", "8"])
    out = capsys.readouterr().out
    assert "WARNING: does not fit" in out and "with --fsdp it fits" in out
    stage1_sft.main(
        [
            "--preset",
            "paper",
            "--model",
            "Qwen/Qwen2.5-7B-Instruct",
            "--fsdp",
            "--dry-run",
            "--world-size",
            "8",
        ]
    )
    assert "fits:" in capsys.readouterr().out
