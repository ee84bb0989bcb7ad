"""How a step's summed token losses become its loss, when the ranks hold different numbers of target tokens
(padding, masked prompts): one object per choice, asked by both frameworks' Trainers (`--loss-normalization`).

global-tokens  (sum of every rank's token losses) / (global count of targets): what one rank computes over the
               whole batch, whatever the world size. torchtitan's choice, Megatron-Core's calculate_per_token_loss,
               and transformers' Trainer since its fix (issue 37474).
per-rank       each rank divides its own sum by its own count, then the ranks' losses (and gradients) are averaged:
               mlx-lm's trainer (tuner/trainer.py) and a plain mean loss under DDP. With unequal counts per rank it
               weighs a token of a rank with few targets more: it does not compute what one rank computes, and the
               N-vs-1 verdict says so (docs/parity.md, "Loss normalization").

Each rank's gradients are scaled by `gradient_scale` and then averaged over the N data-parallel ranks (sum / N), so
global-tokens scales by N / T and per-rank by 1 / t (t: the rank's own count). The loss is computed from every rank's
(sum, sum / t) summed over the ranks, in float64 on the host.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class GlobalTokens:
    name: str = "global-tokens"

    def gradient_scale(self, global_tokens: float, local_tokens: float, dp_size: int) -> float:
        return dp_size / global_tokens

    def loss(self, summed: np.ndarray, global_tokens: float, dp_size: int) -> float:
        """`summed`: (sum of token losses, sum / own count) added over the data-parallel ranks."""
        return float(summed[0] / global_tokens)


@dataclass(frozen=True)
class PerRank:
    name: str = "per-rank"

    def gradient_scale(self, global_tokens: float, local_tokens: float, dp_size: int) -> float:
        return 1.0 / local_tokens if local_tokens else 0.0  # a rank without targets adds nothing

    def loss(self, summed: np.ndarray, global_tokens: float, dp_size: int) -> float:
        return float(summed[1] / dp_size)


NORMALIZATIONS = {n.name: n for n in (GlobalTokens(), PerRank())}


def normalization(name: str) -> GlobalTokens | PerRank:
    return NORMALIZATIONS[name]


def loss_parts(loss_sum: float, local_tokens: float) -> np.ndarray:
    """What a rank adds to the step's loss: its sum, and its sum over its own count (0 without targets)."""
    return np.array([loss_sum, loss_sum / local_tokens if local_tokens else 0.0], dtype=np.float64)


def local_tokens(batches) -> float:
    """The rank's own count of targets in the step's micro-batches: the sum of their masks."""
    return float(sum(np.asarray(mask, dtype=np.float64).sum() for _, _, mask in batches))
