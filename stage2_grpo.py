"""Stage 2 of SRT: recall-reasoning alignment with GRPO (paper §3.4, Eqs. (8)-(9)), in plain PyTorch.

One GRPO step, in the order of the paper:

    for each prompt P(Q_t, C_t): sample K completions tau^(k) from pi_old       (one batched generate)
    score them with the verifiable reward R = format + recall + answer          (reward.py, Eqs. (4)-(7))
    Eq. (8): group-relative advantage  A~(k) = (R(k) - mean R) / (std R + 1e-8)
    log-probs of pi_old (once per sample batch) and of the frozen pi_ref = the SFT model
    split the sample batch into backprop minibatches (sample/backprop ratio 4, §4.1), `mu` passes:
        Eq. (9): r = pi_theta / pi_old per token, clipped surrogate min(r A, clip(r, 1-eps, 1+eps) A),
                 averaged over each completion's tokens and over the group, minus beta * KL(pi_theta||pi_ref)
        AdamW step (constant learning rate after a linear warm-up, §4.1)

Run on one CPU or GPU, or on N of them with torchrun (each rank samples and scores its own prompts,
DDP all-reduces the gradients, rank 0 alone logs and saves):

    python stage2_grpo.py --model runs/demo/sft/final --data runs/data/train.jsonl --out runs/demo/grpo \\
        --preset cpu-demo --eval-data runs/data/dev.jsonl
    torchrun --nproc_per_node=8 stage2_grpo.py --model runs/paper/sft/final --data ... --preset paper

Outputs under --out: config.json, metrics.jsonl (one line per step), samples.jsonl (what the policy
writes as it learns), checkpoint/ (resumable: weights, tokenizer, trainer_state.pt), final/ (weights
and tokenizer), eval_before.json / eval_after.json (with --eval-data), summary.json.

Run `python stage2_grpo.py --help`.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from reward import compute_rewards
from stage0_build import DataError, read_jsonl, render_prompt, write_json, write_jsonl
from modeling import autocast, load_model_and_tokenizer, resolve_dtype, setup_distributed

# --------------------------------------------------------------------------------------------
# Configuration: working defaults, two presets, explicit flags win over both.
# --------------------------------------------------------------------------------------------
DEFAULTS = dict(
    model="runs/demo/sft/final", data="runs/data/train.jsonl", out="runs/demo/grpo", seed=0, resume=False,
    max_steps=100,               # GRPO steps; each is one sample batch and mu * sample_ratio AdamW updates
    prompts_per_step=1,          # prompts per rank per step; each gives one group of K completions
    num_generations=8,           # K, the rollout size of §4.1
    temperature=1.0, top_p=1.0, max_new_tokens=256, max_prompt_length=1024,
    lr=1e-6, warmup_steps=2, weight_decay=0.0, max_grad_norm=1.0,
    beta=0.04,                   # KL weight; the paper uses a KL term but does not print beta
    clip_eps=0.2, mu=1, loss_norm="seq",
    sample_ratio=4,              # sample batch / backprop minibatch (§4.1)
    dtype="auto", gradient_checkpointing=False,
    sample_every=5, save_every=10, time_budget_minutes=None,
    eval_data=None, eval_limit=40, eval_batch_size=8, eval_max_new_tokens=None,
)
PRESETS = {
    # §4.1 where the paper gives a value (lr 3e-7, K = 8, ratio 4, AdamW, KL to the SFT policy);
    # the rest is ours, sized for 8 x A100-80GB.
    "paper": dict(lr=3e-7, num_generations=8, sample_ratio=4, beta=0.04, clip_eps=0.2, mu=1,
                  prompts_per_step=8, max_new_tokens=1024, max_prompt_length=4096, warmup_steps=10,
                  max_steps=1000, save_every=50, sample_every=10, dtype="auto", gradient_checkpointing=True),
    # SmolLM2-135M after SFT on an idle 2-core CPU, evaluation before and after included: one group
    # of 4 a step (about 25 s under bf16 autocast on an AMX CPU: ~12 s generating, ~12 s training;
    # twice that in fp32), two AdamW updates per group. The time budget ends the run. Learning rate
    # chosen on 40 dev queries after the 90-step SFT (Jaccard / F1: SFT 38.1% / 75.8): lr 1e-5 drifts
    # (39.0% / 64.8, K = 8: 33.9% / 67.1), lr 3e-6 recalls better (47.3% / 68.7).
    "cpu-demo": dict(num_generations=4, prompts_per_step=1, sample_ratio=2, mu=1, lr=3e-6, warmup_steps=1,
                     beta=0.04, max_new_tokens=160, max_prompt_length=700, gradient_checkpointing=False,
                     max_steps=40, sample_every=1, save_every=4, time_budget_minutes=19.0,
                     eval_limit=40, eval_batch_size=8, dtype="auto"),
}


def build_parser() -> argparse.ArgumentParser:
    d = DEFAULTS
    p = argparse.ArgumentParser(description="Stage 2 of SRT: GRPO with the verifiable recall reward (§3.4).",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--model", help=f"the SFT policy to start from; also the frozen KL reference (default {d['model']})")
    add("--data", help=f"training records, JSONL (default {d['data']})")
    add("--out", help=f"output folder (default {d['out']})")
    add("--seed", type=int, help=f"(default {d['seed']})")
    add("--preset", choices=sorted(PRESETS), help="paper (§4.1) or cpu-demo (a 2-core laptop, ~20 min)")
    add("--resume", action="store_true", default=None,
        help="continue from <out>/checkpoint (policy, optimizer, step, RNG, data position); "
             "without one, start from scratch; a finished run is left as it is")
    add("--max-steps", type=int, help=f"stop after N GRPO steps (default {d['max_steps']})")
    add("--num-generations", "-K", type=int, help=f"K completions per prompt (default {d['num_generations']})")
    add("--prompts-per-step", type=int, help=f"prompts per rank per step (default {d['prompts_per_step']})")
    add("--temperature", type=float, help=f"sampling temperature (default {d['temperature']})")
    add("--top-p", type=float, help=f"nucleus sampling (default {d['top_p']})")
    add("--max-new-tokens", type=int, help=f"completion length cap (default {d['max_new_tokens']})")
    add("--max-prompt-length", type=int,
        help=f"prompt tokens; a longer prompt is re-rendered with the pruned + recent turns, then "
             f"skipped (default {d['max_prompt_length']}; 0 = no cap)")
    add("--lr", type=float, help=f"AdamW learning rate after warm-up (default {d['lr']})")
    add("--warmup-steps", type=int, help=f"linear warm-up, in GRPO steps (default {d['warmup_steps']})")
    add("--weight-decay", type=float, help=f"(default {d['weight_decay']})")
    add("--max-grad-norm", type=float, help=f"gradient clipping (default {d['max_grad_norm']})")
    add("--beta", type=float, help=f"KL weight of Eq. (9); 0 skips the reference model (default {d['beta']})")
    add("--clip-eps", type=float, help=f"epsilon of the clipped ratio in Eq. (9) (default {d['clip_eps']})")
    add("--mu", type=int, help=f"passes over each sample batch (default {d['mu']})")
    add("--loss-norm", choices=["seq", "token"],
        help=f"seq: Eq. (9) as written; token: mean over all tokens (DAPO) (default {d['loss_norm']})")
    add("--sample-ratio", type=int, help=f"sample batch / backprop minibatch (default {d['sample_ratio']})")
    add("--dtype", choices=["auto", "float32", "bfloat16"],
        help=f"auto: fp32 weights with bf16 autocast on a GPU or an AMX CPU, plain fp32 elsewhere (default {d['dtype']})")
    add("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=None,
        help=f"(default {d['gradient_checkpointing']})")
    add("--sample-every", type=int, help=f"write sampled completions every N steps (default {d['sample_every']})")
    add("--save-every", type=int, help=f"write <out>/checkpoint every N steps (default {d['save_every']})")
    add("--time-budget-minutes", type=float,
        help="stop cleanly (and save) when the next step and the final evaluation would not fit")
    add("--eval-data", help="held-out records: greedy evaluation before step 1 and after the last step "
                            "(cpu-demo: dev.jsonl beside --data, when it exists)")
    add("--eval-limit", type=int,
        help=f"evaluate on this many records; 0 = no evaluation (default {d['eval_limit']})")
    add("--eval-batch-size", type=int, help=f"(default {d['eval_batch_size']})")
    add("--eval-max-new-tokens", type=int, help="(default: --max-new-tokens)")
    return p


def resolve_config(argv=None) -> argparse.Namespace:
    """DEFAULTS, then the preset, then the flags given on the command line."""
    args = build_parser().parse_args(argv)
    config = dict(DEFAULTS)
    if args.preset:
        config.update(PRESETS[args.preset])
    config.update({k: v for k, v in vars(args).items() if v is not None})
    config.setdefault("preset", None)
    if config["preset"] == "cpu-demo" and args.eval_data is None:  # the demo shows its before / after
        dev = Path(config["data"]).parent / "dev.jsonl"
        config["eval_data"] = str(dev) if dev.exists() else None
    if config["eval_max_new_tokens"] is None:
        config["eval_max_new_tokens"] = config["max_new_tokens"]
    for name in ("num_generations", "prompts_per_step", "max_new_tokens", "mu", "sample_ratio"):
        if config[name] < 1:
            raise SystemExit(f"error: --{name.replace('_', '-')} must be at least 1")
    return argparse.Namespace(**config)


# --------------------------------------------------------------------------------------------
# Prompts P(Q_t, C_t). A prompt over --max-prompt-length tokens is rendered again with only the
# dependency-pruned history C~_t (stage 0's Eq. (2) scores, not the teacher's answer) plus the last
# RECENT_TURNS utterances, the same view phase 1 of SFT trained on; if that is still too long the
# record is skipped. Cutting tokens off the front would break the chat template.
# --------------------------------------------------------------------------------------------
RECENT_TURNS = 4


def fit_prompt(tokenizer, record, max_prompt_length) -> str | None:
    prompt = render_prompt(tokenizer, record)
    if not max_prompt_length or len(tokenizer(prompt, add_special_tokens=False).input_ids) <= max_prompt_length:
        return prompt
    keep = set(record["pruned"]) | {turn["label"] for turn in record["history"][-RECENT_TURNS:]}
    prompt = render_prompt(tokenizer, record, keep=keep)
    if len(tokenizer(prompt, add_special_tokens=False).input_ids) <= max_prompt_length:
        return prompt
    return None


class PromptStream:
    """An endless, seeded walk over the training records, a fresh permutation each epoch. Every rank
    walks the same order and takes its own slice of each global batch, so ranks never share a prompt.
    The position (epoch, cursor) is part of the checkpoint."""

    def __init__(self, records, tokenizer, max_prompt_length, seed, rank=0, world_size=1):
        self.records, self.tokenizer, self.max_prompt_length = records, tokenizer, max_prompt_length
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.epoch, self.cursor, self.skipped = 0, 0, 0
        self._order = self._permutation()

    def _permutation(self):
        order = list(range(len(self.records)))
        random.Random(f"grpo-data-{self.seed}-{self.epoch}").shuffle(order)
        return order

    def _next(self):
        for _ in range(2 * len(self.records)):  # 2 x N draws in a row hold one whole epoch
            if self.cursor == len(self._order):
                self.epoch, self.cursor = self.epoch + 1, 0
                self._order = self._permutation()
            record = self.records[self._order[self.cursor]]
            self.cursor += 1
            prompt = fit_prompt(self.tokenizer, record, self.max_prompt_length)
            if prompt is not None:
                return record, prompt
            self.skipped += 1
        raise DataError(f"no training prompt fits --max-prompt-length {self.max_prompt_length}")

    def next_batch(self, n):
        """-> this rank's n (record, prompt) pairs of the next global batch of n * world_size."""
        batch = [self._next() for _ in range(n * self.world_size)]
        return batch[self.rank * n:(self.rank + 1) * n]

    def state_dict(self):
        return {"epoch": self.epoch, "cursor": self.cursor, "skipped": self.skipped}

    def load_state_dict(self, state):
        self.epoch, self.cursor, self.skipped = state["epoch"], state["cursor"], state["skipped"]
        self._order = self._permutation()


