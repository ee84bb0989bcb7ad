"""The learning-rate schedule, written once as a closed-form function that both backends call.

torch's LinearLR cannot start at 0 and SequentialLR drifts by a step at the seams, so neither backend
uses its framework's schedulers: each sets the learning rate from `lr_at` before every optimizer step.
"""
from __future__ import annotations

import math


def lr_at(step: int, *, lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup, then cosine to lr * min_lr_ratio."""
    if step < warmup_steps:
        return lr * (step + 1) / (warmup_steps + 1)
    floor = lr * min_lr_ratio
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return floor + 0.5 * (lr - floor) * (1.0 + math.cos(math.pi * progress))


def lr_for(cfg, step: int) -> float:
    """The learning rate of `step` (0-based) under a RunConfig's schedule: training and diagnosis alike."""
    return lr_at(step, lr=cfg.lr, warmup_steps=cfg.warmup_steps,
                 total_steps=cfg.lr_decay_steps or cfg.steps, min_lr_ratio=cfg.min_lr_ratio)
