"""Meshes in MLX (`--mesh dp=2,tp=2`): a sub-group per axis, and the strategies composed over them.

Sub-groups come from `Group.split(color, key)`: the ranks of one group of an axis (common/parallel/mesh.py
`groups`) share a color, ordered by their coordinate on the axis. mlx 0.32.4 splits on MPI (and nccl), not on
ring ("[ring] Group split not supported"): common/config.py refuses a ring mesh before the run starts, rather
than emulate each sub-group with a slot per group in a world-wide collective, which would move world/group
times the bytes. The sub-groups must be freed before MPI finalizes, or the process aborts at exit
(`release_axes`, launch.py).

The composition (common/parallel/composed.py says the same of the cost): the model-parallel strategy (tp.py's
TensorParallel, pp.py's Pipeline) runs on its axis's sub-group as if that were the job, and the data axis
reduces what it leaves:
- dp (`DataParallelOver`): ddp.py's Replicated over the dp sub-group averages every gradient the rank holds
  (its tp shards, or its stage's tensors) after the backward, in the Trainer's compiled update; over pp x tp
  (three axes) its inner strategy is `TensorParallelStages`;
- fsdp x tp (`ShardedTensorParallel`): fsdp.py's fully_shard wraps each tp-sharded block over the fsdp
  sub-group, so a rank holds 1/fsdp of its tp shard; the reduce-scatter runs in the backward as under fsdp.
Data is sliced by the data coordinate (common/train/loop.py), the exact loss sums over the data group
(World.data_group) or, under pp, over the world (only last stages hold a part), and the gradient norm adds
every tensor's squares once over the whole mesh.
"""
from __future__ import annotations

from typing import Iterator, Mapping, Sequence

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

from common.checkpoint.sharded import LocalState, box_of, local_pieces, pieces_at
from common.checkpoint.tensorsource import Index, TensorSource
from common.config import RunConfig
from common.parallel.fsdp import fsdp_rows
from common.parallel.mesh import Mesh
from common.parallel.tp import tp_split_axis
from common.train.protocols import Batch, ForwardBackwardResult, Phase, StateStream, World, no_phase

from .comm import CommCounter
from .cp import SequenceParallel, exchanges_for, sequence_attention, sequence_slices
from .ddp import Replicated
from .fsdp import Sharding, shard_model
from .grads import squares_of
from .load import SHARD, hf_name
from .microsteps import Grads, Losses, MicroSteps, StepFunctions
from .pp import Pipeline
from .rank_state import as_float32, local_numpy
from .tp import TensorParallel

MODEL_PARALLEL: dict[str, type[TensorParallel] | type[Pipeline]] = {"tp": TensorParallel, "pp": Pipeline}


def split_axes(world: World, mesh: Mesh) -> dict[str, World]:
    """This rank's world on each axis of `mesh`: its group there, split from the job's (every rank calls it)."""
    axes = {}
    for name in mesh.names:
        mine = mesh.group(world.rank, name)
        group = world.group.split(mesh.groups(name).index(mine), mesh.coordinate(world.rank, name))
        axes[name] = World(rank=group.rank(), size=group.size(), group=group, device=world.device)
    return axes


