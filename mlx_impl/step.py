"""One optimizer step in MLX: compiled forward/backward, bucketed gradient averaging, clipped AdamW.

Precision (common/model/precision.py): the model computes in cfg.dtype from float32 master weights, so the
gradients, their all-reduce and the AdamW state are float32 whatever the dtype.

The Trainer holds one strategy (common/train/protocols.py; `STRATEGIES` below is the only place that maps names
to classes): ddp replicates the model (ddp.py), fsdp shards it (fsdp.py: sharded gradients arrive
reduce-scattered from the backward, only the replicated ones are averaged after it), tp splits each layer
(tp.py), pp splits the layers into stages (pp.py). The step asks the strategy, never which one it is; the
strategy runs the Trainer's compiled micro-step and eval (`micro_step`, `eval_step`: microsteps.py's
StepFunctions).

The loss of a step is (sum of masked token losses on all ranks) / (global count of real target tokens),
so DP is exact even when ranks hold different numbers of real tokens (padding mode). Each rank scales
its gradients by N / global_tokens; `nn.average_gradients` then divides the all-reduced sum by N.

The reported loss is summed apart from the gradients, in float64 on the host (MLX has no float64 on
GPU; torch sums in float64 on the device): a float32 sum of thousands of token losses is off by ~1e-5,
enough to hide a real difference between frameworks or world sizes. For the same reason the gradient
norm, and so the clip coefficient, is a tree of short float32 sums rather than one flat sum.

Under tensor parallelism (tp.py) N is the data-parallel size, 1: every rank computes the whole loss and
holds the full gradient of its own pieces, so nothing is averaged.
"""
from __future__ import annotations

from typing import Mapping, Protocol, Sequence

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from common.checkpoint.sharded import LocalState
from common.checkpoint.tensorsource import TensorSource, as_source
from common.config import RunConfig
from common.model.spec import ModelSpec
from common.train.normalization import local_tokens, loss_parts, normalization
from common.train.protocols import Batch, Phase, StateStream, Strategy, StrategyClass, World, no_phase

from .comm import CommCounter, communication_stream
from .ddp import Replicated
from .fsdp import Sharding
from .grads import clip_by_norm
from .load import read_local
from .lora import attach
from .quantized import quantize_base
from .mesh import mesh_strategy
from .kernel_choice import choice_for
from .microsteps import Grads, Losses, StepFunctions
from .model import (Llama, cross_entropy, load_weights, set_attention, set_bf16_matmul,  # noqa: F401
                    set_cross_entropy, set_exp, token_loss_sum, weights_of)  # (benchmarks, tests)
from .opclasses import Workloads, workloads
from .optimizer import make_optimizer
from .pp import Pipeline
from .tp import TensorParallel
from .zero import Zero1, Zero2
from .cp import SequenceParallel
from .trace import Tracer

FRAMEWORK = "mlx"


class StepStrategy(Strategy[nn.Module, nn.Module, StepFunctions, Losses, Grads, mx.array], Protocol):
    """The Strategy protocol with MLX's types, and the member only MLX's step asks: the gradient reduction,
    which MLX runs after the backward (in the compiled update, or as the communication phase of its own)."""

    def reduce_gradients(self, grads: Grads) -> Grads:
        """The step's gradient reduction (ddp: all of them; fsdp: the replicated ones; tp, pp: none; zero1, zero2:
        all of them, to the rank's rows)."""
        ...

    def optimizer(self, base: optim.Optimizer) -> optim.Optimizer:
        """The optimizer the Trainer steps: `base`, or (zero1, zero2) `base` on the rank's rows (zero.py)."""
        ...

    def state_bytes(self, model: nn.Module, optimizer: optim.Optimizer) -> dict[str, int]:
        """{"params", "grads", "optimizer"}: bytes this rank holds."""
        ...


# Typed so that mypy (`make lint`) checks every class's constructor and members against StepStrategy.
STRATEGIES: dict[str, StrategyClass[CommCounter, StepStrategy]] = {
    "ddp": Replicated, "fsdp": Sharding, "tp": TensorParallel, "pp": Pipeline, "zero1": Zero1, "zero2": Zero2,
    "cp": SequenceParallel,
    "mesh": mesh_strategy}  # --mesh: the strategies of its axes, composed (mesh.py)


def strategy_for(cfg: RunConfig, world: World, comm: CommCounter) -> StepStrategy:
    return STRATEGIES[cfg.strategy](cfg, world, comm)


def _exact_sum(arrays: Losses) -> float:
    return float(sum(np.array(a, dtype=np.float64).sum() for a in arrays))


