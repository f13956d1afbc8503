"""FSDP (srt/distributed.py), micro-batched GRPO, chunked log-probs and the memory planner.

One torchrun launch (2 processes, gloo, CPU, fp32) runs every distributed check in FSDP_DRIVER and
leaves its results in files; the tests below read them. Why the comparisons are valid:

- stage 1: the global batch of a step is the same records whatever the rank count (PhaseData), and
  the loss is normalised by the global batch's target tokens, so 2 ranks x 1 row x 2 accumulation
  steps and 1 process x 4 rows must reach the same gradient. The tests compare that gradient (the
  one AdamW is handed, recorded on both sides: GRADIENTS) and its norm, and check that the weights
  FSDP exported are AdamW's step on its own gradient; not the two runs' weights after AdamW, whose
  first step lr * g / (|g| + eps) turns rounding on near-zero gradients into lr-sized differences
  (see GRAD_RTOL).
- stage 2: sampling cannot be made rank-count independent (each rank draws from its own stream),
  so grpo_step is compared on fixed rollouts: `generate` is replaced by a table of completions per
  prompt, rank r holds prompt r, the single process both. With one backprop minibatch
  (--sample-ratio 1), Eq. (9)'s mean over the 2 x K completions equals the mean over ranks of each
  rank's mean over its K (FSDP averages gradients), so the gradients of the mu = 2 updates (SGD
  between them), the frozen sharded pi_ref's KL and the old log-probs must all agree. The FSDP
  side also micro-batches (2 rows), the single process does not.
- resume: a run resumed from its sharded checkpoint has the layout of the straight run (same
  ranks, micro-batches and kernels, so every sum in the same order): weights and AdamW state agree
  to the last bit (measured), the tolerances are only a margin.
"""

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from grpo_records import run_step
from records import hand_record
from safetensors.torch import load_file

import stage1_sft
import stage2_grpo as g
from srt import generation, memory_plan
from srt.data_io import write_jsonl
from srt.loading import load_model_and_tokenizer
from srt.logprobs import token_logprobs
from srt.probe import evaluate_policy
from srt.run import resume_keys

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")

