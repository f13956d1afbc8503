"""Stage 2 of SRT: recall-reasoning alignment with GRPO (paper §3.4, Eqs. (8)-(9)), in plain PyTorch.

One GRPO step (grpo_step), in the paper's order, which is this file's:

  rollout     K completions tau^(k) of each prompt P(Q_t, C_t), each token's log pi_sampler kept, scored
              with R = format + recall + answer (sample_groups; reward.py, Eqs. (4)-(7))
  Eq. (8)     A~(k) = (R(k) - mean R) / (std R + 1e-8) within each group (group_advantages)
  experience  the advantages, log pi_old (the policy before the step), log pi_ref (the frozen SFT
              model) and each token's weights, filled once before the first update (Experience)
  Eq. (9)     the clipped surrogate minus beta * KL, k3 to pi_ref (k3_kl, loss_weights, grpo_loss), its
              ratio per token, or GSPO's per completion (importance_ratio, --importance-sampling-level)
  update      `mu` passes over the backprop minibatches (§4.1: sample/backprop ratio 4), one AdamW
              step each (constant learning rate after a linear warm-up)

Then the run: flags, train loop, logs. Where this departs from the paper: one numbered list, with
the flags of the "beyond the paper" group, in docs/pipeline.md ("Stage 2: departures from the paper").

    python stage2_grpo.py --preset cpu-lesson --model runs/demo/sft/final --data runs/demo/data/train.jsonl \\
        --out runs/demo/grpo
    python stage2_grpo.py --explain --model runs/demo/sft/final      # one step, every quantity printed
    torchrun --nproc_per_node=8 stage2_grpo.py --model runs/paper/sft/final --data ... --preset paper --fsdp
"""

from __future__ import annotations

import srt.startup  # noqa: F401  # isort: skip  (first: Ctrl-C while torch loads is one line)

import argparse
import dataclasses
import functools
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from reward import add_answer_flags, compute_rewards
from srt import grpo_explain, step_page
from srt import run as harness  # srt/run.py, the harness: --out, ranks, loading, resume, checkpoints
from srt.config import (
    Bounded,
    add_max_new_tokens,
    at_least,
    parse_config,
    positive,
    require,
)
from srt.data_io import finite_or_none, read_jsonl, read_mixture
from srt.distributed import (
    accumulate,
    all_ranks_any,
    clip_grad_norm,
    full_weights,
    gather_objects,
    shard_model,
)
from srt.generation import completion_logprobs, generate
from srt.loading import parameter_digest
from srt.precision import peak_gpu_gb
from srt.probe import (
    StepStats,
    add_probe_flags,
    pick_eval_records,
    probe_and_log,
    resolve_probe_flags,
    sample_lines,
    step_metrics,
)
from srt.recall import add_recall_flag
from srt.rollouts import PromptStream, Rollout, think_lengths
from srt.training import seed_everything, warmup_lr


# --------------------------------------------------------------------------------------------
# One step's inputs: the models and what the step reads of the flags
# --------------------------------------------------------------------------------------------
@dataclass
class Models:
    """The step's models: `policy` samples and holds the weights; `train_model` is its DDP or FSDP
    wrapper (default: the policy), whose backward all-reduces; `ref_model` the frozen pi_ref, None
    at beta = 0."""

    policy: torch.nn.Module
    tokenizer: object
    optimizer: torch.optim.Optimizer
    ref_model: torch.nn.Module | None = None
    train_model: torch.nn.Module | None = None

    def __post_init__(self):
        self.train_model = self.policy if self.train_model is None else self.train_model


@dataclass(frozen=True)
class StepSettings:
    """What one step reads of the flags (StepSettings.of(cfg)), and the autocast precision."""

    num_generations: int  # K
    sample_ratio: int  # sample batch / backprop minibatch
    mu: int  # passes over the sample batch
    clip_eps: float
    beta: float
    loss_type: str  # LOSS_TYPES
    scale_rewards: str  # SCALE_REWARDS
    credit: str  # sequence | segment
    importance_sampling_level: str  # IMPORTANCE_SAMPLING_LEVELS: token (Eq. (9)) | sequence (GSPO)
    gspo_clip_eps: float  # the clip's epsilon at the sequence level
    clip_higher: float | None  # the clip's upper epsilon (DAPO); None: the lower one
    is_mode: str  # IS_MODES: how the sampler's tokens are corrected to pi_old
    is_cap: float
    max_new_tokens: int
    temperature: float
    top_p: float
    recall: str  # free | copy
    dynamic_sampling: str  # off | total | recall
    max_draws: int
    max_grad_norm: float
    micro_batch_size: int  # 0: the whole minibatch at once
    share_prompts: bool
    gradient_checkpointing: bool
    autocast_dtype: torch.dtype | None = None

    @classmethod
    def of(cls, cfg, autocast_dtype=None) -> StepSettings:
        names = [f.name for f in dataclasses.fields(cls) if f.name != "autocast_dtype"]
        return cls(**{name: getattr(cfg, name) for name in names}, autocast_dtype=autocast_dtype)


# --------------------------------------------------------------------------------------------
# The rollout: K completions of each prompt, scored with R = format + recall + answer
# (Eqs. (4)-(7))
# --------------------------------------------------------------------------------------------
def sample_groups(models: Models, records, prompts, settings: StepSettings, reward_fn) -> Rollout:
    """K completions per prompt from the policy in one batched generate (srt/decode.py's loop: each
    prompt prefilled once for its K rows; on a bf16 copy of the policy where the hardware has bf16
    units, under FSDP on the gathered bf16 weights), scored with the verifiable reward
    R = format + recall + answer (Eqs. (4)-(7))."""
    t0 = time.perf_counter()
    # FSDP: gathered once for the whole batch, decoded as a plain module, freed after (srt/distributed.py)
    with full_weights(models.policy):
        out = generate(
            models.policy,
            models.tokenizer,
            prompts,
            num_generations=settings.num_generations,
            max_new_tokens=settings.max_new_tokens,
            temperature=settings.temperature,
            top_p=settings.top_p,
            autocast_dtype=settings.autocast_dtype,
            recall=settings.recall,
        )
    t1 = time.perf_counter()
    examples = [record for record in records for _ in range(settings.num_generations)]
    scores = reward_fn(out["texts"], examples)
    return Rollout(
        prompt_ids=out["prompt_ids"],
        prompt_mask=out["prompt_mask"],
        completion_ids=out["completion_ids"],
        completion_mask=out["completion_mask"],
        policy_mask=out.get("policy_mask", out["completion_mask"]),  # 0 on a turn copied out (--recall copy)
        sampler_logprobs=out.get("sampler_logprobs"),
        texts=out["texts"],
        records=examples,
        scores=scores,
        num_generations=settings.num_generations,
        groups_drawn=len(prompts),
        generate_s=t1 - t0,
        score_s=time.perf_counter() - t1,
    )


