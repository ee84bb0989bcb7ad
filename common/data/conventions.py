"""How a padded row's targets are kept and how far a batch is padded: two recipe choices (common/recipes.py), one
object each, that common/data/sequences.py asks. They apply to padded rows only (instruction records, or
`--sequence padding`); a packed row has no padding.

Mask conventions (`--mask-convention`), for a row holding a record of L tokens (L - 1 real targets):

exact   the L - 1 real targets (and, with --mask-prompt, the completion's only).
mlx-lm  one target more: mlx-lm's tuner/trainer.py default_loss keeps target steps 1..L (`steps <= length`), so it
        also trains the prediction of the padding after each record (ml-explore/mlx-lm#1697, a fix closed
        unmerged). mlx-lm pads with zeros (iterate_batches: np.zeros), so that target is token 0. A record that
        fills the whole row (L = seq_len + 1) has no padding after it and no extra target, as in mlx-lm.

Padding rules (`--padding-rule`): how many target columns a micro-batch keeps, from its rows' lengths L and the
columns its mask needs. Cutting trailing padding changes no kept target's loss (attention is causal), only the
work: tokens/s and memory. A rule never cuts a column the mask keeps.

seq-len  every row to --seq-len: dpcompare's.
longest  to the longest row of the micro-batch: transformers' DataCollatorWithPadding (padding=True) and trl's
         DataCollatorForLanguageModeling.
mlx-lm   to 1 + 32 ceil(max L / 32) tokens, capped at the row (tuner/trainer.py iterate_batches, pad_to = 32):
         32 ceil(max L / 32) target columns.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MLX_LM_PAD_TO = 32           # tuner/trainer.py iterate_batches: pad_to = 32
MLX_LM_PAD_TOKEN = 0         # tuner/trainer.py iterate_batches: batch_arr = np.zeros(...)


@dataclass(frozen=True)
class Exact:
    name: str = "exact"

    def extra_targets(self, lengths: np.ndarray, seq_len: int) -> np.ndarray:
        """Per row, whether one target past the record's last token is kept (its column is L - 1)."""
        return np.zeros(len(lengths), dtype=bool)

    def extra_token(self, pad_id: int) -> int:
        return pad_id


@dataclass(frozen=True)
class MlxLmExtraTarget:
    name: str = "mlx-lm"

    def extra_targets(self, lengths: np.ndarray, seq_len: int) -> np.ndarray:
        return np.asarray(lengths) <= seq_len  # column L - 1 exists: the record leaves padding after it

    def extra_token(self, pad_id: int) -> int:
        return MLX_LM_PAD_TOKEN


@dataclass(frozen=True)
class ToSeqLen:
    name: str = "seq-len"

    def columns(self, lengths: np.ndarray, needed: int, seq_len: int) -> int:
        return seq_len


@dataclass(frozen=True)
class ToLongest:
    name: str = "longest"

    def columns(self, lengths: np.ndarray, needed: int, seq_len: int) -> int:
        return max(1, needed)


@dataclass(frozen=True)
class ToMlxLmMultiple:
    name: str = "mlx-lm"

    def columns(self, lengths: np.ndarray, needed: int, seq_len: int) -> int:
        longest = int(np.max(lengths)) if len(lengths) else 1
        rounded = MLX_LM_PAD_TO * -(-longest // MLX_LM_PAD_TO)
        return max(1, needed, min(rounded, seq_len))


MASK_CONVENTIONS = {c.name: c for c in (Exact(), MlxLmExtraTarget())}
PADDING_RULES = {r.name: r for r in (ToSeqLen(), ToLongest(), ToMlxLmMultiple())}
MaskConvention = Exact | MlxLmExtraTarget
PaddingRule = ToSeqLen | ToLongest | ToMlxLmMultiple
