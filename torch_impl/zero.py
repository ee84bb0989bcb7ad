"""ZeRO-1 and ZeRO-2 in PyTorch: ddp's data and whole fp32 weights on every rank, AdamW's moments sharded by rows.

`Zero1` and `Zero2` are the strategies (common/train/protocols.py; their cost and memory: common/parallel/zero.py).
Each trained tensor is split along axis 0 as fsdp splits it, ceil(rows / N) rows a rank, the last ranks' padded
with zero rows, so every rank's shard of every tensor has the same shape. Per step:

- zero1 wraps the model in DDP, whose hooks average every gradient in the backward, as under ddp, and keeps views
  of its rows; zero2 runs the bare model, then lays the padded gradients out as an (N, shard) matrix, divides it by
  N (DDP's order: divide, then sum) and reduce-scatters it (`dist.reduce_scatter_single`, which gloo runs on the
  CPU, and nccl), and frees the whole gradients: the rank keeps only its rows' gradient between steps;
- the global gradient norm is the square root of the ranks' summed squares of their rows (float64, as every
  torch strategy's; the padding adds zeros);
- `ShardedOptimizer` runs the run's Adam or AdamW (adamw.py) on the rank's rows (views of the weights, updated in
  place; a padded copy only where an uneven split leaves the rank short), then all-gathers the updated rows
  (`dist.all_gather_single`, one collective of the padded shard) into the whole weights.

Why not torch.distributed.optim.ZeroRedundancyOptimizer: it assigns whole parameters to ranks (greedily by size),
so a rank's state is not 1/N of the moments and padding does not exist to show; it would shard the moments
differently from mlx_impl/zero.py, give no ZeRO-2, and building a torch.optim.Optimizer imports torch._dynamo
(adamw.py). Its own code with reduce_scatter_single and all_gather_single keeps both frameworks' shards, numbers
and bytes the same, and runs on gloo.

Checkpoints: the hf format gathers each moment to rank 0 (export_state); at resume every rank reads the whole
moments and keeps its rows (ShardedOptimizer's state cuts them as they are set). --checkpoint-format sharded is
refused (common/parallel/zero.py). Mirrors mlx_impl/zero.py.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

from common.checkpoint.sharded import LocalState
from common.checkpoint.tensorsource import Index, TensorSource
from common.config import RunConfig
from common.parallel.zero import shard_rows
from common.train.protocols import Batch, ForwardBackwardResult, Phase, StateStream, World, no_phase

from .adamw import AdamW
from .comm import CommCounter, FixedCount, Watch
from .ddp import Replicated
from .grads import norm_dtype, squares_of
from .load import load_local
from .microsteps import Grads, StepFunctions
from .model import Llama
from .rank_state import as_float32, numpy_stream, state_bytes


class ZeroRedundancy(Replicated):
    """zero1 and zero2 (the module docstring); `stage` says which."""
    stage = 1
    full_state_on_every_rank = False  # rank 0 gathers the moments, the checkpoint's one writer
    reduce_scatter: str | None = None  # zero2: "native" or "all_sum_slice" (summary.json), as fsdp's

    def __init__(self, cfg: RunConfig, world: World, comm: CommCounter):
        super().__init__(cfg, world, comm)
        self.reduce_scatter = "native" if self.stage >= 2 else None
        self.keeps_grads = self.stage == 1 and self.dp_size > 1  # DDP's bucket views
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.params: list[nn.Parameter] = []
        self.shards: list[torch.Tensor] = []

    def wrap(self, model: Llama, source: TensorSource) -> nn.Module:
        if self.stage == 1:
            wrapped = super().wrap(model, source)  # DDP averages the gradients in the backward
        else:
            load_local(model, self.device, source, self.local_index)  # every tensor whole, no DDP
            self.model, self.wrapped = model, model
            wrapped = model
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.shapes = {n: tuple(p.shape) for n, p in named}
        self.params = [p for _, p in named]
        self.shards = [self._rows_of(n, p) for n, p in named]
        return wrapped

    def _rows_of(self, path: str, p: torch.Tensor) -> torch.Tensor:
        """What AdamW updates of `p`: a view of the rank's rows, updated in place (no copy of the weights kept
        beside them), or where the rank's rows run short (the last ranks of an uneven split) a padded copy."""
        start, c = self.rows(path)
        if start + c <= p.shape[0]:
            return p.detach()[start:start + c]
        return self.own_rows({path: p.detach()})[path]

    def local_index(self, name: str, shape: tuple[int, ...]) -> Index:
        """Whole: the weights are whole on every rank, and the moments are read whole at resume and cut to the
        rank's rows by ShardedOptimizer."""
        return ()

    def rows(self, path: str) -> tuple[int, int]:
        """(first row, rows every rank holds) of the tensor named `path`."""
        c = shard_rows(self.shapes[path][0], self.dp_size)
        return self.rank * c, c

    def own_rows(self, tree: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's rows of every whole tensor in `tree`, padded with zero rows to the common shard shape
        (copies)."""
        out = {}
        for path, x in tree.items():
            start, c = self.rows(path)
            out[path] = x.new_zeros((c, *x.shape[1:]))
            part = x[start:start + c]
            out[path][:part.shape[0]] = part
        return out

    def gather_rows(self, tree: Sequence[torch.Tensor]) -> None:
        """Every rank's updated rows (`tree`: the shards) into the whole weights: one all-gather of the rank's padded
        rows."""
        mine = torch.cat([s.reshape(-1) for s in tree])
        every = mine.new_empty(self.dp_size * mine.numel())
        dist.all_gather_single(every, mine)
        every = every.view(self.dp_size, -1)
        offset = 0
        with torch.no_grad():
            for path, p, s in zip(self.shapes, self.params, tree):
                width = s.numel()
                whole = every[:, offset:offset + width].reshape(self.dp_size * s.shape[0], *s.shape[1:])
                p.copy_(whole[:p.shape[0]])
                offset += width

    def forward_backward(self, step: StepFunctions, batches: Sequence[Batch], scale: float,
                         phase: Phase = no_phase, wait: bool = False,
                         sync: bool = True) -> ForwardBackwardResult[torch.Tensor, Grads]:
        """ddp's passes (zero1: DDP averages in the backward), then this rank's rows of the gradients (zero2:
        reduce-scattered here, and the whole gradients freed) as the gradients of the shards AdamW updates."""
        passes = super().forward_backward(step, batches, scale, phase, wait, sync)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        if self.stage >= 2 and sync:
            with phase("backward"):
                self._reduce_scatter(grads)
        else:  # zero1: views of the averaged gradients' rows (a step without its sync: the rank's own)
            for path, s, g in zip(self.shapes, self.shards, grads):
                start, c = self.rows(path)
                s.grad = g[start:start + c] if g.shape[0] >= start + c else self.own_rows({path: g})[path]
        if self.stage >= 2:
            for p in self.params:
                p.grad = None
        return ForwardBackwardResult(passes.losses, [s.grad for s in self.shards if s.grad is not None])

    def _reduce_scatter(self, grads: list[torch.Tensor]) -> None:
        columns = []
        for path, g in zip(self.shapes, grads):
            _, c = self.rows(path)
            padded = g.new_zeros((c * self.dp_size, *g.shape[1:]))
            padded[:g.shape[0]] = g
            columns.append(padded.view(self.dp_size, -1))
        matrix = torch.cat(columns, dim=1).div_(self.dp_size)  # (N, shard); DDP's order: divide, then sum
        row = matrix.new_empty(matrix.shape[1])
        dist.reduce_scatter_single(row, matrix.reshape(-1))
        offset = 0
        for s, column in zip(self.shards, columns):
            width = column.shape[1]
            s.grad = row[offset:offset + width].view(s.shape)
            offset += width

    def _watch_collectives(self) -> Watch:
        """The gradients handed to the reduction (zero1: DDP's all-reduce of every gradient; zero2: the padded
        (N, shard) matrix) and the rank's rows handed to the all-gather, known from the shapes."""
        shard = sum(s.numel() for s in self.shards) * 4
        grads = sum(p.numel() for p in self.params) * 4 if self.stage == 1 else shard * self.dp_size
        return FixedCount(grads + shard)

    def global_norm(self, grads: Grads) -> torch.Tensor:
        """The ranks' summed squares of their rows (the padding adds zeros)."""
        squares = squares_of(grads, norm_dtype(self.device), self.device)
        dist.all_reduce(squares)
        return squares.sqrt()

    def optimizer(self, base: AdamW) -> AdamW:
        return ShardedOptimizer(base, self)

    def state_bytes(self, model: nn.Module, optimizer: AdamW) -> dict[str, int]:
        """The whole weights, the moments of the rank's rows, and the gradients: whole (zero1: DDP's buckets keep
        them whole) or the rank's rows (zero2)."""
        held = state_bytes(model, optimizer)
        if self.stage >= 2:
            held["grads"] = sum(s.nbytes for s in self.shards)
        return held

    def export_state(self, weights: Mapping[str, torch.Tensor], exp_avg: Mapping[str, torch.Tensor],
                     exp_avg_sq: Mapping[str, torch.Tensor]) -> tuple[StateStream, StateStream, StateStream]:
        return self._on_rank0(numpy_stream(weights)), self.whole(exp_avg), self.whole(exp_avg_sq)

    def _on_rank0(self, stream: Iterator[tuple[str, np.ndarray]]) -> StateStream:
        for name, value in stream:
            yield name, value if self.rank == 0 else None

    def whole(self, moments: Mapping[str, torch.Tensor]) -> StateStream:
        """Each moment gathered whole to rank 0, one at a time (every rank iterates: collectives)."""
        for path, value in moments.items():
            if value.shape[0] != self.rows(path)[1]:  # whole already: before the first step
                yield path, as_float32(value) if self.rank == 0 else None
                continue
            every = value.new_empty((self.dp_size * value.shape[0], *value.shape[1:]))
            dist.all_gather_single(every, value.contiguous())
            yield path, as_float32(every[:self.shapes[path][0]]) if self.rank == 0 else None

    def local_state(self, shapes: Mapping[str, tuple[int, ...]], weights: Mapping[str, torch.Tensor],
                    exp_avg: Mapping[str, torch.Tensor], exp_avg_sq: Mapping[str, torch.Tensor]) -> LocalState:
        raise NotImplementedError("zero1 and zero2 write hf checkpoints only (common/parallel/zero.py refuses "
                                  "--checkpoint-format sharded)")


class Zero1(ZeroRedundancy):
    stage = 1


class Zero2(ZeroRedundancy):
    stage = 2


class ShardedOptimizer(AdamW):
    """The run's Adam or AdamW (`base`'s settings) on this rank's rows. Its `state` answers for the whole
    parameters too (the Trainer reads and writes the moments by them), holding the rows' moments."""

    def __init__(self, base: AdamW, strategy: ZeroRedundancy):
        group = base.param_groups[0]
        super().__init__([{"params": strategy.shards}], lr=group["lr"], betas=group["betas"], eps=group["eps"],
                         weight_decay=group["weight_decay"], bias_correction=base.bias_correction,
                         decoupled=base.decoupled)
        self.base, self.strategy = base, strategy
        self.state = _ByParameter(strategy)

    def step(self) -> None:
        """AdamW on the rank's rows, then the updated rows of every rank gathered into the whole weights."""
        super().step()
        self.strategy.gather_rows(self.strategy.shards)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(True)                 # the rows' gradients: views or a fresh reduce-scatter each step
        self.base.zero_grad(set_to_none)        # the whole ones (zero1: DDP's bucket views stay)


class _ByParameter(defaultdict):
    """AdamW's state keyed by the shards, answering for the whole parameters too: a whole moment set for a whole
    parameter (Trainer.import_optimizer at resume) is cut to the rank's rows."""

    def __init__(self, strategy: ZeroRedundancy):
        super().__init__(dict)
        self.strategy = strategy
        self.shard_of = {id(p): (path, s) for path, p, s in zip(strategy.shapes, strategy.params, strategy.shards)}

    def _key(self, p: Any) -> Any:
        return self.shard_of[id(p)][1] if id(p) in self.shard_of else p

    def __getitem__(self, p: Any) -> Any:
        return super().__getitem__(self._key(p))

    def get(self, p: Any, default: Any = None) -> Any:
        return super().get(self._key(p), default)

    def __setitem__(self, p: Any, value: Any) -> None:
        if id(p) in self.shard_of:
            path, _ = self.shard_of[id(p)]
            value = {k: self.strategy.own_rows({path: v})[path] if k != "step" else v for k, v in value.items()}
        super().__setitem__(self._key(p), value)
