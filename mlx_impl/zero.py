"""ZeRO-1 and ZeRO-2 in MLX: ddp's data and whole fp32 weights on every rank, AdamW's moments sharded by rows.

`Zero1` and `Zero2` are the strategies (common/train/protocols.py; their cost and memory: common/parallel/zero.py).
Each trained tensor is split along axis 0 as fsdp splits it, ceil(rows / N) rows a rank, the last ranks' padded
with zero rows, so every rank's shard of every tensor has the same shape. Per step, in the Trainer's compiled
update:

- zero1 averages every gradient as ddp does (mlx_impl/comm.py's bucketed all-reduce, divided by N) and keeps its
  rows; zero2 lays the padded gradients out as an (N, shard) matrix and reduce-scatters it, divided by N: MLX's
  ring and MPI backends have no reduce-scatter (mlx 0.32.4: "[ring] sum_scatter not supported"), so there, at two
  ranks, each rank sends the other its row and adds the row it receives (send/recv, evaluated one by one before the
  update: half an all_sum's bytes, `forward_backward`), and at more ranks it is an all_sum of the matrix and the
  rank's row (an all-reduce's bytes, the same sums); nccl has sum_scatter (common/parallel/fsdp.py
  reduce_scatter_kind). Either way MLX has computed the whole gradient tree in the backward before the reduction
  can free it: zero2 holds less than zero1 between steps, not at the backward's peak.
- the global gradient norm is the square root of the ranks' summed squares of their rows (padding adds zeros);
- `ShardedOptimizer` runs the run's Adam or AdamW on the rank's rows (elementwise: the same numbers ddp computes
  for those elements), then all-gathers the updated rows, one collective of the padded shard, into whole weights.

Checkpoints: the hf format gathers each moment to rank 0 (export_state); at resume every rank reads the whole
moments and keeps its rows (`ShardedOptimizer` cuts them at its first update). --checkpoint-format sharded is
refused (common/parallel/zero.py). Mirrors torch_impl/zero.py.
"""
from __future__ import annotations

from typing import Any, Iterator, Mapping, Sequence

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from common.checkpoint.sharded import LocalState
from common.checkpoint.tensorsource import Index, TensorSource
from common.config import RunConfig
from common.parallel.fsdp import reduce_scatter_kind
from common.parallel.zero import shard_rows
from common.train.protocols import Batch, ForwardBackwardResult, Phase, StateStream, World, no_phase

from .comm import CommCounter, average_gradients
from .ddp import Replicated
from .grads import squares_of
from .load import load_local
from .microsteps import Grads, Losses, StepFunctions
from .rank_state import as_float32, numpy_stream, state_bytes