FSDP_DRIVER = r"""
import faulthandler, json, shutil, sys
faulthandler.dump_traceback_later(240, exit=True)  # a collective that never matches: fail with the stacks
from pathlib import Path
import torch, torch.distributed as dist
from safetensors.torch import save_file
import stage1_sft, stage2_grpo as g
from srt import distributed, generation, loading
tmp = Path(sys.argv[1])
exec(open(tmp / "gradients.py").read())
adamw, torch.optim.AdamW = torch.optim.AdamW, recording(torch.optim.AdamW)  # stage1_sft builds this one
s1 = ["--model", "tiny-random", "--data", str(tmp / "sft.jsonl"), "--dtype", "float32", "--phase", "2",
      "--lr", "1e-2", "--warmup-steps", "0", "--batch-size", "1", "--grad-accum", "2", "--save-every", "1",
      "--fsdp", "--gradient-checkpointing"]
sft = lambda *more: stage1_sft.train(stage1_sft.parse_args(s1 + list(more)))
sft("--out", str(tmp / "s1_a"), "--max-steps", "2", "--eval-limit", "2",
    "--eval-data", str(tmp / "sft.jsonl"), "--eval-max-new-tokens", "3")
model = sft("--out", str(tmp / "s1_b"), "--max-steps", "1")
grads = step_gradients(torch.optim.AdamW.made[-1], model)  # full tensors: every rank gathers
rank = dist.get_rank()
if rank == 0:
    shutil.copytree(tmp / "s1_b" / "final", tmp / "s1_b_step1")
    save_file(grads, tmp / "s1_grads.safetensors")
dist.barrier()
sft("--out", str(tmp / "s1_b"), "--max-steps", "2", "--resume")
# SmolLM2 ties lm_head to the embeddings: one parameter in the root unit, two names in final/.
tied = ["--model", str(tmp / "tied")] + s1[2:] + ["--out", str(tmp / "s1_tied"), "--max-steps", "1"]
model = stage1_sft.train(stage1_sft.parse_args(tied))
grads = step_gradients(torch.optim.AdamW.made[-1], model)
if rank == 0:
    save_file(grads, tmp / "tied_grads.safetensors")
torch.optim.AdamW = adamw

# Stage 2, grpo_step on fixed rollouts (see the test module's docstring).
exec(open(tmp / "fixed_rollouts.py").read())
g.generate = fixed_generate
cfg = g.parse_args(["--model", "tiny-random", "--dtype", "float32", "-K", "4", "--sample-ratio", "1",
                    "--mu", "2", "--lr", "1", "--beta", "0.04", "--micro-batch-size", "2", "--fsdp"])
policy, tok = loading.load_model_and_tokenizer("tiny-random", dtype="float32")
ref, _ = loading.load_model_and_tokenizer("tiny-random", dtype="float32")
ref.requires_grad_(False)
policy = distributed.shard_model(policy, torch.device("cpu"))
ref = distributed.shard_model(ref, torch.device("cpu"))
optimizer = recording(torch.optim.SGD)(policy.parameters(), lr=cfg.lr)  # SGD: see the test
models = g.Models(policy, tok, optimizer, ref_model=ref)
result = g.grpo_step(models, [None], [PROMPTS[rank]], g.StepSettings.of(cfg), toy_reward)
grads = {f"{i}.{k}": v for i in range(len(optimizer.gradients))
         for k, v in step_gradients(optimizer, policy, i).items()}
stats = g.gather_objects({k: getattr(result, k) for k in ("loss", "kl", "updates", "grad_norm")}, 2)
if rank == 0:
    save_file(grads, tmp / "grpo_grads.safetensors")
# What pi_ref holds on this rank after grpo_step's no-grad forwards: a DTensor's local shard, or the
# whole tensor where FSDP left the unit gathered.
def held(p):
    local = p.to_local() if hasattr(p, "to_local") else p
    size = local.numel() * local.element_size()
    return {"sharded": hasattr(p, "to_local"), "rows": local.shape[0], "bytes": size}
ref_held = g.gather_objects({name: held(p) for name, p in ref.named_parameters()}, 2)
if rank == 0:
    (tmp / "ref_held.json").write_text(json.dumps(ref_held))

# Rollouts with the weights gathered once: the same greedy text as the plain model, and no
# all-gather while decoding (each unit gathers once on entry).
g.generate = generation.generate
count = [0]
real = dist.all_gather_single
def counting(*a, **k):
    count[0] += 1
    return real(*a, **k)
dist.all_gather_single = counting
model, tok = loading.load_model_and_tokenizer("tiny-random", dtype="float32")
model = distributed.shard_model(model, torch.device("cpu"))
with distributed.full_weights(model):
    gathered = count[0]
    texts = generation.generate(model, tok, ["Hello", "Q1: What time is it?"], 12, greedy=True)["texts"]
    decoding = count[0] - gathered
count[0] = 0
per_step = generation.generate(model, tok, ["Hello"], 12, greedy=True)["texts"]
layer_by_layer = count[0]
dist.all_gather_single = real

# Sampled rollouts under the gather: which module the decode loop runs, in which mode, on which step.
# The ranks decode different numbers of steps, which a collective inside the loop would not survive.
from torch.distributed.fsdp import FSDPModule
from srt import decode
def hooks(module):
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in module.modules())
decoded_on, grouped_steps = [], [0]
real_decode, real_grouped = decode.decode, decode.GroupedStep.__init__
def spy_decode(module, *a, **k):
    decoded_on.append({"fsdp_units": sum(isinstance(m, FSDPModule) for m in module.modules()),
                       "hooks": hooks(module), "inference_mode": torch.is_inference_mode_enabled()})
    return real_decode(module, *a, **k)
def spy_grouped(self, *a, **k):
    grouped_steps[0] += 1
    real_grouped(self, *a, **k)
decode.decode, decode.GroupedStep.__init__ = spy_decode, spy_grouped
with distributed.full_weights(model):
    plain = decode.sampling_model(model, None)
    names = dict(model.named_parameters())
    aliased = all(p is names[n] for n, p in plain.named_parameters())
    torch.manual_seed(11 + rank)
    out = generation.generate(model, tok, SAMPLED_PROMPTS[rank], SAMPLED_TOKENS[rank], num_generations=4)
decode.decode, decode.GroupedStep.__init__ = real_decode, real_grouped
freed = all(p.untyped_storage().size() == 0 for p in plain.parameters())
ids, logprobs = out["completion_ids"].tolist(), out["sampler_logprobs"].tolist()
sampled = g.gather_objects({"ids": ids, "logprobs": logprobs,
                            "decoded_on": decoded_on, "grouped_steps": grouped_steps[0], "aliased": aliased,
                            "fsdp_hooks": hooks(model), "freed_after": freed}, 2)

# bf16 compute over fp32 masters (the GPU set-up), here on gloo: weights and gradients stay fp32.
model, tok = loading.load_model_and_tokenizer("tiny-random", dtype="float32")
model = distributed.shard_model(model, torch.device("cpu"), torch.bfloat16)
logits = model(input_ids=torch.tensor([tok("Hello there, how are you?").input_ids])).logits
logits.float().logsumexp(-1).mean().backward()
mixed = {"logits": str(logits.dtype), "weights": sorted({str(p.dtype) for p in model.parameters()}),
         "grads": sorted({str(p.grad.dtype) for p in model.parameters()})}
with distributed.full_weights(model):
    mixed["gathered"] = sorted({str(p.dtype) for p in model.parameters()})
    mixed["text"] = generation.generate(model, tok, ["Hello"], 4, greedy=True)["texts"]

# Stage 2's run under FSDP: sharded checkpoints, resume, final/ export, the evaluation path.
def length_reward(completions, examples):
    return [{"total": len(t) / 100.0} for t in completions]
s2 = ["--model", "tiny-random", "--data", str(tmp / "grpo.jsonl"), "--dtype", "float32", "-K", "4",
      "--max-new-tokens", "5", "--lr", "1e-2", "--warmup-steps", "0", "--sample-ratio", "2",
      "--save-every", "1", "--micro-batch-size", "1", "--seed", "3", "--fsdp", "--gradient-checkpointing",
      "--eval-data", str(tmp / "grpo.jsonl"), "--eval-limit", "2", "--eval-max-new-tokens", "3"]
grpo = lambda *more: g.train(g.parse_args(s2 + list(more)), reward_fn=length_reward)
grpo("--out", str(tmp / "s2_a"), "--max-steps", "2")
grpo("--out", str(tmp / "s2_b"), "--max-steps", "1")
grpo("--out", str(tmp / "s2_b"), "--max-steps", "2", "--resume")
if rank == 0:
    (tmp / "driver.json").write_text(json.dumps({"grpo_stats": stats, "greedy": texts,
        "decoding_gathers": decoding, "unit_gathers": gathered, "layer_by_layer_gathers": layer_by_layer,
        "per_step_text": per_step, "mixed": mixed, "sampled": sampled}))
# Both ranks past their last collective before either destroys the group: a rank that tears gloo
# down while the other still drains its last eval's collectives can abort at exit (seen once under
# a loaded CPU as "terminate called without an active exception", SIGABRT on rank 1).
dist.barrier()
distributed.teardown_distributed()
"""

