"""Stage 2 of SRT: recall-reasoning alignment with GRPO (paper §3.4, Eqs. (8)-(9)), in plain PyTorch.

One GRPO step, in the order of the paper, as three calls passing one record (grpo_step):

  rollout     for each prompt P(Q_t, C_t): sample K completions tau^(k) from the policy, keeping each
              token's log pi_sampler (srt/rollouts.py, a Rollout); score them with the verifiable reward
              R = format + recall + answer (reward.py, Eqs. (4)-(7)); --dynamic-sampling: groups whose
              K rewards are all equal are replaced by fresh prompts (DAPO)
  advantages  Eq. (8): group-relative advantage  A~(k) = (R(k) - mean R) / (std R + 1e-8)
  update      log-probs of pi_old (once per sample batch) and of the frozen pi_ref = the SFT model;
              the sample batch in backprop minibatches (sample/backprop ratio 4, §4.1), `mu` passes:
                Eq. (9): r = pi_theta / pi_old per token, clipped surrogate min(r A, clip(r, 1-eps, 1+eps) A),
                         times w = min(pi_old / pi_sampler, C) where the sampler is a bf16 copy,
                         averaged over each completion's tokens and over the group, minus beta * KL
                AdamW step (constant learning rate after a linear warm-up, §4.1)

Paper vs this implementation (1-3 always hold; 4-11 are flags of the "beyond the paper" group, off
or the paper's choice by default unless said):

  1. Eq. (8) std is the population std (divide by K): a group of one gets advantage 0, not NaN, and a
     group whose K rewards are all equal gets exactly 0.
  2. pi_old shortcut: pi_old is the policy before the step. The first backprop minibatch is scored
     before any update, so its own log-probs, detached, are its pi_old (at mu = 1 its ratio is 1);
     the later minibatches get one no-grad pi_old pass before the first update.
  3. KL: the k3 estimator to pi_ref = the SFT model, beta 0.04 (§4.1 names the term, not its
     estimator nor its weight).
  4. Truncated importance sampling (--is-cap 2, on): rollouts come from a bf16 copy of the policy
     where the hardware has bf16 units, so each token's surrogate is weighted by
     min(pi_old / pi_sampler, 2); about 1 on an fp32 CPU, where the sampler is the policy.
  5. Loss normalisation: --loss-norm seq (default) is Eq. (9) as written, each completion's tokens
     averaged, then the completions; --loss-norm token averages over every token (DAPO).
  6. Dynamic sampling (--dynamic-sampling total | recall, --max-draws; cpu-demo: recall): groups
     whose K total rewards, or recall parts, are all equal are replaced by fresh prompts (DAPO).
  7. Segment credit (--credit segment): the think tokens take the advantage of format + recall, the
     answer tokens that of format + answer, instead of one advantage per completion.
  8. Answer gate (--answer-gate recall, reward.py): an answer whose recall shares no turn with H*
     earns -1, as a missing answer does.
  9. Recall by pointer (--recall copy, srt/recall.py): the policy writes <HIS>A3: and the decoder
     copies turn A3; the copied tokens are outside the ratio, the KL and the normalisation.
 10. Placebo (--placebo): each group's K rewards shuffled among its samples before Eq. (8), seeded
     by --seed: a control run that keeps every statistic of a real one but the reward's signal.
 11. --train-turns dependent trains on the turns whose H* is not empty; --top-p below 1 is refused
     (Eq. (9)'s ratio and KL are over the full softmax(logits / T)).

Run on one CPU or GPU, or on N of them with torchrun (each rank samples and scores its own prompts,
DDP all-reduces the gradients, rank 0 alone logs and saves):

    python stage2_grpo.py --preset cpu-demo --model runs/demo/sft/final --data runs/data/train.jsonl \
        --out runs/demo/grpo
    python stage2_grpo.py --explain --model runs/demo/sft/final      # one step, every quantity printed,
                                                                     # and runs/explain/grpo-step.html
    torchrun --nproc_per_node=8 stage2_grpo.py --model runs/paper/sft/final --data ... --preset paper --fsdp
    python stage2_grpo.py --preset paper --model Qwen/Qwen2.5-7B-Instruct --fsdp --dry-run --world-size 8

Outputs under --out: config.json, metrics.jsonl (one line per step), samples.jsonl (what the policy
writes as it learns), checkpoint/ (resumable), final/ (save_pretrained), with --eval-data:
eval_before.json, eval_after.json, probe.jsonl and learning_curve.png; summary.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from reward import ANSWER_GATES, ANSWER_REWARDS, compute_rewards
from srt import grpo_explain
from srt.config import MAX_NEW_TOKENS, Bounded, at_least, parse_config, positive, require, up_to
from srt.data_io import (
    DataError,  # noqa: F401  (raised by the prompt stream; tests catch it from here)
    data_paths,
    finite_or_none,
    read_jsonl,
    read_mixture,
    write_json,
)
from srt.decode import follow_optimizer
from srt.distributed import (
    accumulate,
    all_ranks_any,
    clip_grad_norm,
    full_weights,
    gather_objects,
    merge_probes,
    shard_model,
    teardown_distributed,  # noqa: F401  (a torchrun test ends its processes through the script)
)
from srt.modeling import (
    autocast,
    completion_logprobs,
    load_model_and_tokenizer,  # noqa: F401  (bench/grpo_workers.py instruments the script's loaders)
    parameter_digest,
    peak_gpu_gb,
)
from srt.probe import (
    PROBE_KEYS,
    greedy_probe,
    pick_eval_records,
    plot_learning_curve,
    sample_lines,
    step_metrics,
)
from srt.prompt import fit_prompt
from srt.recall import RECALL_MODES
from srt.rollouts import PromptStream, Rollout, sample_batch, think_lengths
from srt.run import (
    Run,
    add_log_group,
    add_run_flags,
    add_scale_group,
    finish_parser,
    method_group,
    resume_keys,
    training_parser,
)
from srt.run import main as run_main
from srt.training import seed_everything, warmup_lr

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


def shuffled_within_groups(reward_fn, K: int, rng: random.Random):
    """--placebo: reward_fn whose scores are permuted inside each aligned block of K rows (one group:
    srt/rollouts.py lays a step's rows out prompt by prompt, K each). Each group keeps its own K
    rewards, so its mean, spread and Eq. (8)'s advantages are a real group's; only which completion
    earns which is cut."""

    def placebo(completions, examples):
        scores = list(reward_fn(completions, examples))
        if len(scores) % K:
            raise ValueError(f"placebo: {len(scores)} rows are not whole groups of K = {K}")
        for g in range(0, len(scores), K):
            block = scores[g : g + K]
            rng.shuffle(block)
            scores[g : g + K] = block
        return scores

    return placebo


# --------------------------------------------------------------------------------------------
# Eq. (9): the GRPO objective, as a loss to minimise (its negative).
# --------------------------------------------------------------------------------------------
def k3_kl(logprobs, ref_logprobs):
    """Per-token KL(pi_theta || pi_ref), the unbiased k3 estimator on tokens sampled from pi_theta:
    exp(ref - logp) - (ref - logp) - 1. Always >= 0 (x - 1 >= log x), exactly 0 when the two agree."""
    log_ratio = ref_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1


def grpo_loss(
    logprobs,
    old_logprobs,
    ref_logprobs,
    advantages,
    mask,
    clip_eps=0.2,
    beta=0.04,
    loss_norm="seq",
    is_weights=None,
    return_terms=False,
):
    """-> (loss, stats), and with return_terms the per-token terms (below). logprobs / old / ref:
    [B, C]; advantages: [B] or [B, C]; mask: [B, C], the rollout's policy_mask (1 on the tokens the
    policy sampled: only they count, in every term and in the normalisation); is_weights: [B, C]
    truncated importance weights pi_old / pi_sampler (truncated_is_weights), or None for 1.

    loss_norm="seq" is Eq. (9) as written: each completion's token terms are averaged over its own
    |o_i| tokens, then completions are averaged (1/G). A token of a short completion thus weighs more
    than a token of a long one: a long wrong answer is punished less per token, a short right one
    rewarded more, which biases length (long when wrong). loss_norm="token" (DAPO, Dr. GRPO) sums
    over every token of the batch and divides by their number, so each token weighs the same.

    return_terms: also a dict of [B, C] tensors, what --explain prints token by token: ratio, clipped,
    is_weight (1 where None), kl, objective (the token's term of Eq. (9), 0 where masked) and weight
    (its share in the normalisation), so that loss = -sum(objective * weight) up to rounding."""
    mask = mask.to(logprobs.dtype)
    ratio = torch.exp(logprobs - old_logprobs)  # r_{i,t}(theta)
    A = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages  # A~_i on every token, or one each
    unclipped = ratio * A
    clipped = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * A
    objective = torch.min(unclipped, clipped)  # pessimistic bound, no gradient when clipped
    if is_weights is not None:  # the samples came from pi_sampler, Eq. (9)'s expectation is over pi_old
        objective = objective * is_weights
    kl = k3_kl(logprobs, ref_logprobs) if ref_logprobs is not None else torch.zeros_like(logprobs)
    objective = objective - beta * kl
    # A masked token may hold anything (a NaN from a -inf log-prob): it is selected out, not multiplied.
    objective = torch.where(mask > 0, objective, 0.0)
    if loss_norm == "seq":
        per_completion = objective.sum(1) / mask.sum(1).clamp(min=1)  # 1/|o_i| sum_t
        loss = -per_completion.mean()  # 1/G sum_i
    elif loss_norm == "token":
        loss = -objective.sum() / mask.sum().clamp(min=1)
    else:
        raise ValueError(f"unknown loss_norm {loss_norm!r}; use seq or token")
    with torch.no_grad():
        is_clipped = ((ratio > 1 + clip_eps) & (A > 0)) | ((ratio < 1 - clip_eps) & (A < 0))
        tokens = mask.sum().clamp(min=1)

        def token_mean(x):
            return (torch.where(mask > 0, x.float(), 0.0).sum() / tokens).item()

        stats = {"kl": token_mean(kl), "clip_fraction": token_mean(is_clipped), "ratio": token_mean(ratio)}
    if not return_terms:
        return loss, stats
    with torch.no_grad():
        if loss_norm == "seq":
            weight = mask / (mask.sum(1, keepdim=True).clamp(min=1) * len(mask))
        else:
            weight = mask / mask.sum().clamp(min=1)
        terms = {
            "ratio": ratio.detach(),
            "clipped": is_clipped,
            "is_weight": torch.ones_like(ratio) if is_weights is None else is_weights.detach(),
            "kl": kl.detach(),
            "objective": objective.detach(),
            "weight": weight,
        }
    return loss, stats, terms


def truncated_is_weights(old_logprobs, sampler_logprobs, cap: float):
    """Per token w = min(pi_old / pi_sampler, cap), detached: truncated importance sampling (TRL's
    vllm_importance_sampling_correction in its token / truncate mode; verl, OpenRLHF). Eq. (9)
    takes its expectation over o ~ pi_old, but the rollouts came from the sampler: a bf16 copy of the
    policy where the hardware has bf16 units (srt/decode.py), whose log-probs differ from the fp32
    master weights' under autocast by ~0.04 nats a token. Multiplying each token's surrogate by w
    makes the gradient the on-policy one in expectation; the cap bounds the variance a rare token
    with pi_sampler << pi_old would add, at the price of a bias on those tokens. On an fp32 CPU
    the sampler is the policy itself and w = 1 up to rounding. None (no sampler log-probs, or
    cap 0): no correction."""
    if sampler_logprobs is None or cap == 0:
        return None
    return torch.exp(old_logprobs.detach() - sampler_logprobs).clamp(max=cap)


# --------------------------------------------------------------------------------------------
# One GRPO step in three calls, as GRPO-Zero's train.py: rollout (sample and score, Eqs. (4)-(7)),
# advantages (Eq. (8)), update (Eq. (9)). One record, srt/rollouts.py's Rollout, passes between them.
# --------------------------------------------------------------------------------------------
def grpo_step(
    policy,
    ref_model,
    tokenizer,
    optimizer,
    records,
    prompts,
    cfg,
    reward_fn=None,
    train_model=None,
    autocast_dtype=None,
    draw_more=None,
    batch=None,
) -> dict:
    """One GRPO step on this rank's prompts. `reward_fn` defaults to reward.compute_rewards;
    `train_model` is the DDP wrapper if any (its backward all-reduces), `policy` the module that
    samples; `draw_more()` gives dynamic sampling fresh prompts; `batch` is a Rollout already drawn
    by rollouts.sample_batch (--explain prints it first). -> what the step reports (step_result)."""
    reward_fn = reward_fn or compute_rewards
    device = next(policy.parameters()).device
    rollout = batch or sample_batch(
        policy, tokenizer, records, prompts, cfg, reward_fn, autocast_dtype, draw_more
    )
    advantages = rollout_advantages(rollout, tokenizer, cfg.credit, device)
    stats = update(policy, ref_model, optimizer, rollout, advantages, cfg, train_model, autocast_dtype)
    return step_result(rollout, stats)


def rollout_advantages(rollout: Rollout, tokenizer, credit: str, device) -> torch.Tensor:
    """Eq. (8) for every completion of the sample batch: [B] (one A~ per completion, --credit
    sequence, the paper), or [B, C] (--credit segment, not in the paper: Eq. (4) pays a lucky answer
    for a wrong recall, so here the think tokens take the advantage of format + recall and the
    answer tokens that of format + answer)."""
    if credit == "sequence":
        return group_advantages(rollout.rewards("total")).view(-1).to(device)
    columns = torch.arange(rollout.completion_ids.shape[1])
    in_think = (columns < think_lengths(tokenizer, rollout.completion_ids).unsqueeze(1)).to(device)
    think_advantage = group_advantages(rollout.rewards("format", "recall")).view(-1, 1).to(device)
    answer_advantage = group_advantages(rollout.rewards("format", "answer")).view(-1, 1).to(device)
    return torch.where(in_think, think_advantage, answer_advantage)


def update(
    policy, ref_model, optimizer, rollout: Rollout, advantages, cfg, train_model=None, autocast_dtype=None
):
    """Eq. (9) on one rollout: `mu` passes over its backprop minibatches (§4.1: sample / backprop =
    4), one AdamW step each. Every rank has as many rows, so as many minibatches, which DDP needs
    (one all-reduce per backward). -> the statistics of the updates."""
    started, train_model = time.perf_counter(), policy if train_model is None else train_model
    device = next(policy.parameters()).device
    logprobs_of = token_logprobs_of(policy, train_model, rollout, cfg, autocast_dtype)
    policy_mask = rollout.policy_mask.to(device)
    sampler = None if rollout.sampler_logprobs is None else rollout.sampler_logprobs.to(device)
    minibatches = torch.arange(len(policy_mask), device=device).tensor_split(
        min(cfg.sample_ratio, len(policy_mask))
    )

    # pi_old and pi_ref, once per rollout, by the same path as the loss's forward: the same function,
    # the same micro-batches, train mode (the models have no dropout; gradient checkpointing runs only
    # there). The first minibatch needs no pi_old pass: it is scored before any update, where
    # pi_theta = pi_old, so its own log-probs serve.
    policy.train()
    old_logprobs = torch.zeros(policy_mask.shape, device=device)
    ref_logprobs = (
        torch.zeros(policy_mask.shape, device=device) if cfg.beta > 0 and ref_model is not None else None
    )
    with torch.no_grad():
        for index, rows in enumerate(minibatches):
            for part in micro_batches(rows, cfg.micro_batch_size):
                if index > 0:
                    old_logprobs[part] = logprobs_of(policy, part)[0]
                if ref_logprobs is not None:
                    ref_logprobs[part] = logprobs_of(ref_model, part)[0]

    updates, entropies, skipped = [], [], 0
    for epoch in range(cfg.mu):
        for index, rows in enumerate(minibatches):
            optimizer.zero_grad(set_to_none=True)
            parts = micro_batches(rows, cfg.micro_batch_size)
            tokens = policy_mask[rows].sum().clamp(min=1).item()  # Eq. (9)'s tokens: the policy's
            totals = dict.fromkeys(("loss", "kl", "clip_fraction", "ratio", "entropy_sum"), 0.0)
            for i, part in enumerate(parts):
                with accumulate(train_model, sync=i == len(parts) - 1):  # DDP: all-reduce after the last
                    logprobs, entropy = logprobs_of(train_model, part, with_entropy=epoch == 0)
                    if epoch == 0 and index == 0:  # pi_old of the first minibatch, for the passes mu > 1
                        old_logprobs[part] = logprobs.detach()
                    ref = None if ref_logprobs is None else ref_logprobs[part]
                    sampled = None if sampler is None else sampler[part]
                    is_weights = truncated_is_weights(old_logprobs[part], sampled, cfg.is_cap)
                    loss, loss_stats = grpo_loss(
                        logprobs, old_logprobs[part], ref, advantages[part], policy_mask[part],
                        cfg.clip_eps, cfg.beta, cfg.loss_norm, is_weights,
                    )  # fmt: skip
                    weight = micro_batch_weight(part, rows, policy_mask, cfg.loss_norm)
                    (loss * weight).backward()  # every rank, even a bad loss: DDP/FSDP need all ranks
                add_micro_batch(totals, loss.item() * weight, loss_stats, entropy, policy_mask[part], tokens)
            if epoch == 0:
                entropies.append(totals["entropy_sum"] / tokens)
            grad_norm = clip_grad_norm(policy.parameters(), cfg.max_grad_norm).item()
            # A non-finite loss or gradient must never reach the weights (nor AdamW's moments).
            if all_ranks_any(not (math.isfinite(totals["loss"]) and math.isfinite(grad_norm)), device):
                optimizer.zero_grad(set_to_none=True)
                skipped += 1
                continue
            optimizer.step()
            updates.append(dict(totals, grad_norm=grad_norm))
    optimizer.zero_grad(set_to_none=True)
    policy.eval()
    return dict(
        updates=updates,
        entropies=entropies,
        skipped=skipped,
        train_s=time.perf_counter() - started,
        **sampler_mismatch(old_logprobs, sampler, policy_mask, cfg.is_cap),
    )


def token_logprobs_of(policy, train_model, rollout: Rollout, cfg, autocast_dtype):
    """-> logprobs_of(model, rows, with_entropy=False): (log pi(o_t | P, o_<t) [R, C], entropy or
    None) of the completion tokens of `rows` (one micro-batch) in one forward. One path for
    pi_old, pi_theta and pi_ref: each distinct prompt runs once for its K rows
    (modeling.completion_logprobs) unless a wrapper (DDP, FSDP) or gradient checkpointing allows only
    one module call per backward; then no pass shares, so pi_old equals pi_theta before an update to
    the last bit, where the two paths differ under bf16 autocast by ~0.03 nats a token."""
    device = next(policy.parameters()).device
    input_ids, attention_mask = rollout.sequences(device)
    C = rollout.completion_ids.shape[1]
    sharded = any(hasattr(p, "to_local") for p in policy.parameters())
    share = cfg.share_prompts and not sharded and train_model is policy and not cfg.gradient_checkpointing
    suppress = policy.generation_config.suppress_tokens  # never sampled (srt/decode.py): not in pi either
    suppress = torch.tensor(suppress, device=device) if suppress else None

    def logprobs_of(model, rows, with_entropy=False):
        with autocast(device, autocast_dtype):
            return completion_logprobs(
                model, input_ids[rows], attention_mask[rows], C, cfg.temperature,
                with_entropy, share, suppress,
            )  # fmt: skip

    return logprobs_of


def sampler_mismatch(old_logprobs, sampler_logprobs, policy_mask, cap: float) -> dict:
    """How far the sampler was from pi_old, over the policy's tokens: the mean of log pi_old -
    log pi_sampler, the k3 estimate of KL(pi_sampler || pi_old) (the tokens came from the sampler),
    and the share of tokens whose importance weight the cap truncated. NaN where the sampler's
    log-probs are unknown. About 0 on an fp32 CPU; ~0.04 nats a token on a bf16 sampler."""
    if sampler_logprobs is None:
        return dict(sampler_log_ratio=float("nan"), sampler_kl=float("nan"), is_capped_fraction=float("nan"))
    sampled = policy_mask.bool()  # in fp64: the fp32 gap is ~1e-7, and k3 of it rounds below 0 in fp32
    old_logprobs, sampler_logprobs = old_logprobs.double(), sampler_logprobs.double()
    log_ratio = (old_logprobs - sampler_logprobs)[sampled]
    capped = (log_ratio > math.log(cap)).float().mean().item() if cap > 0 and len(log_ratio) else 0.0
    return dict(
        sampler_log_ratio=log_ratio.mean().item() if len(log_ratio) else 0.0,
        sampler_kl=k3_kl(sampler_logprobs[sampled], old_logprobs[sampled]).mean().item()
        if len(log_ratio)
        else 0.0,
        is_capped_fraction=capped,
    )


def micro_batches(rows: torch.Tensor, size: int) -> tuple[torch.Tensor, ...]:
    """--micro-batch-size rows at a time: the unit of every forward pass (memory_plan.py)."""
    return rows.split(size or len(rows))


def micro_batch_weight(part, rows, policy_mask, loss_norm: str) -> float:
    """Eq. (9) averages over a minibatch's completions (seq) or its policy tokens (token): each
    micro-batch weighs by its share, so the summed gradient is the one of the whole minibatch at once."""
    if loss_norm == "seq":
        return len(part) / len(rows)
    return policy_mask[part].sum().item() / policy_mask[rows].sum().clamp(min=1).item()


def add_micro_batch(totals: dict, weighted_loss, loss_stats, entropy, policy_mask, tokens) -> None:
    """Fold one micro-batch into its minibatch's totals: the loss by its Eq. (9) weight, the token
    means (KL, clip fraction, ratio) by its share of the minibatch's policy tokens, the entropy summed."""
    totals["loss"] += weighted_loss
    for key, value in loss_stats.items():
        totals[key] += value * policy_mask.sum().item() / tokens
    if entropy is not None:
        totals["entropy_sum"] += torch.where(policy_mask > 0, entropy, 0.0).sum().item()


def step_result(rollout: Rollout, stats: dict) -> dict:
    """What a step reports: its samples and scores, the mean of each update's statistics, the
    sampler's mismatch, lengths, timings."""
    updates, lengths = stats["updates"], rollout.completion_mask.sum(1).float()
    copied = (rollout.completion_mask - rollout.policy_mask).sum(1).float()  # --recall copy's tokens

    def mean_over_updates(key):
        return float(np.mean([update[key] for update in updates])) if updates else float("nan")

    return {
        "scores": rollout.scores,
        "texts": rollout.texts,
        "records": rollout.records,
        **{key: mean_over_updates(key) for key in ("loss", "grad_norm", "kl", "clip_fraction", "ratio")},
        "entropy": float(np.mean(stats["entropies"])) if stats["entropies"] else float("nan"),
        **{key: stats[key] for key in ("sampler_log_ratio", "sampler_kl", "is_capped_fraction")},
        "completion_length": lengths.mean().item(),
        "copied_length": copied.mean().item(),
        "completion_tokens": int(lengths.sum().item()),
        "sequence_tokens": int(rollout.prompt_mask.sum().item() + rollout.completion_mask.sum().item()),
        "skipped_updates": stats["skipped"],
        "updates": len(updates),
        "generate_s": rollout.generate_s,
        "score_s": rollout.score_s,
        "train_s": stats["train_s"],
        "draws": rollout.draws,
        "groups_drawn": rollout.groups_drawn,
        "groups_all_equal": rollout.groups_all_equal,
        "groups_recall_constant": rollout.groups_recall_constant,
    }


# --------------------------------------------------------------------------------------------
# Greedy evaluation on held-out records (the "before / after" check; evaluate.py does the full §4).
# --------------------------------------------------------------------------------------------
def evaluate_policy(
    model,
    tokenizer,
    records,
    max_new_tokens=160,
    batch_size=8,
    reward_fn=None,
    max_prompt_length=None,
    autocast_dtype=None,
    progress=True,
    recall="free",
) -> dict:
    """Mean reward components and recall Jaccard of greedy completions, on prompts fitted the way
    GRPO fits them (oldest turns first; a gold turn cut is counted), decoded in `recall` mode."""
    fitted = [fit_prompt(tokenizer, r, max_prompt_length) for r in records]
    result = greedy_probe(
        model,
        tokenizer,
        records,
        [p for p, _ in fitted],
        reward_fn or compute_rewards,
        max_new_tokens,
        batch_size,
        autocast_dtype,
        progress,
        recall,
    )
    return dict(result, gold_turns_cut=sum(cut for _, cut in fitted))


# --------------------------------------------------------------------------------------------
# Configuration: argparse defaults that work, presets, explicit flags win.
# --------------------------------------------------------------------------------------------
# Why each value: docs/experiments/presets.md ("Stage 2").
# fmt: off
PRESETS = {
    # §4.1 where the paper gives a value (lr 3e-7, K = 8, ratio 4, AdamW, KL to the SFT policy);
    # the rest is ours, sized for 8 x A100-80GB with --fsdp (memory_plan.py: about 50 GB per GPU).
    "paper": dict(lr=3e-7, num_generations=8, sample_ratio=4, beta=0.04, clip_eps=0.2, mu=1,
                  prompts_per_step=8, max_new_tokens=1024, max_prompt_length=4096, warmup_steps=10,
                  max_steps=1000, save_every=50, sample_every=10, gradient_checkpointing=True,
                  micro_batch_size=2),
    # `make table2`: SmolLM2-135M after SFT on a 2-core CPU: 12 steps of one group of K = 4, two AdamW
    # updates each; 1536 prompt tokens hold every synthetic prompt and 256 new tokens the longest SFT
    # chain; dynamic sampling on the recall part (after SFT most groups recall one set), at most 2
    # draws; T = 1.0.
    "cpu-demo": dict(num_generations=4, prompts_per_step=1, sample_ratio=2, mu=1, lr=3e-6, warmup_steps=1,
                     beta=0.04, max_new_tokens=256, max_prompt_length=1536, max_steps=12, sample_every=1,
                     save_every=4, eval_limit=16, eval_batch_size=8, probe_every=6, dynamic_sampling="recall",
                     max_draws=2),
}
# GRPO on the turns that need recall (§3): 30 steps of two groups at lr 1e-5
# (docs/experiments/grpo-recall.md).
PRESETS["cpu-long"] = dict(PRESETS["cpu-demo"], train_turns="dependent", prompts_per_step=2, lr=1e-5,
                           max_steps=30, probe_every=10, save_every=5)
# `make demo`, the lesson: cpu-demo's GRPO on the short dialogues of stage 0's cpu-lesson (prompts
# under 1024 tokens), 4 steps, probed before and after: the mechanics of Eqs. (4)-(9) on a real run.
PRESETS["cpu-lesson"] = dict(PRESETS["cpu-demo"], max_prompt_length=1024, max_steps=4, probe_every=4)
# fmt: on


def build_parser() -> argparse.ArgumentParser:
    p = training_parser(__doc__.split("\n\n")[0])
    run = add_run_flags(
        p,
        model_default="runs/demo/sft/final",
        model_help="the SFT policy to start from; also the frozen KL reference",
        data_help="training records, JSONL; several files with a weight each train on a mix "
        "(srt/data_io.py mix_sources), e.g. syn/train.jsonl:0.5 locomo/train.jsonl:0.5",
        out_default="runs/demo/grpo",
        resume_help="continue from <out>/checkpoint; a finished run is left as it is",
        max_steps_default=100,
        max_steps_help="GRPO steps; each is one sample batch",
        budget_help="stop early (saved, resumable) when the next step and the final evaluation would "
        "overrun this",
    )
    run.add_argument(
        "--explain",
        action="store_true",
        help="run one step on one group and print every quantity of "
        "Eqs. (4)-(9), as computed by hand (docs/grpo-step.md); only --explain-html is written",
    )
    run.add_argument(
        "--explain-tries",
        type=at_least(1),
        default=8,
        help="--explain: groups to sample, one prompt each, until one whose K rewards differ "
        "(an all-equal group has advantage 0, Eq. (8)); the last is explained if none does",
    )
    run.add_argument(
        "--explain-html",
        default="runs/explain/grpo-step.html",
        metavar="PATH",
        help="--explain: the step as a self-contained page, tokens shaded by their ratio (srt/step_page.py)",
    )

    paper = method_group(
        p,
        "the paper's §4.1 settings and Eq. (9)'s constants",
        "§4.1 gives the learning rate, K, the sample/backprop ratio, AdamW with a linear warm-up and the "
        "KL term; the values it leaves out (beta, epsilon, lengths) are ours",
    )
    add = paper.add_argument
    add("--num-generations", "-K", type=at_least(1), default=8, help="K completions per prompt (§4.1: 8)")
    add("--prompts-per-step", type=at_least(1), default=1, help="prompts per rank per step")
    add("--sample-ratio", type=at_least(1), default=4, help="sample batch / backprop minibatch (§4.1: 4)")
    add("--mu", type=at_least(1), default=1, help="passes over each sample batch")
    add(
        "--lr",
        type=at_least(0.0, float),
        default=1e-6,
        help="AdamW learning rate after warm-up (paper: 3e-7)",
    )
    add("--warmup-steps", type=at_least(0), default=2, help="linear warm-up, in GRPO steps")
    add("--weight-decay", type=at_least(0.0, float), default=0.0, help="AdamW weight decay")
    add("--max-grad-norm", type=positive(float), default=1.0, help="gradient clipping")
    add(
        "--beta",
        type=at_least(0.0, float),
        default=0.04,
        help="KL weight of Eq. (9), not printed in the paper; 0 skips pi_ref",
    )
    add("--clip-eps", type=positive(float), default=0.2, help="epsilon of the clipped ratio in Eq. (9)")
    add("--temperature", type=positive(float), default=1.0, help="sampling temperature")
    add(
        "--top-p",
        type=Bounded(float, low=0.0, high=1.0, strict=True),
        default=1.0,
        help="nucleus sampling; stage 2 takes only 1.0 (Eq. (9)'s ratio and KL are over the full softmax)",
    )
    add("--max-new-tokens", type=up_to(MAX_NEW_TOKENS), default=256, help="completion length cap")
    add(
        "--max-prompt-length",
        type=at_least(0),
        default=1024,
        help="prompt tokens; a longer prompt loses its oldest utterances, whatever they are (0 = no cap)",
    )

    beyond = method_group(
        p,
        "beyond the paper",
        "listed in the module docstring; each off or the paper's choice by default, but --is-cap, which "
        "acts only where rollouts come from a bf16 copy of the policy",
    )
    add = beyond.add_argument
    add(
        "--answer-reward",
        choices=ANSWER_REWARDS,
        default="cosine",
        help="Eq. (7): cosine (the paper), keys, both",
    )
    add(
        "--answer-gate",
        choices=ANSWER_GATES,
        default="off",
        help="recall: -1 for an answer whose recall missed H* (reward.py)",
    )
    add(
        "--dynamic-sampling",
        choices=["off", "total", "recall"],
        default="off",
        help="DAPO: replace groups whose "
        "K total rewards (advantage 0, no gradient), or recall parts (no recall signal), are all equal",
    )
    add(
        "--max-draws",
        type=at_least(1),
        default=4,
        help="sample batches one step may draw under --dynamic-sampling",
    )
    add(
        "--train-turns",
        choices=["all", "dependent"],
        default="all",
        help="dependent: only turns whose H* is not empty",
    )
    add(
        "--credit",
        choices=["sequence", "segment"],
        default="sequence",
        help="sequence: Eq. (8)'s one advantage per completion; segment: the think tokens take the "
        "advantage of format + recall, the answer's of format + answer",
    )
    add(
        "--loss-norm",
        choices=["seq", "token"],
        default="seq",
        help="seq: Eq. (9) as written; token: mean over all tokens (DAPO)",
    )
    add(
        "--is-cap",
        type=at_least(0.0, float),
        default=2.0,
        help="truncated importance sampling: each token's surrogate times min(pi_old / pi_sampler, C), "
        "for rollouts drawn on a bf16 copy of the policy (not in the paper); 0: off",
    )
    add(
        "--recall",
        choices=RECALL_MODES,
        default="free",
        help="copy: the policy names a turn (<HIS>A3:) and the decoder writes it out, tokens outside "
        "the loss (srt/recall.py; not in the paper); free: the policy copies every token (the paper)",
    )
    add(
        "--placebo",
        action="store_true",
        help="a control: each group's K rewards shuffled among its samples before Eq. (8) (seeded by "
        "--seed), so that a real run is credited only with what it does beyond updates of the same size "
        "and spread that carry no signal; the probes score with the true reward",
    )

    scale = add_scale_group(p)
    add = scale.add_argument
    add(
        "--micro-batch-size",
        type=at_least(0),
        default=0,
        help="rows per forward and backward inside a backprop "
        "minibatch, gradients accumulated (the update is unchanged); 0 = the whole minibatch at once",
    )
    add(
        "--share-prompts",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run each group's prompt once in the log-prob passes (its KV cache copied to its K rows)",
    )

    logs = add_log_group(p, save_every_default=10, save_every_low=0)
    add = logs.add_argument
    add("--sample-every", type=at_least(0), default=5, help="write sampled completions every N steps")
    add(
        "--eval-data",
        default=None,
        help="held-out records for the greedy probe (cpu-demo: dev.jsonl beside --data)",
    )
    add(
        "--eval-limit",
        type=at_least(0),
        default=40,
        help="probe this many records, stratified by bucket; 0 = none",
    )
    add(
        "--probe-every",
        type=at_least(0),
        default=0,
        help="probe also every N steps (0: before and after only)",
    )
    add("--eval-batch-size", type=at_least(1), default=8, help="greedy evaluation batch")
    add("--eval-max-new-tokens", type=at_least(1), default=None, help="(default: --max-new-tokens)")
    return finish_parser(p, scale)


def parse_args(argv=None) -> argparse.Namespace:
    cfg = parse_config(build_parser(), PRESETS, argv)
    # The ratio and the KL of Eq. (9) read log-probs of softmax(logits / T) over the whole vocabulary
    # (but suppressed tokens): a nucleus sampler draws from another distribution, which they would
    # not see. Refused rather than half-corrected.
    require(
        cfg.top_p == 1.0,
        f"--top-p {cfg.top_p}: stage 2 samples from the full softmax(logits / T), whose log-probs "
        "the ratio and KL of Eq. (9) use; a nucleus would bias both (use 1.0)",
    )
    require(cfg.is_cap == 0 or cfg.is_cap >= 1, f"--is-cap {cfg.is_cap}: 0 (off) or a cap of at least 1")
    require(
        not (cfg.explain and cfg.placebo),
        "--explain prints one step with the true rewards; --placebo is for a training run",
    )
    # Eq. (8) centres each group's rewards on their mean: a group of one has advantage 0, and a
    # learning rate of 0 moves nothing. Either run would train its steps and change no weight.
    require(
        cfg.num_generations >= 2,
        f"-K {cfg.num_generations}: a group of one completion has advantage 0 (Eq. (8)), so no step "
        "would train; use -K 2 or more (§4.1: 8)",
    )
    require(
        cfg.lr > 0, f"--lr {cfg.lr}: a learning rate of 0 moves no weight; give one above 0 (paper: 3e-7)"
    )
    # the CPU presets show their before / after on the dev split beside the training data
    if cfg.preset in ("cpu-demo", "cpu-long", "cpu-lesson") and cfg.eval_data is None:
        dev = Path(data_paths(cfg.data)[0]).parent / "dev.jsonl"
        cfg.eval_data = str(dev) if dev.exists() else None
    cfg.eval_max_new_tokens = cfg.eval_max_new_tokens or cfg.max_new_tokens
    return cfg


# --------------------------------------------------------------------------------------------
# The training run
# --------------------------------------------------------------------------------------------
SAVE_MARGIN_S = 30  # writing checkpoint/ and final/ at the end of a time-budgeted run
# What a --resume must match, derived from the flag groups (srt/run.py resume_keys): the model, the
# data and its sha256, the seed, the world size, and every flag of the paper's and the departures'
# groups. Not --micro-batch-size nor --fsdp: the same update in parts or shards.
RESUME_MUST_MATCH = resume_keys(build_parser())


def draw_prompts(stream: PromptStream, n: int) -> tuple[list[dict], list[str]]:
    """This rank's next n (records, prompts) from the prompt stream."""
    pairs = stream.next_batch(n)
    return [record for record, _ in pairs], [prompt for _, prompt in pairs]


def train(cfg, reward_fn=None, step_fn=None) -> dict:
    """Run stage 2 as configured by `cfg` (see parse_args); -> the summary written to summary.json.
    `reward_fn(completions, records) -> [{"total": .., <components>}]` defaults to reward.py's;
    `step_fn`, what runs one step, to grpo_step (bench/grpo_workers.py passes a timed one)."""
    step_fn = step_fn or grpo_step
    run = Run(cfg, "stage2_grpo.py", build_parser(), reserve_s=SAVE_MARGIN_S)  # srt/run.py
    rank, world_size, device, main_process = run.rank, run.world_size, run.device, run.main_process
    out, budget = run.out, run.budget
    reward_fn = reward_fn or functools.partial(
        compute_rewards, answer_reward=cfg.answer_reward, answer_gate=cfg.answer_gate
    )
    # --placebo: the training steps read shuffled rewards, the probes the true ones. The permutations
    # have their own generator, seeded by --seed, which a --resume starts afresh.
    step_reward_fn = (
        shuffled_within_groups(reward_fn, cfg.num_generations, random.Random(cfg.seed))
        if cfg.placebo
        else reward_fn
    )
    # --train-turns dependent: H* chooses which turns train (in each file, before the mix), never
    # what a prompt shows
    keep = (lambda r: bool(r["recall"])) if cfg.train_turns == "dependent" else None
    records = read_mixture(cfg.data, cfg.seed, keep, note=f" (--train-turns {cfg.train_turns})")
    run.record_data()
    eval_records = (
        pick_eval_records(read_jsonl(cfg.eval_data), cfg.eval_limit)
        if cfg.eval_data and cfg.eval_limit > 0
        else None
    )
    done = run.finished(cfg.max_steps, also=["eval_after.json"] if eval_records else [])
    if done:
        return done

    # The policy (fp32 master weights, bf16 autocast where the hardware has it) and the frozen
    # reference pi_ref = the SFT model we start from, even when resuming. Under FSDP both load on
    # the CPU and each rank moves only its shards to its GPU; pi_ref, which never trains, in bf16.
    policy, tokenizer = run.load_model("grpo")
    ref_model = None
    if cfg.beta > 0:
        ref_dtype = "bfloat16" if cfg.fsdp and run.autocast_dtype == torch.bfloat16 else cfg.dtype
        ref_model, _ = run.load_model("grpo", name=cfg.model, dtype=ref_dtype)
        ref_model.eval().requires_grad_(False)
    if cfg.fsdp and ref_model is not None:  # pi_ref never trains: sharded, without a wrapper
        ref_model = shard_model(ref_model, device)
    policy, train_model, optimizer = run.prepare(policy, tokenizer)
    autocast_dtype = run.autocast_dtype
    # Rollouts sample from a bf16 copy of the policy where the hardware has bf16 units (srt/decode.py),
    # refreshed after each optimizer step; the loss and the fp32 master weights are untouched.
    follow_optimizer(policy, optimizer)
    stream = PromptStream(records, tokenizer, cfg.max_prompt_length, cfg.seed, rank, world_size)
    seed_everything(cfg.seed + rank)  # each rank samples its own completions
    state = run.resume()
    if state:
        stream.load_state_dict(state["stream"])
    start_step = run.start_step
    metrics, samples, probes = run.log("metrics.jsonl"), run.log("samples.jsonl"), run.log("probe.jsonl")
    run.write_config()

    def run_eval(step, name=None):  # each rank its slice of the records, the weights gathered once (FSDP)
        with full_weights(policy):
            mine = evaluate_policy(
                policy,
                tokenizer,
                eval_records[rank::world_size],
                cfg.eval_max_new_tokens,
                cfg.eval_batch_size,
                reward_fn=reward_fn,
                max_prompt_length=cfg.max_prompt_length,
                autocast_dtype=autocast_dtype,
                progress=main_process,
                recall=cfg.recall,
            )
        result = {k: finite_or_none(v) for k, v in merge_probes(gather_objects(mine, world_size)).items()}
        if main_process:
            probes.append({"step": step, **{k: v for k, v in result.items() if k != "examples"}})
            plot_learning_curve(metrics.rows, probes.rows, out / "learning_curve.png")
            if name:  # eval_before.json / eval_after.json
                write_json(out / name, result)
            tqdm.write(f"probe at step {step}: " + ", ".join(f"{k} {result[k]}" for k in PROBE_KEYS))

    if eval_records and start_step == 0:
        t = time.perf_counter()
        run_eval(0, "eval_before.json")
        budget.reserve_s += time.perf_counter() - t  # the final evaluation takes about as long
    elif eval_records and (out / "eval_before.json").exists():
        budget.reserve_s += json.loads((out / "eval_before.json").read_text()).get("seconds") or 0.0

    def save(step):
        run.save(step, stream=stream.state_dict())

    step = start_step
    progress = tqdm(total=cfg.max_steps, initial=start_step, desc="grpo", disable=not main_process)
    while run.keep_going(step, cfg.max_steps):
        step += 1
        lr = warmup_lr(step, cfg.lr, cfg.warmup_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        t = time.perf_counter()
        records_of_step, prompts_of_step = draw_prompts(stream, cfg.prompts_per_step)
        result = step_fn(
            policy,
            ref_model,
            tokenizer,
            optimizer,
            records_of_step,
            prompts_of_step,
            cfg,
            reward_fn=step_reward_fn,
            train_model=train_model,
            autocast_dtype=autocast_dtype,
            draw_more=functools.partial(draw_prompts, stream, cfg.prompts_per_step),
        )
        step_s = time.perf_counter() - t
        budget.record_step(step_s)

        # Every rank's completions and statistics, logged by rank 0.
        all_results = gather_objects(
            {k: v for k, v in result.items() if k not in ("texts", "records")}, world_size
        )
        if main_process:
            line = step_metrics(
                step,
                all_results,
                step_s,
                lr=lr,
                skipped_prompts=stream.skipped,
                gold_turns_cut=stream.gold_cut,
                peak_gpu_gb=peak_gpu_gb(device),
            )
            metrics.append({k: finite_or_none(v) for k, v in line.items()})
            if result["skipped_updates"]:
                tqdm.write(
                    f"step {step}: skipped {result['skipped_updates']} update(s) with a non-finite "
                    f"loss or gradient; the weights are unchanged by them"
                )
            if cfg.sample_every and step % cfg.sample_every == 0:
                samples.append(*sample_lines(step, result, cfg.num_generations))
            progress.set_postfix(
                reward=f"{line.get('reward_total_mean', float('nan')):.3f}",
                kl=f"{line['kl']:.4f}",
                len=f"{line['completion_length']:.0f}",
            )
        progress.update(1)
        if cfg.save_every and step % cfg.save_every == 0 and step < cfg.max_steps:
            save(step)
        if eval_records and cfg.probe_every and step % cfg.probe_every == 0 and step < cfg.max_steps:
            run_eval(step)
    progress.close()

    save(step)
    run.save_final()  # save_pretrained form, also under FSDP
    run.warn_if_stopped_early(step, cfg.max_steps)
    if eval_records:
        run_eval(step, "eval_after.json")
    digests = gather_objects(parameter_digest(policy), world_size)  # DDP ranks must agree bit for bit
    summary = {
        "steps": step,
        "stop_reason": "max_steps" if step >= cfg.max_steps else "time_budget",
        "seconds": budget.elapsed_s(),
        "world_size": world_size,
        "ranks_in_sync": None if cfg.fsdp else len(set(digests)) == 1,
    }  # FSDP ranks hold different shards
    run.write_summary(summary)
    if main_process:
        print(f"done: {step} steps ({summary['stop_reason']}); model in {out / 'final'}", flush=True)
    run.barrier()
    return summary


def main(argv=None) -> None:
    cfg = parse_args(argv)
    run_main(
        cfg, "grpo", (lambda cfg: grpo_explain.explain(cfg, sys.modules[__name__])) if cfg.explain else train
    )


if __name__ == "__main__":
    main()