class ZeroRedundancy(Replicated):
    """zero1 and zero2 (the module docstring); `stage` says which."""
    stage = 1
    full_state_on_every_rank = False  # rank 0 gathers the moments, the checkpoint's one writer
    reduce_scatter: str | None = None  # zero2: "native" or "all_sum_slice" (summary.json), as fsdp's

    def __init__(self, cfg: RunConfig, world: World, comm: CommCounter):
        super().__init__(cfg, world, comm)
        self.kind = reduce_scatter_kind("mlx", cfg.resolved_backend)
        if self.kind == "all_sum_slice" and self.dp_size == 2:
            self.kind = "send_recv"  # two ranks: each sends the other its half (half the bytes of an all_sum)
        self.reduce_scatter = self.kind if self.stage >= 2 else None
        self.shapes: dict[str, tuple[int, ...]] = {}

    def wrap(self, model: nn.Module, source: TensorSource) -> nn.Module:
        load_local(model, source, self.local_index)  # every tensor whole, as ddp
        self.shapes = {path: tuple(p.shape) for path, p in tree_flatten(model.trainable_parameters())}
        return model

    def local_index(self, name: str, shape: tuple[int, ...]) -> Index:
        """Whole: the weights are whole on every rank, and the moments are read whole at resume and cut to the
        rank's rows by ShardedOptimizer."""
        return ()

    def rows(self, path: str) -> tuple[int, int]:
        """(first row, rows every rank holds) of the tensor at `path`."""
        c = shard_rows(self.shapes[path][0], self.dp_size)
        return self.rank * c, c

    def own_rows(self, tree: Any) -> Any:
        """This rank's rows of every whole tensor in `tree`, padded with zero rows to the common shard shape."""
        out = []
        for path, x in tree_flatten(tree):
            start, c = self.rows(path)
            part = x[start:start + c]
            if part.shape[0] < c:
                part = mx.pad(part, [(0, c - part.shape[0])] + [(0, 0)] * (x.ndim - 1))
            out.append((path, part))
        return tree_unflatten(out)

    def gather_rows(self, tree: Any) -> Any:
        """Every rank's rows of each tensor in `tree` (shards, all of one shape per tensor) -> the whole tensors:
        one all-gather of the rank's padded rows, laid out as one vector."""
        flat = tree_flatten(tree)
        mine = mx.concatenate([x.reshape(-1) for _, x in flat])
        self.comm.add(mine)
        every = mx.distributed.all_gather(mine, group=self.group, stream=self.stream).reshape(self.dp_size, -1)
        out, offset = [], 0
        for path, x in flat:
            width = x.size
            whole = every[:, offset:offset + width].reshape(self.dp_size * x.shape[0], *x.shape[1:])
            out.append((path, whole[:self.shapes[path][0]]))
            offset += width
        return tree_unflatten(out)

    def forward_backward(self, step: StepFunctions, batches: Sequence[Batch], scale: float,
                         phase: Phase = no_phase, wait: bool = False,
                         sync: bool = True) -> ForwardBackwardResult[Losses, Grads]:
        """The micro-batches as ddp runs them; zero2 over send/recv then reduce-scatters here, eagerly: MLX runs
        independent sends and receives of one graph in no set order (the pipeline's tests saw them reversed), so
        they cannot go into the compiled update, and each is evaluated in turn (rank 0 sends first)."""
        passes = super().forward_backward(step, batches, scale, phase, wait, sync)
        if self.stage < 2 or self.kind != "send_recv" or not sync:
            return passes
        with phase("backward"):
            grads = self._send_recv_scatter(passes.grads)
        return ForwardBackwardResult(passes.losses, grads)

    def _matrix(self, grads: Grads) -> tuple[list[tuple[str, mx.array]], list[mx.array], mx.array]:
        """The padded gradients laid out as (N, shard): row r is rank r's rows of every tensor."""
        flat = tree_flatten(grads)
        columns = []
        for path, g in flat:
            _, c = self.rows(path)
            padded = mx.pad(g, [(0, c * self.dp_size - g.shape[0])] + [(0, 0)] * (g.ndim - 1))
            columns.append(padded.reshape(self.dp_size, -1))
        return flat, columns, mx.concatenate(columns, axis=1)

    def _split(self, flat: list[tuple[str, mx.array]], columns: list[mx.array], row: mx.array) -> Grads:
        out, offset = [], 0
        for (path, g), column in zip(flat, columns):
            width = column.shape[1]
            out.append((path, row[offset:offset + width].reshape(-1, *g.shape[1:])))
            offset += width
        return tree_unflatten(out)

    def _send_recv_scatter(self, grads: Grads) -> Grads:
        """Two ranks' reduce-scatter: each sends the other's row and adds the row it receives (the same sum as an
        all_sum's, a + b), divided by N."""
        flat, columns, matrix = self._matrix(grads)
        mx.eval(matrix)
        self.comm.per_call.setdefault("step", matrix.nbytes)  # the reduce-scatter's input, as all_sum's counts
        peer = 1 - self.rank
        sent = matrix[peer]
        if self.rank == 0:
            mx.eval(mx.distributed.send(sent, peer, group=self.group, stream=self.stream))
        got = mx.distributed.recv(sent.shape, sent.dtype, peer, group=self.group, stream=self.stream)
        mx.eval(got)
        if self.rank == 1:
            mx.eval(mx.distributed.send(sent, peer, group=self.group, stream=self.stream))
        row = (matrix[self.rank] + got) / self.dp_size
        return self._split(flat, columns, row)

    def reduce_gradients(self, grads: Grads) -> Grads:
        """The gradient sync of a step -> this rank's rows of the averaged gradients (padded); zero2 over send/recv
        has reduced them already (forward_backward)."""
        if self.is_shard(grads):
            return grads
        if self.stage == 1:
            self.comm.add_all(v for _, v in tree_flatten(grads))
            return self.own_rows(average_gradients(grads, self.group, self.reduce_bytes, self.stream))
        flat, columns, matrix = self._matrix(grads)
        self.comm.add(matrix)
        if self.kind == "native":
            row = mx.distributed.sum_scatter(matrix, group=self.group, stream=self.stream).reshape(-1)
        else:  # all_sum, then the rank's row: an all-reduce's bytes
            row = mx.distributed.all_sum(matrix, group=self.group, stream=self.stream)[self.rank]
        return self._split(flat, columns, row / self.dp_size)

    def is_shard(self, grads: Grads) -> bool:
        """Whether `grads` are this rank's rows (reduced) or whole (a step timed without its sync)."""
        return all(g.shape[0] == self.rows(path)[1] for path, g in tree_flatten(grads))

    def global_norm(self, grads: Grads) -> mx.array:
        """The ranks' summed squares of their rows (the padding adds zeros), whole gradients' own where the sync
        was skipped (time breakdown only)."""
        squares = squares_of(g for _, g in tree_flatten(grads))
        if not self.is_shard(grads):
            return mx.sqrt(squares)
        return mx.sqrt(mx.distributed.all_sum(squares.reshape(1), group=self.group, stream=self.stream)[0])

    def optimizer(self, base: optim.Optimizer) -> optim.Optimizer:
        return ShardedOptimizer(base, self)

    def state_bytes(self, model: nn.Module, optimizer: optim.Optimizer) -> dict[str, int]:
        """The whole weights, the moments of the rank's rows, and the gradients: whole (zero1: the averaged
        gradient is whole before the rank keeps its rows) or the rank's rows (zero2)."""
        held = state_bytes(model, optimizer)
        if self.stage >= 2:
            held["grads"] = sum(self.rows(path)[1] * int(np.prod(shape[1:])) * 4 for path, shape in self.shapes.items())
        return held

    def export_state(self, weights: Mapping[str, mx.array], exp_avg: Mapping[str, mx.array],
                     exp_avg_sq: Mapping[str, mx.array]) -> tuple[StateStream, StateStream, StateStream]:
        return self._on_rank0(numpy_stream(weights)), self.whole(exp_avg), self.whole(exp_avg_sq)

    def _on_rank0(self, stream: Iterator[tuple[str, np.ndarray]]) -> StateStream:
        for name, value in stream:
            yield name, value if self.rank == 0 else None

    def whole(self, moments: Mapping[str, mx.array]) -> StateStream:
        """Each moment gathered whole to rank 0, one at a time (every rank iterates: collectives)."""
        for path, value in moments.items():
            if value.shape[0] != self.rows(path)[1]:  # whole already: read at resume, not yet cut
                yield path, as_float32(value) if self.rank == 0 else None
                continue
            whole = mx.distributed.all_gather(value, group=self.group, stream=self.stream)[:self.shapes[path][0]]
            mx.eval(whole)  # on every rank: a gather left lazy on one rank would pair with its next collective
            yield path, as_float32(whole) if self.rank == 0 else None

    def local_state(self, shapes: Mapping[str, tuple[int, ...]], weights: Mapping[str, mx.array],
                    exp_avg: Mapping[str, mx.array], exp_avg_sq: Mapping[str, mx.array]) -> LocalState:
        raise NotImplementedError("zero1 and zero2 write hf checkpoints only (common/parallel/zero.py refuses "
                                  "--checkpoint-format sharded)")


