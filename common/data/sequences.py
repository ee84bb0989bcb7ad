"""Training samples cut from a token split, in one of two ways.

packing   the split as one stream (documents separated by their EOS); sample i is the window
          tokens[i*T : i*T + T + 1], so consecutive samples share one boundary token and together cover
          the stream. Every target is real.
padding   one sample per document: its tokens (EOS included) cut to T + 1 and padded with pad_id. Targets
          past the document's end are masked out.

Instruction records (common/data/instructions.py) are always one sample each, as in padding, whatever the mode.
With `mask_prompt` (--mask-prompt) the targets that are their record's prompt are masked out too: the loss is
the completion's (mlx-lm's mask_prompt).

The loss of a step is the sum of token losses over the global count of real targets. Every rank gets
that count from `real_target_count` on the global batch's indices, which reads only document lengths (and the
samples' prompt masks), so data-parallel training with padding or masked prompts weighs each token exactly as one
process would.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from common.errors import UserError
from common.data.conventions import MASK_CONVENTIONS, PADDING_RULES
from common.data.tokencache import TokenCache, TokenSplit

MODES = ("packing", "padding")


class SequenceView:
    def __init__(self, split: TokenSplit, seq_len: int, mode: str = "packing", mask_prompt: bool = False,
                 mask_convention: str = "exact", padding_rule: str = "seq-len"):
        if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len <= 0:
            raise UserError(f"sequence length must be a positive integer, got {seq_len!r}")
        if mode not in MODES:
            raise UserError(f"unknown sequence mode {mode!r}; allowed: {', '.join(MODES)}")
        if mask_prompt and split.prompt_mask is None:
            raise UserError(MASK_PROMPT_NEEDS_RECORDS)
        if split.prompt_mask is not None:  # a record is a sample
            mode = "padding"
        self.split, self.seq_len, self.mode, self.mask_prompt = split, int(seq_len), mode, bool(mask_prompt)
        # a padded row's targets and the micro-batch's width (common/data/conventions.py; recipe choices)
        self.convention, self.padding = MASK_CONVENTIONS[mask_convention], PADDING_RULES[padding_rule]

    @property
    def truncated_records(self) -> int | None:
        """Samples whose document (record) is longer than the seq_len + 1 tokens of a sample, and was cut; None
        when packing, where no sample is a document."""
        if self.mode == "packing":
            return None
        return int(np.count_nonzero(np.diff(np.asarray(self.split.offsets)) > self.seq_len + 1))

    @property
    def num_samples(self) -> int:
        if self.mode == "padding":
            return self.split.num_documents
        return max(0, (self.split.num_tokens - 1) // self.seq_len)

    def sample_lengths(self) -> np.ndarray:
        """Every sample's length in tokens, uncut (a document's, a record's; a packed window's is seq_len + 1): what
        mlx-lm's order sorts by (common/data/sampler.py LengthSortedBatches)."""
        if self.mode == "packing":
            return np.full(self.num_samples, self.seq_len + 1, dtype=np.int64)
        return np.diff(np.asarray(self.split.offsets, dtype=np.int64))[:self.num_samples]

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
            if self.mask_prompt:
                for row, prompt in enumerate(self._prompt_targets(starts, lengths)):
                    mask[row, :len(prompt)][prompt] = 0.0
            extra = np.nonzero(self.convention.extra_targets(lengths, self.seq_len))[0]
            mask[extra, lengths[extra] - 1] = 1.0  # the target after the record's last token (mlx-lm's)
            rows[extra, lengths[extra]] = self.convention.extra_token(self.split.pad_id)
            needed = int(np.max(lengths - 1 + np.isin(np.arange(len(lengths)), extra), initial=0))
            columns = self.padding.columns(lengths, needed, self.seq_len)
            return (np.ascontiguousarray(rows[:, :columns]), np.ascontiguousarray(rows[:, 1:columns + 1]),
                    np.ascontiguousarray(mask[:, :columns]))
        return np.ascontiguousarray(rows[:, :-1]), np.ascontiguousarray(rows[:, 1:]), mask

    def real_target_count(self, indices) -> int:
        """The number of unmasked targets of these samples (mask.sum() of their batch), from lengths (and, with
        mask_prompt, the samples' prompt masks) only."""
        indices = self._checked(indices)
        if self.mode == "packing":
            return len(indices) * self.seq_len
        starts, lengths = self._document_windows(indices)
        extra = int(np.count_nonzero(self.convention.extra_targets(lengths, self.seq_len)))
        if self.mask_prompt:
            return extra + int(sum(len(prompt) - int(np.count_nonzero(prompt))
                                   for prompt in self._prompt_targets(starts, lengths)))
        return extra + int(np.sum(lengths - 1))

    def _prompt_targets(self, starts: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
        """Per sample, whether each of its length - 1 targets (tokens 1..length-1 of its window) is prompt."""
        return [self.split.read_prompt_mask(start + 1, start + length).astype(bool)
                for start, length in zip(starts.tolist(), lengths.tolist())]

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


MASK_PROMPT_NEEDS_RECORDS = ("--mask-prompt needs instruction data: a .jsonl --dataset of {\"prompt\", \"completion\"} "
                             "or {\"messages\"} records; this dataset is plain text")


def truncated_records(token_cache: str | Path | None, seq_len: int, mode: str) -> int | None:
    """summary.json's count of the training records (documents, when padding) cut to seq_len + 1 tokens; None
    when packing plain text, or where the cache is gone."""
    if token_cache is None:
        return None
    try:
        split = TokenCache.open(Path(token_cache)).split("train")
    except (UserError, OSError):
        return None
    return SequenceView(split, seq_len, mode).truncated_records
