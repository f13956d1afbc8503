"""The rollout record of GRPO (stage2_grpo.py, §3.4), what sampling hands to the update, and the
prompt stream the samples are drawn from. Sampling itself (K completions a prompt, scored, and DAPO's
dynamic sampling) is stage2_grpo.py's sample_batch, one hop from its step."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from srt.data_io import DataError
from srt.prompt import fit_prompt


# --------------------------------------------------------------------------------------------
# The rollout record: what the policy wrote, with what probability, and what it scored
# --------------------------------------------------------------------------------------------
@dataclass
class Rollout:
    """One sample batch, the hand-off from sampling to the update (stage2_grpo.py: rollout ->
    advantages -> update). Rows are grouped by prompt: rows g*K .. g*K+K-1 are group g.

    Two masks, because two questions are asked of a completion token. completion_mask: is it part
    of o_i (through the first stop token)? The forward attends to every such token. policy_mask: did
    the policy sample it? Only those tokens enter the ratio, the KL, the entropy and the loss's
    normalisation of Eq. (9); a token the program wrote into the completion (a recalled turn copied
    out, TRL's tool_mask, Search-R1's state masking) has policy_mask 0 and is still attended to.

    sampler_logprobs: log pi_sampler(o_t), the log-probability of each token under the distribution
    it was drawn from (the same temperature, suppressed tokens and precision: a bf16 copy of the
    policy where the hardware has bf16 units, srt/decode.py), 0 on padding; None where the sampler
    did not report it (Hugging Face's generate). Stage 2 weighs pi_old against it."""

    prompt_ids: torch.Tensor  # [B, P] left padded
    prompt_mask: torch.Tensor  # [B, P] 1 on real prompt tokens
    completion_ids: torch.Tensor  # [B, C] right padded
    completion_mask: torch.Tensor  # [B, C] 1 through the first stop token: attended to
    policy_mask: torch.Tensor  # [B, C] 1 where the policy sampled the token: in the loss
    sampler_logprobs: torch.Tensor | None  # [B, C] log pi_sampler of each token, or None
    texts: list[str]  # the completions as text, what the reward read
    records: list[dict]  # each row's record (the reward's gold lives here, never in a prompt)
    scores: list[dict]  # each row's reward terms, Eqs. (4)-(7): total, format, recall, answer, ...
    num_generations: int  # K, the group size
    draws: int = 1  # sample batches drawn (dynamic sampling)
    groups_drawn: int = 0  # groups sampled, kept or not
    groups_all_equal: int = 0  # groups whose K totals were equal: advantage 0 (Eq. (8))
    groups_recall_constant: int = 0  # groups whose K recall parts were equal
    generate_s: float = 0.0
    score_s: float = 0.0

    # The row tensors, and how join() pads each: prompts on the left, completions on the right.
    ROW_TENSORS = (
        "prompt_ids",
        "prompt_mask",
        "completion_ids",
        "completion_mask",
        "policy_mask",
        "sampler_logprobs",
    )

    def rewards(self, *components: str) -> torch.Tensor:
        """[groups, K] of the summed reward `components` of each row ("total" = Eq. (4))."""
        values = [sum(float(score[name]) for name in components) for score in self.scores]
        return torch.tensor(values, dtype=torch.float64).view(-1, self.num_generations)

    def sequences(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, attention_mask) [B, P + C] of prompt + completion, what a forward reads."""
        input_ids = torch.cat([self.prompt_ids, self.completion_ids], dim=1).to(device)
        attention_mask = torch.cat([self.prompt_mask, self.completion_mask], dim=1).to(device)
        return input_ids, attention_mask

    @classmethod
    def join(
        cls, draws: list[Rollout], picks, pad_id, groups_all_equal=0, groups_recall_constant=0
    ) -> Rollout:
        """The groups `picks` = [(draw, group), ...] of several sample batches as one batch: prompts
        left padded, completions right padded (masks 0) to the widest of them; the counts and
        timings of every draw, kept or not."""
        K = draws[0].num_generations
        rows = [(d, g * K + k) for d, g in picks for k in range(K)]
        tensors = {}
        for key in cls.ROW_TENSORS:
            if any(getattr(d, key) is None for d in draws):
                tensors[key] = None
                continue
            width = max(getattr(d, key).shape[1] for d in draws)

            def padded(d):
                t, fill = getattr(d, key), (pad_id if key.endswith("ids") else 0)
                gap = width - t.shape[1]
                return F.pad(t, (gap, 0) if key.startswith("prompt") else (0, gap), value=fill)

            each = [padded(d) for d in draws]  # each draw padded once, then its chosen rows taken
            tensors[key] = torch.stack([each[d][r] for d, r in rows])
        lists = {key: [getattr(draws[d], key)[r] for d, r in rows] for key in ("texts", "records", "scores")}
        return cls(
            **tensors,
            **lists,
            num_generations=K,
            draws=len(draws),
            groups_drawn=sum(d.groups_drawn for d in draws),
            groups_all_equal=groups_all_equal,
            groups_recall_constant=groups_recall_constant,
            generate_s=sum(d.generate_s for d in draws),
            score_s=sum(d.score_s for d in draws),
        )


def think_lengths(tokenizer, completion_ids, marker="</think>") -> torch.Tensor:
    """Per row, the number of completion tokens that write the think block through `marker` (every
    token where the marker never comes): the tokens that made the recall, for --credit segment. A
    decoded prefix that holds the marker keeps it, so a binary search finds the shortest one. Special
    tokens are decoded too: a tokenizer may make the marker one of them (Qwen3's </think>)."""
    lengths = []
    for ids in completion_ids.tolist():
        low, high = 1, len(ids)
        if marker not in tokenizer.decode(ids, skip_special_tokens=False):
            lengths.append(len(ids))
            continue
        while low < high:
            middle = (low + high) // 2
            if marker in tokenizer.decode(ids[:middle], skip_special_tokens=False):
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
