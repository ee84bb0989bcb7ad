"""What an MLX rank holds of the training state, as numpy and in bytes: the float32 views export_state and
local_state hand on, and the state's size. Mirrors torch_impl/rank_state.py."""
from __future__ import annotations

from typing import Iterator, Mapping

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten


def as_float32(value: mx.array | np.ndarray) -> np.ndarray:
    """float32 numpy: a view of the MLX array where it is float32 already (MLX arrays are immutable, so a
    view is safe and saving costs no copy of the state)."""
    if isinstance(value, mx.array) and value.dtype != mx.float32:
        value = value.astype(mx.float32)
    return np.asarray(value, dtype=np.float32)


def local_numpy(named: Mapping[str, mx.array]) -> dict[str, np.ndarray]:
    """What this rank holds of each array, as float32 numpy views (local_state's pieces)."""
    return {name: as_float32(value) for name, value in named.items()}


def numpy_stream(named: Mapping[str, mx.array]) -> Iterator[tuple[str, np.ndarray]]:
    """export_state's stream of a rank's whole tensors: float32 numpy one at a time (a view of the MLX
    array where it is float32 already), so the checkpoint's writer never holds two."""
    for name, value in named.items():
        yield name, as_float32(value)


def state_bytes(model: nn.Module, optimizer: optim.Optimizer) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state on this rank. A gradient has its parameter's
    shape on this rank (a shard under fsdp, a slice under tp), so the two take the same bytes."""
    params = _nbytes(model.trainable_parameters())
    return {"params": params, "grads": params, "optimizer": _nbytes(optimizer.state)}


def _nbytes(tree: object) -> int:
    return sum(a.nbytes for _, a in tree_flatten(tree) if isinstance(a, mx.array))
