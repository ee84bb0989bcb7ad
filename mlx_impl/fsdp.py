"""FSDP in MLX: `nn.fully_shard` per transformer block, the root unwrapped.

What each rank holds (torch_impl/fsdp.py does the same with FSDP2):
- Every transformer block is wrapped by `nn.fully_shard`: each parameter is split along axis 0, the full
  parameters are all-gathered for the block's forward (and again in its backward), and the gradient is
  reduce-scattered in the backward, so a rank stores and updates only its 1/N of the block.
- The embedding and the head are wrapped the same way, each on its own, when their first axis (the
  vocabulary) divides by N. Otherwise (GPT-2's 50257 tokens over 2 ranks) they stay replicated and their
  gradients are averaged as under DDP: `fully_shard` cannot split an uneven axis (torch's FSDP2 pads it).
  The final norm stays replicated too: one vector is not worth a collective of its own.
  common/strategy.py refuses, before the run starts, a block that does not divide.

Reduce-scatter. `fully_shard`'s backward calls `mx.distributed.sum_scatter`, which the ring and MPI
backends of mlx 0.32.4 do not implement ("[ring] sum_scatter not supported"; upstream reports a group that
hangs instead of raising). So on those backends the reduce-scatter is an `all_sum` of the full gradient
followed by this rank's slice (twice the traffic of a true reduce-scatter, the same sums); nccl keeps
the native one. summary.json records which one ran.

Streams. Every wrapper's gather function is replaced by `_gather_fn` below, upstream's own with the
reduce-scatter made an argument and every collective on the Trainer's communication stream
(mlx_impl/comm.py: the CPU stream on a Metal GPU): upstream's all-gather takes no stream, so it ran on
the GPU stream, inside a command buffer, exactly what communication_stream keeps collectives out of.

Accumulation happens on the shards. In MLX the reduce-scatter is the backward of the parameter gather (a
custom vjp), so it runs in every micro-step's backward and cannot be deferred the way torch's
`set_requires_gradient_sync(False)` defers it. Reduction is linear, so summing the reduce-scattered
micro-step gradients equals reduce-scattering their sum: exact, and a rank never keeps more than 1/N of a
block's gradient between micro-steps. The price is one reduce-scatter per micro-step. Replicated
gradients accumulate locally and are averaged once per step, as under DDP.
"""
from __future__ import annotations

from functools import reduce

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from common.shardedcheckpoint import local_pieces

from .comm import CommCounter, average_gradients
from .ddp import MicroSteps, moments, sum_of_squares

NATIVE_REDUCE_SCATTER = ("nccl",)  # the mlx 0.32.4 backends that implement mx.distributed.sum_scatter
SHARD = ".module."                 # fully_shard puts the wrapped module under `module`; HF names never hold it


def reduce_scatter_kind(backend: str) -> str:
    return "native" if backend in NATIVE_REDUCE_SCATTER else "all_sum_slice"


def shard_model(model, group, kind: str, compute_dtype=None, stream=None) -> None:
    """Wrap the blocks (and the embedding and head when the vocabulary divides by N) in place; their
    collectives run on `stream` (None: MLX's default)."""
    size = group.size()
    reduce_scatter = _all_sum_slice(group, stream) if kind == "all_sum_slice" else _sum_scatter(group, stream)

    def wrap(module):
        if isinstance(module, (nn.Embedding, nn.Linear)) and module.weight.shape[0] % size:
            return module  # an uneven vocabulary: replicated, averaged as under DDP
        wrapped = nn.fully_shard(module, group=group, compute_dtype=compute_dtype)
        params = dict(tree_flatten(wrapped.module.parameters()))
        wrapped._gather_fn = _gather_fn(group, [params[p] for p in wrapped._paths], reduce_scatter, compute_dtype,
                                        stream)
        return wrapped

    model.model.layers = [wrap(layer) for layer in model.model.layers]
    model.model.embed_tokens = wrap(model.model.embed_tokens)
    if "lm_head" in model:
        model.lm_head = wrap(model.lm_head)


