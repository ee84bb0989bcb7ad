"""Tensor parallelism in PyTorch (Megatron), with DTensor's `parallelize_module`: the split is
common/parallel/strategy.py's.

q/k/v and gate/up are `ColwiseParallel` (weights Shard(0): output features 1/N per rank), o_proj and
down_proj `RowwiseParallel` (Shard(1): input features; the partial outputs are all-reduced). The gradient
flowing back into the column-parallel layers is summed over ranks once per attention and once per MLP:
`PrepareModuleInput` hands the attention and the MLP a replicated DTensor, so q, k and v add their partial
input gradients as DTensors and one all-reduce happens where it turns back into a plain tensor (Megatron's
"f"; ColwiseParallel alone would all-reduce in each of q, k and v). Embedding, norms and lm_head stay plain
replicated tensors (why: common/parallel/strategy.py); their inputs and incoming gradients are the same on every
rank, so are their gradients, and nothing averages them.

Bytes all-reduced are counted in the collectives the first step issues (a dispatch mode sees every one;
the step's shapes are those of every step). Mirrors mlx_impl/tp.py.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               parallelize_module)

from common.checkpoint.sharded import local_pieces
from common.parallel.strategy import tp_index

from .comm import CommCounter
from .ddp import MicroSteps, _local_numpy, as_float32, sum_of_squares
from .load import load_local


class TensorParallel(MicroSteps):
    """The tp strategy (common/train/protocols.py): one model's split over every rank, and what the Trainer needs
    to train and checkpoint it. The data-parallel size is 1, so no gradient is averaged."""

    reduce_scatter = None
    full_state_on_every_rank = True
    communicates = False
    keeps_grads = False

    def __init__(self, cfg, world, device: torch.device):
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.mesh, self.device = init_device_mesh(device.type, (self.size,)), device

    def wrap(self, model, source):
        """Shard the model while it is on the meta device (the sharded weights become DTensors, under the same
        names), then allocate and load only this rank's blocks (torch_impl/load.py)."""
        for block in model.model.layers:
            parallelize_module(block, self.mesh, {
                "self_attn": PrepareModuleInput(input_layouts=(Replicate(), None),
                                                desired_input_layouts=(Replicate(), None)),
                "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
                "mlp": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)),
                "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel(),
            })
            attn = block.self_attn
            attn.n_heads, attn.n_kv_heads = attn.n_heads // self.size, attn.n_kv_heads // self.size
        load_local(model, self.device, source, self.local_index)
        return model

    def local_index(self, name: str, shape: tuple) -> tuple:
        return tp_index(name, shape, self.rank, self.size)

    def no_sync(self):
        return contextlib.nullcontext()  # nothing to defer: no gradient is averaged

    def param_groups(self, model) -> list[dict]:
        """Sharded DTensors and plain tensors apart: foreach kernels take one kind at a time."""
        groups = [{"params": [p for p in model.parameters() if isinstance(p, DTensor) == sharded]}
                  for sharded in (False, True)]
        return [g for g in groups if g["params"]]

    def comm_counter(self):
        return CommCounter()  # the first step's collectives: its shapes are those of every step

    @torch.no_grad()
    def global_norm(self, params, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole model's gradient norm: the squares of sharded gradients summed over ranks, those of
        replicated ones (the same on every rank) counted once."""
        grads = [(p.grad, isinstance(p.grad, DTensor)) for p in params if p.grad is not None]
        local = [g.to_local() if sharded else g for g, sharded in grads]

        def squares(tensors):
            return torch.stack([sum_of_squares(t, dtype) for t in tensors]).sum() if tensors else \
                torch.zeros((), dtype=dtype)

        sharded = squares([t for t, (_, is_sharded) in zip(local, grads) if is_sharded])
        dist.all_reduce(sharded)
        return (squares([t for t, (_, is_sharded) in zip(local, grads) if not is_sharded]) + sharded).sqrt()

    def export_state(self, params: dict, exp_avg: dict, exp_avg_sq: dict):
        return self.gather(params), self.gather(exp_avg), self.gather(exp_avg_sq)

    def local_state(self, shapes: dict, params: dict, exp_avg: dict, exp_avg_sq: dict):
        """--checkpoint-format sharded (common/checkpoint/sharded.py): (weights, exp_avg, exp_avg_sq, where) of
        what this rank writes, under HF names; no collectives."""
        axes = {name: p.placements[0].dim if isinstance(p, DTensor) else None for name, p in params.items()}
        return local_pieces(self.rank, tuple(map(_local_numpy, (params, exp_avg, exp_avg_sq))), axes, shapes)

    def gather(self, named: dict[str, torch.Tensor]) -> Iterator[tuple[str, np.ndarray]]:
        """Whole arrays from this rank's pieces, one at a time (every rank iterates it: collectives)."""
        for name, t in named.items():
            yield name, as_float32(t.full_tensor() if isinstance(t, DTensor) else t)