class Zero1(ZeroRedundancy):
    stage = 1


class Zero2(ZeroRedundancy):
    stage = 2


class ShardedOptimizer(optim.Optimizer):
    """The run's Adam or AdamW (`base`) on this rank's rows: its state holds the rows' moments under the
    parameters' paths, so the Trainer reads and writes them as it does the whole ones."""

    def __init__(self, base: optim.Optimizer, strategy: ZeroRedundancy):
        super().__init__()
        self.base, self.strategy = base, strategy

    @property
    def state(self) -> Any:
        return self.base.state

    @state.setter
    def state(self, state: dict) -> None:
        if hasattr(self, "base"):
            self.base.state = state

    def init(self, parameters: dict) -> None:
        self.base.init(self.strategy.own_rows(parameters))

    def update(self, model: nn.Module, gradients: dict) -> None:
        """AdamW on the rank's rows, then the updated rows of every rank gathered into the whole weights."""
        if not self.strategy.is_shard(gradients):  # a step timed without its sync: the rank's own rows
            gradients = self.strategy.own_rows(gradients)
        rows = self.strategy.own_rows(model.trainable_parameters())
        tree_map(self._cut, rows, self.base.state)
        model.update(self.strategy.gather_rows(self.base.apply_gradients(gradients, rows)))

    def _cut(self, rows: mx.array, state: dict) -> None:
        """Moments read whole at resume (Trainer.import_optimizer) -> this rank's rows, padded as its rows are."""
        for key, value in state.items():
            if isinstance(value, mx.array) and value.shape != rows.shape:
                c = rows.shape[0]
                start = self.strategy.rank * c
                part = value[start:start + c]
                state[key] = mx.pad(part, [(0, c - part.shape[0])] + [(0, 0)] * (value.ndim - 1))
