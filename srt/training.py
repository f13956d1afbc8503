"""What the two training loops share and nothing else: seeding, the learning-rate schedule of
§4.1 and the optional wall-clock budget."""

from __future__ import annotations

import random
import time

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


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
