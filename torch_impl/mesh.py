"""Meshes in PyTorch (`--mesh dp=2,tp=2`): a process group per axis, and the strategies composed over them.

The axes come from one `init_device_mesh` over every rank, its dimensions named and ordered as
common/parallel/mesh.py lays them out (row-major: the last axis varies fastest, as there); each axis's 1-D
DeviceMesh and process group go into the rank's World (`split_axes`, launch.py).

The composition (common/parallel/composed.py says the same of the cost): the model-parallel strategy (tp.py's
TensorParallel on its axis's DeviceMesh, pp.py's Pipeline on its axis's group) runs as if its sub-group were the
job, and the data axis reduces what it leaves:
- dp (`DataParallelOver`): after the inner strategy's backward, every gradient the rank holds (its tp shards'
  local tensors, or its stage's) is averaged over the dp group in one flat all-reduce. DDP's wrapper is not
  used: it does not take DTensor parameters, and a pipeline stage's backward runs inside the schedule. Over
  pp x tp (three axes) its inner strategy is `TensorParallelStages`.
- fsdp x tp (`ShardedTensorParallel`): DTensor tp on the tp axis, then FSDP2's fully_shard on the fsdp axis
  (torchtitan's 2-D composition, which FACTS.md measured on gloo): a rank holds 1/fsdp of its tp shard.
Data is sliced by the data coordinate (common/train/loop.py), the exact loss sums over the data group
(World.data_group) or, under pp, over the world, and the gradient norm adds every tensor's squares once over
the mesh. Mirrors mlx_impl/mesh.py.
"""
from __future__ import annotations

from typing import Iterator, Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from common.checkpoint.sharded import LocalState, box_of, local_pieces, pieces_at
from common.checkpoint.tensorsource import Index, TensorSource
from common.config import RunConfig
from common.parallel.fsdp import fsdp_rows
from common.parallel.mesh import Mesh
from common.parallel.tp import tp_index, tp_split_axis
from common.train.protocols import Batch, ForwardBackwardResult, Phase, StateStream, World, no_phase

from .adamw import AdamW
from .comm import CommCounter
from .cp import SequenceParallel, exchanges_for, sequence_attention, sequence_slices
from .fsdp import Sharding, shard_model
from .grads import norm_dtype, squares_of
from .load import load_local
from .microsteps import Grads, StepFunctions
from .model import Llama
from .pp import Pipeline
from .rank_state import as_float32, local_numpy
from .tp import TensorParallel

MODEL_PARALLEL: dict[str, type[TensorParallel] | type[Pipeline]] = {"tp": TensorParallel, "pp": Pipeline}


def split_axes(world: World, mesh: Mesh) -> dict[str, World]:
    """This rank's world on each axis of `mesh`: its DeviceMesh and process group there (every rank calls it)."""
    device_mesh = init_device_mesh(torch.device(world.device).type, tuple(size for _, size in mesh.axes),
                                   mesh_dim_names=mesh.names)
    world.device_mesh = device_mesh
    return {name: World(rank=mesh.coordinate(world.rank, name), size=size, group=device_mesh.get_group(name),
                        device=world.device, device_mesh=device_mesh[name]) for name, size in mesh.axes}


def release_axes(world: World) -> None:
    """torch's sub-groups go with destroy_process_group (launch.py): nothing to drop first."""
    world.axes.clear()


def mesh_strategy(cfg: RunConfig, world: World, comm: CommCounter):
    """The strategy of `--strategy mesh`: the composition of cfg.mesh's axes (the module docstring)."""
    mesh = Mesh.parse(cfg.mesh)
    if mesh.has("cp"):  # dp x cp: ddp over every rank, each on its slice of the sequence (cp.py)
        return ContextParallelOver(cfg, world, comm) if mesh.model_axis else SequenceParallel(cfg, world, comm)
    if mesh.has("fsdp"):
        return ShardedTensorParallel(cfg, world, comm)
    if mesh.tp_stages and not mesh.has("dp"):
        return TensorParallelStages(cfg, world, comm)
    return DataParallelOver(cfg, world, comm)


