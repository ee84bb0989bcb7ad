"""DDP in PyTorch: every rank holds the whole model; DDP's hooks all-reduce the gradients in buckets during
the backward, on the micro-step that ends the optimizer step.

`Replicated` is the strategy (common/train/protocols.py); the helpers below are what every strategy shares.
Mirrors mlx_impl/ddp.py.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import numpy as np

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from common.train.protocols import no_phase
from common.checkpoint.sharded import local_pieces

from .load import local as _local
from .load import load_local
from .model import token_loss_sum


class MicroSteps:
    """The shared default of `forward_backward` (common/train/protocols.py) for ddp, fsdp and tp: the micro-batches
    one after another -> the float64 sum of this rank's token losses. sync=False runs the bare model, whose
    gradient hooks never sync (time breakdown only); DDP and FSDP communicate only on the micro-step that ends
    the optimizer step (the bare model has no hooks apart from the wrapper's, unless the strategy wraps in
    place: fsdp). `counter` counts the first step's collectives. backward=False: eval, the loss sum only."""

    loss_over = "data"  # each data-parallel rank holds its part of the loss sum

    def forward_backward(self, trainer, batches, scale, phase=no_phase, wait=False, sync=True,
                         counter=None, backward=True):
        loss_sum = torch.zeros((), dtype=torch.float64, device=trainer.device)
        if not backward:
            for batch in batches:
                loss_sum += token_loss_sum(trainer.model, *trainer.to_device(*batch))
            return loss_sum
        model = trainer.wrapped if sync else trainer.model
        counter = counter or contextlib.nullcontext()
        for i, (inputs, targets, mask) in enumerate(batches):
            last = i == len(batches) - 1
            deferred = contextlib.nullcontext() if last or model is not trainer.wrapped else self.no_sync()
            with deferred, counter:
                with phase("forward"):
                    micro = token_loss_sum(model, *trainer.to_device(inputs, targets, mask))
                    trainer.wait(wait)
                with phase("backward"):
                    (micro * scale).backward()
                    trainer.wait(wait)
            loss_sum += micro.detach()
        return loss_sum

    def figures(self) -> dict:
        return {}


class Replicated(MicroSteps):
    reduce_scatter = None
    full_state_on_every_rank = True
    communicates = False  # inside the backward (DDP's hooks), not a phase of its own

    def __init__(self, cfg, world, device: torch.device):
        self.device, self.dp_size, self.rank = device, cfg.data_parallel_size, world.rank
        self.bucket_cap_mb, self.static_graph = cfg.bucket_cap_mb, cfg.grad_accum == 1
        # DDP's bucket views must stay allocated between steps.
        self.keeps_grads = self.dp_size > 1

    def wrap(self, model, source):
        load_local(model, self.device, source, self.local_index)  # every tensor whole
        self.model = self.wrapped = model
        if self.dp_size > 1:
            self.wrapped = DDP(model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                               bucket_cap_mb=self.bucket_cap_mb, gradient_as_bucket_view=True,
                               # no_sync() and a static graph do not mix; accumulation needs the former.
                               static_graph=self.static_graph)
        return self.wrapped

    def local_index(self, name: str, shape: tuple) -> tuple:
        return ()

    def no_sync(self):
        """Accumulate without communicating (every micro-step but the last)."""
        return self.wrapped.no_sync() if self.dp_size > 1 else contextlib.nullcontext()

    def param_groups(self, model) -> list[dict]:
        return [{"params": list(model.parameters())}]

    def comm_counter(self):
        """DDP all-reduces every gradient once, in C++ buckets no dispatch mode sees: count their sizes."""
        return FixedCount(sum(p.numel() * p.element_size() for p in self.model.parameters()) * (self.dp_size > 1))

    def global_norm(self, params, dtype: torch.dtype) -> torch.Tensor:
        squares = [sum_of_squares(p.grad, dtype) for p in params if p.grad is not None]
        return torch.stack(squares).sum().sqrt()

    def export_state(self, params: dict, exp_avg: dict, exp_avg_sq: dict):
        return tuple(map(numpy_stream, (params, exp_avg, exp_avg_sq)))


    def local_state(self, shapes: dict, params: dict, exp_avg: dict, exp_avg_sq: dict):
        """--checkpoint-format sharded (common/checkpoint/sharded.py): (weights, exp_avg, exp_avg_sq, where) of
        what this rank writes (every tensor whole, from rank 0 alone), under HF names; no collectives."""
        return local_pieces(self.rank, tuple(map(_local_numpy, (params, exp_avg, exp_avg_sq))), dict.fromkeys(params),
                            shapes)


class FixedCount(contextlib.nullcontext):
    """A comm counter whose bytes are known without watching: DDP's buckets; None under fsdp."""

    def __init__(self, nbytes: int | None):
        super().__init__()
        self.bytes = nbytes


def sum_of_squares(x: torch.Tensor, dtype: torch.dtype = torch.float64, width: int = 1024) -> torch.Tensor:
    """Sum of x², in `dtype`: float32 norms of rows of `width` elements (short sums), squared and summed in
    `dtype`. Casting every element to float64 first, as vector_norm(dtype=float64) does, made the norm of
    `small`'s 28M gradients 69 ms of a step on the 2-core Zen 5 VM (2 threads); this takes 3.4 ms and is
    within 1e-9 of the float64 norm, where one flat float32 norm per tensor was 4.5e-4 off (gradients with a
    mean, issue 27). mlx_impl/ddp.py's sum_of_squares is the same idea as a tree of sums."""
    flat = x.detach().reshape(-1)
    n = flat.numel() // width * width
    norms = [torch.linalg.vector_norm(flat[:n].view(-1, width), dim=1)] if n else []
    if n < flat.numel():
        norms.append(torch.linalg.vector_norm(flat[n:]).reshape(1))
    return torch.cat(norms).to(dtype).square().sum() if norms else torch.zeros((), dtype=dtype, device=x.device)


def clip_by_norm(params, max_norm: float, norm: torch.Tensor) -> None:
    """torch's clip formula, in place, with the precise norm (and on a DTensor's local shard, where a
    DTensor gradient would need the same mesh as the norm)."""
    grads = [_local(p.grad) for p in params if p.grad is not None]
    torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))


def state_bytes(model, optimizer) -> dict:
    """Bytes of parameters, gradients and optimizer state on this rank. A gradient has its parameter's
    shape on this rank (a shard under fsdp, a slice under tp), so the two take the same bytes."""
    states = (t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor))
    params = sum(_local(p).nbytes for p in model.parameters() if p.requires_grad)
    return {"params": params, "grads": params, "optimizer": sum(_local(t).nbytes for t in states)}


def _local_numpy(flat: dict) -> dict:
    """What this rank holds of each tensor (a DTensor's local shard) as float32 numpy, a view on CPU."""
    return {k: as_float32(_local(v)) for k, v in flat.items()}


def numpy_stream(named: dict) -> Iterator[tuple[str, np.ndarray]]:
    """export_state's stream of a rank's whole tensors: float32 numpy one at a time (a view of a float32
    CPU tensor), so the checkpoint's writer never holds two."""
    for name, value in named.items():
        yield name, as_float32(value)


def as_float32(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().float().cpu().numpy()
