"""The interfaces between the shared loop and a framework, written as code (torchtitan's `protocols/`).

A backend's `step.py` supplies a `Trainer`; the Trainer holds one `Strategy` (ddp.py `Replicated`, fsdp.py
`Sharding`, tp.py `TensorParallel`, pp.py `Pipeline`, the same names in mlx_impl/ and torch_impl/) and asks it
everything that differs between strategies, so a new parallelism is a new class, not a new branch in the step.

common/ imports neither framework, so the protocol is generic in the framework's types; each backend's step.py
binds them once (`StepStrategy`) and types its `STRATEGIES` with `StrategyClass`, so that mypy (`make lint`)
fails on a strategy class whose constructor or members do not match. The type parameters:

    ModelT   what `wrap` gets: the framework's freshly built Llama
    RunT     what `wrap` returns and the step runs: the same Llama (MLX), or its DDP wrapper (torch)
    StepT    what a strategy runs a micro-batch with: the backend's `StepFunctions` (its microsteps.py)
    LossT    the token losses of the step's passes, not yet waited for: MLX the token losses of each
             micro-batch (the Trainer sums them in float64 on the host once the step is evaluated: MLX has no
             float64 on a GPU), torch their float64 sum on the device
    GradsT   the rank's gradients: MLX the tree of accumulated arrays (lazy, the compiled update consumes it),
             torch the parameters' `.grad` tensors, which autograd accumulates in place (the list only names them)
    ArrayT   the framework's array (mx.array, torch.Tensor): the state's tensors and the gradient norm
"""
from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Generic, Iterator, Mapping, Protocol, Sequence, TypeVar

import numpy as np

from common.checkpoint.sharded import LocalState
from common.checkpoint.tensorsource import Index, TensorSource
from common.config import RunConfig
from common.model.spec import ModelSpec
from common.parallel.mesh import DATA_AXES

if TYPE_CHECKING:
    from common.costmodel.probe import Collectives

# export_state's result: (HF name, whole float32 tensor) pairs, the tensor None on a rank that does not receive it
StateStream = Iterator[tuple[str, "np.ndarray | None"]]
Phase = Callable[[str], AbstractContextManager[object]]  # phase("forward") wraps one phase of a step
Batch = tuple[np.ndarray, np.ndarray, np.ndarray]  # a micro-batch's (inputs, targets, mask): common/data/sequences.py


def no_phase(name: str) -> AbstractContextManager[object]:
    """A step's phases, unobserved: what an ordinary training step passes."""
    return nullcontext()


@dataclass
class World:
    """Who this process is in the job. `group` is the framework's communicator (MLX), or torch's process group (None:
    the default one);
    `device` names where the rank computes ("cpu", "gpu", "cuda:0")."""
    rank: int = 0
    size: int = 1
    group: Any = None  # mx.distributed.Group: common/ cannot name the framework's type
    device: str = "cpu"
    collectives: Callable[[], Collectives] | None = None  # for the probe of the job's all-reduce (costmodel/probe.py)
    # --mesh (common/parallel/mesh.py): the world of each axis, this rank's group on it (launch.py's start_world)
    axes: dict[str, World] = field(default_factory=dict)
    device_mesh: Any = None  # torch: the DeviceMesh over these ranks, named by mesh axis (None: one axis, built by tp)

    @property
    def data_group(self) -> Any:
        """The group the ranks that read different samples sum over (Trainer.all_sum over "data"): the data
        axis's of a mesh, else the whole group."""
        data = next((self.axes[a] for a in DATA_AXES if a in self.axes), None)
        return self.group if data is None else data.group


ModelT = TypeVar("ModelT", contravariant=True)
RunT = TypeVar("RunT", covariant=True)
StepT = TypeVar("StepT", contravariant=True)
LossT = TypeVar("LossT")
GradsT = TypeVar("GradsT")
ArrayT = TypeVar("ArrayT")
CommT = TypeVar("CommT", contravariant=True)
StrategyT = TypeVar("StrategyT", covariant=True)


