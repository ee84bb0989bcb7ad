"""Tensor parallelism in PyTorch (Megatron), with DTensor's `parallelize_module`: the split is
common/parallel/tp.py's.

q/k/v and gate/up are `ColwiseParallel` (weights Shard(0): output features 1/N per rank), o_proj and
down_proj `RowwiseParallel` (Shard(1): input features; the partial outputs are all-reduced). The gradient
flowing back into the column-parallel layers is summed over ranks once per attention and once per MLP:
`PrepareModuleInput` hands the attention and the MLP a replicated DTensor, so q, k and v add their partial
input gradients as DTensors and one all-reduce happens where it turns back into a plain tensor (Megatron's
"f"; ColwiseParallel alone would all-reduce in each of q, k and v). Embedding, norms and lm_head stay plain
replicated tensors (why: common/parallel/tp.py); their inputs and incoming gradients are the same on every
rank, so are their gradients, and nothing averages them.

Bytes all-reduced are counted in the collectives the first step issues (a dispatch mode sees every one;
the step's shapes are those of every step). Mirrors mlx_impl/tp.py.
"""
from __future__ import annotations

from typing import Iterable, Iterator, Mapping, cast

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               parallelize_module)

from common.checkpoint.sharded import LocalState, local_pieces
from common.checkpoint.tensorsource import Index, TensorSource
from common.config import RunConfig
from common.parallel.tp import tp_index
from common.train.protocols import StateStream, World

from .comm import AllReduceCounter, CommCounter, Watch
from .grads import norm_dtype, squares_of
from .load import load_local
from .microsteps import Grads, MicroSteps
from .model import Attention, Llama
from .rank_state import as_float32, local_numpy


class TensorParallel(MicroSteps):
    """The tp strategy (common/train/protocols.py): one model's split over every rank, and what the Trainer needs
    to train and checkpoint it. The data-parallel size is 1, so no gradient is averaged."""

    reduce_scatter = None
    full_state_on_every_rank = True
    communicates = False
    keeps_grads = False

    def __init__(self, cfg: RunConfig, world: World, comm: CommCounter):
        # its world: the job, or a mesh's tp axis (torch_impl/mesh.py), whose DeviceMesh it shards over
        self.rank, self.size, self.group = world.rank, world.size, world.group
        self.device, self.comm = torch.device(world.device), comm
        self.mesh = world.device_mesh if world.device_mesh is not None else init_device_mesh(self.device.type,
                                                                                             (self.size,))

    def wrap(self, model: Llama, source: TensorSource) -> Llama:
        """Shard the model while it is on the meta device (the sharded weights become DTensors, under the same
        names), then allocate and load only this rank's blocks (torch_impl/load.py)."""
        self._parallelize(model)
        load_local(model, self.device, source, self.local_index)
        return model

    def _parallelize(self, model: Llama, layers: Iterable[int] | None = None) -> None:
        """The tp plan on the meta model: each block's weights become DTensors over the tp DeviceMesh (the blocks
        `layers`, a pipeline stage's; None: every block)."""
        blocks = model.model.layers
        for block in (blocks if layers is None else [blocks[i] for i in layers]):
            parallelize_module(block, self.mesh, {
                "self_attn": PrepareModuleInput(input_layouts=(Replicate(), None),
                                                desired_input_layouts=(Replicate(), None)),
                "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
                "mlp": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)),
                "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel(),
            })
            attn = cast(Attention, block.self_attn)
            attn.n_heads, attn.n_kv_heads = attn.n_heads // self.size, attn.n_kv_heads // self.size

    def local_index(self, name: str, shape: tuple[int, ...]) -> Index:
        return tp_index(name, shape, self.rank, self.size)

    @torch.no_grad()
    def global_norm(self, grads: Grads) -> torch.Tensor:
        """The whole model's gradient norm: the squares of sharded gradients summed over ranks, those of
        replicated ones (the same on every rank) counted once."""
        dtype = norm_dtype(self.device)

        def squares(tensors: list[torch.Tensor]) -> torch.Tensor:
            return squares_of(tensors, dtype, "cpu" if not tensors else tensors[0].device)

        sharded = squares([g.to_local() for g in grads if isinstance(g, DTensor)])
        dist.all_reduce(sharded, group=self.group)
        return (squares([g for g in grads if not isinstance(g, DTensor)]) + sharded).sqrt()

    def export_state(self, weights: Mapping[str, torch.Tensor], exp_avg: Mapping[str, torch.Tensor],
                     exp_avg_sq: Mapping[str, torch.Tensor]) -> tuple[StateStream, StateStream, StateStream]:
        return self.gather(weights), self.gather(exp_avg), self.gather(exp_avg_sq)

    def local_state(self, shapes: Mapping[str, tuple[int, ...]], weights: Mapping[str, torch.Tensor],
                    exp_avg: Mapping[str, torch.Tensor], exp_avg_sq: Mapping[str, torch.Tensor]) -> LocalState:
        """--checkpoint-format sharded (common/checkpoint/sharded.py): (weights, exp_avg, exp_avg_sq, where) of
        what this rank writes, under HF names; no collectives."""
        axes = {name: cast(Shard, p.placements[0]).dim if isinstance(p, DTensor) else None for name, p in weights.items()}
        return local_pieces(self.rank, (local_numpy(weights), local_numpy(exp_avg), local_numpy(exp_avg_sq)), axes,
                            shapes)

    def _watch_collectives(self) -> Watch:
        return AllReduceCounter()  # the first step's all-reduces: its shapes are those of every step

    def gather(self, named: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, np.ndarray]]:
        """Whole arrays from this rank's pieces, one at a time (every rank iterates it: collectives)."""
        for name, t in named.items():
            yield name, as_float32(t.full_tensor() if isinstance(t, DTensor) else t)
