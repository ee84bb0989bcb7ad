"""DDP in MLX: every rank holds the whole model and averages the gradients once per step.

`Replicated` is the strategy (common/train/protocols.py); the helpers below are what every strategy shares: the
precise norm, the clip and the moments' layout in the optimizer state. Mirrors torch_impl/ddp.py.
"""
from __future__ import annotations

from typing import Iterator

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_map

from common.train.protocols import no_phase
from common.checkpoint.sharded import local_pieces

from .comm import CommCounter, average_gradients
from .load import load_local


class MicroSteps:
    """The shared default of `forward_backward` (common/train/protocols.py) for ddp, fsdp and tp: the micro-batches
    one after another, each the Trainer's compiled forward and backward, the gradients accumulated lazily
    (DDP communicates only in the update; fsdp: see fsdp.py). -> (token losses per micro-batch, gradients).
    wait=True ends each phase in mx.eval: forward (a micro-batch's losses), backward (the rest of its
    gradients: the compiled micro-step's graph is then evaluated in two parts, and kernels it fused across the
    two run in forward). backward=False: eval, the token losses only."""

    loss_over = "data"  # each data-parallel rank holds its part of the loss sum

    def forward_backward(self, trainer, batches, scale, phase=no_phase, wait=False, backward=True):
        if not backward:
            return [trainer._eval_losses(*(mx.array(a) for a in batch)) for batch in batches], None
        token_losses, grads = [], None
        for inputs, targets, mask in batches:
            with phase("forward"):
                losses, micro_grads = trainer._micro_step(mx.array(inputs), mx.array(targets), mx.array(mask), scale)
                token_losses.append(losses)
                wait_for(wait, losses)
            with phase("backward"):
                grads = micro_grads if grads is None else tree_map(mx.add, grads, micro_grads)
                wait_for(wait, grads)
        return token_losses, grads

    def figures(self) -> dict:
        return {}


def wait_for(wait: bool, arrays) -> None:
    if wait:
        mx.eval(arrays)


class Replicated(MicroSteps):
    reduce_scatter = None
    full_state_on_every_rank = True

    def __init__(self, cfg, world, comm: CommCounter, stream=None):
        self.group, self.comm, self.stream, self.rank = world.group, comm, stream, world.rank
        self.dp_size, self.reduce_bytes = cfg.data_parallel_size, int(cfg.all_reduce_size_mb * 2**20)
        self.communicates = self.dp_size > 1

    def wrap(self, model, source):
        load_local(model, source, self.local_index)  # every tensor whole
        return model

    def local_index(self, name: str, shape: tuple) -> tuple:
        return ()

    def reduce_gradients(self, grads):
        """The gradient sync of a step: a bucketed all-reduce, divided by N."""
        if not self.communicates:
            return grads
        self.comm.add_all(v for _, v in tree_flatten(grads))
        return average_gradients(grads, self.group, self.reduce_bytes, self.stream)

    def global_norm(self, grads) -> mx.array:
        return mx.sqrt(sum(sum_of_squares(g) for _, g in tree_flatten(grads)))

    def export_state(self, weights: dict, optimizer: dict):
        return tuple(map(numpy_stream, (weights, *moments(weights, optimizer))))

    def local_state(self, shapes: dict, weights: dict, optimizer: dict):
        """--checkpoint-format sharded (common/checkpoint/sharded.py): (weights, exp_avg, exp_avg_sq, where) of
        what this rank writes (every tensor whole, from rank 0 alone), under HF names; no collectives."""
        return local_pieces(self.rank, (weights, *moments(weights, optimizer)), dict.fromkeys(weights), shapes)


def sum_of_squares(x: mx.array, width: int = 4) -> mx.array:
    """Sum of x², as a tree of sums of `width` terms: a flat float32 sum over the millions of elements of
    an embedding gradient is off by ~4e-5, and the clip coefficient with it (measured on `small`)."""
    x = x.astype(mx.float32).reshape(-1)
    x = x * x
    while x.size > width:
        if x.size % width:
            x = mx.concatenate([x, mx.zeros((width - x.size % width,), dtype=x.dtype)])
        x = x.reshape(-1, width).sum(axis=1)
    return x.sum()


def clip_by_norm(grads, max_norm: float, norm: mx.array):
    """optim.clip_grad_norm's (and torch's) formula, with the precise norm."""
    return tree_map(lambda g: g * mx.minimum(max_norm / (norm + 1e-6), 1.0), grads)


def moments(weights: dict, optimizer: dict) -> tuple[dict, dict]:
    """AdamW's (exp_avg, exp_avg_sq) under HF names from the flat optimizer state. Views, not copies: MLX
    arrays are immutable, and a copy of the optimizer state costs its size again."""
    return ({n: np.asarray(optimizer[f"{n}.m"]) for n in weights},
            {n: np.asarray(optimizer[f"{n}.v"]) for n in weights})


def numpy_stream(named: dict) -> Iterator[tuple[str, np.ndarray]]:
    """export_state's stream of a rank's whole tensors: float32 numpy one at a time (a view of the MLX
    array where it is float32 already), so the checkpoint's writer never holds two."""
    for name, value in named.items():
        yield name, as_float32(value)


def as_float32(value) -> np.ndarray:
    if isinstance(value, mx.array) and value.dtype != mx.float32:
        value = value.astype(mx.float32)
    return np.asarray(value, dtype=np.float32)


def state_bytes(model, optimizer) -> dict:
    """Bytes of parameters, gradients and optimizer state on this rank. A gradient has its parameter's
    shape on this rank (a shard under fsdp, a slice under tp), so the two take the same bytes."""
    params = _nbytes(model.trainable_parameters())
    return {"params": params, "grads": params, "optimizer": _nbytes(optimizer.state)}


def _nbytes(tree):
    return sum(a.nbytes for _, a in tree_flatten(tree) if isinstance(a, mx.array))
