"""How a rank fills its part of the model (or of AdamW's moments) from a TensorSource, in PyTorch.

The Trainer builds the Llama on the meta device (shapes, no memory); the strategy shards it there (FSDP2's
fully_shard and DTensor's parallelize_module accept meta modules; pp drops the other stages' modules) and
calls `load_local`: `to_empty` allocates only what the rank keeps, and each parameter's local tensor (its
shard of a DTensor) is filled with the slice the strategy keeps (`strategy.local_index`), read from the
source. The model has no buffers (RoPE's tables are computed from the spec at use: torch_impl/model.py), so
nothing else needs filling. A rank's peak thus holds its own part of the model, not the whole. Mirrors
mlx_impl/load.py.
"""
from __future__ import annotations

import numpy as np
import torch

from common.checkpoint.tensorsource import TensorSource


def local(tensor: torch.Tensor) -> torch.Tensor:
    """What this rank holds of a tensor: its shard of a DTensor (FSDP2 keeps uneven shards unpadded here)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def read_local(source: TensorSource, name: str, like: torch.Tensor, local_index) -> torch.Tensor:
    """This rank's slice of `name`, as a CPU tensor of the shape `like` holds locally."""
    value = source.read(name, local_index(name, source.shape(name)))
    if value.dtype == np.uint32:  # a quantized base's packed words (quantized.py): the same bits, as torch's int32
        value = value.view(np.int32)
    if value.shape != tuple(local(like).shape):
        raise AssertionError(f"{name}: read {value.shape}, this rank holds {tuple(local(like).shape)}")
    return torch.from_numpy(np.ascontiguousarray(value))


@torch.no_grad()
def load_local(model, device: torch.device, source: TensorSource, local_index) -> None:
    """Allocate the rank's part of a model built on the meta device (to_empty) and load it from `source`."""
    if any(hasattr(p, "to_local") for p in model.parameters()):
        model.to_empty(device=device)  # empty_like keeps each DTensor's placement
    else:  # what to_empty does, but torch.empty_like of a meta tensor runs torch's Python reference, which
        # imports sympy: 0.45 s of a ddp rank's start (AMD EPYC Zen 4)
        model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    for name, param in model.named_parameters():
        local(param).copy_(read_local(source, name, param, local_index))


@torch.no_grad()
def filled_like(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """A tensor placed as `param` is (a DTensor of the same sharding, or plain) holding `value` locally:
    what AdamW's state for `param` must look like."""
    out = torch.zeros_like(param)
    local(out).copy_(value)
    return out
