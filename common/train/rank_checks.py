"""What every rank checks against the others: the same starting weights, the same final step, replicas that
stayed equal. Each check is one small all-reduce; a rank that disagrees raises TrainingError, so every rank
stops before a checkpoint that would hide the difference."""
from __future__ import annotations

import numpy as np

from common.checkpoint.tensorsource import TensorSource, probe_checksum


class TrainingError(Exception):
    """The run cannot go on (NaN loss, diverging ranks); the last good checkpoint stays."""


def check_identical_weights(trainer, source: TensorSource) -> None:
    """All ranks must start from the same weights: compare a checksum of the source across ranks. It probes
    the first row of every tensor (common/checkpoint/tensorsource.py's probe_checksum), which every rank can read
    whatever part of the model it keeps, so no sharded rank reads the whole model for it."""
    checksum = probe_checksum(source)
    total, total_sq = trainer.all_sum(np.array([checksum, checksum * checksum], dtype=np.float64), over="world")
    # Equal checksums on every rank give total_sq == total**2 / N exactly up to rounding.
    spread = total_sq - total * total / trainer.world_size
    if abs(spread) > 1e-6 * max(1.0, total_sq):
        raise TrainingError("ranks hold different initial weights (checksum mismatch); check that every "
                            "host reads the same seed checkpoint")


def check_same_step(trainer, step: int) -> None:
    """Every rank must end at the same step: one that skipped or repeated steps while its collectives
    still matched would have trained on other batches. A rank whose step is not the mean over the ranks
    raises (exact in float32 up to 2**24 steps)."""
    count, total = trainer.all_sum(np.array([1.0, step], dtype=np.float64), over="world")
    if abs(total - count * step) > 0.5:
        raise TrainingError(f"ranks ended at different steps: this rank at {step}, the mean over "
                            f"{count:.0f} ranks {total / count:g}; check that every node runs the same --steps")


def replica_checksum(array: np.ndarray) -> float:
    """One tensor's part of check_replicas_agree's checksum (summed over the tensors as they stream by)."""
    return float(np.float64(np.abs(array).sum()))


def check_replicas_agree(trainer, checksum: float, step: int) -> None:
    """Every rank exports the same full weights (ddp replicas; tp's replicated embedding, norms and head, whose
    gradients are the same on every rank by construction): this rank's checksum (replica_checksum summed
    over its weights) against the mean over ranks."""
    total = trainer.all_sum(np.array([checksum], dtype=np.float64), over="world")[0]
    if abs(total - trainer.world_size * checksum) > 1e-6 * abs(total):
        raise TrainingError(f"rank {trainer.rank} holds other weights than the mean of the ranks after step {step}: "
                            "the replicas drifted apart; not saving (the last checkpoint is kept)")
