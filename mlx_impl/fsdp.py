"""FSDP in MLX: `nn.fully_shard` per transformer block, the root unwrapped.

What each rank holds (torch_impl/fsdp.py does the same with FSDP2):
- Every transformer block is wrapped by `nn.fully_shard`: each parameter is split along axis 0, the full
  parameters are all-gathered for the block's forward (a node of the step's graph, which the backward
  uses too: one gather per micro-step, as the measured step times say, docs/scaling.md), and the gradient
  is reduce-scattered in the backward, so a rank stores and updates only its 1/N of the block.
- The embedding and the head are wrapped the same way, each on its own. A vocabulary that does not divide
  by N (GPT-2's 50257 tokens over 2 ranks) is padded first with zero rows to the next multiple of N, as
  torch's FSDP2 pads it: `fully_shard` cannot split an uneven axis. The pad rows are never looked up (no
  token has their id) and the head's logits lose their pad columns before the loss (`VocabShard`), so
  their gradients are zero and AdamW keeps them zero; export_state drops them again, so checkpoints hold
  the true vocabulary. The final norm stays replicated: one vector is not worth a collective of its own.
  common/parallel/fsdp.py refuses, before the run starts, a block that does not divide.
- Nothing whole is ever materialised: the model arrives unevaluated (MLX is lazy), the padding and
  fully_shard's split slice the lazy init, and `wrap` then loads only this rank's rows from the source
  (mlx_impl/load.py, common/parallel/fsdp.py's fsdp_rows), so the rank never evaluates a tensor it does not keep.

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
from typing import Iterator, Mapping

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.nn.layers.distributed import FullyShardedModule
from mlx.utils import tree_flatten, tree_unflatten

from common.checkpoint.sharded import LocalState, local_pieces
from common.checkpoint.tensorsource import Index, TensorSource
from common.config import RunConfig
from common.parallel.fsdp import fsdp_rows, reduce_scatter_kind
from common.train.protocols import StateStream, World

from .comm import CommCounter, average_gradients
from .grads import squares_of
from .load import SHARD, hf_name, load_local
from .microsteps import Grads, MicroSteps
from .rank_state import as_float32, local_numpy




def shard_model(model, group, kind: str, compute_dtype=None, stream=None) -> dict[str, int]:
    """Wrap the blocks, the embedding and the head in place (the vocabulary padded to a multiple of N);
    their collectives run on `stream` (None: MLX's default). -> {HF name: true rows} of the padded."""
    size = group.size()
    reduce_scatter = _all_sum_slice(group, stream) if kind == "all_sum_slice" else _sum_scatter(group, stream)
    vocab_rows = {}

    def wrap(module, name=None):
        rows = module.weight.shape[0] if name is not None else 0  # the embedding or the head: the vocabulary
        padded = -(-rows // size) * size
        if padded == rows:
            wrapped = nn.fully_shard(module, group=group, compute_dtype=compute_dtype)
        else:  # zero rows appended to the lazy init: nothing is evaluated yet
            module.weight = mx.concatenate([module.weight, mx.zeros((padded - rows, *module.weight.shape[1:]),
                                                                    dtype=module.weight.dtype)])
            wrapped, vocab_rows[name] = VocabShard(module, rows, group=group, compute_dtype=compute_dtype), rows
        params = dict(tree_flatten(wrapped.module.parameters()))
        wrapped._gather_fn = _gather_fn(group, [params[p] for p in wrapped._paths], reduce_scatter, compute_dtype,
                                        stream)
        return wrapped

    model.model.layers = [wrap(layer) for layer in model.model.layers]
    model.model.embed_tokens = wrap(model.model.embed_tokens, "model.embed_tokens.weight")
    if "lm_head" in model:
        model.lm_head = wrap(model.lm_head, "lm_head.weight")
    return vocab_rows


class VocabShard(FullyShardedModule):
    """fully_shard of an embedding or head whose vocabulary was padded to a multiple of N: the logits lose
    their pad columns, so the pad rows never reach the softmax (the lookup never reads them: no token has
    their id)."""

    def __init__(self, module, vocab_size: int, **kwargs):
        super().__init__(module, **kwargs)
        self.vocab_size = vocab_size

    def __call__(self, x: mx.array) -> mx.array:
        out = super().__call__(x)
        return out if isinstance(self.module, nn.Embedding) else out[..., :self.vocab_size]

    def as_linear(self, x: mx.array) -> mx.array:  # the tied head
        return super().as_linear(x)[..., :self.vocab_size]


class Sharding(MicroSteps):
    """The fsdp strategy (common/train/protocols.py): which parameters a rank holds a shard of, and the
    collectives that treat them apart."""

    full_state_on_every_rank = False  # rank 0 gathers the state, the checkpoint's one writer
    communicates = True               # the replicated gradients, averaged after the backward

    def __init__(self, cfg: RunConfig, world: World, comm: CommCounter):
        group = world.group
        self.group, self.size, self.rank, self.stream = group, group.size(), group.rank(), comm.stream
        self.reduce_scatter = reduce_scatter_kind("mlx", cfg.resolved_backend)
        self.reduce_bytes = int(cfg.all_reduce_size_mb * 2**20)

    def wrap(self, model: nn.Module, source: TensorSource) -> nn.Module:
        """Shard the unevaluated model, then load this rank's rows of each sharded tensor (padded where the
        vocabulary runs short) and the replicated ones whole."""
        self.vocab_rows = shard_model(model, self.group, self.reduce_scatter, stream=self.stream)
        self.sharded = {hf_name(path) for path, _ in tree_flatten(model.parameters()) if self.is_sharded(path)}
        load_local(model, source, self.local_index)
        return model

    def local_index(self, name: str, shape: tuple[int, ...]) -> Index:
        return (fsdp_rows(shape[0], self.rank, self.size),) if name in self.sharded else ()

    @staticmethod
    def is_sharded(path: str) -> bool:
        return SHARD in path

    def reduce_gradients(self, grads: Grads) -> Grads:
        """Average the replicated gradients over the ranks; the shards were reduce-scattered already."""
        flat = tree_flatten(grads)
        replicated = [(k, g) for k, g in flat if not self.is_sharded(k)]
        averaged = tree_flatten(average_gradients(dict(replicated), self.group, self.reduce_bytes, self.stream))
        return tree_unflatten(averaged + [(k, g) for k, g in flat if self.is_sharded(k)])

    def global_norm(self, grads: Grads) -> mx.array:
        """The global gradient norm: replicated gradients counted once, the shards summed over the ranks.

        nn.utils.clip_grad_norm_sharded would all-sum the replicated ones too, counting them N times."""
        flat = tree_flatten(grads)
        replicated_sq = squares_of(g for k, g in flat if not self.is_sharded(k))
        sharded_sq = squares_of(g for k, g in flat if self.is_sharded(k))
        return mx.sqrt(replicated_sq + mx.distributed.all_sum(sharded_sq, group=self.group, stream=self.stream))

    def export_state(self, weights: Mapping[str, mx.array], exp_avg: Mapping[str, mx.array],
                     exp_avg_sq: Mapping[str, mx.array]) -> tuple[StateStream, StateStream, StateStream]:
        return self.full(weights), self.full(exp_avg), self.full(exp_avg_sq)

    def local_state(self, shapes: Mapping[str, tuple[int, ...]], weights: Mapping[str, mx.array],
                    exp_avg: Mapping[str, mx.array], exp_avg_sq: Mapping[str, mx.array]) -> LocalState:
        """--checkpoint-format sharded (common/checkpoint/sharded.py): (weights, exp_avg, exp_avg_sq, where) of
        what this rank writes, under HF names; no collectives. A padded vocabulary's last shard is cut to
        the true vocabulary there (shardedcheckpoint.trim)."""
        def hf(flat: Mapping[str, mx.array]) -> dict[str, np.ndarray]:
            return {key.replace(SHARD, "."): value for key, value in local_numpy(flat).items()}

        axes = {key.replace(SHARD, "."): 0 if self.is_sharded(key) else None for key in weights}
        return local_pieces(self.rank, (hf(weights), hf(exp_avg), hf(exp_avg_sq)), axes, shapes)

    def full(self, flat: Mapping[str, mx.array]) -> Iterator[tuple[str, np.ndarray | None]]:
        """Arrays under this rank's parameter paths -> (HF name, whole numpy array) one at a time, the array on
        rank 0 only (the checkpoint's writer), None elsewhere; every rank iterates it (collectives). The
        other ranks drop each gathered array at once. The vocabulary's pad rows are dropped: files hold the
        true vocabulary."""
        for key, value in flat.items():
            name = hf_name(key)
            if self.is_sharded(key):
                value = mx.distributed.all_gather(value, group=self.group, stream=self.stream)
                rows = self.vocab_rows.get(name)
                value = value[:rows] if rows else value
                mx.eval(value)
            yield name, as_float32(value) if self.rank == 0 else None


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
