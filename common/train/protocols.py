"""The interfaces between the shared loop and a framework, written as code (torchtitan's `protocols/`).

A backend's `step.py` supplies a `Trainer`; the Trainer holds one `Strategy` (ddp.py `Replicated`, fsdp.py
`Sharding`, tp.py `TensorParallel`, pp.py `Pipeline`, the same names in mlx_impl/ and torch_impl/) and asks it everything
that differs between strategies, so a new parallelism is a new class, not a new branch in the step.
Arrays are the framework's own (mx.array trees, torch tensors); common/ imports neither framework.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable, ContextManager, Iterator, Protocol

import numpy as np

from common.checkpoint.tensorsource import Index, TensorSource

# export_state's result: (HF name, whole float32 tensor) pairs, the tensor None on a rank that does not receive it
StateStream = Iterator[tuple[str, "np.ndarray | None"]]
Phase = Callable[[str], ContextManager]  # phase("forward") wraps one phase of a step


def no_phase(name: str) -> ContextManager:
    """A step's phases, unobserved: what an ordinary training step passes."""
    return nullcontext()


class Strategy(Protocol):
    """How the ranks share one model: replicated (ddp), sharded (fsdp), each layer split (tp) or the layers
    split into stages (pp).

    What both frameworks ask of it is below. Where the gradients are reduced differs, so each framework adds
    its own members: MLX reduces after the backward, `reduce_gradients(grads)`; torch's DDP and FSDP2 reduce
    inside it from hooks, so there the strategy gives `no_sync()` for accumulation, `param_groups(model)`,
    `comm_counter()` (the first step's bytes) and `keeps_grads` (DDP's bucket views stay allocated)."""

    reduce_scatter: str | None       # fsdp: "native" | "all_sum_slice" (summary.json); None otherwise
    full_state_on_every_rank: bool   # export_state's tensors are whole on every rank (fsdp: on rank 0 only)
    communicates: bool               # the step reduces gradients apart from the backward (a phase of its own)
    loss_over: str                   # the ranks whose loss sums add up to the step's: "data" (the data-parallel
                                     # ranks; under tp each holds the whole sum) or "world" (pp: the last stage
                                     # holds it, the others contribute 0); the Trainer's all_sum(over=...)

    def forward_backward(self, trainer: Any, batches, scale, phase: Phase = no_phase, wait: bool = False,
                         **options) -> Any:
        """The forward and backward passes of a step's micro-batches on this rank; the framework's step.py
        says what it passes and gets back (the token losses and the accumulated gradients). ddp, fsdp and tp
        run the micro-batches one after another (the shared default in ddp.py, `MicroSteps`); pp runs its
        pipeline schedule (pp.py), with `backward=False` for eval (forward only)."""

    def figures(self) -> dict:
        """What the rank's status file records for this strategy beyond the common figures (pp: the bubble)."""

    def wrap(self, model: Any, source: TensorSource) -> Any:
        """Make a freshly built model this rank's part, in place, and load from `source` only the slices the
        rank keeps (`local_index`); returns what the step runs. The model arrives unmaterialised (MLX: lazy
        arrays never evaluated; torch: on the meta device), so a sharded rank never holds a whole tensor it
        does not keep: it shards first, then reads its slices (mlx_impl/load.py, torch_impl/load.py)."""

    def local_index(self, name: str, shape: tuple[int, ...]) -> Index | None:
        """The slice (common/checkpoint/tensorsource.py's Index) of the whole HF-named tensor of `shape` this rank keeps:
        () for all of it (ddp, replicated parts), None for nothing (pp: another stage's). The weights at
        `wrap` and the AdamW moments at `import_optimizer` are read through it."""

    def global_norm(self, grads: Any, *args) -> Any:
        """The whole model's gradient norm: replicated gradients counted once, pieces summed over ranks."""

    def export_state(self, *state) -> tuple[StateStream, StateStream, StateStream]:
        """(weights, exp_avg, exp_avg_sq) as streams of whole tensors under HF names, gathered one at a time
        as they are iterated (collectives: every rank iterates all three, in order)."""

    def local_state(self, shapes: dict, *state) -> tuple[dict, dict, dict, dict]:
        """(weights, exp_avg, exp_avg_sq, where) of what this rank writes into a sharded checkpoint, numpy under
        HF names, and where each piece lies in the global tensor (common/checkpoint/sharded.py): its own shards
        and slices, a replicated tensor on rank 0 only; `shapes` the global shapes. No collectives."""


class Trainer(Protocol):
    """What common/train/loop.py, breakdown.py and trace.py ask of a backend's step.py.

    Trainer(cfg, spec, weights, world): `weights` is a TensorSource (common/checkpoint/tensorsource.py; a dict of whole
    arrays is wrapped in a DictSource), of which the rank reads only what its strategy keeps; arrays out are
    numpy."""

    framework: str                   # "mlx" | "torch"
    device: Any                      # str() of it names it, e.g. "cpu", "gpu", "cuda:0"
    rank: int
    world_size: int
    strategy: Strategy
    tracer: type                     # --trace (common/train/trace.py): the framework's Tracer

    def train_step(self, batches, lr: float, global_tokens: int, sync: bool = True, phase: Phase = no_phase,
                   wait: bool = False) -> tuple[float, float]:
        """One optimizer step -> (loss, grad_norm) as floats, after the work is done. sync=False skips the
        gradient reduction (time breakdown only: the ranks' weights part ways); `phase(name)` wraps each
        phase (forward and backward per micro-batch, communication, optimizer), and wait=True makes each
        phase wait for the device (common/train/breakdown.py, common/train/trace.py)."""

    def eval_loss_sum(self, inputs, targets, mask) -> float:
        """This rank's sum of token losses."""

    def all_sum(self, values: np.ndarray, over: str = "data") -> np.ndarray:
        """Summed over the data-parallel ranks (under tp that is the rank itself), or over="world": all."""

    def export_state(self) -> tuple[StateStream, StateStream, StateStream]:
        """(weights, exp_avg, exp_avg_sq) as streams of whole numpy tensors: on every rank where
        strategy.full_state_on_every_rank, else on rank 0 only (the others get None for each tensor).
        Every rank iterates all three, in order: each tensor is gathered by collectives when its turn comes,
        so a rank holds one whole tensor at a time (common/train/loop.py's checkpoint writes it and lets it go)."""

    def local_state(self) -> tuple[dict, dict, dict, dict]:
        """strategy.local_state of this rank's parameters and moments: what it writes of a sharded checkpoint."""

    def import_optimizer(self, exp_avg: TensorSource, exp_avg_sq: TensorSource, step: int) -> None:
        """AdamW's moments under HF names (sources, or dicts of whole arrays), on every rank; each reads only
        the slices it keeps (strategy.local_index), as for the weights."""

    def peak_memory_bytes(self) -> int:
        """The framework's own peak."""

    def state_bytes(self) -> dict:
        """{"params", "grads", "optimizer"}: bytes this rank holds."""

    def comm_bytes_per_step(self) -> int | None:
        """Bytes given to all-reduce by one training step, measured."""