class DataParallelOver:
    """dp over a model-parallel strategy (tp, pp, or pp x tp): the inner one trains on its sub-groups, then the
    gradients it leaves are averaged over the dp group."""

    reduce_scatter = None
    full_state_on_every_rank = True
    communicates = False  # inside forward_backward, after the backward, as DDP's is inside the backward
    keeps_grads = False
    averaged_over = "dp"  # the axis whose ranks average every gradient the inner strategy leaves

    def __init__(self, cfg: RunConfig, world: World, comm: CommCounter):
        mesh = Mesh.parse(cfg.mesh)
        self.inner: TensorParallel | Pipeline
        if mesh.tp_stages:  # pp x dp x tp: each dp replica a pipeline of tp-split stages
            self.inner = TensorParallelStages(cfg, world, comm)
        else:
            axis = mesh.model_axis
            assert axis is not None  # mesh_strategy wraps a model axis here (tp or pp)
            self.inner = MODEL_PARALLEL[axis](cfg, world.axes[axis], comm)
        dp = world.axes[self.averaged_over]
        self.dp_group, self.dp_size, self.data_rank, self.comm = dp.group, dp.size, dp.rank, comm
        self.averaged = [dp]  # the groups that average the gradients, one after the other
        self.loss_over = self.inner.loss_over
        self.counted = False

    def wrap(self, model: Llama, source: TensorSource) -> nn.Module:
        return self.inner.wrap(model, source)

    def local_index(self, name: str, shape: tuple[int, ...]) -> Index | None:
        return self.inner.local_index(name, shape)

    def forward_backward(self, step: StepFunctions, batches: Sequence[Batch], scale: float,
                         phase: Phase = no_phase, wait: bool = False,
                         sync: bool = True) -> ForwardBackwardResult[torch.Tensor, Grads]:
        result = self.inner.forward_backward(step, batches, scale, phase, wait, sync)
        if sync:
            self._average(result.grads)
        return result

    @torch.no_grad()
    def _average(self, grads: Grads) -> None:
        """Every local gradient averaged over the dp group (each of `averaged` in turn), in place, through one flat
        buffer."""
        local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        flat = torch.cat([g.reshape(-1) for g in local])
        for axis in self.averaged:
            dist.all_reduce(flat, group=axis.group)
            flat /= axis.size
        offset = 0
        for g in local:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        if not self.counted:  # the inner strategy counted its own first step; the average is every step's too
            self.comm.per_step = (self.comm.per_step or 0) + len(self.averaged) * flat.numel() * flat.element_size()
            self.counted = True

    def eval_losses(self, step: StepFunctions, batches: Sequence[Batch]) -> torch.Tensor:
        return self.inner.eval_losses(step, batches)

    def global_norm(self, grads: Grads) -> torch.Tensor:
        """The dp replicas hold the same averaged gradients: the inner strategy's norm is the mesh's."""
        return self.inner.global_norm(grads)

    def export_state(self, weights: Mapping[str, torch.Tensor], exp_avg: Mapping[str, torch.Tensor],
                     exp_avg_sq: Mapping[str, torch.Tensor]) -> tuple[StateStream, StateStream, StateStream]:
        return self.inner.export_state(weights, exp_avg, exp_avg_sq)

    def local_state(self, shapes: Mapping[str, tuple[int, ...]], weights: Mapping[str, torch.Tensor],
                    exp_avg: Mapping[str, torch.Tensor], exp_avg_sq: Mapping[str, torch.Tensor]) -> LocalState:
        """The first dp replica writes its pieces (the inner strategy's); the others hold copies of them."""
        if self.data_rank:
            return {}, {}, {}, {}
        return self.inner.local_state(shapes, weights, exp_avg, exp_avg_sq)

    def figures(self) -> dict[str, object]:
        return self.inner.figures()

    def optimizer(self, base: AdamW) -> AdamW:
        return self.inner.optimizer(base)

    def state_bytes(self, model: nn.Module, optimizer: AdamW) -> dict[str, int]:
        return self.inner.state_bytes(model, optimizer)