# Fixed rollouts: 2 prompts x K = 4 completions of 5 tokens, stop tokens at different places.
ROLLOUTS = r"""
import torch
from srt import generation
PROMPTS = ["Hello", "Q1: What time is it?"]
SAMPLED_PROMPTS = [["Hello", "Q1: What time is it?"], ["A2: at noon", "Q3: and tomorrow?", "Hi"]]
SAMPLED_TOKENS = [6, 10]  # new tokens a row, per rank

def fixed_generate(model, tokenizer, prompts, num_generations=1, **_):
    stop = generation.stop_token_ids(model, tokenizer)[0]
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
    mask = generation.completion_mask(completion_ids, [stop])
    texts = [str(int(m.sum())) + "x" * int(c[0] % 7) for m, c in zip(mask, completion_ids)]
    return dict(prompt_ids=prompt_ids, prompt_mask=torch.ones_like(prompt_ids), completion_ids=completion_ids,
                completion_mask=mask, texts=texts)

def toy_reward(completions, examples):
    return [{"total": float(len(t))} for t in completions]
"""

# The gradients an optimizer is handed, recorded in the driver and in the one-process runs alike.
GRADIENTS = r"""
import torch

def recording(optimizer_class):
    '''`optimizer_class` that keeps the gradients of every step it takes (after clipping), full
    tensors also of FSDP's sharded ones (a collective: every rank steps), in parameter order.'''

    class Recording(optimizer_class):
        made = []  # every instance, oldest first

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.gradients = []
            Recording.made.append(self)

        def step(self, closure=None):
            full = lambda g: g.full_tensor() if hasattr(g, "full_tensor") else g.detach().clone()
            self.gradients.append([full(p.grad) for group in self.param_groups for p in group["params"]])
            return super().step(closure)

    return Recording

def step_gradients(optimizer, model, step=0):
    '''{name: gradient} of the optimizer's step `step` (0-based); `model` is the one it was built on.'''
    named = list(model.named_parameters())
    grads = optimizer.gradients[step]
    assert [tuple(p.shape) for _, p in named] == [tuple(g.shape) for g in grads]
    return {name: g.contiguous() for (name, _), g in zip(named, grads)}
"""


def gradient_tools():
    namespace = {}
    exec(GRADIENTS, namespace)
    return namespace["recording"], namespace["step_gradients"]


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
    (tmp / "gradients.py").write_text(GRADIENTS)
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