def release_axes(world: World) -> None:
    """Drop the sub-groups (MPI_Comm_free) while MPI is still up: freed after MPI_Finalize, the process aborts."""
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
    """dp over a model-parallel strategy (tp, pp, or pp x tp): the inner one trains on its sub-groups, Replicated
    averages its gradients over the dp sub-group."""

    reduce_scatter = None
    full_state_on_every_rank = True
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
        averaged = world.axes[self.averaged_over]
        self.data = Replicated(cfg, averaged, comm)
        self.data.dp_size = averaged.size
        self.averaged = [self.data]  # the groups that average the gradients, one after the other
        self.data_rank = averaged.rank
        self.loss_over = self.inner.loss_over

    @property
    def communicates(self) -> bool:
        return self.data.communicates

    def wrap(self, model: nn.Module, source: TensorSource) -> nn.Module:
        return self.inner.wrap(model, source)

    def local_index(self, name: str, shape: tuple[int, ...]) -> Index | None:
        return self.inner.local_index(name, shape)

    def forward_backward(self, step: StepFunctions, batches: Sequence[Batch], scale: float,
                         phase: Phase = no_phase, wait: bool = False,
                         sync: bool = True) -> ForwardBackwardResult[Losses, Grads]:
        return self.inner.forward_backward(step, batches, scale, phase, wait, sync)

    def eval_losses(self, step: StepFunctions, batches: Sequence[Batch]) -> Losses:
        return self.inner.eval_losses(step, batches)

    def reduce_gradients(self, grads: Grads) -> Grads:
        grads = self.inner.reduce_gradients(grads)
        for data in self.averaged:
            grads = data.reduce_gradients(grads)
        return grads

    def global_norm(self, grads: Grads) -> mx.array:
        """The dp replicas hold the same averaged gradients: the inner strategy's norm is the mesh's."""
        return self.inner.global_norm(grads)

    def export_state(self, weights: Mapping[str, mx.array], exp_avg: Mapping[str, mx.array],
                     exp_avg_sq: Mapping[str, mx.array]) -> tuple[StateStream, StateStream, StateStream]:
        return self.inner.export_state(weights, exp_avg, exp_avg_sq)

    def local_state(self, shapes: Mapping[str, tuple[int, ...]], weights: Mapping[str, mx.array],
                    exp_avg: Mapping[str, mx.array], exp_avg_sq: Mapping[str, mx.array]) -> LocalState:
        """The first dp replica writes its pieces (the inner strategy's); the others hold copies of them."""
        if self.data_rank:
            return {}, {}, {}, {}
        return self.inner.local_state(shapes, weights, exp_avg, exp_avg_sq)

    def figures(self) -> dict[str, object]:
        return self.inner.figures()

    def optimizer(self, base: optim.Optimizer) -> optim.Optimizer:
        return self.inner.optimizer(base)

    def state_bytes(self, model: nn.Module, optimizer: optim.Optimizer) -> dict[str, int]:
        return self.inner.state_bytes(model, optimizer)


class ContextParallelOver(DataParallelOver):
    """tp x cp, pp x cp: the model-parallel strategy on its axis, every block's attention cp.py's over the cp
    sub-group (Ulysses on the heads tp leaves the rank, or ring), each rank on its slice of the sequence. As under
    cp alone, each rank's gradients are its own tokens' scaled by cp, and the cp group averages them (dp's part in
    DataParallelOver, on the cp axis). The loss sums over the world: each cp rank holds its slice's token losses
    (pp: the last stage's), tp rank 0 reports them (its tp peers hold the same). pp x dp x cp x tp: each dp replica
    that, on its rows, then the dp group averages what the cp group averaged (`replicas`)."""

    averaged_over = "cp"

    def __init__(self, cfg: RunConfig, world: World, comm: CommCounter):
        super().__init__(cfg, world, comm)
        self.replicas = world.axes.get("dp")
        if self.replicas is not None:
            dp = Replicated(cfg, self.replicas, comm)
            dp.dp_size = self.replicas.size
            self.averaged.append(dp)
            self.data_rank = max(self.data_rank, self.replicas.rank)  # the first replica's first cp rank writes
        cp = world.axes["cp"]
        self.attention, self.cp_rank, self.cp_size = cfg.cp_attention, cp.rank, cp.size
        self.exchanges = exchanges_for(self.attention, cp.group, cp.rank, cp.size, comm)
        self.tp_rank = world.axes["tp"].rank if "tp" in world.axes else 0
        self.loss_over = "world"

    def wrap(self, model: nn.Module, source: TensorSource) -> nn.Module:
        sequence_attention(model, self.attention, self.cp_rank, self.cp_size, self.exchanges)
        return self.inner.wrap(model, source)

    def forward_backward(self, step: StepFunctions, batches: Sequence[Batch], scale: float,
                         phase: Phase = no_phase, wait: bool = False,
                         sync: bool = True) -> ForwardBackwardResult[Losses, Grads]:
        mine = sequence_slices(batches, self.attention, self.cp_rank, self.cp_size)
        result = self.inner.forward_backward(step, mine, scale * self.cp_size, phase, wait, sync)
        return ForwardBackwardResult(self._reported(result.losses), result.grads)

    def eval_losses(self, step: StepFunctions, batches: Sequence[Batch]) -> Losses:
        token_losses = self.inner.eval_losses(step, sequence_slices(batches, self.attention, self.cp_rank,
                                                                    self.cp_size))
        mx.eval(token_losses)  # a tp rank > 0 drops them, but its forward's collectives must run (MLX is lazy)
        return self._reported(token_losses)

    def _reported(self, token_losses: Losses) -> Losses:
        return token_losses if self.tp_rank == 0 else []


