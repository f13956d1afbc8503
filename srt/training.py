"""What the two training loops share and nothing else: seeding, the optimizer and learning-rate
schedule of §4.1, and the optional wall-clock budget."""

from __future__ import annotations

import random
import time

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def adamw(params, lr: float, weight_decay: float, fsdp: bool = False) -> torch.optim.AdamW:
    """§4.1's AdamW, in torch's fused kernel (one pass over each tensor) where it has one: on a CPU
    torch's default is a Python loop of small ops over every tensor, a few times slower
    (docs/experiments/presets.md, "AdamW's kernel"). The same update up to rounding. FSDP's sharded
    parameters keep the default."""
    params = list(params)
    fused = not fsdp and all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused or None)


def warmup_lr(step: int, base_lr: float, warmup_steps: int) -> float:
    """§4.1: constant learning rate after a linear warm-up; `step` counts from 1."""
    if warmup_steps > 0 and step <= warmup_steps:
        return base_lr * step / warmup_steps
    return base_lr


class TimeBudget:
    """An optional wall-clock ceiling. Presets fix the number of steps; a budget only stops a run
    early (checkpoint saved, --resume continues), and the caller says loudly how many steps are
    missing. `reserve_s` is what must still fit after the last step (saving, a final evaluation)."""

    def __init__(self, minutes: float | None, reserve_s: float = 60.0):
        self.started = time.perf_counter()
        self.limit_s = None if minutes is None else 60.0 * minutes
        self.reserve_s = reserve_s
        self.slowest_step_s = 0.0

    def record_step(self, seconds: float) -> None:
        self.slowest_step_s = max(self.slowest_step_s, seconds)

    def exhausted(self) -> bool:
        """True when another step (the slowest so far, with a margin) and the reserve no longer fit."""
        if self.limit_s is None:
            return False
        left = self.limit_s - (time.perf_counter() - self.started)
        return left < 1.5 * self.slowest_step_s + self.reserve_s

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started
