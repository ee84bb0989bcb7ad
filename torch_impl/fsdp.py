"""FSDP in PyTorch: FSDP2 `fully_shard` per transformer block, the embedding and the head, then the root,
on a mesh over the job.

What each rank holds (mlx_impl/fsdp.py does the same with nn.fully_shard): every parameter is a DTensor
sharded along axis 0. A unit's parameters are all-gathered for its forward and backward, its gradient
reduce-scattered in the backward. The embedding and the head are units of their own, as in MLX: in one
root unit with the final norm (what FSDP2 does by default) both vocabulary matrices were gathered at once
and stayed gathered from the forward to the end of the backward, with their unsharded gradients and the
reduce-scatter's buffer beside them: on `base` (2 x 50,000 x 768) that took peak RSS from 0.77x ddp's to
0.67x (benchmarks/bench_memory.py, docs/benchmarks.md). Each vocabulary matrix is gathered once per
micro-step, as MLX does, where a block is gathered twice (FSDP2 frees it after its forward): the
embedding's backward needs no weights, the head stays gathered to its backward (shard_model). Tied
embeddings stay in the root unit: the head is then the embedding's `as_linear`, which FSDP2's forward hooks
would not see. FSDP2 pads an axis that does not divide by N (a 50257-token vocabulary over 2 ranks), as
mlx_impl/fsdp.py does by hand.

Nothing whole is ever allocated: the model is built on the meta device, sharded there, and `wrap` then
allocates (to_empty) and loads only this rank's rows of each tensor (torch_impl/load.py, common/parallel/fsdp.py's
fsdp_rows, which is torch.chunk's split as FSDP2 uses it). The mesh is a CPU mesh over gloo or a CUDA mesh
over nccl, whichever process group the job runs.

Gradient averaging. Each rank scales its loss by N / global_tokens (step.py) and FSDP2 divides the
reduce-scattered sum by N, as DDP does. FSDP2 asks the backend for ReduceOp.AVG, and gloo has silently
summed instead (pytorch issue 162338: gradients N times too large, which Adam and clipping mostly hide).
torch 2.13's gloo averages correctly, but the version is not trusted: on gloo every FSDP unit reduces
with SUM and divides by N itself. tests/integration/test_fsdp.py proves step 1's gradient norm equals DDP's.

Accumulation: `no_sync()` turns FSDP2's gradient sync off for all but the last micro-step, so unsharded
gradients accumulate locally and are reduce-scattered once per step (the same as DDP's no_sync).
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Mapping, Sequence, cast

import numpy as np

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from common.checkpoint.sharded import LocalState, local_pieces
from common.checkpoint.tensorsource import Index, TensorSource
from common.config import RunConfig
from common.parallel.fsdp import fsdp_rows, reduce_scatter_kind
from common.train.heap import release_freed_heap
from common.train.protocols import Batch, StateStream, World

from .comm import CommCounter, FixedCount, Watch
from .grads import norm_dtype, squares_of
from .load import load_local
from .microsteps import Grads, MicroSteps, StepFunctions
from .model import Llama
from .rank_state import as_float32, local_numpy



def shard_model(model, device: torch.device, backend: str, *, release_heap: bool, mesh=None) -> None:
    """Shard every block, the embedding and the head (untied), then the root, in place: `model` becomes an
    FSDPModule. release_heap: give glibc's freed heap back in the backward (below). `mesh`: the DeviceMesh to
    shard over (a mesh's fsdp axis, torch_impl/mesh.py), else every rank."""
    mesh = mesh if mesh is not None else init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model.model.layers:
        fully_shard(block, mesh=mesh)
    if not model.spec.tie_embeddings:  # the vocabulary matrices one at a time (module docstring)
        fully_shard(model.model.embed_tokens, mesh=mesh)
        # The embedding's backward reads only the token ids: no second gather of its weight.
        model.model.embed_tokens.set_unshard_in_backward(False)
        # The head's backward comes right after its forward: kept gathered, it is not gathered twice (at the
        # backward's peak it is held either way: its weight beside its gradient).
        fully_shard(model.lm_head, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh)
    if release_heap:
        release_heap_in_backward(model)
    if backend == "gloo":  # see the module docstring: SUM, then FSDP's own division by N
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)


def release_heap_in_backward(model) -> None:
    """Give glibc's freed heap back to the OS twice per backward: as it starts (the gradient of the logits)
    and as the embedding's backward starts (the gradient of its output). A torch fsdp rank peaks in the
    backward: every unit's gathered weight, whole gradient and reduce-scatter buffer come and go there, the
    embedding's (2 x 147 MiB on `base`) last, when every sharded gradient exists; and glibc's heap then
    holds 300-480 MiB of blocks the forward and the blocks' backward freed but did not return
    (common/train/heap.py). On `base` at N=2 the two releases took the peak from 0.66-0.68x ddp's to about 0.56x
    (either alone: 0.59-0.64); they cost 1-14 % of a step there and 4-10 % on `small` (docs/benchmarks.md)."""
    def on_output(module, args, output):
        if output.requires_grad:  # not in an evaluation
            output.register_hook(_release_freed_heap)
    model.register_forward_hook(on_output)  # the logits, whether the head is its own unit or tied
    model.model.embed_tokens.register_forward_hook(on_output)