class ShardedTensorParallel(MicroSteps):
    """fsdp x tp: tp splits each layer over the tp sub-group (tp.py's TensorParallel on it), then fully_shard wraps
    each block, the embedding and the head over the fsdp sub-group (fsdp.py's shard_model), so a rank holds rows
    1/fsdp of its tp shard; the final norm stays replicated and is averaged over the fsdp group."""

    full_state_on_every_rank = True
    communicates = True  # the replicated gradients, averaged after the backward

    def __init__(self, cfg: RunConfig, world: World, comm: CommCounter):
        self.tp = TensorParallel(cfg, world.axes["tp"], comm)
        self.fsdp = Sharding(cfg, world.axes["fsdp"], comm)
        self.reduce_scatter: str | None = self.fsdp.reduce_scatter

    def wrap(self, model: nn.Module, source: TensorSource) -> nn.Module:
        """tp's split and load (its blocks: the rank never reads a whole split tensor), then fsdp's rows of each."""
        self.tp.wrap(model, source)
        self.fsdp.vocab_rows = shard_model(model, self.fsdp.group, self.fsdp.reduce_scatter, stream=self.fsdp.stream)
        self.fsdp.sharded = {hf_name(p) for p, _ in tree_flatten(model.parameters()) if SHARD in p}
        mx.eval(model.parameters())
        return model

    def local_index(self, name: str, shape: tuple[int, ...]) -> Index:
        """tp's block, then fsdp's rows of it (a padded vocabulary: rows past the end are zeros, not read)."""
        index = list(self.tp.local_index(name, shape)) or [slice(None)] * len(shape)
        if name in self.fsdp.sharded:
            first = index[0]
            start, stop = first.start or 0, shape[0] if first.stop is None else first.stop
            rows = fsdp_rows(stop - start, self.fsdp.rank, self.fsdp.size)
            index[0] = slice(start + rows.start, start + rows.stop)
        return tuple(index)

    def reduce_gradients(self, grads: Grads) -> Grads:
        return self.fsdp.reduce_gradients(grads)

    def global_norm(self, grads: Grads) -> mx.array:
        """Squares of every tensor once over the mesh: the tp-split shards summed over tp and fsdp, the other
        fsdp shards over fsdp, the replicated final norm once."""
        flat = tree_flatten(grads)
        replicated = squares_of(g for key, g in flat if SHARD not in key)
        tp_split = squares_of(g for key, g in flat if SHARD in key and tp_split_axis(hf_name(key)) is not None)
        sharded = squares_of(g for key, g in flat if SHARD in key and tp_split_axis(hf_name(key)) is None)
        over_tp = mx.distributed.all_sum(tp_split, group=self.tp.group)
        return mx.sqrt(replicated + mx.distributed.all_sum(over_tp + sharded, group=self.fsdp.group))

    def export_state(self, weights: Mapping[str, mx.array], exp_avg: Mapping[str, mx.array],
                     exp_avg_sq: Mapping[str, mx.array]) -> tuple[StateStream, StateStream, StateStream]:
        return self.full(weights), self.full(exp_avg), self.full(exp_avg_sq)

    def full(self, flat: Mapping[str, mx.array]) -> Iterator[tuple[str, np.ndarray | None]]:
        """Whole tensors one at a time on every rank: gathered over fsdp (the vocabulary's pad rows dropped),
        then over tp along its split axis (every rank iterates it: collectives)."""
        for key, value in flat.items():
            name = hf_name(key)
            if SHARD in key:
                value = mx.distributed.all_gather(value, group=self.fsdp.group)
                value = value[:self.fsdp.vocab_rows[name]] if name in self.fsdp.vocab_rows else value
            axis = tp_split_axis(name)
            if axis is None:
                yield name, as_float32(value)
                continue
            moved = mx.array(np.moveaxis(as_float32(value), axis, 0))
            yield name, np.moveaxis(np.array(mx.distributed.all_gather(moved, group=self.tp.group)), 0, axis)

    def local_state(self, shapes: Mapping[str, tuple[int, ...]], weights: Mapping[str, mx.array],
                    exp_avg: Mapping[str, mx.array], exp_avg_sq: Mapping[str, mx.array]) -> LocalState:
        """--checkpoint-format sharded (common/checkpoint/sharded.py): each piece is the block local_index reads
        (a row-parallel weight's on two axes: fsdp's rows of tp's columns), the vocabulary's pad rows cut. A
        tensor several ranks hold alike is written by the first of them: one tp leaves whole by tp rank 0 of its
        fsdp rank, the final norm (which fsdp leaves whole too) by rank 0 alone. No collectives."""
        def hf(flat: Mapping[str, mx.array]) -> dict[str, np.ndarray]:
            return {hf_name(key): value for key, value in local_numpy(flat).items()}

        def written(name: str) -> bool:  # by this rank: no other rank before it holds the same piece
            return not (self.tp.rank and tp_split_axis(name) is None) and \
                not (self.fsdp.rank and name not in self.fsdp.sharded)

        where = {name: box_of(self.local_index(name, shapes[name]), shapes[name])
                 for name in map(hf_name, weights) if written(name)}
        return pieces_at((hf(weights), hf(exp_avg), hf(exp_avg_sq)), where)


