"""What a torch rank holds of the training state, as numpy and in bytes: the float32 arrays export_state and
local_state hand on, and the state's size. Mirrors mlx_impl/rank_state.py."""
from __future__ import annotations

from typing import Iterator, Mapping

import numpy as np
import torch
import torch.nn as nn

from .adamw import AdamW
from .load import local


def as_float32(tensor: torch.Tensor) -> np.ndarray:
    """float32 numpy: a view of a float32 CPU tensor, a copy otherwise."""
    return tensor.detach().float().cpu().numpy()


def local_numpy(named: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """What this rank holds of each tensor (a DTensor's local shard) as float32 numpy, a view on CPU
    (local_state's pieces)."""
    return {name: as_float32(local(value)) for name, value in named.items()}


def numpy_stream(named: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, np.ndarray]]:
    """export_state's stream of a rank's whole tensors: float32 numpy one at a time (a view of a float32
    CPU tensor), so the checkpoint's writer never holds two."""
    for name, value in named.items():
        yield name, as_float32(value)


def state_bytes(model: nn.Module, optimizer: AdamW) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state on this rank. A gradient has its parameter's
    shape on this rank (a shard under fsdp, a slice under tp), so the two take the same bytes."""
    states = (t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor))
    params = sum(local(p).nbytes for p in model.parameters() if p.requires_grad)
    return {"params": params, "grads": params, "optimizer": sum(local(t).nbytes for t in states)}
