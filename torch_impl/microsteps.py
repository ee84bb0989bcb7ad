"""A step's micro-batches one after another, in PyTorch: the `forward_backward` ddp, fsdp and tp share (pp runs
its own schedule, pp.py). Mirrors mlx_impl/microsteps.py.

Each micro-batch is a forward of the model the Trainer runs (`StepFunctions.wrapped`: DDP's wrapper, FSDP2's
hooked model, compiled under --torch-compile) and a backward that accumulates the gradients in the parameters'
`.grad`. DDP and FSDP communicate only on the micro-step that ends the optimizer step (the others run under the
strategy's `_no_sync()`); sync=False runs the bare model (`StepFunctions.model`), whose gradient hooks never sync
(time breakdown only; the bare model has no hooks apart from the wrapper's, unless the strategy wraps in place:
fsdp). The first training step is counted by the strategy's `_watch_collectives` (torch_impl/comm.py).
"""
from __future__ import annotations

import contextlib
from typing import Protocol, Sequence

import numpy as np
import torch
import torch.nn as nn

from common.train.protocols import Batch, ForwardBackwardResult, Phase, no_phase

from .adamw import AdamW
from .comm import CommCounter, FixedCount, Watch
from .model import Llama, token_loss_sum
from .rank_state import state_bytes

Grads = list[torch.Tensor]  # the parameters' .grad, accumulated in place by autograd


class StepFunctions(Protocol):
    """What a strategy runs of the Trainer (torch_impl/step.py): its model, bare and as the step runs it."""

    @property
    def model(self) -> Llama: ...

    @property
    def wrapped(self) -> nn.Module: ...


class MicroSteps:
    """The strategies' shared passes: the micro-batches one after another (common/train/protocols.py)."""

    loss_over = "data"  # each data-parallel rank holds its part of the loss sum
    device: torch.device
    comm: CommCounter

    def forward_backward(self, step: StepFunctions, batches: Sequence[Batch], scale: float,
                         phase: Phase = no_phase, wait: bool = False,
                         sync: bool = True) -> ForwardBackwardResult[torch.Tensor, Grads]:
        """-> (the float64 sum of this rank's token losses, the parameters' gradients)."""
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        model = step.wrapped if sync else step.model
        with self.comm.first_step(self._watch_collectives):
            for i, (inputs, targets, mask) in enumerate(batches):
                last = i == len(batches) - 1
                deferred = contextlib.nullcontext() if last or model is not step.wrapped else self._no_sync()
                with deferred:
                    with phase("forward"):
                        micro = token_loss_sum(model, *to_device(self.device, inputs, targets, mask))
                        wait_for(wait, self.device)
                    with phase("backward"):
                        (micro * scale).backward()
                        wait_for(wait, self.device)
                loss_sum += micro.detach()
        return ForwardBackwardResult(loss_sum, [p.grad for p in step.model.parameters() if p.grad is not None])

    def eval_losses(self, step: StepFunctions, batches: Sequence[Batch]) -> torch.Tensor:
        """The float64 sum of this rank's token losses (the Trainer runs it under torch.no_grad)."""
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for batch in batches:
            loss_sum += token_loss_sum(step.model, *to_device(self.device, *batch))
        return loss_sum

    def figures(self) -> dict[str, object]:
        return {}

    def optimizer(self, base: AdamW) -> AdamW:
        """The optimizer the Trainer steps: `base` on the whole parameters the rank holds (zero.py: on its rows)."""
        return base

    def state_bytes(self, model: nn.Module, optimizer: AdamW) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state this rank holds (rank_state.py)."""
        return state_bytes(model, optimizer)

    def _no_sync(self) -> contextlib.AbstractContextManager[object]:
        """Accumulate without communicating (every micro-step but the last): nothing to defer by default."""
        return contextlib.nullcontext()

    def _watch_collectives(self) -> Watch:
        """What counts the first step's collectives (torch_impl/comm.py); by default nothing is counted."""
        return FixedCount(None)


def to_device(device: torch.device, inputs: np.ndarray, targets: np.ndarray,
              mask: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A micro-batch's numpy arrays as tensors on the device (token ids as int64, as embedding lookups want)."""
    return (torch.from_numpy(inputs).long().to(device), torch.from_numpy(targets).long().to(device),
            torch.from_numpy(mask).to(device))


def wait_for(wait: bool, device: torch.device) -> None:
    """End a phase in a device sync when the step is timed phase by phase (MLX evaluates its lazy arrays
    instead); CPU ops are done when they return."""
    if not wait:
        return
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