# Runs in another layout sum the same terms in another order (2 ranks x 2 micro-batches and a
# reduce-scatter vs one batch of 4; FSDP's micro-batches of 2 rows vs one pass; other vectorised
# kernels: ATEN_CPU_CAPABILITY, AVX-512, AMX), so they agree to rounding only, and a bound on the
# rounding holds only for quantities linear in the sums. AdamW's update is not: its first step is
# lr * g / (|g| + 1e-8), so on a coordinate whose gradient is near 1e-8 (terms that cancel) a 1e-9
# difference of g becomes one of order lr = 1e-2 in the weights. (The weights compared before:
# here 4.7e-5 apart against a tolerance of 5e-5 when the two runs used different
# ATEN_CPU_CAPABILITY; over it on an AMX Xeon.) So these tests compare what their claims are about:
# the gradients the optimizer is handed (GRPO's second update follows an SGD step, linear in the
# first gradient, so both sides start it as close as their first gradients are).
#
# The tolerance. A gradient entry ends a chain of fp32 sums: a weight's gradient sums outer
# products over the batch's positions (about 1,600 in stage 1, 88 in GRPO), and backprop reaches it
# through dot products of length <= 698 (vocabulary; hidden 64, intermediate 128) in 2 layers. A sum
# of n terms is off by at most (n - 1) u sum|terms| (u = 2^-24 = 6e-8, half of fp32's eps 1.2e-7),
# typically by sqrt(n) u sum|terms| (independent roundings add like a random walk): for n = 1,600,
# 2.4e-6 sum|terms|, so two orders differ by about 3.4e-6 of it, and a few such sums add up along
# the chain. sum|terms| is the entry's magnitude times its cancellation, bounded by a small multiple
# of the tensor's max |g|: about 1e-5 of max |g| at the worst entries. GRAD_RTOL = 3e-5 of the
# tensor's max |g| is 3x that, and 10x the largest difference measured (1e-6 of max |g| for one
# step, 3.2e-6 for GRPO's second update, 1e-7 on average; ATEN_CPU_CAPABILITY default, avx2, or
# the two mixed between the runs), yet far below a wrong implementation, which is off by a factor
# somewhere: one rank's loss weighted 1% off moves entries by 1e-2 of their size (measured:
# 1.7e-4 against 1.9e-6 allowed); so would a micro-batch weighted wrongly, ranks summed instead of
# averaged, a shard left out. GRAD_ATOL = 1e-10 is a floor for a gradient that is exactly 0 on both
# sides (every tensor's max |g| here is >= 8e-5). Clipping to norm 1 divides both gradients by their
# norms (sums of squares: no cancellation, so within GRAD_RTOL too), which hides a gradient off by
# the same factor everywhere (2x on every rank: measured, the old AdamW comparison passed it too);
# the norms are compared for that.
GRAD_RTOL, GRAD_ATOL = 3e-5, 1e-10


def assert_same_gradients(actual: dict, expected: dict, label: str) -> None:
    assert actual.keys() == expected.keys(), label
    for name, want in expected.items():
        scale = want.abs().max().item()
        assert scale > 1e-7, (label, name, scale)  # every tensor has a gradient worth comparing
        torch.testing.assert_close(
            actual[name],
            want,
            rtol=0,
            atol=GRAD_RTOL * scale + GRAD_ATOL,
            msg=lambda detail: f"{label}: {name}: {detail}",
        )


def assert_first_adamw_step(weights: dict, initial: dict, grads: dict, lr=1e-2, eps=1e-8) -> None:
    """`weights` are AdamW's first step (bias-corrected: m / sqrt(v) = g / |g|; no weight decay) from
    `initial` on `grads`, computed in float64. Elementwise, no sum: only roundings, of the weight
    (once in torch, once here: 2 eps relative, |w| <= 1.01) and of torch's step (measured: <= 3.4e-6
    of lr with either capability, 1e-5 allowed)."""
    assert weights.keys() == grads.keys()
    for name, grad in grads.items():
        g = grad.double()
        stepped = (initial[name].double() - lr * g / (g.abs() + eps)).float()
        torch.testing.assert_close(
            weights[name], stepped, rtol=2.4e-7, atol=1e-5 * lr, msg=lambda detail: f"{name}: {detail}"
        )


def first_metric(folder, key):
    """`key` of step 1 in a run's metrics.jsonl."""
    lines = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return next(line[key] for line in lines if line["step"] == 1)


def stage1_one_process(model, tmp, out, monkeypatch):
    """The one-process run of the FSDP run's first step: 1 process x 4 rows, no accumulation.
    -> (trained model, {name: gradient of its step})."""
    recording, step_gradients = gradient_tools()
    monkeypatch.setattr(torch.optim, "AdamW", recording(torch.optim.AdamW))  # the one stage1_sft builds
    args = ["--model", model, "--data", str(tmp / "sft.jsonl"), "--out", str(out), "--dtype", "float32"]
    args += ["--phase", "2", "--max-steps", "1", "--lr", "1e-2", "--warmup-steps", "0", "--batch-size", "4"]
    single = stage1_sft.train(stage1_sft.parse_args(args))
    (optimizer,) = [o for o in torch.optim.AdamW.made if o.gradients]
    return single, step_gradients(optimizer, single)


