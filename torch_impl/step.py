"""One optimizer step in PyTorch: DDP with bucketed all-reduce, no_sync accumulation, clipped AdamW.

Precision (common/model/precision.py): the model computes in cfg.dtype from float32 master weights, so the
gradients, their all-reduce, the loss and the AdamW state are float32 whatever the dtype (no autocast).

The Trainer holds one strategy (common/train/protocols.py; `STRATEGIES` below is the only place that maps names
to classes): ddp wraps the model in DDP (ddp.py); fsdp shards it with FSDP2 (fsdp.py), which averages the
gradients the same way (a reduce-scatter divided by N instead of an all-reduce divided by N); tp splits
each layer (tp.py), pp splits the layers into stages (pp.py). The step asks the strategy, never which one it
is; the strategy runs the Trainer's model, bare or as wrapped (`model`, `wrapped`: microsteps.py's
StepFunctions).

The loss of a step is (sum of masked token losses on all ranks) / (global count of real target tokens),
so DP is exact even when ranks hold different numbers of real tokens (padding mode). Each rank scales
its loss by N / global_tokens; DDP then averages (divides the all-reduced sum by N).
Under tensor parallelism (tp.py) N is the data-parallel size, 1: every rank computes the whole loss and
holds the full gradient of its own pieces, so nothing is averaged.
"""
from __future__ import annotations

from typing import Callable, Mapping, Protocol, Sequence, cast

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

from common.checkpoint.sharded import LocalState
from common.checkpoint.tensorsource import TensorSource, as_source
from common.config import RunConfig
from common.model.spec import ModelSpec
from common.train.normalization import local_tokens, normalization
from common.train.protocols import Batch, Phase, StateStream, Strategy, StrategyClass, World, no_phase

from .comm import CommCounter, communication_stream
from .adamw import AdamW
from .ddp import Replicated
from .grads import clip_by_norm
from .load import filled_like, read_local
from .lora import attach
from .quantized import quantize_base
from .microsteps import Grads, StepFunctions, wait_for
from .model import Llama, cross_entropy, load_weights, token_loss_sum  # noqa: F401 (diagnose, tests)
from .opclasses import Workloads, workloads
from .optimizer import make_optimizer
from .trace import Tracer
from .zero import Zero1, Zero2

FRAMEWORK = "torch"


class StepStrategy(Strategy[Llama, nn.Module, StepFunctions, torch.Tensor, Grads, torch.Tensor], Protocol):
    """The Strategy protocol with torch's types, and the member only torch's step asks: whether the gradients
    must stay allocated between steps (DDP's bucket views), since DDP and FSDP2 reduce inside the backward."""

    @property
    def keeps_grads(self) -> bool: ...

    def optimizer(self, base: AdamW) -> AdamW:
        """The optimizer the Trainer steps: `base`, or (zero1, zero2) `base` on the rank's rows (zero.py)."""
        ...

    def state_bytes(self, model: nn.Module, optimizer: AdamW) -> dict[str, int]:
        """{"params", "grads", "optimizer"}: bytes this rank holds."""
        ...


def _sharding() -> StrategyClass[CommCounter, StepStrategy]:
    from .fsdp import Sharding
    return Sharding


def _tensor_parallel() -> StrategyClass[CommCounter, StepStrategy]:
    from .tp import TensorParallel
    return TensorParallel


def _pipeline() -> StrategyClass[CommCounter, StepStrategy]:
    from .pp import Pipeline
    return Pipeline


def _sequence_parallel() -> StrategyClass[CommCounter, StepStrategy]:
    from .cp import SequenceParallel
    return SequenceParallel


def _mesh() -> StrategyClass[CommCounter, StepStrategy]:
    from .mesh import mesh_strategy
    return mesh_strategy  # --mesh: the strategies of its axes, composed (mesh.py)


# Each strategy's class, imported when a run builds it (unlike MLX's step.py, whose strategies import nothing
# heavy): fsdp, tp, pp and meshes import torch.distributed.tensor or pipelining, and with them torch._dynamo,
# 1.1 s of every rank's start (AMD EPYC Zen 4) that a ddp rank has no use for. Typed, so that mypy (`make lint`)
# checks every class's constructor and members against StepStrategy.
STRATEGIES: dict[str, Callable[[], StrategyClass[CommCounter, StepStrategy]]] = {
    "ddp": lambda: Replicated, "fsdp": _sharding, "tp": _tensor_parallel, "pp": _pipeline, "mesh": _mesh,
    "zero1": lambda: Zero1, "zero2": lambda: Zero2, "cp": _sequence_parallel}