class ContextParallelOver(DataParallelOver):
    """tp x cp, pp x cp: the model-parallel strategy on its axis, every block's attention cp.py's over the cp group
    (Ulysses on the heads tp leaves the rank, or ring), each rank on its slice of the sequence. As under cp alone,
    each rank's gradients are its own tokens' scaled by cp, and the cp group averages them (dp's part in
    DataParallelOver, on the cp axis). The loss sums over the world: each cp rank holds its slice's loss sum (pp:
    the last stage's), tp rank 0 reports it (its tp peers hold the same). pp x dp x cp x tp: each dp replica that,
    on its rows, then the dp group averages what the cp group averaged (`replicas`)."""

    averaged_over = "cp"

    def __init__(self, cfg: RunConfig, world: World, comm: CommCounter):
        super().__init__(cfg, world, comm)
        self.replicas = world.axes.get("dp")
        if self.replicas is not None:
            self.averaged.append(self.replicas)
            self.data_rank = max(self.data_rank, self.replicas.rank)  # the first replica's first cp rank writes
        cp = world.axes["cp"]
        self.attention, self.cp_rank, self.cp_size = cfg.cp_attention, cp.rank, cp.size
        self.exchanges = exchanges_for(self.attention, cp.group, cp.rank, cp.size, comm)
        self.tp_rank = world.axes["tp"].rank if "tp" in world.axes else 0
        self.loss_over = "world"

    def wrap(self, model: Llama, source: TensorSource) -> nn.Module:
        sequence_attention(model, self.attention, self.cp_rank, self.cp_size, self.exchanges)
        return self.inner.wrap(model, source)

    def forward_backward(self, step: StepFunctions, batches: Sequence[Batch], scale: float,
                         phase: Phase = no_phase, wait: bool = False,
                         sync: bool = True) -> ForwardBackwardResult[torch.Tensor, Grads]:
        mine = sequence_slices(batches, self.attention, self.cp_rank, self.cp_size)
        result = super().forward_backward(step, mine, scale * self.cp_size, phase, wait, sync)
        return ForwardBackwardResult(self._reported(result.losses), result.grads)

    def eval_losses(self, step: StepFunctions, batches: Sequence[Batch]) -> torch.Tensor:
        return self._reported(self.inner.eval_losses(step, sequence_slices(batches, self.attention, self.cp_rank,
                                                                           self.cp_size)))

    def _reported(self, loss_sum: torch.Tensor) -> torch.Tensor:
        return loss_sum if self.tp_rank == 0 else torch.zeros_like(loss_sum)


class ShardedTensorParallel(Sharding):
    """fsdp x tp: DTensor tp over the tp axis (TensorParallel's plan), then FSDP2 over the fsdp axis of the same
    2-D DeviceMesh (fsdp.py's shard_model); FSDP2's hooks reduce-scatter over fsdp inside the backward."""

    full_state_on_every_rank = True
    communicates = False  # the reduce-scatter runs inside the backward (FSDP2's hooks)

    def __init__(self, cfg: RunConfig, world: World, comm: CommCounter):
        super().__init__(cfg, world.axes["fsdp"], comm)
        self.tp = TensorParallel(cfg, world.axes["tp"], comm)
        self.fsdp_group, self.tp_group = world.axes["fsdp"].group, world.axes["tp"].group

    def wrap(self, model: Llama, source: TensorSource) -> Llama:
        self.tp._parallelize(model)
        shard_model(model, self.device, self.backend, release_heap=self.release_heap, mesh=self.mesh)
        load_local(model, self.device, source, self.local_index)
        self.model = model
        return model

    def local_index(self, name: str, shape: tuple[int, ...]) -> Index:
        """tp's block, then fsdp's rows of it (FSDP2 shards dim 0 of the tp-local tensor)."""
        index = list(tp_index(name, shape, self.tp.rank, self.tp.size)) or [slice(None)] * len(shape)
        first = index[0]
        start, stop = first.start or 0, shape[0] if first.stop is None else first.stop
        rows = fsdp_rows(stop - start, self.rank, self.size)
        index[0] = slice(start + rows.start, start + rows.stop)
        return tuple(index)

    @torch.no_grad()
    def global_norm(self, grads: Grads) -> torch.Tensor:
        """Squares of every tensor once over the mesh: those sharded on both axes summed over tp and fsdp, those
        FSDP2 shards over fsdp alone (tp-replicated) over fsdp."""
        dtype = norm_dtype(self.device)
        both = [g.to_local() for g in grads if isinstance(g, DTensor) and g.device_mesh.ndim == 2]
        fsdp_only = [g.to_local() if isinstance(g, DTensor) else g for g in grads
                     if not (isinstance(g, DTensor) and g.device_mesh.ndim == 2)]

        def squares(tensors: list[torch.Tensor]) -> torch.Tensor:
            return squares_of(tensors, dtype, self.device)

        over_tp = squares(both)
        dist.all_reduce(over_tp, group=self.tp_group)
        total = over_tp + squares(fsdp_only)
        dist.all_reduce(total, group=self.fsdp_group)
        return total.sqrt()

    def export_state(self, weights: Mapping[str, torch.Tensor], exp_avg: Mapping[str, torch.Tensor],
                     exp_avg_sq: Mapping[str, torch.Tensor]) -> tuple[StateStream, StateStream, StateStream]:
        return self.full(weights), self.full(exp_avg), self.full(exp_avg_sq)

    def full(self, flat: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, np.ndarray | None]]:
        """Whole tensors on every rank, one at a time (every rank iterates it: collectives)."""
        for key, value in flat.items():
            yield key, as_float32(value.full_tensor() if isinstance(value, DTensor) else value)

    def local_state(self, shapes: Mapping[str, tuple[int, ...]], weights: Mapping[str, torch.Tensor],
                    exp_avg: Mapping[str, torch.Tensor], exp_avg_sq: Mapping[str, torch.Tensor]) -> LocalState:
        """--checkpoint-format sharded (common/checkpoint/sharded.py): each piece is the block local_index reads
        (a row-parallel weight's on two axes: fsdp's rows of tp's columns; FSDP2 keeps uneven shards unpadded
        in to_local); a tensor tp does not split, which the tp ranks hold alike, is written by tp rank 0 (FSDP2
        shards every tensor over fsdp, the final norm too). No collectives."""
        where = {name: box_of(self.local_index(name, shapes[name]), shapes[name]) for name in weights
                 if not (self.tp.rank and tp_split_axis(name) is None)}
        return pieces_at((local_numpy(weights), local_numpy(exp_avg), local_numpy(exp_avg_sq)), where)


