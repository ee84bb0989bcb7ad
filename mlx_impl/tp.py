"""Tensor parallelism in MLX (Megatron), on `mx.distributed.all_sum`: the split is common/parallel/tp.py's.

q/k/v and gate/up keep their output features 1/N per rank (column-parallel, plain Linear on a slice),
o_proj and down_proj their input features (row-parallel: `ShardedToAllLinear`, whose all_sum adds the
partial outputs). The gradient flowing back into the column-parallel layers is summed over ranks once
per attention and once per MLP, at the norm that feeds them (Megatron's "f"; MLX's own
AllToShardedLinear would do it in each of q, k and v: three all-reduces instead of one). Embedding,
norms and lm_head are replicated (why: common/parallel/tp.py); their inputs and incoming gradients are the
same on every rank, so are their gradients, and nothing averages them.

Bytes all-reduced are counted here, in these layers' collectives, when MLX traces them: the step is
compiled, so the Python below runs once per traced function and its shapes are those of every call.
Mirrors torch_impl/tp.py.
"""
from __future__ import annotations

from typing import Iterable, Iterator, Mapping

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.nn.layers.distributed import ShardedToAllLinear
from mlx.utils import tree_flatten, tree_unflatten

from common.checkpoint.sharded import LocalState, local_pieces
from common.checkpoint.tensorsource import Index, TensorSource
from common.config import RunConfig
from common.parallel.tp import tp_index, tp_split_axis
from common.train.protocols import StateStream, World

from .comm import CommCounter
from .grads import squares_of
from .load import load_local
from .microsteps import Grads, MicroSteps
from .model import RMSNorm, matmul
from .rank_state import as_float32, local_numpy