# --------------------------------------------------------------------------------------------
# Sampling from pi_old: all K completions of all prompts in one batched generate with a KV cache.
# --------------------------------------------------------------------------------------------
def stop_token_ids(model, tokenizer) -> list[int]:
    ids = model.generation_config.eos_token_id
    ids = [] if ids is None else ([ids] if isinstance(ids, int) else list(ids))
    return list(dict.fromkeys(ids + ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])))


def completion_mask(completion_ids, stop_ids) -> torch.Tensor:
    """1 up to and including the first stop token (the model must learn to stop), 0 after it:
    generate pads finished rows, and those pads are no part of o_i. |o_i| = mask.sum(1)."""
    is_stop = torch.isin(completion_ids, torch.tensor(stop_ids, device=completion_ids.device))
    positions = torch.arange(completion_ids.shape[1], device=completion_ids.device)
    first_stop = torch.where(is_stop, positions, completion_ids.shape[1]).min(dim=1).values
    return (positions.unsqueeze(0) <= first_stop.unsqueeze(1)).long()


@torch.no_grad()
def generate(model, tokenizer, prompts, num_generations=1, max_new_tokens=128, temperature=1.0,
             top_p=1.0, greedy=False, autocast_dtype=None) -> dict:
    """-> {prompt_ids, prompt_mask, completion_ids, completion_mask, texts}, rows grouped by prompt
    (prompt j owns rows j*K .. j*K+K-1). Prompts are left padded so every completion starts at the
    same column."""
    device = next(model.parameters()).device
    tokenizer.padding_side = "left"
    encoded = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
    prompt_ids = encoded.input_ids.repeat_interleave(num_generations, dim=0)
    prompt_mask = encoded.attention_mask.repeat_interleave(num_generations, dim=0)
    stop_ids = stop_token_ids(model, tokenizer)
    if greedy:
        sampling = dict(do_sample=False, temperature=None, top_p=None, top_k=None)
    else:  # top_k=0: no hidden top-k cut, so pi_old is exactly softmax(logits / T) (up to top-p)
        sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
    was_training = model.training
    model.eval()
    with autocast(device, autocast_dtype):
        sequences = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, max_new_tokens=max_new_tokens,
                                   eos_token_id=stop_ids, pad_token_id=tokenizer.pad_token_id, use_cache=True,
                                   **sampling)
    model.train(was_training)
    completion_ids = sequences[:, prompt_ids.shape[1]:]
    mask = completion_mask(completion_ids, stop_ids)
    texts = tokenizer.batch_decode([row[:n] for row, n in zip(completion_ids, mask.sum(1).tolist())],
                                   skip_special_tokens=True)
    return dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                completion_mask=mask, texts=texts)