def sample_batch(
    models: Models, records, prompts, settings: StepSettings, reward_fn, draw_more=None
) -> Rollout:
    """sample_groups, with DAPO's dynamic sampling as a branch (--dynamic-sampling, off by default):
    this rank's sample batch of len(prompts) groups. With --dynamic-sampling total, groups whose K
    rewards are all equal add nothing to the gradient; with --dynamic-sampling recall, groups whose
    recall parts are all equal carry no recall signal. Fresh prompts are drawn in their place, at most
    --max-draws sample batches a step, and what stays uninformative fills the rest. Every rank draws
    as often as the others, so the prompt stream and the DDP all-reduces stay in step."""
    K, key = settings.num_generations, settings.dynamic_sampling
    device = next(models.policy.parameters()).device
    draws = [sample_groups(models, records, prompts, settings, reward_fn)]

    def informative_groups():
        return [
            (d, g)
            for d, draw in enumerate(draws)
            for g, same in enumerate(constant_groups(draw.scores, K, key))
            if not same
        ]

    while (
        key != "off"
        and draw_more is not None
        and len(draws) < settings.max_draws
        and all_ranks_any(len(informative_groups()) < len(prompts), device)
    ):
        draws.append(sample_groups(models, *draw_more(), settings, reward_fn))
    if key == "off":
        picks = [(0, g) for g in range(len(prompts))]
    else:
        everything = [(d, g) for d, draw in enumerate(draws) for g in range(len(draw.scores) // K)]
        informative = informative_groups()
        picks = (informative + [p for p in everything if p not in informative])[: len(prompts)]
    scores = [s for draw in draws for s in draw.scores]
    return Rollout.join(
        draws,
        picks,
        models.tokenizer.pad_token_id,
        groups_all_equal=sum(constant_groups(scores, K)),
        groups_recall_constant=sum(constant_groups(scores, K, "recall")),
    )


def constant_groups(scores, K, key="total") -> list[bool]:
    """Per group: are its K values of `key` all equal? Then Eq. (8) gives it advantage 0."""
    values = [float(s.get(key, float("nan"))) for s in scores]
    return [len(set(values[g : g + K])) == 1 for g in range(0, len(values), K)]


# --------------------------------------------------------------------------------------------
# Eq. (8): group-relative advantage
# --------------------------------------------------------------------------------------------
ADVANTAGE_EPS = 1e-8
SCALE_REWARDS = ("group", "batch", "none")  # Eq. (8)'s denominator: --scale-rewards


def group_advantages(rewards: torch.Tensor, eps: float = ADVANTAGE_EPS, scale="group", batch_rewards=None):
    """rewards [num_groups, K] -> A~ [num_groups, K] = (R - mean R) / (std R + eps), per group.

    std is the population std (divide by K, not K - 1): a group of one then has std 0 and advantage 0,
    where the sample std would be NaN; for K = 8 the two differ by a constant factor sqrt(8/7) that
    only rescales the step. A group whose rewards are all equal teaches nothing: its advantage is
    exactly 0 under every scale (computed in float64, returned in float32, the loss's dtype); a NaN
    reward stays NaN, with its whole group, so that the step is skipped (never replaced by a number).

    scale (--scale-rewards): "group" is Eq. (8); "batch" divides by the std of `batch_rewards` (the
    whole step's rewards, every rank's; default `rewards`), so a group whose rewards barely differ
    is not blown up to unit scale (Liu et al., 2025 call that a question-difficulty bias); "none"
    keeps R - mean R (Dr. GRPO)."""
    rewards = rewards.double()
    mean = rewards.mean(dim=1, keepdim=True)
    if scale == "group":
        advantages = (rewards - mean) / (rewards.std(dim=1, keepdim=True, unbiased=False) + eps)
    elif scale == "batch":
        everything = rewards if batch_rewards is None else batch_rewards.double()
        advantages = (rewards - mean) / (everything.std(unbiased=False) + eps)
    elif scale == "none":
        advantages = rewards - mean
    else:
        raise ValueError(f"unknown scale {scale!r}; use one of {', '.join(SCALE_REWARDS)}")
    all_equal = (rewards == rewards[:, :1]).all(dim=1, keepdim=True)
    return torch.where(all_equal, torch.zeros_like(advantages), advantages).float()


def rollout_advantages(rollout: Rollout, tokenizer, settings: StepSettings, device) -> torch.Tensor:
    """Eq. (8) for every completion of the sample batch, scaled by --scale-rewards: [B, 1] (one A~
    per completion, --credit sequence, the paper), or [B, C] (--credit segment, not in the paper:
    Eq. (4) pays a lucky answer for a wrong recall, so here the think tokens take the advantage of
    format + recall and the answer tokens that of format + answer)."""

    def advantages_of(*components):
        rewards = rollout.rewards(*components)
        batch = all_ranks_rewards(rewards) if settings.scale_rewards == "batch" else None
        return (
            group_advantages(rewards, scale=settings.scale_rewards, batch_rewards=batch)
            .view(-1, 1)
            .to(device)
        )

    if settings.credit == "sequence":
        return advantages_of("total")
    columns = torch.arange(rollout.completion_ids.shape[1])
    in_think = (columns < think_lengths(tokenizer, rollout.completion_ids).unsqueeze(1)).to(device)
    return torch.where(in_think, advantages_of("format", "recall"), advantages_of("format", "answer"))


# --------------------------------------------------------------------------------------------
# The experience: Eq. (8) over the sample batch, and everything else Eq. (9) reads, filled
# once before the first update
# --------------------------------------------------------------------------------------------
@dataclass
class Experience:
    """One sample batch as Eq. (9) reads it, [B, C] per token (tiny-grpo's Experience), filled once
    by make_experience before the first update and never changed after. experience[rows] is the
    same record for some rows: what one micro-batch's loss reads."""

    input_ids: torch.Tensor  # [B, P + C] prompt + completion, what a forward reads
    attention_mask: torch.Tensor  # [B, P + C]
    policy_mask: torch.Tensor  # [B, C] 1 where the policy sampled the token: the only tokens in the loss
    advantages: torch.Tensor  # [B, C] A~ of Eq. (8) on each token (one per completion, or per segment)
    old_logprobs: torch.Tensor  # [B, C] log pi_old, the policy before the step (0 where masked)
    ref_logprobs: torch.Tensor | None  # [B, C] log pi_ref, the SFT model (None at beta = 0)
    is_weights: torch.Tensor  # [B, C] min(pi_old / pi_sampler, --is-cap), 1 where not corrected
    loss_weights: torch.Tensor  # [B, C] Eq. (9)'s normalisation in its minibatch (loss_weights)
    minibatches: tuple  # the rows of each backprop minibatch (--sample-ratio)

    def __getitem__(self, rows) -> Experience:
        def take(tensor):
            return None if tensor is None else tensor[rows]

        tensors = {
            f.name: take(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "minibatches"
        }
        return Experience(**tensors, minibatches=())


def make_experience(models: Models, rollout: Rollout, settings: StepSettings) -> Experience:
    """Fill the step's Experience: Eq. (8)'s advantages, then pi_old and pi_ref on every sampled token
    in one no-grad pass before the first update, the one place pi_old is filled. The pass is the
    loss's own forward (the same micro-batches, train mode; gradient checkpointing runs only in the
    loss), so that before any update pi_theta / pi_old is 1 to the last bit."""
    device = next(models.policy.parameters()).device
    input_ids, attention_mask = rollout.sequences(device)
    policy_mask = rollout.policy_mask.to(device).float()
    sampled, width = policy_mask > 0, policy_mask.shape[1]
    advantages = rollout_advantages(rollout, models.tokenizer, settings, device)
    minibatches = torch.arange(len(policy_mask), device=device).tensor_split(settings.sample_ratio)
    models.policy.train()  # the loss's mode (dropout is zeroed in stage 2)
    old = logprobs_without_grad(
        models, models.policy, input_ids, attention_mask, width, minibatches, settings
    )
    old = torch.where(sampled, old, 0.0)
    ref = None
    if settings.beta > 0 and models.ref_model is not None:
        ref = logprobs_without_grad(
            models, models.ref_model, input_ids, attention_mask, width, minibatches, settings
        )
        ref = torch.where(sampled, ref, 0.0)
    sampler = None if rollout.sampler_logprobs is None else rollout.sampler_logprobs.to(device)
    if settings.is_mode == "sequence_mask":
        is_weights = sequence_mask_is_weights(old, sampler, policy_mask, settings.is_cap)
    else:
        is_weights = truncated_is_weights(old, sampler, settings.is_cap)
    weights = torch.zeros_like(policy_mask)
    for minibatch in minibatches:
        tokens = all_ranks_tokens(policy_mask[minibatch]) if settings.loss_type == "dapo" else None
        weights[minibatch] = loss_weights(
            policy_mask[minibatch], settings.loss_type, settings.max_new_tokens, tokens, world_size()
        )
    return Experience(
        input_ids=input_ids,
        attention_mask=attention_mask,
        policy_mask=policy_mask,
        advantages=advantages.expand_as(policy_mask),
        old_logprobs=old,
        ref_logprobs=ref,
        is_weights=torch.ones_like(old) if is_weights is None else torch.where(sampled, is_weights, 1.0),
        loss_weights=weights,
        minibatches=minibatches,
    )


# The sampler's correction to pi_old (--is-mode) and the cap each takes unless --is-cap says.
IS_MODES = ("token", "sequence_mask")
IS_CAPS = {"token": 2.0, "sequence_mask": 3.0}  # sequence_mask: TRL's vllm_importance_sampling_cap


def truncated_is_weights(old_logprobs, sampler_logprobs, cap: float):
    """Per token w = min(pi_old / pi_sampler, cap), detached: truncated importance sampling. Eq. (9)
    takes its expectation over o ~ pi_old, but the rollouts came from the sampler: a bf16 copy of the
    policy where the hardware has bf16 units (srt/decode.py), whose log-probs differ a little from the
    fp32 master weights' under autocast. Multiplying each token's surrogate by w makes the gradient
    the on-policy one in expectation; the cap bounds the variance a rare token with
    pi_sampler << pi_old would add, at the price of a bias on those tokens. On an fp32 CPU the
    sampler is the policy itself and w = 1 up to rounding. None (no sampler log-probs, or cap 0):
    no correction."""
    if sampler_logprobs is None or cap == 0:
        return None
    return torch.exp(old_logprobs.detach() - sampler_logprobs).clamp(max=cap)


def sequence_mask_is_weights(old_logprobs, sampler_logprobs, policy_mask, cap: float):
    """--is-mode sequence_mask, TRL's default correction (GRPOTrainer, vllm_importance_sampling_mode
    "sequence_mask"): one weight per completion, rho_i = pi_old(o_i) / pi_sampler(o_i) = exp of the
    SUM over its policy tokens of log pi_old - log pi_sampler (the whole sequence's likelihood ratio,
    not GSPO's per-token mean), on each of its tokens; a completion whose rho_i exceeds the cap is
    masked out of the surrogate (weight 0) instead of truncated. Detached; None as
    truncated_is_weights."""
    if sampler_logprobs is None or cap == 0:
        return None
    sampled = policy_mask > 0
    gap = torch.where(sampled, old_logprobs.detach() - sampler_logprobs, 0.0).sum(1, keepdim=True)
    rho = torch.exp(gap)
    return torch.where(rho > cap, 0.0, rho).expand_as(old_logprobs)


# The log-prob path: one forward per micro-batch, for pi_old, pi_theta and pi_ref alike.
def token_logprobs(
    models: Models, model, input_ids, attention_mask, width: int, settings: StepSettings, with_entropy=False
):
    """-> (log pi(o_t | P, o_<t) [R, width] of the completion tokens of these R rows, their entropy
    [R, width] or None), in one forward of `model`: models.policy (pi_old), models.train_model (pi_theta,
    the policy or its DDP or FSDP wrapper) or models.ref_model (pi_ref). Suppressed tokens are never
    sampled (srt/decode.py), so they are left out of pi too."""
    suppress = models.policy.generation_config.suppress_tokens
    return completion_logprobs(
        model,
        input_ids,
        attention_mask,
        completion_length=width,
        temperature=settings.temperature,
        with_entropy=with_entropy,
        share_prompts=shares_prompts(models, settings),
        suppress=torch.tensor(suppress, device=input_ids.device) if suppress else None,
        autocast_dtype=settings.autocast_dtype,
    )


def logprobs_without_grad(
    models: Models, model, input_ids, attention_mask, width: int, minibatches, settings: StepSettings
) -> torch.Tensor:
    """log pi [B, width] of every row, without gradient, in the micro-batches the loss's forward reads
    (each minibatch's forward_parts): a bf16 forward over other rows rounds otherwise."""
    logprobs = []
    with torch.no_grad():
        for minibatch in minibatches:
            for part in forward_parts(minibatch, settings.micro_batch_size):
                part_logprobs, _ = token_logprobs(
                    models, model, input_ids[part], attention_mask[part], width, settings
                )
                logprobs.append(part_logprobs)
    return torch.cat(logprobs)


def forward_parts(rows: torch.Tensor, size: int) -> tuple[torch.Tensor, ...]:
    """The rows of one backprop minibatch, --micro-batch-size at a time: the unit of every forward
    pass (memory_plan.py)."""
    return rows.split(size or len(rows))


# --------------------------------------------------------------------------------------------
# Eq. (9): the GRPO objective, as a loss to minimise (its negative), on the step's experience
# --------------------------------------------------------------------------------------------
def k3_kl(logprobs, ref_logprobs):
    """Per token, the k3 estimator of KL(pi_theta || pi_ref) on tokens sampled from pi_theta:
    exp(ref - logp) - (ref - logp) - 1. Always >= 0 (x - 1 >= log x), exactly 0 when the two agree;
    unbiased as an estimate of the value. Elementwise: the result has the inputs' shape. As a loss
    term, its gradient is that of the reverse KL(pi_ref || pi_theta) at the sampled tokens, as in
    DeepSeekMath's GRPO: it pulls pi_theta back wherever pi_ref puts mass, not only where
    pi_theta does."""
    log_ratio = ref_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1


# Eq. (9)'s 1/G sum_i 1/|o_i| sum_t, and its two rivals (--loss-type), as one weight per token:
# loss = -sum_{i,t} w_{i,t} * term_{i,t}. G: the minibatch's completions; L: --max-new-tokens.
LOSS_TYPES = {
    "grpo": "w = 1 / (|o_i| G): each completion's token mean, then the mean of the G (Eq. (9))",
    "dapo": "w = 1 / N: one mean over the N policy tokens of the minibatch on every rank (DAPO)",
    "dr_grpo": "w = 1 / (G L): a constant, so no length bias (Dr. GRPO; --scale-rewards none)",
}


def loss_weights(policy_mask, loss_type: str, max_new_tokens: int, all_rank_tokens=None, world_size=1):
    """[G, C] policy_mask of one backprop minibatch -> each token's weight w in Eq. (9) (LOSS_TYPES),
    0 where the policy did not sample. G counts every row, one without a sampled token too (its
    weights are 0, never NaN); all_rank_tokens is a number or a 0-d tensor; unknown loss types raise
    ValueError. DDP averages the ranks' gradients: grpo's and dr_grpo's
    weights are each rank's share of that average, and dapo's N counts every rank's tokens
    (all_rank_tokens), so its weights are multiplied by the world size that the averaging divides by."""
    G, mask = len(policy_mask), policy_mask.float()
    if loss_type == "grpo":
        return mask / (mask.sum(1, keepdim=True).clamp(min=1) * G)
    if loss_type == "dapo":
        tokens = mask.sum().clamp(min=1) if all_rank_tokens is None else all_rank_tokens
        return mask * world_size / tokens
    if loss_type == "dr_grpo":
        return mask / (G * max_new_tokens)
    raise ValueError(f"unknown loss_type {loss_type!r}; use one of {', '.join(LOSS_TYPES)}")


# The unit of Eq. (9)'s ratio (--importance-sampling-level): "token" is Eq. (9)'s r_{i,t}, one ratio
# per token; "sequence" is GSPO's s_i (Zheng et al., 2025, §4.1), one ratio per completion. A mean
# log-ratio moves far less than a token's, so GSPO clips with an epsilon of its own (its §5.1: 3e-4
# below, 4e-4 above: --gspo-clip-eps 3e-4 --clip-higher 4e-4).
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
GSPO_CLIP_EPS = 3e-4


def importance_ratio(
    logprobs, old_logprobs, mask, level="token", clip_eps=0.2, gspo_clip_eps=GSPO_CLIP_EPS, clip_eps_high=None
):
    """[B, C] log pi_theta and log pi_old of the sampled tokens, mask 1 where the policy sampled ->
    (ratio, clipped ratio) [B, C], the ratio and its clip that Eq. (9)'s min() compares.

    level "token": r_{i,t} = pi_theta / pi_old of each token, clipped to [1 - clip_eps,
    1 + clip_eps_high]. level "sequence" (GSPO): s_i = exp(the mean over the completion's sampled
    tokens of log pi_theta - log pi_old), the geometric mean of its token ratios, the same on each of
    its tokens, clipped to [1 - gspo_clip_eps, 1 + clip_eps_high]. clip_eps_high None: the lower
    epsilon of the level (a symmetric clip). The gradient flows through every token's log-prob (TRL's
    importance_sampling_level="sequence"). A masked token may hold anything (-inf) and counts in no
    mean; its ratio is 1. A row without a sampled token has s_i = 1. Unknown levels raise ValueError."""
    log_ratio = torch.where(mask > 0, logprobs - old_logprobs, 0.0)
    if level == "token":
        ratio, eps = torch.exp(log_ratio), clip_eps
    elif level == "sequence":
        mean = log_ratio.sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)
        ratio, eps = torch.exp(mean).expand_as(log_ratio), gspo_clip_eps
    else:
        raise ValueError(f"unknown level {level!r}; use one of {', '.join(IMPORTANCE_SAMPLING_LEVELS)}")
    high = eps if clip_eps_high is None else clip_eps_high
    return ratio, torch.clamp(ratio, 1 - eps, 1 + high)


class TokenTerms(NamedTuple):
    """grpo_loss's per-token quantities [B, C], detached: what the statistics and --explain read."""

    ratio: torch.Tensor  # r_{i,t} = pi_theta / pi_old (GSPO: s_i on each token of completion i)
    clipped: torch.Tensor  # the clip took over (no gradient through r)
    kl: torch.Tensor  # k3 to pi_ref
    objective: torch.Tensor  # the token's term of Eq. (9): w_IS * min(r A~, clip(r) A~) - beta * KL


def grpo_loss(
    logprobs,
    experience: Experience,
    clip_eps=0.2,
    beta=0.04,
    level="token",
    gspo_clip_eps=GSPO_CLIP_EPS,
    clip_eps_high=None,
):
    """Eq. (9) on (rows of) one Experience: logprobs [B, C] = log pi_theta of its sampled tokens.
    Only the tokens the policy sampled count (policy_mask); masked positions may hold -inf and are
    replaced before any exp. -> (loss = -sum(loss_weights * objective), TokenTerms).

    The ratio and its clip are importance_ratio's, at `level` (token: Eq. (9); sequence: GSPO), with
    the epsilons passed on (clip_eps_high None: a symmetric clip). The loss weights are
    the Experience's, whatever --loss-type made them. The importance weights multiply the clipped
    surrogate only, never the KL term (TokenTerms.objective); the KL is to pi_ref, 0 when
    ref_logprobs is None. TokenTerms.clipped is True where the clip took the gradient away: r above
    its band with A~ > 0, or below it with A~ < 0 (the other two cases keep it)."""
    sampled = experience.policy_mask > 0
    logprobs = torch.where(sampled, logprobs, 0.0)
    ratio, clipped_ratio = importance_ratio(
        logprobs,
        experience.old_logprobs,
        experience.policy_mask,
        level,
        clip_eps,
        gspo_clip_eps,
        clip_eps_high,
    )
    A = experience.advantages  # A~ of Eq. (8) on every token
    surrogate = torch.min(ratio * A, clipped_ratio * A)  # pessimistic bound: no gradient when clipped
    surrogate = surrogate * experience.is_weights  # the samples came from pi_sampler (--is-mode)
    if experience.ref_logprobs is None:  # beta = 0: no pi_ref
        kl = torch.zeros_like(logprobs)
    else:
        kl = k3_kl(logprobs, experience.ref_logprobs)
    objective = torch.where(sampled, surrogate - beta * kl, 0.0)
    loss = -(experience.loss_weights * objective).sum()
    with torch.no_grad():
        clipped = ((ratio > clipped_ratio) & (A > 0)) | ((ratio < clipped_ratio) & (A < 0))
    return loss, TokenTerms(ratio.detach(), clipped, kl.detach(), objective.detach())


def settings_loss(logprobs, experience: Experience, settings: StepSettings):
    """grpo_loss with the step's flags: the level of the ratio and its clip's epsilons."""
    level, eps_high = settings.importance_sampling_level, settings.clip_higher
    return grpo_loss(
        logprobs, experience, settings.clip_eps, settings.beta, level, settings.gspo_clip_eps, eps_high
    )


# --------------------------------------------------------------------------------------------
# The update: Eq. (9) on the experience, one AdamW step a backprop minibatch
# --------------------------------------------------------------------------------------------
class UpdateStats(NamedTuple):
    """One optimizer step's statistics: the minibatch's loss, and token means over its policy tokens."""

    loss: float
    kl: float
    clip_fraction: float
    ratio: float
    ratio_std: float  # the ratio's spread over the minibatch's policy tokens (GSPO: s_i's, by token)
    entropy: float  # NaN after the first pass (--mu): computed with the first forward only
    grad_norm: float


def update(models: Models, experience: Experience, settings: StepSettings) -> list[UpdateStats | None]:
    """Eq. (9) on one experience: `mu` passes over its backprop minibatches (§4.1: sample / backprop =
    4), one AdamW step each; a step whose loss or gradient is not finite is skipped (None in the
    list), on every rank alike. Every rank has as many rows, so as many minibatches, which DDP needs
    (one all-reduce per backward)."""
    models.policy.train()
    updates = []
    for epoch in range(settings.mu):
        for minibatch in experience.minibatches:
            updates.append(minibatch_update(models, experience, minibatch, settings, first_pass=epoch == 0))
    models.optimizer.zero_grad(set_to_none=True)
    models.policy.eval()
    return updates


def minibatch_update(models: Models, experience: Experience, minibatch, settings: StepSettings, first_pass):
    """One AdamW step on Eq. (9) over the rows `minibatch` of the experience, its gradient accumulated
    over their forward_parts. -> UpdateStats (the entropy on the first pass only), or None when the
    loss or the gradient is not finite on some rank: the weights and AdamW's moments stay as they were."""
    models.optimizer.zero_grad(set_to_none=True)
    sums = dict.fromkeys(
        ("loss", "kl", "clipped", "ratio", "ratio_sq", "entropy"), 0.0
    )  # over the policy tokens
    parts = forward_parts(minibatch, settings.micro_batch_size)
    for i, part in enumerate(parts):
        batch = experience[part]
        width = batch.policy_mask.shape[1]
        with accumulate(models.train_model, sync=i == len(parts) - 1):  # DDP: all-reduce after the last
            logprobs, entropy = token_logprobs(
                models,
                models.train_model,
                batch.input_ids,
                batch.attention_mask,
                width,
                settings,
                with_entropy=first_pass,
            )
            loss, terms = settings_loss(logprobs, batch, settings)
            loss.backward()  # every rank, even a bad loss: DDP/FSDP need all ranks
        add_token_sums(sums, loss, terms, entropy, batch.policy_mask)
    grad_norm = clip_grad_norm(models.policy.parameters(), settings.max_grad_norm).item()
    # A non-finite loss or gradient must never reach the weights (nor AdamW's moments), on any rank.
    device = experience.input_ids.device
    if all_ranks_any(not (math.isfinite(sums["loss"]) and math.isfinite(grad_norm)), device):
        models.optimizer.zero_grad(set_to_none=True)
        return None
    models.optimizer.step()
    tokens = experience.policy_mask[minibatch].sum().clamp(min=1).item()
    return UpdateStats(
        loss=sums["loss"],
        kl=sums["kl"] / tokens,
        clip_fraction=sums["clipped"] / tokens,
        ratio=sums["ratio"] / tokens,
        ratio_std=math.sqrt(max(sums["ratio_sq"] / tokens - (sums["ratio"] / tokens) ** 2, 0.0)),
        entropy=sums["entropy"] / tokens if first_pass else float("nan"),
        grad_norm=grad_norm,
    )


def add_token_sums(sums: dict, loss, terms: TokenTerms, entropy, policy_mask) -> None:
    """Add one micro-batch's loss, and its sums of KL, clipped tokens, ratio, squared ratio and
    entropy over its policy tokens, to `sums` (float64): the minibatch's sums, which minibatch_update
    divides by its tokens."""
    sampled = policy_mask > 0

    def total(x):
        return torch.where(sampled, x.double(), 0.0).sum().item()

    sums["loss"] += loss.detach().double().item()
    sums["kl"] += total(terms.kl)
    sums["clipped"] += total(terms.clipped)
    sums["ratio"] += total(terms.ratio)
    sums["ratio_sq"] += total(terms.ratio.double() ** 2)
    sums["entropy"] += 0.0 if entropy is None else total(entropy.detach())


def experience_loss(models: Models, experience: Experience, settings: StepSettings):
    """Eq. (9) on the whole experience at the policy's weights now, no step taken: what a further pass
    over the record would compute (--explain prints it). -> (loss, TokenTerms, log pi_theta [B, C])."""
    models.policy.train()
    logprobs = logprobs_without_grad(
        models,
        models.policy,
        experience.input_ids,
        experience.attention_mask,
        experience.policy_mask.shape[1],
        experience.minibatches,
        settings,
    )
    with torch.no_grad():
        loss, terms = settings_loss(logprobs, experience, settings)
    models.policy.eval()
    return loss.item(), terms, logprobs


# --------------------------------------------------------------------------------------------
# The step: rollout, experience, update, and what the step reports
# --------------------------------------------------------------------------------------------
def grpo_step(models: Models, records, prompts, settings: StepSettings, reward_fn=None, draw_more=None):
    """One GRPO step on this rank's prompts; `reward_fn` defaults to reward.compute_rewards and
    `draw_more()` gives dynamic sampling fresh prompts. -> StepStats (srt/probe.py)."""
    rollout = sample_batch(models, records, prompts, settings, reward_fn or compute_rewards, draw_more)
    started = time.perf_counter()
    experience = make_experience(models, rollout, settings)
    updates = update(models, experience, settings)
    return step_stats(rollout, experience, updates, settings, train_s=time.perf_counter() - started)


def step_stats(rollout: Rollout, experience: Experience, updates: list, settings: StepSettings, train_s=0.0):
    """What a step reports: its samples and scores, the mean of its updates' statistics, the
    sampler's mismatch, lengths, timings."""
    done = [u for u in updates if u is not None]
    lengths = rollout.completion_mask.sum(1).float()
    copied = (rollout.completion_mask - rollout.policy_mask).sum(1).float()  # --recall copy's tokens

    def mean_over_updates(name):  # entropy is NaN after the first pass
        values = [getattr(u, name) for u in done if not math.isnan(getattr(u, name))]
        return float(np.mean(values)) if values else float("nan")

    sampler = (
        None
        if rollout.sampler_logprobs is None
        else rollout.sampler_logprobs.to(experience.old_logprobs.device)
    )
    return StepStats(
        scores=rollout.scores,
        texts=rollout.texts,
        records=rollout.records,
        **{name: mean_over_updates(name) for name in UpdateStats._fields},
        **sampler_mismatch(
            experience.old_logprobs, sampler, experience.policy_mask, settings.is_cap, settings.is_mode
        ),
        completion_length=lengths.mean().item(),
        copied_length=copied.mean().item(),
        completion_tokens=int(lengths.sum().item()),
        sequence_tokens=int(rollout.prompt_mask.sum().item() + rollout.completion_mask.sum().item()),
        skipped_updates=len(updates) - len(done),
        updates=len(done),
        generate_s=rollout.generate_s,
        score_s=rollout.score_s,
        train_s=train_s,
        draws=rollout.draws,
        groups_drawn=rollout.groups_drawn,
        groups_all_equal=rollout.groups_all_equal,
        groups_recall_constant=rollout.groups_recall_constant,
    )


def sampler_mismatch(old_logprobs, sampler_logprobs, policy_mask, cap: float, mode="token") -> dict:
    """How far the sampler was from pi_old, over the policy's tokens: the mean of log pi_old -
    log pi_sampler, the k3 estimate of KL(pi_sampler || pi_old) (the tokens came from the sampler),
    and the share of tokens whose importance weight the cap acted on (--is-mode token: truncated;
    sequence_mask: in a completion masked out). NaN where the sampler's log-probs are unknown. About 0
    on an fp32 CPU."""
    if sampler_logprobs is None:
        return dict(sampler_log_ratio=float("nan"), sampler_kl=float("nan"), is_capped_fraction=float("nan"))
    sampled = policy_mask.bool()  # in fp64: the fp32 gap is ~1e-7, and k3 of it rounds below 0 in fp32
    old_logprobs, sampler_logprobs = old_logprobs.double(), sampler_logprobs.double()
    log_ratio = (old_logprobs - sampler_logprobs)[sampled]
    if not len(log_ratio):
        return dict(sampler_log_ratio=0.0, sampler_kl=0.0, is_capped_fraction=0.0)
    capped = log_ratio  # the log of what the cap compares, on each policy token
    if mode == "sequence_mask":  # the completion's summed log-ratio
        sums = torch.where(sampled, old_logprobs - sampler_logprobs, 0.0).sum(1, keepdim=True)
        capped = sums.expand_as(old_logprobs)[sampled]
    return dict(
        sampler_log_ratio=log_ratio.mean().item(),
        sampler_kl=k3_kl(sampler_logprobs[sampled], old_logprobs[sampled]).mean().item(),
        is_capped_fraction=(capped > math.log(cap)).float().mean().item() if cap > 0 else 0.0,
    )


# --------------------------------------------------------------------------------------------
# Ranks: what one rank does for the others under torchrun (DDP or FSDP). Each rank samples and
# scores its own prompts; the wrapper (Models.train_model) all-reduces the gradients in backward.
# On one process each of these is the plain case. A reader of the algorithm may skip them.
# --------------------------------------------------------------------------------------------
def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def all_ranks_tokens(policy_mask) -> torch.Tensor:
    """The policy tokens of a minibatch summed over every rank: dapo's N, one number for the whole
    batch (a rank's own count would weigh a token of a short rank more)."""
    tokens = policy_mask.sum().float()
    if dist.is_initialized():
        dist.all_reduce(tokens)
    return tokens.clamp(min=1)


def all_ranks_rewards(rewards) -> torch.Tensor:
    """The whole step's rewards, every rank's groups, flat: --scale-rewards batch's std."""
    return torch.tensor(sum(gather_objects(rewards.view(-1).tolist(), world_size()), []))


def shares_prompts(models: Models, settings: StepSettings) -> bool:
    """May each distinct prompt run once for its K rows in the log-prob forward (srt/generation.py
    completion_logprobs)? Not under a wrapper (DDP, FSDP: sharded parameters) nor gradient
    checkpointing, which allow only one module call per backward."""
    sharded = any(hasattr(p, "to_local") for p in models.policy.parameters())
    return (
        settings.share_prompts
        and not sharded
        and models.train_model is models.policy
        and not settings.gradient_checkpointing
    )


# --------------------------------------------------------------------------------------------
# The run. Configuration: argparse defaults that work (the paper's values where it gives
# one), presets (a dict of flag values each, saying why they differ), explicit flags win.
# --------------------------------------------------------------------------------------------
# Why each value: docs/experiments/presets.md ("Stage 2").
# fmt: off
PRESETS = {
    # §4.1 where the paper gives a value (the defaults: lr 3e-7, K = 8, ratio 4, AdamW, KL to the SFT
    # policy); the rest is ours, sized for 8 x A100-80GB with --fsdp (memory_plan.py: about 50 GB per GPU).
    "paper": dict(prompts_per_step=8, max_new_tokens=1024, max_prompt_length=4096, warmup_steps=10,
                  max_steps=1000, save_every=50, sample_every=10, gradient_checkpointing=True,
                  micro_batch_size=2),
    # `make table2`: SmolLM2-135M after SFT on a 2-core CPU: 12 steps of one group of K = 4, two AdamW
    # updates each; lr 10x the paper's, which moves a 135M model within 12 steps; 1536 prompt tokens
    # hold every synthetic prompt and 256 new tokens the longest SFT chain; dynamic sampling on the
    # recall part (after SFT most groups recall one set), at most 2 draws; T = 1.0; probed on the
    # dev split beside --data.
    "cpu-table2": dict(num_generations=4, prompts_per_step=1, sample_ratio=2, mu=1, lr=3e-6, warmup_steps=1,
                       beta=0.04, max_new_tokens=256, max_prompt_length=1536, max_steps=12, sample_every=1,
                       save_every=4, eval_data="dev.jsonl", eval_limit=16, eval_batch_size=8, probe_every=6,
                       dynamic_sampling="recall", max_draws=2),
}
# GRPO on the turns that need recall (§3): 30 steps of two groups at lr 1e-5
# (docs/experiments/grpo-recall.md).
PRESETS["cpu-long"] = dict(PRESETS["cpu-table2"], train_turns="dependent", prompts_per_step=2, lr=1e-5,
                           max_steps=30, probe_every=10, save_every=5)
# `make demo`, the lesson: cpu-table2's GRPO on the short dialogues of stage 0's cpu-lesson (prompts
# under 1024 tokens), 4 steps, probed before and after: the mechanics of Eqs. (4)-(9) on a real run.
PRESETS["cpu-lesson"] = dict(PRESETS["cpu-table2"], max_prompt_length=1024, max_steps=4, probe_every=4)
# fmt: on


def build_parser() -> argparse.ArgumentParser:
    p = harness.training_parser(__doc__.split("\n\n")[0])
    run = harness.add_run_flags(p, "grpo")  # srt/run.py: --model, --data, --out, --resume, --max-steps, ...
    grpo_explain.add_flags(run)  # --explain, --explain-tries, --explain-html

    paper = harness.method_group(
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
    harness.add_optimizer_flags(
        paper,
        lr=3e-7,
        lr_help="AdamW learning rate after warm-up (§4.1: 3e-7)",
        warmup_steps=2,
        warmup_help="linear warm-up, in GRPO steps",
    )
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
    add_max_new_tokens(paper, 256, "completion length cap")
    add(
        "--max-prompt-length",
        type=at_least(0),
        default=1024,
        help="prompt tokens; a longer prompt loses its oldest utterances, whatever they are (0 = no cap)",
    )

    beyond = harness.method_group(
        p,
        "beyond the paper",
        "listed in the module docstring; each off or the paper's choice by default, but --is-cap, which "
        "acts only where rollouts come from a bf16 copy of the policy",
    )
    add_answer_flags(beyond)
    add = beyond.add_argument
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
        "--loss-type",
        choices=LOSS_TYPES,
        default="grpo",
        help="Eq. (9)'s normalisation, one weight per token (loss_weights): "
        + "; ".join(f"{name}: {weight}" for name, weight in LOSS_TYPES.items()),
    )
    add(
        "--scale-rewards",
        choices=SCALE_REWARDS,
        default=None,
        help="Eq. (8)'s denominator: group, each group's std (the paper); batch, the std of the whole "
        "step's rewards; none, no division. Unset (None): group, or none under --loss-type dr_grpo",
    )
    add(
        "--importance-sampling-level",
        choices=IMPORTANCE_SAMPLING_LEVELS,
        default="token",
        help="the unit of Eq. (9)'s ratio (importance_ratio): token, r_{i,t} per token (the paper); "
        "sequence, GSPO's s_i = exp(mean of the completion's log-ratios), one per completion, clipped "
        "with --gspo-clip-eps; it differs from token only off-policy (--mu > 1 or --sample-ratio > 1)",
    )
    add(
        "--gspo-clip-eps",
        type=positive(float),
        default=GSPO_CLIP_EPS,
        help="epsilon of the clip at --importance-sampling-level sequence (GSPO §5.1: 3e-4 below, 4e-4 "
        "above, i.e. --clip-higher 4e-4)",
    )
    add(
        "--clip-higher",
        type=positive(float),
        default=None,
        metavar="EPS_HIGH",
        help="DAPO's clip-higher: the clip's upper epsilon, 1 + EPS_HIGH, at either level (DAPO: 0.28 "
        "over --clip-eps 0.2); unset: the lower epsilon, a symmetric clip (the paper)",
    )
    add(
        "--is-mode",
        choices=IS_MODES,
        default="token",
        help="how the sampler's tokens are corrected to pi_old: token, each token's surrogate times "
        "min(pi_old / pi_sampler, --is-cap); sequence_mask (TRL's default), the completion's "
        "pi_old(o) / pi_sampler(o) on each of its tokens, 0 for a completion above --is-cap",
    )
    add(
        "--is-cap",
        type=at_least(0.0, float),
        default=None,
        help="the cap of --is-mode, for rollouts drawn on a bf16 copy of the policy (not in the paper); "
        "0: no correction. Unset: 2 (token), 3 (sequence_mask, TRL's)",
    )
    add_recall_flag(
        beyond,
        "copy: the policy names a turn (<HIS>A3:) and the decoder writes it out, tokens outside "
        "the loss (srt/recall.py; not in the paper); free: the policy copies every token (the paper)",
    )
    add(
        "--placebo",
        action="store_true",
        help="a control: each group's K rewards shuffled among its samples before Eq. (8) (seeded by "
        "--seed), so that a real run is credited only with what it does beyond updates of the same size "
        "and spread that carry no signal; the probes score with the true reward",
    )

    scale = harness.add_scale_group(p)
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

    logs = harness.add_log_group(p, save_every_default=10, save_every_low=0)
    add = logs.add_argument
    add("--sample-every", type=at_least(0), default=5, help="write sampled completions every N steps")
    add_probe_flags(logs)  # srt/probe.py: --eval-data, --eval-limit, --probe-every, ...
    return harness.finish_parser(p, scale)


def parse_args(argv=None) -> argparse.Namespace:
    cfg = parse_config(build_parser(), PRESETS, argv)
    if cfg.scale_rewards is None:  # Dr. GRPO drops the std of Eq. (8) along with the length normaliser
        cfg.scale_rewards = "none" if cfg.loss_type == "dr_grpo" else "group"
    # The ratio and the KL of Eq. (9) read log-probs of softmax(logits / T) over the whole vocabulary
    # (but suppressed tokens): a nucleus sampler draws from another distribution, which they would
    # not see. Refused rather than half-corrected.
    require(
        cfg.top_p == 1.0,
        f"--top-p {cfg.top_p}: stage 2 samples from the full softmax(logits / T), whose log-probs "
        "the ratio and KL of Eq. (9) use; a nucleus would bias both (use 1.0)",
    )
    # A sample batch of K x --prompts-per-step rows splits into at most that many minibatches: the
    # ratio the run uses is the one config.json records (said in a line when it was asked for).
    rows = cfg.num_generations * cfg.prompts_per_step
    if cfg.sample_ratio > rows:
        if cfg.sample_ratio != build_parser().get_default("sample_ratio"):
            note = f"--sample-ratio {cfg.sample_ratio} of {rows} rows (-K x --prompts-per-step)"
            print(f"note: {note} is {rows} minibatches of one row: --sample-ratio {rows}", file=sys.stderr)
        cfg.sample_ratio = rows
    if cfg.is_cap is None:
        cfg.is_cap = IS_CAPS[cfg.is_mode]
    require(cfg.is_cap == 0 or cfg.is_cap >= 1, f"--is-cap {cfg.is_cap}: 0 (off) or a cap of at least 1")
    # An upper epsilon under the lower one would clip a rising ratio sooner than a falling one: the
    # reverse of clip-higher, and the mark of a token epsilon given at the sequence level or back.
    lower = cfg.gspo_clip_eps if cfg.importance_sampling_level == "sequence" else cfg.clip_eps
    require(
        cfg.clip_higher is None or cfg.clip_higher >= lower,
        f"--clip-higher {cfg.clip_higher} is below the lower epsilon {lower} of --importance-sampling-level "
        f"{cfg.importance_sampling_level} (--clip-eps at token, --gspo-clip-eps at sequence)",
    )
    require(
        not (cfg.explain and cfg.placebo),
        "--explain prints one step with the true rewards; --placebo is for a training run",
    )
    require(
        not cfg.explain
        or (cfg.importance_sampling_level, cfg.clip_higher, cfg.is_mode) == ("token", None, "token"),
        "--explain works Eq. (9) one token at a time, as the paper writes it: it takes "
        "--importance-sampling-level token, no --clip-higher and --is-mode token",
    )
    if cfg.explain:  # the page may only replace a page of its own
        problem = step_page.page_problem(cfg.explain_html, cfg.overwrite)
        require(problem is None, problem)
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
    resolve_probe_flags(cfg)  # srt/probe.py: --eval-data beside --data, --eval-max-new-tokens
    return cfg


# --------------------------------------------------------------------------------------------
# The training run (srt/run.py carries the harness: --out, ranks, loading, resume,
# checkpoints, logs)
# --------------------------------------------------------------------------------------------
SAVE_MARGIN_S = 30  # writing checkpoint/ and final/ at the end of a time-budgeted run


# What a --resume must match, derived from the flag groups (srt/run.py resume_keys): the model, the
# data and its sha256, the seed, the world size, and every flag of the paper's and the departures'
# groups. Not --micro-batch-size nor --fsdp: the same update in parts or shards.
RESUME_MUST_MATCH = harness.resume_keys(build_parser())


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


def draw_prompts(stream: PromptStream, n: int) -> tuple[list[dict], list[str]]:
    """This rank's next n (records, prompts) from the prompt stream."""
    pairs = stream.next_batch(n)
    return [record for record, _ in pairs], [prompt for _, prompt in pairs]


def train(cfg, reward_fn=None, step_fn=None) -> dict:
    """Run stage 2 as configured by `cfg` (see parse_args); -> the summary written to summary.json.
    `reward_fn(completions, records) -> [{"total": .., <components>}]` defaults to reward.py's;
    `step_fn`, what runs one step, to grpo_step (bench/grpo_workers.py passes a timed one)."""
    step_fn = step_fn or grpo_step
    run = harness.Run(cfg, "stage2_grpo.py", build_parser(), reserve_s=SAVE_MARGIN_S)  # srt/run.py
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
    records, eval_records = read_records(run, cfg)
    done = run.finished(cfg.max_steps, also=["eval_after.json"] if eval_records else [])
    if done:
        return done
    models = load_models(run, cfg)
    settings = StepSettings.of(cfg, run.autocast_dtype)
    stream = PromptStream(
        records, models.tokenizer, cfg.max_prompt_length, cfg.seed, run.rank, run.world_size
    )
    seed_everything(cfg.seed + run.rank)  # each rank samples its own completions
    state = run.resume()
    if state:
        stream.load_state_dict(state["stream"])
    logs = {name: run.log(f"{name}.jsonl") for name in ("samples", "probe")}
    logs["metrics"] = run.log("metrics.jsonl", every=1)  # a line every step
    run.write_config()

    def run_eval(step, name=None):  # srt/probe.py: each rank a slice, rank 0 logs and plots
        return probe_and_log(
            run,
            models.policy,
            models.tokenizer,
            eval_records,
            cfg,
            reward_fn,
            step,
            logs["metrics"],
            logs["probe"],
            name,
        )

    if eval_records and run.start_step == 0:
        t = time.perf_counter()
        run_eval(0, "eval_before.json")
        run.budget.reserve_s += time.perf_counter() - t  # the final evaluation takes about as long
    elif eval_records and (run.out / "eval_before.json").exists():
        run.budget.reserve_s += json.loads((run.out / "eval_before.json").read_text()).get("seconds") or 0.0

    step = run.start_step
    progress = tqdm(total=cfg.max_steps, initial=step, desc="grpo", disable=not run.main_process)
    while run.keep_going(step, cfg.max_steps):
        step += 1
        lr = warmup_lr(step, cfg.lr, cfg.warmup_steps)
        for group in models.optimizer.param_groups:
            group["lr"] = lr
        t = time.perf_counter()
        records_of_step, prompts_of_step = draw_prompts(stream, cfg.prompts_per_step)
        draw_more = functools.partial(draw_prompts, stream, cfg.prompts_per_step)
        result = step_fn(models, records_of_step, prompts_of_step, settings, step_reward_fn, draw_more)
        step_s = time.perf_counter() - t
        run.budget.record_step(step_s)
        log_step(run, cfg, logs, progress, step, result, step_s, lr=lr, stream=stream)
        if cfg.save_every and step % cfg.save_every == 0 and step < cfg.max_steps:
            run.save(step, stream=stream.state_dict())
        if eval_records and cfg.probe_every and step % cfg.probe_every == 0 and step < cfg.max_steps:
            run_eval(step)
    progress.close()
    run.save(step, stream=stream.state_dict())
    run.save_final()  # save_pretrained form, also under FSDP
    run.warn_if_stopped_early(step, cfg.max_steps)
    if eval_records:
        run_eval(step, "eval_after.json")
    return finish(run, cfg, models.policy, step)


def read_records(run, cfg):
    """-> (the training records, the probe's records or None). --train-turns dependent: H* chooses
    which turns train (in each file, before the mix), never what a prompt shows."""
    keep = (lambda r: bool(r["recall"])) if cfg.train_turns == "dependent" else None
    records = read_mixture(cfg.data, cfg.seed, keep, note=f" (--train-turns {cfg.train_turns})")
    run.record_data()
    if not (cfg.eval_data and cfg.eval_limit > 0):
        return records, None
    return records, pick_eval_records(read_jsonl(cfg.eval_data), cfg.eval_limit)


def load_models(run, cfg) -> Models:
    """The policy (fp32 master weights, bf16 autocast where the hardware has it), its wrapper and
    AdamW, and the frozen reference pi_ref = the SFT model we start from, even when resuming. Under
    FSDP both load on the CPU and each rank moves only its shards to its GPU; pi_ref, which never
    trains, in bf16. Rollouts sample from a bf16 copy of the policy where the hardware has bf16
    units (srt/decode.py), refreshed after every optimizer step; the loss and the fp32 master
    weights are untouched."""
    policy, tokenizer = run.load_model("grpo")
    ref_model = None
    if cfg.beta > 0:
        ref_dtype = "bfloat16" if cfg.fsdp and run.autocast_dtype == torch.bfloat16 else cfg.dtype
        ref_model, _ = run.load_model("grpo", name=cfg.model, dtype=ref_dtype)
        ref_model.eval().requires_grad_(False)
        if cfg.fsdp:  # pi_ref never trains: sharded, without a wrapper
            ref_model = shard_model(ref_model, run.device)
    policy, train_model, optimizer = run.prepare(policy, tokenizer)
    return Models(policy, tokenizer, optimizer, ref_model=ref_model, train_model=train_model)


def log_step(run, cfg, logs, progress, step, result: StepStats, step_s, **extra) -> None:
    """Every rank's statistics, gathered; rank 0 writes the metrics line, the step's samples and
    the progress bar."""
    all_results = gather_objects(result.without_samples(), run.world_size)
    if run.main_process:
        stream = extra.pop("stream")
        line = step_metrics(
            step,
            all_results,
            step_s,
            **extra,
            skipped_prompts=stream.skipped,
            gold_turns_cut=stream.gold_cut,
            peak_gpu_gb=peak_gpu_gb(run.device),
        )
        logs["metrics"].append({k: finite_or_none(v) for k, v in line.items()})
        if result.skipped_updates:
            tqdm.write(
                f"step {step}: skipped {result.skipped_updates} update(s) with a non-finite "
                f"loss or gradient; the weights are unchanged by them"
            )
        if cfg.sample_every and step % cfg.sample_every == 0:
            logs["samples"].append(*sample_lines(step, result, cfg.num_generations))
        progress.set_postfix(
            reward=f"{line.get('reward_total_mean', float('nan')):.3f}",
            kl=f"{line['kl']:.4f}",
            len=f"{line['completion_length']:.0f}",
        )
    progress.update(1)


def finish(run, cfg, policy, step) -> dict:
    """summary.json: steps, why the run stopped, and whether the DDP ranks agree bit for bit."""
    digests = gather_objects(parameter_digest(policy), run.world_size)
    summary = {
        "steps": step,
        "stop_reason": "max_steps" if step >= cfg.max_steps else "time_budget",
        "seconds": run.budget.elapsed_s(),
        "world_size": run.world_size,
        "ranks_in_sync": None if cfg.fsdp else len(set(digests)) == 1,  # FSDP ranks hold different shards
    }
    run.write_summary(summary)
    if run.main_process:
        print(f"done: {step} steps ({summary['stop_reason']}); model in {run.out / 'final'}", flush=True)
    run.barrier()
    return summary


def main(argv=None) -> None:
    cfg = parse_args(argv)
    if cfg.explain:  # one step that trains no run: no checkpoint to speak of, only its page
        harness.main(cfg, "grpo", explain, saved=lambda: grpo_explain.LEAVES)
    else:
        harness.main(cfg, "grpo", train)


def explain(cfg, reward_fn=None, print_fn=print) -> dict:
    """--explain: one step on one group, every quantity printed (srt/grpo_explain.py, which is handed
    this script's step: the package imports no script)."""
    step = grpo_explain.GRPOStep(
        settings_of=StepSettings.of,
        models=Models,
        sample_batch=sample_batch,
        make_experience=make_experience,
        update=update,
        experience_loss=experience_loss,
        loss=grpo_loss,
        loss_types=LOSS_TYPES,
        compute_rewards=compute_rewards,
    )
    return grpo_explain.explain(cfg, step, reward_fn, print_fn)


if __name__ == "__main__":
    main()
