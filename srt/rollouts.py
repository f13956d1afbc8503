"""Sampling from pi_old for GRPO (stage2_grpo.py, §3.4): K completions per prompt in one batched
generate, scored with the verifiable reward, and DAPO's dynamic sampling (Yu et al., 2025), which
replaces groups whose K rewards are all equal: Eq. (8) gives them advantage 0, so they add nothing to
the gradient. A library module: the caller passes the reward function (reward.compute_rewards)."""

from __future__ import annotations

import random
import time

import torch
import torch.nn.functional as F

from srt.data_io import DataError
from srt.distributed import all_ranks_any, full_weights
from srt.modeling import generate
from srt.prompt import fit_prompt

ROLLOUT_TENSORS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")


def sample_groups(policy, tokenizer, records, prompts, cfg, reward_fn, autocast_dtype) -> dict:
    """K completions per prompt from pi_old in one batched generate (srt/decode.py's loop: each prompt
    prefilled once for its K rows; on a bf16 copy of the policy where the hardware has bf16 units),
    scored with the verifiable reward R = format + recall + answer (Eqs. (4)-(7)). Rows are grouped
    by prompt."""
    t0 = time.perf_counter()
    with full_weights(policy):  # FSDP: gathered once for the whole batch, freed after (sharding.py)
        rollout = generate(
            policy,
            tokenizer,
            prompts,
            num_generations=cfg.num_generations,
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            autocast_dtype=autocast_dtype,
            draft_tokens=getattr(cfg, "draft_tokens", None),
        )
    t1 = time.perf_counter()
    examples = [record for record in records for _ in range(cfg.num_generations)]
    scores = reward_fn(rollout["texts"], examples)
    return dict(
        rollout, scores=scores, records=examples, generate_s=t1 - t0, score_s=time.perf_counter() - t1
    )


def constant_groups(scores, K, key="total") -> list[bool]:
    """Per group: are its K values of `key` all equal? Then Eq. (8) gives it advantage 0."""
    values = [float(s.get(key, float("nan"))) for s in scores]
    return [len(set(values[g : g + K])) == 1 for g in range(0, len(values), K)]


def join_groups(draws, picks, K, pad_id) -> dict:
    """The groups `picks` = [(draw, group), ...] of several sample batches as one batch: prompts left
    padded, completions right padded (mask 0) to the widest of them."""
    width = {key: max(d[key].shape[1] for d in draws) for key in ROLLOUT_TENSORS}

    def padded(d, key):
        fill = pad_id if key.endswith("ids") else 0
        gap = width[key] - d[key].shape[1]
        return F.pad(d[key], (gap, 0) if key.startswith("prompt") else (0, gap), value=fill)

    rows = [(d, g * K + k) for d, g in picks for k in range(K)]
    batch = {}
    for key in ROLLOUT_TENSORS:  # each draw padded once, then its chosen rows taken
        tensors = [padded(draw, key) for draw in draws]
        batch[key] = torch.stack([tensors[d][r] for d, r in rows])
    for key in ("texts", "scores", "records"):
        batch[key] = [draws[d][key][r] for d, r in rows]
    return batch


def sample_batch(policy, tokenizer, records, prompts, cfg, reward_fn, autocast_dtype, draw_more=None) -> dict:
    """This rank's sample batch of len(prompts) groups. With --dynamic-sampling total (DAPO), groups whose
    K rewards are all equal add nothing to the gradient; with --dynamic-sampling recall, groups whose
    recall parts are all equal carry no recall signal. Fresh prompts are drawn in their place, at most
    --max-draws sample batches a step, and what stays uninformative fills the rest. Every rank draws
    as often as the others, so the prompt stream and the DDP all-reduces stay in step."""
    K, device, key = cfg.num_generations, next(policy.parameters()).device, cfg.dynamic_sampling
    draws = [sample_groups(policy, tokenizer, records, prompts, cfg, reward_fn, autocast_dtype)]

    def informative_groups():
        return [
            (d, g)
            for d, draw in enumerate(draws)
            for g, same in enumerate(constant_groups(draw["scores"], K, key))
            if not same
        ]

    while (
        key != "off"
        and draw_more is not None
        and len(draws) < cfg.max_draws
        and all_ranks_any(len(informative_groups()) < len(prompts), device)
    ):
        draws.append(sample_groups(policy, tokenizer, *draw_more(), cfg, reward_fn, autocast_dtype))
    if key == "off":
        picks = [(0, g) for g in range(len(prompts))]
    else:
        everything = [(d, g) for d, draw in enumerate(draws) for g in range(len(draw["scores"]) // K)]
        informative = informative_groups()
        picks = (informative + [p for p in everything if p not in informative])[: len(prompts)]
    scores = [s for draw in draws for s in draw["scores"]]
    batch = join_groups(draws, picks, K, tokenizer.pad_token_id)
    batch.update(
        draws=len(draws),
        groups_drawn=len(scores) // K,
        generate_s=sum(d["generate_s"] for d in draws),
        score_s=sum(d["score_s"] for d in draws),
        groups_all_equal=sum(constant_groups(scores, K)),
        groups_recall_constant=sum(constant_groups(scores, K, "recall")),
    )
    return batch


def think_lengths(tokenizer, completion_ids, marker="</think>") -> torch.Tensor:
    """Per row, the number of completion tokens that write the think block through `marker` (every
    token where the marker never comes): the tokens that made the recall, for --credit segment. A
    decoded prefix that holds the marker keeps it, so a binary search finds the shortest one."""
    lengths = []
    for ids in completion_ids.tolist():
        low, high = 1, len(ids)
        if marker not in tokenizer.decode(ids, skip_special_tokens=True):
            lengths.append(len(ids))
            continue
        while low < high:
            middle = (low + high) // 2
            if marker in tokenizer.decode(ids[:middle], skip_special_tokens=True):
                high = middle
            else:
                low = middle + 1
        lengths.append(low)
    return torch.tensor(lengths)


class PromptStream:
    """An endless, seeded walk over the training records, a fresh permutation each epoch. Every rank
    walks the same order and takes its own slice of each global batch, so ranks never share a prompt.
    The position (epoch, cursor) is part of the checkpoint."""

    def __init__(self, records, tokenizer, max_prompt_length, seed, rank=0, world_size=1):
        self.records, self.tokenizer, self.max_prompt_length = records, tokenizer, max_prompt_length
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.epoch, self.cursor, self.skipped, self.gold_cut = 0, 0, 0, 0
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
            prompt, gold_cut = fit_prompt(self.tokenizer, record, self.max_prompt_length)
            if prompt is not None:
                self.gold_cut += gold_cut
                return record, prompt
            self.skipped += 1
        raise DataError(f"no training prompt fits --max-prompt-length {self.max_prompt_length}")

    def next_batch(self, n):
        """-> this rank's n (record, prompt) pairs of the next global batch of n * world_size."""
        batch = [self._next() for _ in range(n * self.world_size)]
        return batch[self.rank * n : (self.rank + 1) * n]

    def state_dict(self):
        return {
            "epoch": self.epoch,
            "cursor": self.cursor,
            "skipped": self.skipped,
            "gold_cut": self.gold_cut,
        }

    def load_state_dict(self, state):
        self.epoch, self.cursor, self.skipped, self.gold_cut = (
            state[k] for k in ("epoch", "cursor", "skipped", "gold_cut")
        )
        self._order = self._permutation()
