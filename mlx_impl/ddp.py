"""DDP in MLX: every rank holds the whole model and averages the gradients once per step.

`Replicated` is the strategy (common/train/protocols.py): the micro-batches one after another (microsteps.py),
then, in the Trainer's compiled update, one bucketed all-reduce of the gradients divided by N
(mlx_impl/comm.py's average_gradients, on the communication stream). Mirrors torch_impl/ddp.py.
"""
from __future__ import annotations

from typing import Mapping

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from common.checkpoint.sharded import LocalState, local_pieces
from common.checkpoint.tensorsource import Index, TensorSource
from common.config import RunConfig
from common.train.protocols import StateStream, World

from .comm import CommCounter, average_gradients
from .grads import squares_of
from .load import load_local
from .microsteps import Grads, MicroSteps
from .rank_state import local_numpy, numpy_stream


class Replicated(MicroSteps):
    reduce_scatter: str | None = None
    full_state_on_every_rank = True

    def __init__(self, cfg: RunConfig, world: World, comm: CommCounter):
        self.group, self.comm, self.stream, self.rank = world.group, comm, comm.stream, world.rank
        self.dp_size, self.reduce_bytes = cfg.data_parallel_size, int(cfg.all_reduce_size_mb * 2**20)

    @property
    def communicates(self) -> bool:
        """The gradients are averaged after the backward, when there is more than one rank."""
        return self.dp_size > 1

    def wrap(self, model: nn.Module, source: TensorSource) -> nn.Module:
        load_local(model, source, self.local_index)  # every tensor whole
        return model

    def local_index(self, name: str, shape: tuple[int, ...]) -> Index:
        return ()

    def reduce_gradients(self, grads: Grads) -> Grads:
        """The gradient sync of a step: a bucketed all-reduce, divided by N."""
        if not self.communicates:
            return grads
        self.comm.add_all(v for _, v in tree_flatten(grads))
        return average_gradients(grads, self.group, self.reduce_bytes, self.stream)

    def global_norm(self, grads: Grads) -> mx.array:
        return mx.sqrt(squares_of(g for _, g in tree_flatten(grads)))

    def export_state(self, weights: Mapping[str, mx.array], exp_avg: Mapping[str, mx.array],
                     exp_avg_sq: Mapping[str, mx.array]) -> tuple[StateStream, StateStream, StateStream]:
        return numpy_stream(weights), numpy_stream(exp_avg), numpy_stream(exp_avg_sq)

    def local_state(self, shapes: Mapping[str, tuple[int, ...]], weights: Mapping[str, mx.array],
                    exp_avg: Mapping[str, mx.array], exp_avg_sq: Mapping[str, mx.array]) -> LocalState:
        """--checkpoint-format sharded (common/checkpoint/sharded.py): (weights, exp_avg, exp_avg_sq, where) of
        what this rank writes (every tensor whole, from rank 0 alone), under HF names; no collectives."""
        return local_pieces(self.rank, (local_numpy(weights), local_numpy(exp_avg), local_numpy(exp_avg_sq)),
                            dict.fromkeys(weights), shapes)