# --------------------------------------------------------------------------------------------
# Eq. (8): group-relative advantage.
# --------------------------------------------------------------------------------------------
ADVANTAGE_EPS = 1e-8


def group_advantages(rewards: torch.Tensor, eps: float = ADVANTAGE_EPS) -> torch.Tensor:
    """rewards [num_groups, K] -> A~ [num_groups, K] = (R - mean R) / (std R + eps), per group.

    std is the population std (divide by K, not K - 1): a group of one then has std 0 and advantage 0,
    where the sample std would be NaN; for K = 8 the two differ by a constant factor sqrt(8/7) that
    only rescales the step. A group whose rewards are all equal teaches nothing: its advantage is
    exactly 0 (computed in float64; a NaN reward stays NaN so that the step is skipped)."""
    rewards = rewards.double()
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True, unbiased=False)
    advantages = (rewards - mean) / (std + eps)
    all_equal = (rewards == rewards[:, :1]).all(dim=1, keepdim=True)
    return torch.where(all_equal, torch.zeros_like(advantages), advantages).float()


# --------------------------------------------------------------------------------------------
# Per-token log-probabilities of the completion tokens under a model.
# --------------------------------------------------------------------------------------------
def completion_logprobs(model, input_ids, attention_mask, completion_length, temperature=1.0,
                        with_entropy=False):
    """-> (log pi(o_t | q, o_<t) [B, C], entropy [B, C] or None) for the last C = completion_length
    columns. Logits are divided by the sampling temperature, so these are the log-probs of the
    distribution the completions were drawn from. Position ids follow the attention mask, as in
    generate: RoPE models do not mind the shift left padding causes, learned absolute positions do."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   use_cache=False, logits_to_keep=completion_length + 1).logits
    logits = logits[:, :-1].float() / temperature  # position t predicts token t + 1
    logprobs_all = logits.log_softmax(dim=-1)
    targets = input_ids[:, -completion_length:]
    logprobs = logprobs_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = -(logprobs_all.exp() * logprobs_all).sum(-1)
    return logprobs, entropy


# --------------------------------------------------------------------------------------------
# Eq. (9): the GRPO objective, as a loss to minimise (its negative).
# --------------------------------------------------------------------------------------------
def k3_kl(logprobs, ref_logprobs):
    """Per-token KL(pi_theta || pi_ref), the unbiased k3 estimator on tokens sampled from pi_theta:
    exp(ref - logp) - (ref - logp) - 1. Always >= 0 (x - 1 >= log x), exactly 0 when the two agree."""
    log_ratio = ref_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1


def grpo_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, clip_eps=0.2, beta=0.04,
              loss_norm="seq"):
    """-> (loss, stats). logprobs / old / ref: [B, C]; advantages: [B]; mask: [B, C] completion mask.

    loss_norm="seq" is Eq. (9) as written: each completion's token terms are averaged over its own
    |o_i| tokens, then completions are averaged (1/G). A token of a short completion thus weighs more
    than a token of a long one: a long wrong answer is punished less per token, a short right one
    rewarded more, which biases length (long when wrong). loss_norm="token" (DAPO, Dr. GRPO) sums
    over every token of the batch and divides by their number, so each token weighs the same."""
    mask = mask.to(logprobs.dtype)
    ratio = torch.exp(logprobs - old_logprobs)                        # r_{i,t}(theta)
    A = advantages.unsqueeze(1)                                       # A~_i, the same for every token
    unclipped = ratio * A
    clipped = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * A
    objective = torch.min(unclipped, clipped)                         # pessimistic bound, no gradient when clipped
    kl = k3_kl(logprobs, ref_logprobs) if ref_logprobs is not None else torch.zeros_like(logprobs)
    objective = objective - beta * kl
    if loss_norm == "seq":
        per_completion = (objective * mask).sum(1) / mask.sum(1).clamp(min=1)  # 1/|o_i| sum_t
        loss = -per_completion.mean()                                           # 1/G sum_i
    elif loss_norm == "token":
        loss = -(objective * mask).sum() / mask.sum().clamp(min=1)
    else:
        raise ValueError(f"unknown loss_norm {loss_norm!r}; use seq or token")
    with torch.no_grad():
        is_clipped = ((ratio > 1 + clip_eps) & (A > 0)) | ((ratio < 1 - clip_eps) & (A < 0))
        tokens = mask.sum().clamp(min=1)
        stats = {"kl": ((kl * mask).sum() / tokens).item(),
                 "clip_fraction": ((is_clipped * mask).sum() / tokens).item(),
                 "ratio": ((ratio * mask).sum() / tokens).item()}
    return loss, stats


# --------------------------------------------------------------------------------------------
# One GRPO step.
# --------------------------------------------------------------------------------------------
def _all_ranks_any(flag: bool, device) -> bool:
    """True on every rank if it is true on one: every rank must skip the same optimizer step."""
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def grpo_step(policy, ref_model, tokenizer, optimizer, records, prompts, cfg, reward_fn=None,
              train_model=None, autocast_dtype=None) -> dict:
    """Sample, score, Eq. (8), then mu passes of Eq. (9) updates over the backprop minibatches.
    `reward_fn(completions, examples) -> [{"total": ..., <components>}]` defaults to
    reward.compute_rewards. `train_model` is the DDP wrapper when there is one (backward through it
    all-reduces the gradients); `policy` is the plain module, used to generate. Returns this rank's
    statistics and its scored completions."""
    reward_fn = reward_fn or compute_rewards
    train_model = train_model if train_model is not None else policy
    device = next(policy.parameters()).device
    K = cfg.num_generations

    # Sample K completions per prompt from pi_old (the current weights, before this step's updates).
    t0 = time.perf_counter()
    rollout = generate(policy, tokenizer, prompts, num_generations=K, max_new_tokens=cfg.max_new_tokens,
                       temperature=cfg.temperature, top_p=cfg.top_p, autocast_dtype=autocast_dtype)
    t1 = time.perf_counter()

    # Score with the verifiable reward R = format + recall + answer (Eqs. (4)-(7)).
    examples = [record for record in records for _ in range(K)]
    scores = reward_fn(rollout["texts"], examples)
    rewards = torch.tensor([float(s["total"]) for s in scores], dtype=torch.float64).view(-1, K)
    advantages = group_advantages(rewards).view(-1).to(device)  # Eq. (8)
    t2 = time.perf_counter()

    input_ids = torch.cat([rollout["prompt_ids"], rollout["completion_ids"]], dim=1)
    attention_mask = torch.cat([rollout["prompt_mask"], rollout["completion_mask"]], dim=1)
    mask = rollout["completion_mask"]
    C = mask.shape[1]
    # The sample batch split into backprop minibatches (§4.1: sample / backprop = 4); every rank has
    # as many rows and so as many minibatches, which DDP needs (one all-reduce per backward).
    minibatches = torch.arange(len(input_ids), device=device).tensor_split(min(cfg.sample_ratio, len(input_ids)))
    # With a single update per sample batch pi_theta == pi_old when the loss is computed, so
    # old log-probs are the current ones, detached (r = 1): one forward pass saved.
    on_policy = cfg.mu == 1 and len(minibatches) == 1

    def logprobs_of(model, rows, with_entropy=False):
        with autocast(device, autocast_dtype):
            return completion_logprobs(model, input_ids[rows], attention_mask[rows], C, cfg.temperature,
                                       with_entropy)

    policy.eval()
    with torch.no_grad():  # old log-probs once per sample batch; pi_ref frozen
        old_logprobs = None if on_policy else torch.cat([logprobs_of(policy, rows)[0] for rows in minibatches])
        ref_logprobs = (torch.cat([logprobs_of(ref_model, rows)[0] for rows in minibatches])
                        if cfg.beta > 0 and ref_model is not None else None)

    policy.train()  # gradient checkpointing works only in train mode; the models have no dropout
    stats, entropies, skipped, updates = [], [], 0, 0
    for epoch in range(cfg.mu):
        for rows in minibatches:
            logprobs, entropy = logprobs_of(train_model, rows, with_entropy=epoch == 0)
            if entropy is not None:
                entropies.append(((entropy * mask[rows]).sum() / mask[rows].sum()).item())
            loss, loss_stats = grpo_loss(
                logprobs, logprobs.detach() if on_policy else old_logprobs[rows],
                None if ref_logprobs is None else ref_logprobs[rows],
                advantages[rows], mask[rows], cfg.clip_eps, cfg.beta, cfg.loss_norm)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # every rank, even with a bad loss: DDP needs every rank in the all-reduce
            grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm)
            # A non-finite loss or gradient must never reach the weights (nor AdamW's moments).
            if _all_ranks_any(not (math.isfinite(loss.item()) and math.isfinite(grad_norm.item())), device):
                optimizer.zero_grad(set_to_none=True)
                skipped += 1
                continue
            optimizer.step()
            updates += 1
            stats.append(dict(loss_stats, loss=loss.item(), grad_norm=grad_norm.item()))
    optimizer.zero_grad(set_to_none=True)
    policy.eval()
    t3 = time.perf_counter()

    lengths = mask.sum(1).float()
    mean = lambda key: float(np.mean([s[key] for s in stats])) if stats else float("nan")
    return {
        "scores": scores, "texts": rollout["texts"], "records": examples,
        "loss": mean("loss"), "grad_norm": mean("grad_norm"), "kl": mean("kl"),
        "clip_fraction": mean("clip_fraction"), "ratio": mean("ratio"),
        "entropy": float(np.mean(entropies)) if entropies else float("nan"),
        "completion_length": lengths.mean().item(), "completion_tokens": int(lengths.sum().item()),
        "sequence_tokens": int(attention_mask.sum().item()),
        "skipped_updates": skipped, "updates": updates,
        "generate_s": t1 - t0, "score_s": t2 - t1, "train_s": t3 - t2,
    }


# --------------------------------------------------------------------------------------------
# Greedy evaluation on held-out records (the "before / after" check; evaluate.py does the full §4).
# --------------------------------------------------------------------------------------------
REWARD_COMPONENTS = ("format", "recall", "answer", "total")


def evaluate_policy(model, tokenizer, records, max_new_tokens=160, batch_size=8, reward_fn=None,
                    max_prompt_length=None, autocast_dtype=None, progress=True) -> dict:
    """Greedy completions for `records` (batched, left padded) -> mean reward components and mean
    recall Jaccard, plus how many records were scored and how many skipped (prompt too long)."""
    reward_fn = reward_fn or compute_rewards
    start = time.perf_counter()
    fitted = [(r, fit_prompt(tokenizer, r, max_prompt_length)) for r in records]
    kept = [(r, p) for r, p in fitted if p is not None]
    kept.sort(key=lambda rp: len(rp[1]))  # similar lengths batch with less padding
    completions, examples = [], []
    for i in tqdm(range(0, len(kept), batch_size), desc="eval", disable=not progress, leave=False):
        batch = kept[i:i + batch_size]
        out = generate(model, tokenizer, [p for _, p in batch], max_new_tokens=max_new_tokens, greedy=True,
                       autocast_dtype=autocast_dtype)
        completions += out["texts"]
        examples += [r for r, _ in batch]
    scores = reward_fn(completions, examples) if completions else []
    result = {"n": len(scores), "skipped": len(records) - len(kept)}
    for key in REWARD_COMPONENTS + ("jaccard",):
        values = [float(s[key]) for s in scores if key in s]
        result[key] = float(np.mean(values)) if values else float("nan")
    result["seconds"] = time.perf_counter() - start
    result["examples"] = [{"id": r["id"], "completion": c, **{k: s.get(k) for k in REWARD_COMPONENTS}}
                          for r, c, s in list(zip(examples, completions, scores))[:3]]
    return result


def pick_eval_records(records, limit):
    """A fixed sample (seed 0, whatever --seed): runs with different seeds compare on the same set."""
    if limit >= len(records):
        return records
    return [records[i] for i in sorted(random.Random(0).sample(range(len(records)), limit))]


# --------------------------------------------------------------------------------------------
# Checkpoints: save_pretrained folders; the trainer state in a weights_only-loadable file.
# --------------------------------------------------------------------------------------------
def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = [name, keys.tolist(), pos, has_gauss, cached]  # plain types: weights_only loads it
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _replace_dir(tmp: Path, target: Path) -> None:
    """Swap a finished folder in: a crash leaves the old one or the new one, never half of one."""
    old = target.with_name(target.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        os.rename(target, old)
    os.rename(tmp, target)
    shutil.rmtree(old, ignore_errors=True)


def save_model(path: Path, policy, tokenizer, trainer_state=None) -> None:
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    policy.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if trainer_state is not None:
        torch.save(trainer_state, tmp / "trainer_state.pt")
    _replace_dir(tmp, path)


def gather_objects(obj, world_size):
    if world_size == 1:
        return [obj]
    objects = [None] * world_size
    dist.all_gather_object(objects, obj)
    return objects


def param_fingerprint(model) -> str:
    """sha256 of every parameter's bytes: DDP ranks must agree bit for bit."""
    digest = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        digest.update(name.encode())
        digest.update(p.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()


# --------------------------------------------------------------------------------------------
# Logging helpers
# --------------------------------------------------------------------------------------------
def reward_metrics(scores) -> dict:
    """Mean and std of every reward component over all completions of the step, and mean Jaccard."""
    metrics = {}
    for key in REWARD_COMPONENTS:
        values = np.array([float(s[key]) for s in scores if key in s], dtype=np.float64)
        if len(values):
            metrics[f"reward_{key}_mean"], metrics[f"reward_{key}_std"] = float(values.mean()), float(values.std())
    jaccard = [float(s["jaccard"]) for s in scores if "jaccard" in s]
    if jaccard:
        metrics["recall_jaccard_mean"] = float(np.mean(jaccard))
    return metrics


def sample_lines(step, result, K) -> list[dict]:
    """The best and the worst completion of the first group: what the policy writes, and what the
    reward prefers."""
    def total(i):  # NaN (a broken reward) sorts lowest
        value = float(result["scores"][i]["total"])
        return value if math.isfinite(value) else -math.inf
    group = sorted(range(min(K, len(result["texts"]))), key=total)
    picks = dict.fromkeys([group[-1], group[0]]) if group else {}
    lines = []
    for i in picks:
        record, score = result["records"][i], result["scores"][i]
        lines.append({"step": step, "id": record["id"], "query": record["query"], "gold_recall": record["recall"],
                      "gold_answer": record["answer"], "completion": result["texts"][i],
                      **{k: _jsonable(v) for k, v in score.items() if isinstance(v, (int, float, str, list))}})
    return lines


def lr_at(step, cfg) -> float:
    """Constant learning rate after a linear warm-up (§4.1); `step` counts from 1."""
    if cfg.warmup_steps and step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    return cfg.lr


def _jsonable(value):
    """NaN and inf are not JSON: they are written as null."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


# --------------------------------------------------------------------------------------------
# The training run
# --------------------------------------------------------------------------------------------
SAVE_MARGIN_S = 30  # writing checkpoint/ and final/ at the end of a time-budgeted run
# Settings that fix the data order and the meaning of a step: a resumed run must match them.
RESUME_MUST_MATCH = ("seed", "prompts_per_step", "max_prompt_length", "world_size")


def main(argv=None, reward_fn=None) -> dict:
    run_start = time.perf_counter()  # the time budget covers everything, model loading included
    cfg = resolve_config(argv)
    rank, world_size, local_rank, device = setup_distributed()
    main_process = rank == 0
    run_config = dict(vars(cfg), world_size=world_size, device=str(device))
    out = Path(cfg.out)
    checkpoint_dir = out / "checkpoint"
    try:
        records = read_jsonl(cfg.data)
        eval_records = (pick_eval_records(read_jsonl(cfg.eval_data), cfg.eval_limit)
                        if cfg.eval_data and cfg.eval_limit > 0 else None)
    except (DataError, OSError) as e:
        sys.exit(f"error: {e}")
    if not records:
        sys.exit(f"error: {cfg.data} holds no records")
    if cfg.resume and (out / "summary.json").exists() and (out / "final").exists():
        done = json.loads((out / "summary.json").read_text())
        if done["steps"] >= cfg.max_steps and (not eval_records or (out / "eval_after.json").exists()):
            if main_process:
                print(f"{out} already holds a finished run of {done['steps']} steps; nothing to do", flush=True)
            if world_size > 1:
                dist.destroy_process_group()
            return done
    resuming = cfg.resume and (checkpoint_dir / "trainer_state.pt").exists()
    if cfg.resume and not resuming and main_process:
        print(f"note: no checkpoint in {checkpoint_dir}; starting from scratch", flush=True)

    # Models: the policy (fp32 master weights, bf16 autocast on GPU) and the frozen reference
    # pi_ref = the SFT model we start from, even when resuming.
    _, autocast_dtype = resolve_dtype(cfg.dtype, device)
    policy, tokenizer = load_model_and_tokenizer(str(checkpoint_dir) if resuming else cfg.model,
                                                 dtype=cfg.dtype, device=device)
    ref_model = None
    if cfg.beta > 0:
        ref_model, _ = load_model_and_tokenizer(cfg.model, dtype=cfg.dtype, device=device)
        ref_model.eval().requires_grad_(False)
    if cfg.gradient_checkpointing:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    stream = PromptStream(records, tokenizer, cfg.max_prompt_length, cfg.seed, rank, world_size)

    # Each rank samples its own completions: its own random stream.
    random.seed(cfg.seed + rank)
    np.random.seed(cfg.seed + rank)
    torch.manual_seed(cfg.seed + rank)
    start_step, metrics, samples = 0, [], []
    if resuming:
        state = torch.load(checkpoint_dir / "trainer_state.pt", map_location="cpu", weights_only=True)
        changed = [k for k in RESUME_MUST_MATCH if state["config"].get(k) != run_config[k]]
        if changed:
            sys.exit(f"error: --resume with different {', '.join(changed)} than the checkpoint in {checkpoint_dir}")
        optimizer.load_state_dict(state["optimizer"])
        start_step = state["step"]
        stream.load_state_dict(state["stream"])
        set_rng_state(state["rng"][rank])
        if main_process:  # the logs continue where the checkpoint left them
            metrics = [m for m in (read_jsonl(out / "metrics.jsonl", validate=False)
                                   if (out / "metrics.jsonl").exists() else []) if m["step"] <= start_step]
            samples = [s for s in (read_jsonl(out / "samples.jsonl", validate=False)
                                   if (out / "samples.jsonl").exists() else []) if s["step"] <= start_step]
    train_model = policy
    if world_size > 1:
        train_model = torch.nn.parallel.DistributedDataParallel(
            policy, device_ids=[local_rank] if device.type == "cuda" else None)

    if main_process:
        write_json(out / "config.json", run_config)

    def run_eval(name):
        if main_process:
            result = evaluate_policy(policy, tokenizer, eval_records, cfg.eval_max_new_tokens, cfg.eval_batch_size,
                                     reward_fn=reward_fn, max_prompt_length=cfg.max_prompt_length,
                                     autocast_dtype=autocast_dtype)
            write_json(out / name, {k: _jsonable(v) for k, v in result.items()})
            tqdm.write(f"{name}: " + ", ".join(f"{k} {result[k]:.3f}" for k in REWARD_COMPONENTS + ("jaccard",)))
        if world_size > 1:
            dist.barrier()

    eval_seconds = 0.0  # the final evaluation will take about as long as the first
    if eval_records and start_step == 0:
        t = time.perf_counter()
        run_eval("eval_before.json")
        eval_seconds = time.perf_counter() - t
    elif eval_records and (out / "eval_before.json").exists():
        eval_seconds = json.loads((out / "eval_before.json").read_text()).get("seconds") or 0.0

    def save_checkpoint(step):
        rng = gather_objects(rng_state(), world_size)
        if main_process:
            save_model(checkpoint_dir, policy, tokenizer, {
                "step": step, "optimizer": optimizer.state_dict(), "stream": stream.state_dict(), "rng": rng,
                "config": {k: run_config[k] for k in RESUME_MUST_MATCH}})
        if world_size > 1:
            dist.barrier()

    step, step_seconds, stop_reason = start_step, [], "max_steps"
    progress = tqdm(total=cfg.max_steps, initial=start_step, desc="grpo", disable=not main_process)
    while step < cfg.max_steps:
        # The time budget: stop when another step, the final evaluation and saving would overrun it.
        if cfg.time_budget_minutes is not None:
            elapsed = time.perf_counter() - run_start
            need = (np.mean(step_seconds) if step_seconds else 0.0) + eval_seconds + SAVE_MARGIN_S
            if _all_ranks_any(elapsed + need > 60 * cfg.time_budget_minutes, device):
                stop_reason = "time_budget"
                break
        step += 1
        lr = lr_at(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        t = time.perf_counter()
        batch = stream.next_batch(cfg.prompts_per_step)
        result = grpo_step(policy, ref_model, tokenizer, optimizer, [r for r, _ in batch], [p for _, p in batch],
                           cfg, reward_fn=reward_fn, train_model=train_model, autocast_dtype=autocast_dtype)
        step_seconds.append(time.perf_counter() - t)

        # Every rank's completions and statistics, logged by rank 0.
        all_results = gather_objects({k: v for k, v in result.items() if k not in ("texts", "records")},
                                     world_size)
        if main_process:
            scores = [s for r in all_results for s in r["scores"]]
            avg = lambda key: float(np.nanmean([r[key] for r in all_results]))
            total = lambda key: sum(r[key] for r in all_results)
            line = {"step": step, **reward_metrics(scores),
                    **{k: avg(k) for k in ("kl", "clip_fraction", "ratio", "entropy", "loss", "grad_norm",
                                           "completion_length", "generate_s", "score_s", "train_s")},
                    "lr": lr, "skipped_updates": total("skipped_updates"), "updates": result["updates"],
                    "tokens_per_s": total("sequence_tokens") / step_seconds[-1],
                    "generated_tokens_per_s": total("completion_tokens") / max(avg("generate_s"), 1e-9),
                    "skipped_prompts": stream.skipped, "step_s": step_seconds[-1]}
            metrics.append({k: _jsonable(v) for k, v in line.items()})
            write_jsonl(out / "metrics.jsonl", metrics)
            if result["skipped_updates"]:
                tqdm.write(f"step {step}: skipped {result['skipped_updates']} update(s) with a non-finite "
                           f"loss or gradient; the weights are unchanged by them")
            if cfg.sample_every and step % cfg.sample_every == 0:
                samples += sample_lines(step, result, cfg.num_generations)
                write_jsonl(out / "samples.jsonl", samples)
            progress.set_postfix(reward=f"{line.get('reward_total_mean', float('nan')):.3f}",
                                 kl=f"{line['kl']:.4f}", len=f"{line['completion_length']:.0f}")
        progress.update(1)
        if cfg.save_every and step % cfg.save_every == 0 and step < cfg.max_steps:
            save_checkpoint(step)
    progress.close()

    save_checkpoint(step)
    if main_process:
        save_model(out / "final", policy, tokenizer)
    if eval_records:
        run_eval("eval_after.json")
    fingerprints = gather_objects(param_fingerprint(policy), world_size)
    summary = {"steps": step, "stop_reason": stop_reason, "seconds": time.perf_counter() - run_start,
               "world_size": world_size, "param_fingerprints": fingerprints,
               "ranks_in_sync": len(set(fingerprints)) == 1}
    if main_process:
        write_json(out / "summary.json", summary)
        print(f"done: {step} steps ({stop_reason}); model in {out / 'final'}", flush=True)
    if world_size > 1:
        dist.barrier()
        dist.destroy_process_group()
    return summary


if __name__ == "__main__":
    try:
        main()
    except DataError as e:  # e.g. no training prompt fits --max-prompt-length
        sys.exit(f"error: {e}")
