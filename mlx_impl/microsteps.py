"""A step's micro-batches one after another, in MLX: the `forward_backward` ddp, fsdp and tp share (pp runs its
own schedule, pp.py). Mirrors torch_impl/microsteps.py.

Each micro-batch is the Trainer's compiled forward and backward (`StepFunctions.micro_step`), its gradients
accumulated lazily: nothing runs until the Trainer's compiled update evaluates the step (DDP communicates only in
the update; fsdp: see fsdp.py). wait=True ends each phase in mx.eval: forward (a micro-batch's losses), backward
(the rest of its gradients: the compiled micro-step's graph is then evaluated in two parts, and kernels it fused
across the two run in forward).
"""
from __future__ import annotations

from typing import Any, Protocol, Sequence

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_map

from common.train.protocols import Batch, ForwardBackwardResult, Phase, no_phase

from .rank_state import state_bytes

Grads = dict[str, Any]   # a tree (nested dicts and lists) of mx.array, as nn.value_and_grad returns it
Losses = list[mx.array]  # the token losses of each micro-batch, lazy: the Trainer sums them in float64


class StepFunctions(Protocol):
    """What a strategy runs of the Trainer (mlx_impl/step.py): its compiled functions of one micro-batch."""

    def micro_step(self, inputs: mx.array, targets: mx.array, mask: mx.array,
                   scale: mx.array) -> tuple[mx.array, Grads]:
        """(the token losses, the gradients of (sum of token losses) x scale), lazy."""
        ...

    def eval_step(self, inputs: mx.array, targets: mx.array, mask: mx.array) -> mx.array:
        """The token losses, lazy."""
        ...


class MicroSteps:
    """The strategies' shared passes: the micro-batches one after another (common/train/protocols.py)."""

    loss_over = "data"  # each data-parallel rank holds its part of the loss sum

    def forward_backward(self, step: StepFunctions, batches: Sequence[Batch], scale: float,
                         phase: Phase = no_phase, wait: bool = False,
                         sync: bool = True) -> ForwardBackwardResult[Losses, Grads]:
        """sync changes nothing here: MLX reduces the gradients after the backward, in the Trainer's update."""
        # An array, not a Python float: the compiled micro-step would take a float as a constant and retrace.
        scale_array = mx.array(scale, dtype=mx.float32)
        token_losses: Losses = []
        grads: Grads | None = None
        for inputs, targets, mask in batches:
            with phase("forward"):
                losses, micro_grads = step.micro_step(mx.array(inputs), mx.array(targets), mx.array(mask), scale_array)
                token_losses.append(losses)
                wait_for(wait, losses)
            with phase("backward"):
                grads = micro_grads if grads is None else tree_map(mx.add, grads, micro_grads)
                wait_for(wait, grads)
        assert grads is not None, "a step has at least one micro-batch"
        return ForwardBackwardResult(token_losses, grads)

    def eval_losses(self, step: StepFunctions, batches: Sequence[Batch]) -> Losses:
        return [step.eval_step(*(mx.array(a) for a in batch)) for batch in batches]

    def figures(self) -> dict[str, object]:
        return {}

    def optimizer(self, base: optim.Optimizer) -> optim.Optimizer:
        """The optimizer the Trainer steps: `base` on the whole parameters the rank holds (zero.py: on its rows)."""
        return base

    def state_bytes(self, model: nn.Module, optimizer: optim.Optimizer) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state this rank holds (rank_state.py)."""
        return state_bytes(model, optimizer)


def wait_for(wait: bool, arrays: object) -> None:
    """End a phase in mx.eval when the step is timed phase by phase (torch waits for the device instead)."""
    if wait:
        mx.eval(arrays)