def test_fsdp_sft_step_equals_one_process_on_the_same_global_batch(fsdp_run, tmp_path, monkeypatch):
    tmp, _, stdout = fsdp_run
    assert "memory plan per GPU: stage 1 (SFT), tiny-random" in stdout and "FSDP over 2 GPU(s)" in stdout
    _, expected = stage1_one_process("tiny-random", tmp, tmp_path / "one", monkeypatch)
    fsdp_grads = load_file(tmp / "s1_grads.safetensors")
    assert_same_gradients(fsdp_grads, expected, "FSDP vs one process")
    norm = first_metric(tmp_path / "one", "grad_norm")
    assert first_metric(tmp / "s1_b", "grad_norm") == pytest.approx(norm, rel=GRAD_RTOL)
    # The weights FSDP exported (an ordinary save_pretrained folder) are AdamW's step on its own gradient.
    initial = load_model_and_tokenizer("tiny-random", dtype="float32")[0].state_dict()
    assert_first_adamw_step(load_file(tmp / "s1_b_step1" / "model.safetensors"), initial, fsdp_grads)


def test_tied_embeddings_under_fsdp_equal_one_process(fsdp_run, tmp_path, monkeypatch):
    tmp, _, _ = fsdp_run
    _, expected = stage1_one_process(str(tmp / "tied"), tmp, tmp_path / "one", monkeypatch)
    assert "lm_head.weight" not in expected  # one parameter: the embedding's and lm_head's gradients summed
    fsdp_grads = load_file(tmp / "tied_grads.safetensors")
    assert_same_gradients(fsdp_grads, expected, "tied, FSDP vs one process")
    norm = first_metric(tmp_path / "one", "grad_norm")
    assert first_metric(tmp / "s1_tied", "grad_norm") == pytest.approx(norm, rel=GRAD_RTOL)
    reloaded, _ = load_model_and_tokenizer(str(tmp / "s1_tied" / "final"))
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight  # still tied after the export
    initial = dict(load_model_and_tokenizer(str(tmp / "tied"))[0].named_parameters())
    assert_first_adamw_step(dict(reloaded.named_parameters()), initial, fsdp_grads)  # as exported


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
    monkeypatch.setattr(g, "generate", rollouts["fixed_generate"])
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
            "1",
            "--beta",
            "0.04",
            "--no-share-prompts",
        ]
    )
    policy, tok = load_model_and_tokenizer("tiny-random", dtype="float32")
    ref, _ = load_model_and_tokenizer("tiny-random", dtype="float32")
    # SGD (lr 1, on gradients clipped to norm 1), in the driver too: the second pass's weights are
    # linear in the first gradient, so the two sides start it as close as their first gradients
    # (1e-7), not AdamW's lr apart on near-zero coordinates; and it moves the policy further than
    # AdamW at 1e-2 (ratios off 1, some clipped), so the second pass is a real off-policy one.
    recording, step_gradients = gradient_tools()
    optimizer = recording(torch.optim.SGD)(policy.parameters(), lr=cfg.lr)
    single = run_step(
        policy, ref, tok, optimizer, [None, None], rollouts["PROMPTS"], cfg, reward_fn=rollouts["toy_reward"]
    )
    assert single.updates == 2 and [r["updates"] for r in result["grpo_stats"]] == [2, 2]
    assert single.clip_fraction > 0.1 and abs(single.ratio - 1) > 1e-2  # the 2nd pass is off-policy
    fsdp_grads = load_file(tmp / "grpo_grads.safetensors")
    for step in range(2):  # the 1st pass on pi_old = pi_theta; the 2nd on old log-probs, after a step
        prefix = f"{step}."
        fsdp = {k[len(prefix) :]: v for k, v in fsdp_grads.items() if k.startswith(prefix)}
        assert_same_gradients(fsdp, step_gradients(optimizer, policy, step), f"GRPO update {step + 1}")
    # The global loss and KL are the means of the ranks' (equal numbers of completions each); the
    # gradient norm (before clipping, mean of the 2 updates) is the global one on every rank.
    assert sum(r["loss"] for r in result["grpo_stats"]) / 2 == pytest.approx(single.loss, abs=1e-5)
    assert sum(r["kl"] for r in result["grpo_stats"]) / 2 == pytest.approx(single.kl, rel=1e-3, abs=1e-9)
    for r in result["grpo_stats"]:
        assert r["grad_norm"] == pytest.approx(single.grad_norm, rel=GRAD_RTOL)