def strategy_for(cfg: RunConfig, world: World, comm: CommCounter) -> StepStrategy:
    return STRATEGIES[cfg.strategy]()(cfg, world, comm)


def _param_groups(model: nn.Module) -> list[dict[str, list[nn.Parameter]]]:
    """AdamW's parameter groups: sharded DTensors and plain tensors apart, since foreach kernels take one kind at
    a time (tp has both; every other strategy one kind, so one group)."""
    groups = [{"params": [p for p in model.parameters() if p.requires_grad and hasattr(p, "to_local") == sharded]}
              for sharded in (False, True)]  # to_local: a DTensor; frozen parameters (LoRA's base) in neither
    return [g for g in groups if g["params"]]


class Trainer:
    framework = FRAMEWORK
    tracer = Tracer  # --trace (common/train/trace.py)
    state_is_immutable = False  # AdamW updates in place: the last step is kept as a copy (rescue.py)

    def __init__(self, cfg: RunConfig, spec: ModelSpec, weights: TensorSource, world: World):
        self.rank, self.world_size, self.group = world.rank, world.size, world.group
        self.data_group = world.data_group  # what all_sum over "data" sums over (a mesh's data axis)
        # Ranks that read different samples and average gradients: all of them, except under tp.
        self.dp_size = cfg.data_parallel_size
        self.normalization = normalization(cfg.loss_normalization)  # the step's loss from its token losses
        self.device = torch.device(world.device)
        # None: gloo and NCCL choose their own streams (torch_impl/comm.py); the comm counts the first step's bytes.
        self.comm = CommCounter(communication_stream(cfg))
        self.stream = self.comm.stream
        self.strategy = strategy_for(cfg, world, self.comm)
        # Built on the meta device: the strategy shards it there, then allocates and loads only this rank's
        # part from the source (torch_impl/load.py), so a sharded rank never holds the whole model.
        with torch.device("meta"):
            self.model = Llama(spec, compute_dtype=cfg.dtype)
            quantize_base(self.model, cfg.base_storage, spec)  # the frozen base's storage (quantized.py)
            # What trains (common/model/lora.py): every parameter, or LoRA's adapters with the rest frozen (lora.py).
            attach(self.model, cfg.trained, spec)
        self.state_shapes = cfg.trained.state_shapes(spec)  # the state a checkpoint holds, under HF names
        self.trained = cfg.trained  # what the op classes differentiate (opclasses.py)
        self.grad_accum, self.grad_clip = cfg.grad_accum, cfg.grad_clip
        # The StepFunctions (microsteps.py) the strategies run: the bare model and what the step runs.
        self.wrapped: nn.Module = self.strategy.wrap(self.model, as_source(weights))
        if cfg.torch_compile:
            self.wrapped = cast(nn.Module, torch.compile(self.wrapped))  # an OptimizedModule
        # Adam or AdamW, bias-corrected or not (optimizer.py; torch's update, adamw.py)
        # (zero1 and zero2 run it on the rank's rows: zero.py)
        self.optimizer = self.strategy.optimizer(make_optimizer(cfg, _param_groups(self.model)))
        self.names = {p: n for n, p in self.model.named_parameters() if p.requires_grad}  # what trains

    def train_step(self, batches: Sequence[Batch], lr: float, global_tokens: int, sync: bool = True,
                   phase: Phase = no_phase, wait: bool = False) -> tuple[float, float]:
        """sync=False runs the bare model, whose gradient hooks never sync (time breakdown only: the ranks'
        weights part ways). `phase(name)` wraps each phase (common/train/protocols.py); wait=True ends each in a
        device sync: forward and backward per micro-batch, optimizer. DDP and FSDP sync the gradients inside
        the backward (their hooks), so there is no communication phase; the profiler shows it there."""
        # The gradients' scale: N / T (global-tokens) or 1 / (this rank's own count) (common/train/normalization.py).
        # The micro-batches' forward and backward: one after another (microsteps.py), or pp's schedule.
        own_tokens = local_tokens(batches)
        scale = self.normalization.gradient_scale(global_tokens, own_tokens, self.dp_size)
        passes = self.strategy.forward_backward(self, batches, scale, phase, wait, sync)
        loss_sum = passes.losses
        # (sum, sum / own count), float64 on the device: what this rank adds to the step's loss
        parts = torch.stack([loss_sum, loss_sum / own_tokens if own_tokens else torch.zeros_like(loss_sum)])
        with phase("optimizer"):
            grad_norm = self._update(passes.grads, lr)
            wait_for(wait, self.device)
        if sync and (self.dp_size if self.strategy.loss_over == "data" else self.world_size) > 1:
            # pp: the last stage holds the sum, the others add 0
            dist.all_reduce(parts, group=self.data_group if self.strategy.loss_over == "data" else None)
        summed = parts.cpu().numpy()  # waits for the device: the step is done
        return self.normalization.loss(summed, global_tokens, self.dp_size), grad_norm.item()

    def _update(self, grads: Grads, lr: float) -> torch.Tensor:
        # One global norm, in float64 (grads.py's norm_dtype): replicated gradients counted once, shards and tp
        # slices summed over ranks.
        grad_norm = self.strategy.global_norm(grads)
        if self.grad_clip > 0:
            clip_by_norm(grads, self.grad_clip, grad_norm)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=not self.strategy.keeps_grads)
        return grad_norm

    def op_workloads(self, batch: Batch, grad_accum: int) -> Workloads:
        """The op classes' workloads at this batch's shapes (opclasses.py), for common/train/opprofile.py."""
        return workloads(self, batch, grad_accum)

    @torch.no_grad()
    def eval_loss_sum(self, inputs: np.ndarray, targets: np.ndarray, mask: np.ndarray) -> float:
        """This rank's part of the sum (under pp: the last stage's, 0 elsewhere; strategy.loss_over)."""
        return self.strategy.eval_losses(self, [(inputs, targets, mask)]).item()

    def all_sum(self, values: np.ndarray, over: str = "data") -> np.ndarray:
        """Sum over the data-parallel ranks (under tp: this rank alone, which holds the whole sum), or
        over="world": over every rank."""
        if (self.dp_size if over == "data" else self.world_size) == 1:
            return np.asarray(values)
        tensor = torch.tensor(np.asarray(values, dtype=np.float64), device=self.device)
        dist.all_reduce(tensor, group=self.data_group if over == "data" else None)
        return tensor.cpu().numpy()

    def export_state(self) -> tuple[StateStream, StateStream, StateStream]:
        """HF-named weights and AdamW moments, full (strategy.full_state_on_every_rank says on which ranks).
        Every rank calls it: collectives."""
        return self.strategy.export_state(*self._named_state())

    def local_state(self) -> LocalState:
        """This rank's own pieces of the state, for a sharded checkpoint (strategy.local_state): no collectives."""
        return self.strategy.local_state(self.state_shapes, *self._named_state())

    def _named_state(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(parameters, exp_avg, exp_avg_sq) as this rank holds them, under HF names."""
        exp_avg, exp_avg_sq = {}, {}
        for param, name in self.names.items():
            state = self.optimizer.state.get(param) or {"exp_avg": torch.zeros_like(param),
                                                        "exp_avg_sq": torch.zeros_like(param)}
            exp_avg[name], exp_avg_sq[name] = state["exp_avg"], state["exp_avg_sq"]
        return {name: param for param, name in self.names.items()}, exp_avg, exp_avg_sq

    def import_optimizer(self, exp_avg: TensorSource | Mapping[str, np.ndarray],
                         exp_avg_sq: TensorSource | Mapping[str, np.ndarray], step: int) -> None:
        """The moments' slices this rank keeps, read as its weights were (strategy.local_index) and placed as
        the parameters are (DTensor shards or plain tensors)."""
        exp_avg, exp_avg_sq = as_source(exp_avg), as_source(exp_avg_sq)
        index = self.strategy.local_index
        for param, name in self.names.items():
            self.optimizer.state[param] = {
                "step": torch.tensor(float(step)),
                "exp_avg": filled_like(param, read_local(exp_avg, name, param, index)),
                "exp_avg_sq": filled_like(param, read_local(exp_avg_sq, name, param, index)),
            }

    def peak_memory_bytes(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        from common.metrics import peak_rss_bytes
        return peak_rss_bytes()  # on CPU the process's peak RSS is torch's peak

    def state_bytes(self) -> dict[str, int]:
        return self.strategy.state_bytes(self.model, self.optimizer)

    def comm_bytes_per_step(self) -> int | None:
        """Bytes given to collectives by one step's forward and backward passes (scalars left out)."""
        return self.comm.bytes_per_step(self.grad_accum)