class TensorParallelStages(Pipeline):
    """pp x tp: pp.py's Pipeline over the pp axis, each stage's blocks split over the stage's tp group by tp.py's
    plan. Stage s's tp rank i exchanges activations with stage s+1's tp rank i (their pp group): every tp rank
    holds the whole activation after its row-parallel all-reduce, and sends it whole (Megatron's scatter-gather,
    1/tp of it per rank, is left out). The embedding, the final norm and the head are replicated over tp, as under
    tp, so the last stage's tp ranks all hold the loss: tp rank 0 reports it (the Trainer sums over the world)."""

    def __init__(self, cfg: RunConfig, world: World, comm: CommCounter):
        super().__init__(cfg, world.axes["pp"], comm)
        self.tp = TensorParallel(cfg, world.axes["tp"], comm)

    def _split_stage(self, model: Llama) -> None:
        self.tp._parallelize(model, self.layers)

    def local_index(self, name: str, shape: tuple[int, ...]) -> Index | None:
        """The stage's own tensors (pp), tp's block of each."""
        return self.tp.local_index(name, shape) if self.holds(name) else None

    def forward_backward(self, step: StepFunctions, batches: Sequence[Batch], scale: float,
                         phase: Phase = no_phase, wait: bool = False,
                         sync: bool = True) -> ForwardBackwardResult[torch.Tensor, Grads]:
        result = super().forward_backward(step, batches, scale, phase, wait, sync)
        return ForwardBackwardResult(self._reported(result.losses), result.grads)

    def eval_losses(self, step: StepFunctions, batches: Sequence[Batch]) -> torch.Tensor:
        return self._reported(super().eval_losses(step, batches))

    def _reported(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """The loss sum tp rank 0 holds (the last stage's), 0 on the other tp ranks, which hold the same sum."""
        return loss_sum if self.tp.rank == 0 else torch.zeros_like(loss_sum)

    @torch.no_grad()
    def global_norm(self, grads: Grads) -> torch.Tensor:
        """Squares of every tensor once over the mesh: the tp-split ones summed over the stage's tp group, the
        replicated ones once (a tied matrix on the first stage only), then the stages summed over pp."""
        dtype = norm_dtype(self.device)
        uncounted = self._uncounted_grads()
        counted = [g for g in grads if id(g) not in uncounted]

        def squares(tensors: list[torch.Tensor]) -> torch.Tensor:
            return squares_of(tensors, dtype, self.device)

        split = squares([g.to_local() for g in counted if isinstance(g, DTensor)])
        dist.all_reduce(split, group=self.tp.group)
        total = split + squares([g for g in counted if not isinstance(g, DTensor)])
        dist.all_reduce(total, group=self.group)
        return total.sqrt()

    def _all_sum(self, value: torch.Tensor | None, shape: tuple[int, ...]) -> np.ndarray:
        """export_state's tensor summed over the stages, a tp-split one first made whole over its tp group (every
        tp rank of the stage holds the same tensors, so their gathers pair up)."""
        return super()._all_sum(value.full_tensor() if isinstance(value, DTensor) else value, shape)

    def local_state(self, shapes: Mapping[str, tuple[int, ...]], weights: Mapping[str, torch.Tensor],
                    exp_avg: Mapping[str, torch.Tensor], exp_avg_sq: Mapping[str, torch.Tensor]) -> LocalState:
        """The stage's own tensors (a tied matrix: the first stage's copy), each tp rank its block of the split
        ones; tp rank 0 the replicated ones (common/checkpoint/sharded.py). No collectives."""
        own = (self.counted(local_numpy(weights)), self.counted(local_numpy(exp_avg)),
               self.counted(local_numpy(exp_avg_sq)))
        return local_pieces(self.tp.rank, own, {name: tp_split_axis(name) for name in own[0]}, shapes)
