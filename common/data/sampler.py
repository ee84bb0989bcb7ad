"""Which samples every rank trains on at every step: the heart of DP correctness.

One seeded permutation of the sample indices per epoch defines a single global stream. Optimizer step k
consumes stream positions [k*G, (k+1)*G); rank r of N takes its contiguous G/N slice (or its `--rank-shares`
size, common/data/shares.py), cut further into `grad_accum` micro-batches. So the global batch at step k is the same for every world size and both
frameworks, and a run resumed at step k sees exactly the batches an uninterrupted run would: the
sampler's whole state is the step number (plus the seed and sizes it checks on resume).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from common.data.shares import micro_sizes, rank_sizes
from common.errors import UserError


def check_divisible(global_batch: int, world_size: int, grad_accum: int) -> int:
    """Micro-batch size per rank; a user error when the global batch does not split evenly."""
    parts = world_size * grad_accum
    if global_batch % parts:
        raise UserError(
            f"global batch size {global_batch} is not divisible by world size {world_size} x grad accum "
            f"{grad_accum} = {parts}")
    return global_batch // parts


@dataclass
class GlobalSampler:
    num_samples: int
    global_batch: int
    seed: int

    def __post_init__(self):
        if self.num_samples < self.global_batch:
            raise UserError(
                f"the dataset holds {self.num_samples} samples, fewer than one global batch "
                f"({self.global_batch}); use more data, a shorter --seq-len or a smaller --global-batch-size")
        self._epoch, self._perm = -1, None

    def permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
            self._epoch, self._perm = epoch, rng.permutation(self.num_samples)
        return self._perm

    def global_batch_indices(self, step: int) -> np.ndarray:
        """The G sample indices of optimizer step `step`, in order; may straddle an epoch boundary."""
        positions = np.arange(step * self.global_batch, (step + 1) * self.global_batch, dtype=np.int64)
        epochs = positions // self.num_samples
        out = np.empty(self.global_batch, dtype=np.int64)
        for epoch in np.unique(epochs):
            sel = epochs == epoch
            out[sel] = self.permutation(int(epoch))[positions[sel] % self.num_samples]
        return out

    def epoch_of(self, step: int) -> int:
        return (step * self.global_batch) // self.num_samples

    def rank_part(self, indices: np.ndarray, rank: int, world_size: int, sizes: tuple[int, ...] = ()) -> np.ndarray:
        """Rank r's samples of a global batch: its contiguous slice, `sizes[r]` long (even by default)."""
        return rank_slice(indices, rank, world_size, sizes)


@dataclass
class LengthSortedBatches(GlobalSampler):
    """mlx-lm's order (`--data-order mlx-lm`; tuner/trainer.py iterate_batches): the samples sorted by length (a
    stable sort, as `sorted(range(n), key=len)`), cut into global batches of consecutive lengths, the remainder
    dropped; each epoch takes those batches in the order of the next `np.random.permutation` of a stream seeded
    once (lora.py's `np.random.seed(args.seed)`, so mlx-lm's own first epoch exactly; its evaluations draw from
    the same stream between epochs). Rank r takes positions r, r + N, ... of each batch (`idx[i + rank : ... : N]`);
    with uneven sizes the positions are dealt round-robin to the ranks that still have room (`dealt`), which is
    that stride when the sizes are even. Still one global batch per step whatever the world size."""
    lengths: np.ndarray | None = None  # each sample's length in tokens

    def __post_init__(self):
        super().__post_init__()
        order = np.argsort(np.asarray(self.lengths), kind="stable")
        count = len(order) // self.global_batch
        self._batches = order[:count * self.global_batch].reshape(count, self.global_batch)
        self._stream, self._orders = np.random.RandomState(self.seed), []

    def permutation(self, epoch: int) -> np.ndarray:
        while len(self._orders) <= epoch:
            self._orders.append(self._stream.permutation(len(self._batches)))
        return self._orders[epoch]

    def global_batch_indices(self, step: int) -> np.ndarray:
        epoch, position = divmod(step, len(self._batches))
        return self._batches[self.permutation(epoch)[position]]

    def epoch_of(self, step: int) -> int:
        return step // len(self._batches)

    def rank_part(self, indices: np.ndarray, rank: int, world_size: int, sizes: tuple[int, ...] = ()) -> np.ndarray:
        return indices[dealt(sizes or rank_sizes(len(indices), world_size)) == rank]


DATA_ORDERS = ("dpcompare", "mlx-lm")


def sampler_for(order: str, num_samples: int, global_batch: int, seed: int, lengths=None) -> GlobalSampler:
    """The sampler of a `--data-order` (a recipe's choice): dpcompare's seeded stream, or mlx-lm's length-sorted
    batches (`lengths`: a callable giving each sample's length, asked only there)."""
    if order == "mlx-lm":
        return LengthSortedBatches(num_samples, global_batch, seed, lengths=lengths())
    return GlobalSampler(num_samples, global_batch, seed)


def rank_slice(indices: np.ndarray, rank: int, world_size: int, sizes: tuple[int, ...] = ()) -> np.ndarray:
    """Rank r's contiguous slice: `sizes[r]` samples after those of the ranks before it (even by default)."""
    sizes = sizes or rank_sizes(len(indices), world_size)
    start = sum(sizes[:rank])
    return indices[start:start + sizes[rank]]


def dealt(sizes: tuple[int, ...]) -> np.ndarray:
    """The rank of each position of a batch, dealt round-robin to the ranks with room left: r, r + N, ... when
    the sizes are even."""
    left, owners, r = list(sizes), [], 0
    for _ in range(sum(sizes)):
        while not left[r]:
            r = (r + 1) % len(sizes)
        owners.append(r)
        left[r] -= 1
        r = (r + 1) % len(sizes)
    return np.asarray(owners, dtype=np.int64)


def micro_batches(rank_indices: np.ndarray, grad_accum: int) -> list[np.ndarray]:
    """A rank's samples in `grad_accum` micro-batches (uneven only under uneven shares: common/data/shares.py)."""
    ends = np.cumsum(micro_sizes(len(rank_indices), grad_accum))
    return [rank_indices[end - n:end] for n, end in zip(micro_sizes(len(rank_indices), grad_accum), ends)]