def _release_freed_heap(grad):
    release_freed_heap()  # returns None: the gradient passes on unchanged


class Sharding(MicroSteps):
    """The fsdp strategy (common/train/protocols.py): deferred gradient sync, the global norm, full and local state."""

    full_state_on_every_rank = False  # rank 0 gathers the state, the checkpoint's one writer
    communicates = False              # the reduce-scatter runs inside the backward (FSDP2's hooks)
    keeps_grads = False               # FSDP2 frees its sharded gradients

    def __init__(self, cfg: RunConfig, world: World, comm: CommCounter):
        self.device, self.comm = torch.device(world.device), comm
        # its world: the job, or a mesh's fsdp axis (torch_impl/mesh.py)
        self.backend, self.rank, self.size = cfg.resolved_backend, world.rank, world.size
        self.group, self.mesh = world.group, world.device_mesh
        self.reduce_scatter = reduce_scatter_kind("torch", self.backend)
        # The host heap is what a CPU rank's tensors live in; on a GPU the trim would only cost time.
        # --tune-malloc keeps freed memory on purpose (common/train/heap.py).
        self.release_heap = self.device.type == "cpu" and not cfg.tune_malloc

    def wrap(self, model: Llama, source: TensorSource) -> Llama:
        """Shard the model while it is on the meta device, then allocate and load only this rank's shards."""
        shard_model(model, self.device, self.backend, release_heap=self.release_heap, mesh=self.mesh)
        load_local(model, self.device, source, self.local_index)
        self.model = model
        return model

    def local_index(self, name: str, shape: tuple[int, ...]) -> Index:
        """Every parameter's rows as FSDP2 splits them (torch.chunk: the last shards run short)."""
        return (fsdp_rows(shape[0], self.rank, self.size),)

    def eval_losses(self, step: StepFunctions, batches: Sequence[Batch]) -> torch.Tensor:
        loss_sum = super().eval_losses(step, batches)
        # The units kept gathered after a forward (the head, the root) are otherwise freed only by the next
        # backward, and a checkpoint saved meanwhile would hold them whole.
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        return loss_sum

    def global_norm(self, grads: Grads) -> torch.Tensor:
        """The global gradient norm, computed in norm_dtype (grads.py) from this rank's shards and summed over the ranks:
        every element lives on exactly one rank (FSDP2 pads uneven shards with zeros)."""
        dtype = norm_dtype(self.device)
        local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        squares = squares_of(local, dtype, self.device)
        dist.all_reduce(squares, group=self.group)
        return squares.sqrt()

    def export_state(self, weights: Mapping[str, torch.Tensor], exp_avg: Mapping[str, torch.Tensor],
                     exp_avg_sq: Mapping[str, torch.Tensor]) -> tuple[StateStream, StateStream, StateStream]:
        return self.full(weights), self.full(exp_avg), self.full(exp_avg_sq)

    def local_state(self, shapes: Mapping[str, tuple[int, ...]], weights: Mapping[str, torch.Tensor],
                    exp_avg: Mapping[str, torch.Tensor], exp_avg_sq: Mapping[str, torch.Tensor]) -> LocalState:
        """--checkpoint-format sharded (common/checkpoint/sharded.py): (weights, exp_avg, exp_avg_sq, where) of
        what this rank writes, under HF names; no collectives."""
        axes = {name: 0 if isinstance(p, DTensor) else None for name, p in weights.items()}
        # FSDP2 splits axis 0 as torch.chunk does: ceil(rows / N) per rank, the last ones shorter or empty.
        size = self.size
        offsets = {name: min(self.rank * -(-shapes[name][0] // size), shapes[name][0])
                   for name, axis in axes.items() if axis == 0}
        return local_pieces(self.rank, (local_numpy(weights), local_numpy(exp_avg), local_numpy(exp_avg_sq)), axes,
                            shapes, offsets)

    @contextlib.contextmanager
    def _no_sync(self) -> Iterator[None]:
        """DDP's no_sync for FSDP2: gradients accumulate unsharded, unreduced, until the context ends."""
        model = cast(FSDPModule, self.model)  # shard_model made it one
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    def _watch_collectives(self) -> Watch:
        return FixedCount(None)  # not counted: FSDP2's collectives are reduce-scatters and all-gathers

    def full(self, flat: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, np.ndarray | None]]:
        """Tensors (DTensor shards or plain) -> (name, whole numpy array) one at a time, the array on rank 0
        only (the checkpoint's writer), None elsewhere; every rank iterates it (collectives)."""
        for key, value in flat.items():
            if isinstance(value, DTensor):
                value = value.full_tensor()
            yield key, as_float32(value) if self.rank == 0 else None