class TensorParallel(MicroSteps):
    """The tp strategy (common/train/protocols.py): one model's split over the group, and what the Trainer needs to
    train and checkpoint it. The data-parallel size is 1, so no gradient is averaged."""

    reduce_scatter = None
    full_state_on_every_rank = True
    communicates = False

    def __init__(self, cfg: RunConfig, world: World, comm: CommCounter):
        group = world.group
        self.group, self.rank, self.size, self.counter = group, group.rank(), group.size(), comm

        @mx.custom_function
        def grad_sum(x):  # identity forward, all_sum of the gradient backward
            return x

        @grad_sum.vjp
        def grad_sum_vjp(x, dx, _):
            comm.add(dx)
            return mx.distributed.all_sum(dx, group=group)

        self.grad_sum = grad_sum

    def wrap(self, model: nn.Module, source: TensorSource) -> nn.Module:
        """Shard the unevaluated model in place: each split weight becomes this rank's block (the lazy init
        sliced, then replaced by the block read from the source: mlx_impl/load.py), then the layers that
        communicate take the place of the plain ones."""
        self._parallelize(model)
        load_local(model, source, self.local_index)
        return model

    def _parallelize(self, model: nn.Module, layers: Iterable[int] | None = None) -> None:
        """Each split weight of the unevaluated blocks `layers` (a pipeline stage's; None: every block) cut to this
        rank's block of the lazy init, and the layers that communicate in place of the plain ones."""
        local = [(k, v[tp_index(k, v.shape, self.rank, self.size)])
                 for k, v in tree_flatten(model.parameters()) if tp_split_axis(k) is not None]
        model.update(tree_unflatten(local))
        blocks = model.model.layers
        for block in (blocks if layers is None else [blocks[i] for i in layers]):
            attn, mlp = block.self_attn, block.mlp
            attn.n_heads, attn.n_kv_heads = attn.n_heads // self.size, attn.n_kv_heads // self.size
            attn.o_proj = RowParallelLinear.from_sharded(attn.o_proj, self)
            mlp.down_proj = RowParallelLinear.from_sharded(mlp.down_proj, self)
            block.input_layernorm = GradSumRMSNorm.from_norm(block.input_layernorm, self)
            block.post_attention_layernorm = GradSumRMSNorm.from_norm(block.post_attention_layernorm, self)

    def local_index(self, name: str, shape: tuple[int, ...]) -> Index:
        return tp_index(name, shape, self.rank, self.size)

    def reduce_gradients(self, grads: Grads) -> Grads:
        return grads  # every rank holds the whole gradient of its pieces

    def global_norm(self, grads: Grads) -> mx.array:
        """The whole model's gradient norm: the squares of sharded gradients summed over ranks, those of
        replicated ones (the same on every rank) counted once."""
        flat = tree_flatten(grads)
        sharded = squares_of(g for k, g in flat if tp_split_axis(k) is not None)
        replicated = squares_of(g for k, g in flat if tp_split_axis(k) is None)
        return mx.sqrt(replicated + mx.distributed.all_sum(sharded, group=self.group))

    def export_state(self, weights: Mapping[str, mx.array], exp_avg: Mapping[str, mx.array],
                     exp_avg_sq: Mapping[str, mx.array]) -> tuple[StateStream, StateStream, StateStream]:
        return self.gather(weights), self.gather(exp_avg), self.gather(exp_avg_sq)

    def local_state(self, shapes: Mapping[str, tuple[int, ...]], weights: Mapping[str, mx.array],
                    exp_avg: Mapping[str, mx.array], exp_avg_sq: Mapping[str, mx.array]) -> LocalState:
        """--checkpoint-format sharded (common/checkpoint/sharded.py): (weights, exp_avg, exp_avg_sq, where) of
        what this rank writes, under HF names; no collectives."""
        axes = {name: tp_split_axis(name) for name in weights}
        return local_pieces(self.rank, (local_numpy(weights), local_numpy(exp_avg), local_numpy(exp_avg_sq)), axes,
                            shapes)

    def gather(self, named: Mapping[str, mx.array]) -> Iterator[tuple[str, np.ndarray]]:
        """Whole arrays from this rank's pieces, one at a time (every rank iterates it: collectives)."""
        for name, piece in named.items():
            axis = tp_split_axis(name)
            if axis is None:
                yield name, as_float32(piece)
                continue
            # all_gather stacks along axis 0: move the split axis there and back.
            gathered = mx.distributed.all_gather(mx.array(np.moveaxis(as_float32(piece), axis, 0)), group=self.group)
            yield name, np.moveaxis(np.array(gathered), 0, axis)


class RowParallelLinear(ShardedToAllLinear):
    """o_proj, down_proj: each rank multiplies its slice of the input features, all_sum adds them up
    (Megatron's "g": all-reduce forward, identity backward)."""

    @classmethod
    def from_sharded(cls, linear: nn.Linear, tp: TensorParallel) -> "RowParallelLinear":
        out_dims, local_in = linear.weight.shape
        layer = cls(local_in * tp.size, out_dims, bias=False, group=tp.group)
        layer.weight, layer.counter = linear.weight, tp.counter
        return layer

    def __call__(self, x: mx.array) -> mx.array:
        y = matmul(x, self["weight"].astype(x.dtype).T)  # the cast at use (precision.py); bf16: --mlx-bf16-matmul
        self.counter.add(y)
        return mx.distributed.all_sum(y, group=self.group)


class GradSumRMSNorm(RMSNorm):
    """A replicated norm whose output feeds column-parallel layers: their gradients with respect to it are
    partial sums, added up over ranks here, once (Megatron's "f")."""

    @classmethod
    def from_norm(cls, norm: nn.RMSNorm, tp: TensorParallel) -> "GradSumRMSNorm":
        layer = cls(norm.weight.shape[0], eps=norm.eps)  # the model's RMSNorm: the bf16 policy's statistics
        layer.weight, layer.grad_sum = norm.weight, tp.grad_sum
        return layer

    def __call__(self, x: mx.array) -> mx.array:
        return self.grad_sum(super().__call__(x))