class TensorParallelStages(Pipeline):
    """pp x tp: pp.py's Pipeline over the pp axis, each stage's blocks split over the stage's tp sub-group by tp.py's
    layers. Stage s's tp rank i exchanges activations with stage s+1's tp rank i (their pp sub-group): every tp
    rank holds the whole activation after its row-parallel all_sum, and sends it whole (Megatron's scatter-gather,
    1/tp of it per rank, is left out). The embedding, the final norm and the head are replicated over tp, as under
    tp, so the last stage's tp ranks all hold the loss: tp rank 0 reports it (the Trainer sums over the world)."""

    def __init__(self, cfg: RunConfig, world: World, comm: CommCounter):
        super().__init__(cfg, world.axes["pp"], comm)
        self.tp = TensorParallel(cfg, world.axes["tp"], comm)

    def _split_stage(self, model: nn.Module) -> None:
        self.tp._parallelize(model, self.layers)

    def local_index(self, name: str, shape: tuple[int, ...]) -> Index | None:
        """The stage's own tensors (pp), tp's block of each."""
        return self.tp.local_index(name, shape) if self.holds(name) else None

    def forward_backward(self, step: StepFunctions, batches: Sequence[Batch], scale: float,
                         phase: Phase = no_phase, wait: bool = False,
                         sync: bool = True) -> ForwardBackwardResult[Losses, Grads]:
        counted, traced = "micro_step" in self.comm.per_call, self.comm.traced_bytes
        result = super().forward_backward(step, batches, scale, phase, wait, sync)
        if not counted:  # the first step: pp's sends per micro-step (pp.py), and now tp's all_sums beside them
            self.comm.per_call["micro_step"] += (self.comm.traced_bytes - traced) // len(batches)
        return ForwardBackwardResult(self._reported(result.losses), result.grads)

    def eval_losses(self, step: StepFunctions, batches: Sequence[Batch]) -> Losses:
        return self._reported(super().eval_losses(step, batches))

    def _reported(self, token_losses: Losses) -> Losses:
        """The token losses tp rank 0 holds (the last stage's), none on the other tp ranks, which hold the same."""
        return token_losses if self.tp.rank == 0 else []

    def global_norm(self, grads: Grads) -> mx.array:
        """Squares of every tensor once over the mesh: the tp-split ones summed over the stage's tp group, the
        replicated ones once (a tied matrix on the first stage only), then the stages summed over pp."""
        counted = [(key, g) for key, g in tree_flatten(grads) if self.counts(key)]
        replicated = squares_of(g for key, g in counted if tp_split_axis(key) is None)
        split = squares_of(g for key, g in counted if tp_split_axis(key) is not None)
        total = mx.distributed.all_sum(split, group=self.tp.group) + replicated
        return mx.sqrt(mx.distributed.all_sum(total, group=self.group))

    def _all_sum(self, value: mx.array | None, shape: tuple[int, ...]) -> np.ndarray:
        """export_state's tensor summed over the stages, a tp-split one first made whole over its tp group along
        the axis where it is short (every tp rank of the stage holds the same tensors, so their gathers pair up)."""
        if value is not None and tuple(value.shape) != tuple(shape):
            axis = next(a for a, (mine, whole) in enumerate(zip(value.shape, shape)) if mine != whole)
            moved = mx.array(np.moveaxis(as_float32(value), axis, 0))
            value = mx.array(np.moveaxis(np.array(mx.distributed.all_gather(moved, group=self.tp.group)), 0, axis))
        return super()._all_sum(value, shape)

    def local_state(self, shapes: Mapping[str, tuple[int, ...]], weights: Mapping[str, mx.array],
                    exp_avg: Mapping[str, mx.array], exp_avg_sq: Mapping[str, mx.array]) -> LocalState:
        """The stage's own tensors (a tied matrix: the first stage's copy), each tp rank its block of the split
        ones; tp rank 0 the replicated ones (common/checkpoint/sharded.py). No collectives."""
        own = (self.counted(local_numpy(weights)), self.counted(local_numpy(exp_avg)),
               self.counted(local_numpy(exp_avg_sq)))
        return local_pieces(self.tp.rank, own, {name: tp_split_axis(name) for name in own[0]}, shapes)
