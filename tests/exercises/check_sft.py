"""Checks of the stage-1 exercise (stage1_sft.py): Eq. (3), the SFT loss of one micro-batch."""

import math

import torch
from tiny import tiny_model

import stage1_sft

IGNORE = stage1_sft.IGNORE_INDEX
PAD = 0


def micro_batch(extra_padding: int = 0) -> dict:
    """Two right-padded rows as stage1_sft.collate lays them out: row 0 a 3-token prompt, 3
    reasoning and 2 answer tokens; row 1 a 2-token prompt, 2 reasoning and 2 answer tokens."""
    rows = [  # (prompt, reasoning, answer)
        ([3, 7, 1], [12, 5, 9], [20, 4]),
        ([8, 2], [14, 6], [25, 11]),
    ]
    width = max(len(p) + len(r) + len(a) for p, r, a in rows) + extra_padding
    batch = {"input_ids": [], "labels": [], "answer_mask": [], "attention_mask": []}
    for prompt, reasoning, answer in rows:
        ids = prompt + reasoning + answer
        pad = width - len(ids)
        batch["input_ids"].append(ids + [PAD] * pad)
        batch["labels"].append([IGNORE] * len(prompt) + reasoning + answer + [IGNORE] * pad)
        batch["answer_mask"].append([0] * (len(prompt) + len(reasoning)) + [1] * len(answer) + [0] * pad)
        batch["attention_mask"].append([1] * len(ids) + [0] * pad)
    return {key: torch.tensor(value) for key, value in batch.items()}


def number(value) -> float:
    return float(torch.as_tensor(value).detach())


# The six sums of micro_batch() under tiny_model(seed=0), computed once by a plain forward and stored:
# the check holds numbers, not a second implementation of Eq. (3).
EXPECTED_SUMS = {
    "nll": 32.76530456542969,
    "reasoning_nll": 18.224729537963867,
    "answer_nll": 14.540576934814453,
    "tokens": 9,
    "reasoning_tokens": 5,
    "answer_tokens": 4,
}
NLL_BEFORE_THE_STEP = 31.452392578125  # micro_batch()'s target NLL under tiny_model(seed=1)


def sums_match_a_forward_by_hand():
    """The six sums (nll, reasoning_nll, answer_nll and their token counts) equal a forward by hand."""
    got = stage1_sft.sft_loss_sums(tiny_model(), micro_batch())
    for key, value in EXPECTED_SUMS.items():
        assert math.isclose(number(got[key]), value, rel_tol=1e-4, abs_tol=1e-6), key


class RememberLogits(torch.nn.Module):
    """The tiny model, keeping the logits it returned so that a check can read their gradient."""

    def __init__(self, model):
        super().__init__()
        self.model, self.logits = model, None

    def forward(self, **inputs):
        output = self.model(**inputs)
        output.logits.retain_grad()
        self.logits = output.logits
        return output


def prompt_and_padding_carry_no_loss():
    """A masked token (prompt, padding) gets no gradient, and extra padding changes no sum."""
    model, batch = tiny_model(), micro_batch()
    padded = stage1_sft.sft_loss_sums(model, micro_batch(extra_padding=3))
    plain = stage1_sft.sft_loss_sums(model, batch)
    for key in plain:
        assert math.isclose(number(padded[key]), number(plain[key]), rel_tol=1e-5, abs_tol=1e-6), key

    remember = RememberLogits(model)
    stage1_sft.sft_loss_sums(remember, batch)["nll"].backward()
    kept = remember.logits.shape[1]  # the logits may start after the prompt (logits_to_keep)
    width = batch["input_ids"].shape[1]
    for row in range(2):
        for column in range(kept):
            predicts = width - kept + column + 1  # the logits at position p predict token p + 1
            labelled = predicts < width and batch["labels"][row, predicts] != IGNORE
            has_gradient = bool(remember.logits.grad[row, column].abs().sum() > 0)
            assert has_gradient == bool(labelled), (row, predicts)


def one_step_lowers_the_target_nll():
    """One SGD step on the loss (nll / tokens) lowers the target tokens' NLL on a tiny random model."""
    model, batch = tiny_model(seed=1), micro_batch()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    sums = stage1_sft.sft_loss_sums(model, batch)
    assert math.isclose(number(sums["nll"]), NLL_BEFORE_THE_STEP, rel_tol=1e-4)
    (sums["nll"] / sums["tokens"]).backward()
    optimizer.step()
    with torch.no_grad():
        after = number(stage1_sft.sft_loss_sums(model, batch)["nll"])
    assert after < NLL_BEFORE_THE_STEP - 1e-3