def test_frozen_pi_ref_reshards_its_root_after_a_forward_as_the_plan_budgets(fsdp_run, tiny):
    """pi_ref never runs a backward, which is where FSDP2 reshards a root unit it left gathered after
    the forward. After grpo_step's no-grad pi_ref forwards every parameter of pi_ref, the root's
    (embeddings, final norm, lm_head) included, must be a DTensor holding its local shard, and what
    a rank holds must be what memory_plan.py budgets for pi_ref: 1/N of it. (Left gathered, the root
    alone is 2 x 152064 x 3584 bf16 numbers for Qwen2.5-7B: 1.9 GB a GPU over the plan on 8.)"""
    tmp, _, _ = fsdp_run
    ranks = json.loads((tmp / "ref_held.json").read_text())
    model, _ = tiny
    full = dict(model.named_parameters())
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        for held in ranks:
            assert held[name]["sharded"] and held[name]["rows"] < full[name].shape[0], (name, held[name])
    for name, p in full.items():  # the shards of each parameter add up to it, once
        assert all(held[name]["sharded"] for held in ranks), name
        assert sum(held[name]["rows"] for held in ranks) == p.shape[0], name
    # The driver's stage 2 settings, in the planner's terms (as the run prints its plan).
    cfg = g.parse_args(
        ["--model", "tiny-random", "--dtype", "float32", "-K", "4", "--sample-ratio", "1", "--mu", "2",
         "--beta", "0.04", "--micro-batch-size", "2", "--fsdp"]
    )  # fmt: skip
    shape = memory_plan.shape_from_config(model.config.to_dict())
    planned = memory_plan.plan(shape, memory_plan.stage_run("grpo", cfg, 2))["reference"]
    assert planned == 4 * shape.parameters() / 2  # fp32 here (the CPU tests), sharded over 2 ranks
    for held in ranks:  # a rank's shards: half of each tensor's rows, the first rank the odd one more
        assert sum(h["bytes"] for h in held.values()) == pytest.approx(planned, rel=0.01)


def test_rollouts_gather_the_weights_once_not_at_every_decode_step(fsdp_run, tiny):
    _, result, _ = fsdp_run
    model, tok = tiny
    assert result["unit_gathers"] == 3  # two decoder layers and the root, one all-gather each
    assert result["decoding_gathers"] == 0
    # What FSDP does without full_weights: the root once (it stays gathered after its forward),
    # each layer again at every one of the 12 decode steps.
    assert result["layer_by_layer_gathers"] == 1 + 2 * 12
    plain = generation.generate(model, tok, ["Hello", "Q1: What time is it?"], 12, greedy=True)["texts"]
    assert result["greedy"] == plain and result["per_step_text"] == plain[:1]


def test_fsdp_rollouts_decode_on_a_plain_module_and_sample_what_the_plain_model_samples(fsdp_run, tiny):
    """Inside full_weights the decode loop runs on the gathered tensors themselves (no copy), as a
    module without FSDP's hooks, in inference mode and with the grouped step, as without FSDP; with
    the same seed it draws the same tokens with the same log-probabilities as the plain model. Rank 1
    decodes more steps than rank 0: nothing in the loop waits for the other rank. Outside the
    gather the plain module holds no memory (FSDP freed the storage it points at)."""
    namespace = {}
    exec(ROLLOUTS, namespace)
    model, tok = tiny
    for rank, got in enumerate(fsdp_run[1]["sampled"]):
        assert got["decoded_on"] == [{"fsdp_units": 0, "hooks": 0, "inference_mode": True}]
        assert got["grouped_steps"] == 1 and got["fsdp_hooks"] > 0
        assert got["aliased"] and got["freed_after"]
        torch.manual_seed(11 + rank)
        prompts, tokens = namespace["SAMPLED_PROMPTS"][rank], namespace["SAMPLED_TOKENS"][rank]
        want = generation.generate(model, tok, prompts, tokens, num_generations=4)
        assert got["ids"] == want["completion_ids"].tolist()
        torch.testing.assert_close(torch.tensor(got["logprobs"]), want["sampler_logprobs"], rtol=0, atol=1e-6)


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
    from srt.probe import merge_probes

    model, tok = tiny
    records = [hand_record(i, 3, ("A1",), (), price=10 + i) for i in range(3)]

    def reward(completions, examples):
        return [{"total": len(t) / 10, "format": float(len(t) % 2), "jaccard": 0.5} for t in completions]

    def probe(rs):
        return evaluate_policy(model, tok, rs, reward, 4, 2, progress=False)

    whole, merged = probe(records), merge_probes([probe(records[0::2]), probe(records[1::2]), probe([])])
    for key in ("total", "format", "jaccard"):
        assert merged[key] == pytest.approx(whole[key]), key
    assert (merged["n"], merged["skipped"], merged["gold_turns_cut"]) == (3, 0, 0) and len(
        merged["examples"]
    ) == 3