class Sharding(MicroSteps):
    """The fsdp strategy (common/protocols.py): which parameters a rank holds a shard of, and the
    collectives that treat them apart."""

    full_state_on_every_rank = False  # rank 0 gathers the state, the checkpoint's one writer
    communicates = True               # the replicated gradients, averaged after the backward

    def __init__(self, cfg, world, comm: CommCounter, stream=None):
        self.group, self.size, self.rank, self.stream = world.group, world.group.size(), world.group.rank(), stream
        self.reduce_scatter = reduce_scatter_kind(cfg.resolved_backend)
        self.reduce_bytes = int(cfg.all_reduce_size_mb * 2**20)

    def wrap(self, model):
        shard_model(model, self.group, self.reduce_scatter, stream=self.stream)
        return model

    @staticmethod
    def is_sharded(path: str) -> bool:
        return SHARD in path

    def reduce_gradients(self, grads: dict) -> dict:
        """Average the replicated gradients over the ranks; the shards were reduce-scattered already."""
        flat = tree_flatten(grads)
        replicated = [(k, g) for k, g in flat if not self.is_sharded(k)]
        averaged = tree_flatten(average_gradients(dict(replicated), self.group, self.reduce_bytes, self.stream))
        return tree_unflatten(averaged + [(k, g) for k, g in flat if self.is_sharded(k)])

    def global_norm(self, grads: dict) -> mx.array:
        """The global gradient norm: replicated gradients counted once, the shards summed over the ranks.

        nn.utils.clip_grad_norm_sharded would all-sum the replicated ones too, counting them N times."""
        flat = tree_flatten(grads)
        replicated_sq = sum((sum_of_squares(g) for k, g in flat if not self.is_sharded(k)), mx.array(0.0))
        sharded_sq = sum((sum_of_squares(g) for k, g in flat if self.is_sharded(k)), mx.array(0.0))
        return mx.sqrt(replicated_sq + mx.distributed.all_sum(sharded_sq, group=self.group, stream=self.stream))

    def export_state(self, weights: dict, optimizer: dict):
        weights = self.full(weights)
        return (weights, *moments(weights, self.full(optimizer)))

    def import_state(self, full: dict, paths) -> dict:
        return self.local(full, paths)

    def local_state(self, shapes: dict, weights: dict, optimizer: dict):
        """--checkpoint-format sharded (common/shardedcheckpoint.py): (weights, exp_avg, exp_avg_sq, where) of
        what this rank writes, under HF names; no collectives."""
        def hf(flat):
            return {key.replace(SHARD, "."): value for key, value in flat.items()}

        axes = {key.replace(SHARD, "."): 0 if self.is_sharded(key) else None for key in weights}
        return local_pieces(self.rank, tuple(map(hf, (weights, *moments(weights, optimizer)))), axes, shapes)

    def full(self, flat: dict) -> dict:
        """Flat arrays under this rank's paths -> whole numpy arrays under HF names, on rank 0 only (the
        checkpoint's writer); every rank must call it. One array at a time, so no rank holds the whole
        state twice: the other ranks drop each gathered array at once."""
        out = {}
        for key, value in flat.items():
            if self.is_sharded(key):
                value = mx.distributed.all_gather(mx.array(value), group=self.group, stream=self.stream)
                mx.eval(value)
            if self.rank == 0:
                out[key.replace(SHARD, ".")] = np.array(value)
        return out

    def local(self, flat: dict, paths) -> dict:
        """Whole arrays under HF names -> this rank's slices under its paths (`paths`: the model's)."""
        out = {}
        for path in paths:
            value = flat[path.replace(SHARD, ".")]
            if self.is_sharded(path):
                rows = value.shape[0] // self.size
                value = value[self.rank * rows:(self.rank + 1) * rows]
            out[path] = value
        return out


def _all_sum_slice(group, stream=None):
    rank = group.rank()

    def reduce_scatter(x):  # (N, S) -> (1, S): row `rank` of the sum over ranks, as sum_scatter returns it
        return mx.distributed.all_sum(x, group=group, stream=stream)[rank:rank + 1]

    return reduce_scatter


def _sum_scatter(group, stream=None):
    def reduce_scatter(x):
        return mx.distributed.sum_scatter(x, group=group, stream=stream)

    return reduce_scatter


def _gather_fn(group, shards, reduce_scatter, compute_dtype=None, stream=None):
    """mlx.nn.layers.distributed._make_gather_fn of mlx 0.32.4 with `reduce_scatter` in place of sum_scatter
    and the all-gather on `stream`.

    `shards` in the wrapper's `_paths` order, the order its forward passes them in."""
    N = group.size()
    shard_shapes = [s.shape for s in shards]
    full_shapes = [(shape[0] * N,) + tuple(shape[1:]) for shape in shard_shapes]
    split_indices = reduce(lambda acc, s: acc + [acc[-1] + s.size], shards, [0])[1:-1]

    def cast(x, dtype):
        return x if dtype is None or x.dtype == dtype else x.astype(dtype)

    @mx.custom_function
    def gather(shards):
        flat = mx.concatenate([cast(s.reshape(1, -1), compute_dtype) for s in shards], axis=1)
        full = mx.distributed.all_gather(flat, group=group, stream=stream)
        return [p.reshape(shape) for p, shape in zip(mx.split(full, split_indices, axis=1), full_shapes)]

    @gather.vjp
    def gather_vjp(shards, cotangents, _):
        local_full = mx.concatenate([c.reshape(N, -1) for c in cotangents], axis=1)
        local_shard = reduce_scatter(local_full) / N
        parts = mx.split(local_shard, split_indices, axis=1)
        return [cast(p.reshape(shape), s.dtype) for p, shape, s in zip(parts, shard_shapes, shards)]

    return gather
