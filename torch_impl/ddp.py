"""DDP in PyTorch: every rank holds the whole model; DDP's hooks all-reduce the gradients in buckets during
the backward, on the micro-step that ends the optimizer step.

`Replicated` is the strategy (common/train/protocols.py): the micro-batches one after another (microsteps.py),
the others deferred with DDP's no_sync. Mirrors mlx_impl/ddp.py.
"""
from __future__ import annotations

import contextlib
from typing import Mapping

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from common.checkpoint.sharded import LocalState, local_pieces
from common.checkpoint.tensorsource import Index, TensorSource
from common.config import RunConfig
from common.train.protocols import StateStream, World

from .comm import CommCounter, FixedCount, Watch
from .grads import norm_dtype, squares_of
from .load import load_local
from .microsteps import Grads, MicroSteps
from .model import Llama
from .rank_state import local_numpy, numpy_stream


class Replicated(MicroSteps):
    reduce_scatter: str | None = None
    full_state_on_every_rank = True
    communicates = False  # inside the backward (DDP's hooks), not a phase of its own

    def __init__(self, cfg: RunConfig, world: World, comm: CommCounter):
        self.device, self.comm = torch.device(world.device), comm
        self.dp_size, self.rank = cfg.data_parallel_size, world.rank
        self.bucket_cap_mb, self.static_graph = cfg.bucket_cap_mb, cfg.grad_accum == 1
        # DDP's bucket views must stay allocated between steps.
        self.keeps_grads = self.dp_size > 1

    def wrap(self, model: Llama, source: TensorSource) -> nn.Module:
        load_local(model, self.device, source, self.local_index)  # every tensor whole
        self.model: Llama = model
        self.wrapped: nn.Module = model
        if self.dp_size > 1:
            self.wrapped = DDP(model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                               bucket_cap_mb=self.bucket_cap_mb, gradient_as_bucket_view=True,
                               # no_sync() and a static graph do not mix; accumulation needs the former.
                               static_graph=self.static_graph)
        return self.wrapped

    def local_index(self, name: str, shape: tuple[int, ...]) -> Index:
        return ()

    def global_norm(self, grads: Grads) -> torch.Tensor:
        dtype = norm_dtype(self.device)
        return squares_of(grads, dtype, self.device).sqrt()

    def export_state(self, weights: Mapping[str, torch.Tensor], exp_avg: Mapping[str, torch.Tensor],
                     exp_avg_sq: Mapping[str, torch.Tensor]) -> tuple[StateStream, StateStream, StateStream]:
        return numpy_stream(weights), numpy_stream(exp_avg), numpy_stream(exp_avg_sq)

    def local_state(self, shapes: Mapping[str, tuple[int, ...]], weights: Mapping[str, torch.Tensor],
                    exp_avg: Mapping[str, torch.Tensor], exp_avg_sq: Mapping[str, torch.Tensor]) -> LocalState:
        """--checkpoint-format sharded (common/checkpoint/sharded.py): (weights, exp_avg, exp_avg_sq, where) of
        what this rank writes (every tensor whole, from rank 0 alone), under HF names; no collectives."""
        return local_pieces(self.rank, (local_numpy(weights), local_numpy(exp_avg), local_numpy(exp_avg_sq)),
                            dict.fromkeys(weights), shapes)

    def _no_sync(self) -> contextlib.AbstractContextManager[object]:
        """Accumulate without communicating (every micro-step but the last)."""
        return self.wrapped.no_sync() if isinstance(self.wrapped, DDP) else contextlib.nullcontext()

    def _watch_collectives(self) -> Watch:
        """DDP all-reduces every gradient once, in C++ buckets no dispatch mode sees: count their sizes."""
        return FixedCount(sum(p.numel() * p.element_size() for p in self.model.parameters() if p.requires_grad)
                          * (self.dp_size > 1))