# ---------------------------------------------------------------------------------------------
# One process: micro-batches, chunked log-probs, the planner
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_micro_batched_grpo_step_equals_the_unbatched_one(monkeypatch, loss_type):
    rollouts = fixed_rollouts()
    monkeypatch.setattr(g, "generate", rollouts["fixed_generate"])
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
                "--loss-type",
                loss_type,
                "--max-new-tokens",  # fixed_generate's length: dr_grpo's normaliser B * 5, not B * 256
                "5",
                "--micro-batch-size",
                micro,
            ]
        )
        policy, tok = load_model_and_tokenizer("tiny-random", dtype="float32")
        ref, _ = load_model_and_tokenizer("tiny-random", dtype="float32")
        # SGD: the update is the gradient itself. (AdamW divides by sqrt(v), which turns float
        # rounding on coordinates whose gradient is near 0 into visible differences.)
        optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)
        result = run_step(
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
        assert getattr(b, key) == pytest.approx(getattr(a, key), rel=1e-4, abs=1e-7), key


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_chunked_logprobs_equal_the_plain_ones_with_their_gradient(temperature):
    """Against log_softmax in float64, values and gradient, at T = 1 (SFT) and T = 0.7 (GRPO's
    sampling temperature)."""
    torch.manual_seed(0)
    logits = (torch.randn(3, 7, 50) * 3).requires_grad_()
    targets = torch.randint(0, 50, (3, 7))
    logp, entropy = token_logprobs(logits, targets, temperature=temperature, chunk_size=3, with_entropy=True)
    plain_all = (logits.double() / temperature).log_softmax(-1)
    plain = plain_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(logp.double(), plain, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy.double(), -(plain_all.exp() * plain_all).sum(-1), rtol=0, atol=1e-5)
    weights = torch.randn(3, 7)
    (grad,) = torch.autograd.grad((logp * weights).sum(), logits)
    (plain_grad,) = torch.autograd.grad((plain * weights.double()).sum(), logits)
    torch.testing.assert_close(grad, plain_grad.float(), rtol=0, atol=1e-5)
    assert token_logprobs(logits.bfloat16(), targets)[0].dtype == torch.float32


def test_suppressed_tokens_leave_the_softmax_of_the_scored_logprobs():
    """A token the sampler never draws is out of the normaliser: the others' log-probs are those of
    the softmax over the rest, and a suppressed target scores -inf."""
    torch.manual_seed(1)
    logits = torch.randn(2, 5, 20)
    targets = torch.randint(1, 20, (2, 5))
    targets[1, 4] = 0
    suppress = torch.tensor([0, 7])
    logp, _ = token_logprobs(logits, targets, temperature=0.9, chunk_size=2, suppress=suppress)
    kept = logits.double() / 0.9
    kept[..., suppress] = float("-inf")
    expected = kept.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(logp.double(), expected, rtol=0, atol=1e-5)
    assert logp[1, 4] == float("-inf")


def test_planner_against_a_hand_computation(tmp_path):
    shape = memory_plan.Shape(
        hidden=8, layers=2, heads=2, kv_heads=1, intermediate=16, vocab=32, tied=False, grouped_decode=True
    )
    # A layer: q 8x8, k and v 8x4 (1 KV head of dim 4), o 8x8, MLP 3 x 8x16, 2 norms of 8.
    layer = 64 + 32 + 32 + 64 + 3 * 128 + 16
    assert shape.layer_parameters() == layer == 592
    assert shape.root_parameters() == 2 * 32 * 8 + 8 == 520 and shape.parameters() == 2 * 592 + 520 == 1704
    # GRPO under FSDP on 2 GPUs: 2 prompts x K = 3 rows of 7 prompt + 3 new tokens, micro-batches of
    # 2 rows, the loss on 4 logits a row (3 new tokens scored, the last predicting nothing).
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
        group_size=3,
        new_tokens=3,
    )
    p = memory_plan.plan(shape, run)
    P = 1704
    assert p["weights"] == p["gradients"] == 4 * P / 2 and p["adamw"] == 8 * P / 2 and p["ddp_buckets"] == 0
    assert p["reference"] == 2 * P / 2 and p["rollout_weights"] == 2 * P and p["sampling_copy"] == 0
    assert p["compute_copies"] == 2 * (520 + 2 * 592)
    # Grouped: each prompt's 7 positions once, then 3 new tokens for each of its 3 rows; x layers x
    # K,V x kv_dim x bf16.
    assert p["kv_cache"] == 2 * (7 + 3 * 3) * 2 * 2 * 4 * 2
    # 2 prompts x 7 tokens: 4 h + 3 I bf16 numbers a token, and a 7 x 7 mask as bool and bf16 bias.
    assert p["prefill"] == 2 * 7 * (2 * (4 * 8 + 3 * 16) + 3 * 7)
    assert p["sampling_logits"] == 6 * 32 * (2 + 4 + 4 + 8 + 8)
    per_token_layer = 8 * 8 + 2 * 4 + 4 * 16  # 136 numbers a token a layer
    # FSDP gathers bf16, so the residual stream (the checkpointed layer inputs) is bf16 too.
    assert p["activations"] == 2 * 10 * (2 * 8 * 2 + 2 * per_token_layer)
    # bf16 logits [2, 4, 32]; one chunk of 3 scored positions, in back-propagation as four fp32 copies.
    assert p["logits"] == 2 * 2 * 4 * 32 + 4 * (4 * 2 * 3 * 32)
    assert p["peak"] == p["weights"] + p["adamw"] + p["reference"] + max(
        p["kv_cache"] + p["prefill"] + p["rollout_weights"] + p["sampling_logits"],
        p["gradients"] + p["compute_copies"] + p["activations"] + p["logits"],
    )
    # Without FSDP under autocast: the rollouts' bf16 copy stays, the residual stream is fp32 (the
    # checkpointed inputs, and 4 h of the 8 h a layer keeps).
    plain = memory_plan.plan(shape, replace(run, world_size=1, fsdp=False))
    assert plain["sampling_copy"] == 2 * P and plain["reference"] == 4 * P
    assert plain["activations"] == 2 * 10 * (2 * 8 * 4 + 2 * per_token_layer + 2 * 4 * 8)
    assert plain["peak"] == 4 * P + 8 * P + 4 * P + 2 * P + plain["training"]
    ungrouped = memory_plan.plan(replace(shape, grouped_decode=False), run)
    assert ungrouped["kv_cache"] == 6 * 10 * 2 * 2 * 4 * 2  # every row: prompt + completion
    ddp = memory_plan.plan(shape, memory_plan.Run("sft", 2, False, "auto", False, 2, 10, 10))
    assert ddp["weights"] == 4 * P and ddp["ddp_buckets"] == 4 * P and ddp["compute_copies"] == 2 * P
    assert ddp["activations"] == 2 * 10 * 2 * (2 * per_token_layer + 2 * 4 * 8) and "kv_cache" not in ddp
    assert ddp["logits"] == 2 * 2 * 10 * 32 + 4 * (4 * 2 * 9 * 32) and "sampling_copy" not in ddp
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


