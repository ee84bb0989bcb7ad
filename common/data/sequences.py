"""Training samples cut from a token split, in one of two ways.

packing   the split as one stream (documents separated by their EOS); sample i is the window
          tokens[i*T : i*T + T + 1], so consecutive samples share one boundary token and together cover
          the stream. Every target is real.
padding   one sample per document: its tokens (EOS included) cut to T + 1 and padded with pad_id. Targets
          past the document's end are masked out.

The loss of a step is the sum of token losses over the global count of real targets. Every rank gets
that count from `real_target_count` on the global batch's indices, which reads only document lengths,
so data-parallel training with padding weighs each token exactly as one process would.
"""
from __future__ import annotations

import numpy as np

from common.errors import UserError
from common.data.tokencache import TokenSplit

MODES = ("packing", "padding")


class SequenceView:
    def __init__(self, split: TokenSplit, seq_len: int, mode: str = "packing"):
        if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len <= 0:
            raise UserError(f"sequence length must be a positive integer, got {seq_len!r}")
        if mode not in MODES:
            raise UserError(f"unknown sequence mode {mode!r}; allowed: {', '.join(MODES)}")
        self.split, self.seq_len, self.mode = split, int(seq_len), mode

    @property
    def num_samples(self) -> int:
        if self.mode == "padding":
            return self.split.num_documents
        return max(0, (self.split.num_tokens - 1) // self.seq_len)

    def batch(self, indices) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(inputs, targets, mask) of shape (len(indices), seq_len): int32, int32, float32.
        Reads only the samples' tokens."""
        indices = self._checked(indices)
        window = self.seq_len + 1
        if self.mode == "packing":
            rows = np.empty((len(indices), window), dtype=np.int32)
            for row, start in enumerate((indices * self.seq_len).tolist()):
                rows[row] = self.split.read(start, start + window)
            mask = np.ones((len(indices), self.seq_len), dtype=np.float32)
        else:
            starts, lengths = self._document_windows(indices)
            rows = np.full((len(indices), window), self.split.pad_id, dtype=np.int32)
            for row, (start, length) in enumerate(zip(starts.tolist(), lengths.tolist())):
                rows[row, :length] = self.split.read(start, start + length)
            mask = (np.arange(self.seq_len) < (lengths - 1)[:, None]).astype(np.float32)
        return np.ascontiguousarray(rows[:, :-1]), np.ascontiguousarray(rows[:, 1:]), mask

    def real_target_count(self, indices) -> int:
        """The number of unmasked targets of these samples (mask.sum() of their batch), from lengths only."""
        indices = self._checked(indices)
        if self.mode == "packing":
            return len(indices) * self.seq_len
        _, lengths = self._document_windows(indices)
        return int(np.sum(lengths - 1))

    def _document_windows(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each document's first token and how many of its tokens fit in a window of seq_len + 1."""
        starts, stops = self.split.document_spans(indices)
        return starts, np.minimum(stops - starts, self.seq_len + 1)

    def _checked(self, indices) -> np.ndarray:
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        if len(indices) and (indices.min() < 0 or indices.max() >= self.num_samples):
            raise IndexError(f"sample index out of range 0..{self.num_samples - 1}: "
                             f"{indices[(indices < 0) | (indices >= self.num_samples)][0]}")
        return indices
