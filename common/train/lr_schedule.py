"""The learning-rate schedule, written once as a closed-form function that both backends call (`--lr-schedule`).

torch's LinearLR cannot start at 0 and SequentialLR drifts by a step at the seams, so neither backend
uses its framework's schedulers: each sets the learning rate from `lr_for` before every optimizer step.
One object per schedule (a recipe's choice, common/recipes.py), each with the warm-up of the tool it comes from:

cosine    dpcompare's: warm-up from lr / (warmup + 1), then cosine to lr * min_lr_ratio.
linear    transformers' get_linear_schedule_with_warmup (optimization.py): lr * step / warmup, then linearly to 0
          at the horizon. The Trainer's default (lr_scheduler_type "linear"), so peft's and trl's.
constant  mlx-lm's without an lr_schedule (the bare learning rate); with a warm-up, transformers'
          constant_with_warmup: lr * step / warmup, then lr.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


def lr_at(step: int, *, lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup, then cosine to lr * min_lr_ratio."""
    if step < warmup_steps:
        return lr * (step + 1) / (warmup_steps + 1)
    floor = lr * min_lr_ratio
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return floor + 0.5 * (lr - floor) * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class Cosine:
    name: str = "cosine"

    def lr(self, step: int, lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
        return lr_at(step, lr=lr, warmup_steps=warmup_steps, total_steps=total_steps, min_lr_ratio=min_lr_ratio)


@dataclass(frozen=True)
class Linear:
    name: str = "linear"

    def lr(self, step: int, lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
        if step < warmup_steps:
            return lr * step / max(1, warmup_steps)
        return lr * max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))


@dataclass(frozen=True)
class Constant:
    name: str = "constant"

    def lr(self, step: int, lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
        return lr * step / warmup_steps if step < warmup_steps else lr


SCHEDULES = {s.name: s for s in (Cosine(), Linear(), Constant())}


def lr_for(cfg, step: int) -> float:
    """The learning rate of `step` (0-based) under a RunConfig's schedule: training and diagnosis alike."""
    return SCHEDULES[cfg.lr_schedule].lr(step, cfg.lr, cfg.warmup_steps, cfg.lr_decay_steps or cfg.steps,
                                         cfg.min_lr_ratio)