@dataclass
class ForwardBackwardResult(Generic[LossT, GradsT]):
    """What `Strategy.forward_backward` returns in both frameworks (the types: the module docstring). Nothing in
    it has been waited for: MLX stays lazy until the compiled update has run, torch's device queue is not drained."""
    losses: LossT
    grads: GradsT


class StrategyFacts(Protocol):
    """What the shared loop (common/train/loop.py) reads of a strategy."""

    @property
    def reduce_scatter(self) -> str | None:
        """fsdp: "native" | "all_sum_slice" (summary.json); None otherwise."""

    @property
    def full_state_on_every_rank(self) -> bool:
        """export_state's tensors are whole on every rank (fsdp: on rank 0 only)."""

    @property
    def loss_over(self) -> str:
        """The ranks whose loss sums add up to the step's: "data" (the data-parallel ranks; under tp each holds
        the whole sum) or "world" (pp: the last stage holds it, the others contribute 0); Trainer.all_sum's `over`."""

    def figures(self) -> dict[str, object]:
        """What the rank's status file records for this strategy beyond the common figures (pp: the bubble)."""


class Strategy(StrategyFacts, Protocol[ModelT, RunT, StepT, LossT, GradsT, ArrayT]):
    """How the ranks share one model: replicated (ddp), sharded (fsdp), each layer split (tp) or the layers
    split into stages (pp). Built as `cls(cfg, world, comm)` (`StrategyClass`): `comm` is the backend's
    CommCounter (its comm.py), which holds the stream collectives run on and counts the bytes they carry.

    Where the gradients are reduced differs, so each framework's `StepStrategy` (its step.py) adds one member:
    MLX reduces after the backward, `reduce_gradients(grads)`; torch's DDP and FSDP2 reduce inside it from
    hooks, and `keeps_grads` says whether the gradients must stay allocated between steps (DDP's bucket views)."""

    @property
    def communicates(self) -> bool:
        """The step reduces gradients apart from the backward (a phase of its own in the time breakdown)."""

    def wrap(self, model: ModelT, source: TensorSource) -> RunT:
        """Make a freshly built model this rank's part, in place, and load from `source` only the slices the
        rank keeps (`local_index`); returns what the step runs. The model arrives unmaterialised (MLX: lazy
        arrays never evaluated; torch: on the meta device), so a sharded rank never holds a whole tensor it
        does not keep: it shards first, then reads its slices (mlx_impl/load.py, torch_impl/load.py)."""

    def local_index(self, name: str, shape: tuple[int, ...]) -> Index | None:
        """The slice (common/checkpoint/tensorsource.py's Index) of the whole HF-named tensor of `shape` this
        rank keeps: () for all of it (ddp, replicated parts), None for nothing (pp: another stage's). The weights
        at `wrap` and the AdamW moments at `import_optimizer` are read through it."""

    def forward_backward(self, step: StepT, batches: Sequence[Batch], scale: float, phase: Phase = no_phase,
                         wait: bool = False, sync: bool = True) -> ForwardBackwardResult[LossT, GradsT]:
        """The forward and backward passes of a step's micro-batches on this rank, the gradients those of
        (sum of token losses) x scale. ddp, fsdp and tp run the micro-batches one after another (`MicroSteps`,
        each backend's microsteps.py); pp runs its pipeline schedule. `phase(name)` wraps each forward and
        backward, wait=True makes each wait for the device; sync=False skips the gradient reduction where the
        backward does it (torch; time breakdown only)."""

    def eval_losses(self, step: StepT, batches: Sequence[Batch]) -> LossT:
        """The forward passes alone (eval): this rank's token losses (pp: the last stage's, none elsewhere)."""

    def global_norm(self, grads: GradsT) -> ArrayT:
        """The whole model's gradient norm: replicated gradients counted once, pieces summed over ranks."""

    def export_state(self, weights: Mapping[str, ArrayT], exp_avg: Mapping[str, ArrayT],
                     exp_avg_sq: Mapping[str, ArrayT]) -> tuple[StateStream, StateStream, StateStream]:
        """(weights, exp_avg, exp_avg_sq) as streams of whole tensors under HF names, from this rank's own
        (under its parameter paths), gathered one at a time as they are iterated (collectives: every rank
        iterates all three, in order)."""

    def local_state(self, shapes: Mapping[str, tuple[int, ...]], weights: Mapping[str, ArrayT],
                    exp_avg: Mapping[str, ArrayT], exp_avg_sq: Mapping[str, ArrayT]) -> LocalState:
        """(weights, exp_avg, exp_avg_sq, where) of what this rank writes into a sharded checkpoint, numpy under
        HF names, and where each piece lies in the global tensor (common/checkpoint/sharded.py): its own shards
        and slices, a replicated tensor on rank 0 only; `shapes` the global shapes. No collectives."""