@pytest.mark.parametrize("positions", [129, 1025])
def test_the_planned_logits_are_what_token_logprobs_holds_at_its_largest(positions):
    """memory_plan.logit_bytes against a count of the tensors alive (a dispatch mode sees each one
    made, a finalizer each one freed) over the loss's forward and backward: bf16 logits of a
    matmul, token_logprobs with the entropy, as the first pass of GRPO computes it. Within 3%: the
    hidden states and the weight's gradient are small beside the vocabulary here."""
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class LiveBytes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.live, self.peak, self.storages = 0, 0, set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.storages:
                    storage = t.untyped_storage()
                    key, size = storage.data_ptr(), storage.nbytes()
                    self.storages.add(key)
                    self.live += size
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self.free, key, size)
            return out

        def free(self, key, size):
            self.live -= size
            self.storages.discard(key)

    rows, vocab = 2, 1000
    hidden = torch.randn(rows, positions, 16, requires_grad=True)
    head = torch.randn(vocab, 16, requires_grad=True)
    targets = torch.randint(0, vocab, (rows, positions - 1))
    count = LiveBytes()
    with count:
        logits = hidden.bfloat16() @ head.bfloat16().T
        logprobs, _ = token_logprobs(logits[:, :-1], targets, with_entropy=True)
        logprobs.sum().backward()
    planned = memory_plan.logit_bytes(rows, positions, vocab, 2)
    assert planned == pytest.approx(count.peak, rel=0.03)


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
        "loss_type",
        "scale_rewards",
        "max_new_tokens",
        "max_prompt_length",
        "weight_decay",
        "max_grad_norm",
    } <= set(g.RESUME_MUST_MATCH)
    stage1_keys = set(resume_keys(stage1_sft.build_parser()))  # derived from the method's flag groups
    assert {
        "lr",
        "weight_decay",
        "max_grad_norm",
        "max_length",
        "target",
        "batch_size",
        "grad_accum",
    } <= stage1_keys
    for keys in (set(g.RESUME_MUST_MATCH), stage1_keys):  # the same update in parts or shards: free to change
        assert not {"micro_batch_size", "fsdp", "gradient_checkpointing"} & keys
        assert "dtype" in keys  # a bf16 step is another step than an fp32 one


def test_stage1_resume_keys_derived_from_its_groups_are_the_settings_of_a_step():
    # every flag of the paper's and the departures' groups, the run's model, data and seed; nothing
    # of scale (but the global batch's shape, the precision and the attention kernel) or logging; --no-cot
    # is an alias of --target
    assert set(resume_keys(stage1_sft.build_parser())) == {
        "data", "data_sha256", "seed", "phase", "phase1_fraction", "batch_size", "grad_accum", "world_size",
        "max_length", "target", "recall", "epochs", "lr", "warmup_steps", "weight_decay", "max_grad_norm",
        "model", "model_sha256", "dtype", "attention",
    }  # fmt: skip


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