class Trainer:
    framework = FRAMEWORK
    tracer = Tracer  # --trace (common/train/trace.py)
    state_is_immutable = True  # MLX arrays never change: the last step is kept without a copy (rescue.py)

    def __init__(self, cfg: RunConfig, spec: ModelSpec, weights: TensorSource, world: World):
        self.rank, self.world_size, self.group = world.rank, world.size, world.group
        self.data_group = world.data_group  # what all_sum over "data" sums over (a mesh's data axis)
        # Ranks that read different samples and average gradients: all of them, except under tp.
        self.dp_size = cfg.data_parallel_size
        self.normalization = normalization(cfg.loss_normalization)  # the step's loss from its token losses
        self.device = "gpu" if mx.default_device() == mx.gpu else "cpu"
        # Collectives run on the CPU stream on a Metal GPU (mlx_impl/comm.py); the comm counts their bytes.
        self.comm = CommCounter(communication_stream(cfg))
        self.stream = self.comm.stream
        self.strategy = strategy = strategy_for(cfg, world, self.comm)
        # Built unevaluated (MLX is lazy): the strategy cuts it to this rank's part and loads only that
        # from the source (mlx_impl/load.py), so the whole model is never materialised on a sharded rank.
        # Which exp and bf16 matmul, before anything is compiled: auto's measured choice, which the launcher
        # cached for this machine and these shapes (kernel_choice.py; measured here where it did not).
        set_exp(choice_for(cfg, spec, "exp")[0])
        set_bf16_matmul(choice_for(cfg, spec, "bf16_matmul")[0])
        set_cross_entropy(choice_for(cfg, spec, "cross_entropy")[0])
        set_attention(choice_for(cfg, spec, "attention")[0])
        self.model = Llama(spec, compute_dtype=cfg.dtype)
        quantize_base(self.model, cfg.base_storage, spec)  # the frozen base's storage (quantized.py)
        # What trains (common/model/lora.py): every parameter, or LoRA's adapters with the rest frozen (lora.py).
        attach(self.model, cfg.trained, spec)
        self.state_shapes = cfg.trained.state_shapes(spec)  # the state a checkpoint holds, under HF names
        self.trained = cfg.trained  # what the op classes differentiate (opclasses.py)
        strategy.wrap(self.model, as_source(weights))
        # Adam or AdamW, bias-corrected or not (optimizer.py); zero1 and zero2 run it on the rank's rows (zero.py)
        self.optimizer = strategy.optimizer(make_optimizer(cfg))
        self.optimizer.init(self.model.trainable_parameters())
        mx.eval(self.model.parameters(), self.optimizer.state)
        self.grad_accum = cfg.grad_accum
        self.grad_clip = grad_clip = cfg.grad_clip
        loss_and_grad = nn.value_and_grad(self.model, token_loss_sum)

        def micro_step(inputs, targets, mask, scale):
            (_, losses), grads = loss_and_grad(self.model, inputs, targets, mask)
            return losses, tree_map(lambda g: g * scale, grads)

        def make_update(sync: bool):
            def update(grads):
                if sync:
                    grads = strategy.reduce_gradients(grads)
                # One global norm: replicated gradients counted once, shards and tp slices summed over ranks.
                grad_norm = strategy.global_norm(grads)
                if grad_clip > 0:
                    grads = clip_by_norm(grads, grad_clip, grad_norm)
                self.optimizer.update(self.model, grads)
                return grad_norm
            return update

        # value_and_grad swaps traced parameters into the model, so every compiled function lists the
        # state as an output too: otherwise the model would be left holding placeholders.
        state = [self.model.state, self.optimizer.state]
        # The StepFunctions (microsteps.py) the strategies run.
        self.micro_step = self.comm.attribute("micro_step", mx.compile(micro_step, inputs=state, outputs=state))
        self.eval_step = mx.compile(lambda x, y, m: token_loss_sum(self.model, x, y, m)[1], inputs=state,
                                    outputs=state)
        self._update = {True: self.comm.attribute("update", mx.compile(make_update(True), inputs=state, outputs=state)),
                        False: mx.compile(make_update(False), inputs=state, outputs=state)}

    def train_step(self, batches: Sequence[Batch], lr: float, global_tokens: int, sync: bool = True,
                   phase: Phase = no_phase, wait: bool = False) -> tuple[float, float]:
        """sync=False skips the gradient sync (time breakdown only: the ranks' weights part ways).
        `phase(name)` wraps each phase (common/train/protocols.py); wait=True ends each in mx.eval: forward (a
        micro-batch's losses), backward (the rest of its gradients: the compiled micro-step's graph is then
        evaluated in two parts, and kernels it fused across the two run in forward), communication (the
        gradient sync, run apart from the update to time it, uncompiled so that it stays out of the per-call
        byte counts of comm_bytes_per_step; under fsdp the shards' reduce-scatter is in backward), optimizer."""
        # scale = N / T (N data-parallel ranks; global-tokens): after averaging, the gradient is that of (sum of
        # losses) / T; per-rank: 1 / (this rank's own count) (common/train/normalization.py).
        # The micro-batches' forward and backward: one after another (microsteps.py), or pp's schedule.
        own_tokens = local_tokens(batches)
        scale = self.normalization.gradient_scale(global_tokens, own_tokens, self.dp_size)
        passes = self.strategy.forward_backward(self, batches, scale, phase, wait, sync)
        token_losses, grads = passes.losses, passes.grads
        update_syncs = sync
        if wait and sync and self.strategy.communicates:
            with phase("communication"):
                grads = self.strategy.reduce_gradients(grads)
                mx.eval(grads)
            update_syncs = False  # reduced already: the update must not reduce twice
        with phase("optimizer"):
            self.optimizer.learning_rate = mx.array(lr, dtype=mx.float32)
            grad_norm = self._update[update_syncs](grads)
            mx.eval(grad_norm, token_losses, self.model.state, self.optimizer.state)  # the step is done when timed
        local = loss_parts(_exact_sum(token_losses), own_tokens)
        summed = self.all_sum(local, over=self.strategy.loss_over) if sync else local
        return self.normalization.loss(summed, global_tokens, self.dp_size), grad_norm.item()

    def op_workloads(self, batch: Batch, grad_accum: int) -> Workloads:
        """The op classes' workloads at this batch's shapes (opclasses.py), for common/train/opprofile.py."""
        return workloads(self, batch, grad_accum)

    def eval_loss_sum(self, inputs: np.ndarray, targets: np.ndarray, mask: np.ndarray) -> float:
        """This rank's part of the sum (under pp: the last stage's, 0 elsewhere; strategy.loss_over)."""
        return _exact_sum(self.strategy.eval_losses(self, [(inputs, targets, mask)]))

    def all_sum(self, values: np.ndarray, over: str = "data") -> np.ndarray:
        """Sum over the data-parallel ranks (under tp: this rank alone, which holds the whole sum), or
        over="world": over every rank."""
        values = np.asarray(values, dtype=np.float64)
        if (self.dp_size if over == "data" else self.world_size) == 1:
            return values
        # float32 on the wire (not every backend reduces float64), yet exact: each rank sends its values
        # as float32 pairs (hi + lo = the float64 to 48 bits) in slots of its own, so the all-reduce
        # adds only zeros, and the host sums the ranks' pairs in float64.
        group = self.data_group if over == "data" else self.group
        hi = values.astype(np.float32)
        slots = np.zeros((group.size(), 2, *values.shape), dtype=np.float32)
        slots[group.rank()] = hi, (values - hi).astype(np.float32)
        summed = mx.distributed.all_sum(mx.array(slots), group=group, stream=self.stream)
        return np.array(summed, dtype=np.float64).sum(axis=(0, 1))

    def export_state(self) -> tuple[StateStream, StateStream, StateStream]:
        """HF-named weights and AdamW moments, full (strategy.full_state_on_every_rank says on which ranks).
        Every rank calls it: collectives."""
        return self.strategy.export_state(*self._named_state())

    def local_state(self) -> LocalState:
        """This rank's own pieces of the state, for a sharded checkpoint (strategy.local_state): no collectives.
        The strategy hands on float32 numpy views of the rank's own arrays, not copies: saving adds nothing to
        the peak."""
        return self.strategy.local_state(self.state_shapes, *self._named_state())

    def _named_state(self) -> tuple[dict[str, mx.array], dict[str, mx.array], dict[str, mx.array]]:
        """(parameters, exp_avg, exp_avg_sq) of what trains, as this rank holds them, under its parameter paths."""
        weights = dict(tree_flatten(self.model.trainable_parameters()))
        state = dict(tree_flatten(self.optimizer.state))
        return weights, {k: state[f"{k}.m"] for k in weights}, {k: state[f"{k}.v"] for k in weights}

    def import_optimizer(self, exp_avg: TensorSource | Mapping[str, np.ndarray],
                         exp_avg_sq: TensorSource | Mapping[str, np.ndarray], step: int) -> None:
        """The moments' slices this rank keeps, read as its weights were (strategy.local_index)."""
        shapes = {k: v.shape for k, v in tree_flatten(self.model.trainable_parameters())}  # this rank's paths, shapes
        moments = [(f"{path}.{key}", mx.array(value))
                   for key, source in (("m", exp_avg), ("v", exp_avg_sq))
                   for path, value in read_local(as_source(source), shapes, self.strategy.local_index)]
        state = self.optimizer.state
        for key, value in tree_flatten(tree_unflatten(moments)):
            _set_path(state, key.split("."), value)
        state["step"] = mx.array(step, dtype=mx.uint64)
        mx.eval(state)

    def peak_memory_bytes(self) -> int:
        return int(mx.get_peak_memory())

    def state_bytes(self) -> dict[str, int]:
        return self.strategy.state_bytes(self.model, self.optimizer)

    def comm_bytes_per_step(self) -> int | None:
        """Bytes given to all-reduce by one step's micro-steps and update (scalars left out)."""
        return self.comm.bytes_per_step(self.grad_accum)


def _set_path(tree, path, value):
    for part in path[:-1]:
        tree = tree[int(part)] if isinstance(tree, list) else tree[part]
    tree[path[-1]] = value