# The constructor every strategy class has, in both frameworks: (config, this rank's world, the backend's comm).
StrategyClass = Callable[[RunConfig, World, CommT], StrategyT]


class Trainer(Protocol):
    """What common/train/loop.py, breakdown.py and trace.py ask of a backend's step.py.

    Trainer(cfg, spec, weights, world) (`TrainerClass`): `weights` is a TensorSource
    (common/checkpoint/tensorsource.py), of which the rank reads only what its strategy keeps; arrays out are
    numpy."""

    @property
    def framework(self) -> str:
        """"mlx" | "torch"."""

    @property
    def device(self) -> object:
        """Where the rank computes; str() of it names it, e.g. "cpu", "gpu", "cuda:0"."""

    @property
    def state_is_immutable(self) -> bool:
        """export_state's arrays never change once exported (MLX arrays), so keeping them needs no copy
        (common/train/rescue.py); torch's optimizer updates its tensors in place."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def strategy(self) -> StrategyFacts: ...

    @property
    def tracer(self) -> type:
        """--trace (common/train/trace.py): the framework's Tracer class."""

    def train_step(self, batches: Sequence[Batch], lr: float, global_tokens: int, sync: bool = True,
                   phase: Phase = no_phase, wait: bool = False) -> tuple[float, float]:
        """One optimizer step -> (loss, grad_norm) as floats, after the work is done. sync=False skips the
        gradient reduction (time breakdown only: the ranks' weights part ways); `phase(name)` wraps each
        phase (forward and backward per micro-batch, communication, optimizer), and wait=True makes each
        phase wait for the device (common/train/breakdown.py, common/train/trace.py)."""

    def op_workloads(self, batch: Batch, grad_accum: int) -> dict[str, list[tuple[Callable[[], None], int]]]:
        """The op classes' workloads at this batch's shapes (common/train/opprofile.py): {class: [(run once and
        wait for the device, times per optimizer step)]}."""

    def eval_loss_sum(self, inputs: np.ndarray, targets: np.ndarray, mask: np.ndarray) -> float:
        """This rank's sum of token losses."""

    def all_sum(self, values: np.ndarray, over: str = "data") -> np.ndarray:
        """Summed over the data-parallel ranks (under tp that is the rank itself), or over="world": all."""

    def export_state(self) -> tuple[StateStream, StateStream, StateStream]:
        """(weights, exp_avg, exp_avg_sq) as streams of whole numpy tensors: on every rank where
        strategy.full_state_on_every_rank, else on rank 0 only (the others get None for each tensor).
        Every rank iterates all three, in order: each tensor is gathered by collectives when its turn comes,
        so a rank holds one whole tensor at a time (common/train/loop.py's checkpoint writes it and lets it go)."""

    def local_state(self) -> LocalState:
        """strategy.local_state of this rank's parameters and moments: what it writes of a sharded checkpoint."""

    def import_optimizer(self, exp_avg: TensorSource | Mapping[str, np.ndarray],
                         exp_avg_sq: TensorSource | Mapping[str, np.ndarray], step: int) -> None:
        """AdamW's moments under HF names (sources, or dicts of whole arrays), on every rank; each reads only the slices it keeps
        (strategy.local_index), as for the weights."""

    def peak_memory_bytes(self) -> int:
        """The framework's own peak."""

    def state_bytes(self) -> dict[str, int]:
        """{"params", "grads", "optimizer"}: bytes this rank holds."""

    def comm_bytes_per_step(self) -> int | None:
        """Bytes given to collectives by one training step, measured (None where not counted)."""


TrainerClass = Callable[[RunConfig, ModelSpec, TensorSource, World], Trainer]
