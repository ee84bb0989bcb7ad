"""One optimizer step in PyTorch: DDP with bucketed all-reduce, no_sync accumulation, clipped AdamW.

Precision (common/model/precision.py): the model computes in cfg.dtype from float32 master weights, so the
gradients, their all-reduce, the loss and the AdamW state are float32 whatever the dtype (no autocast).

The Trainer holds one strategy (common/train/protocols.py; `STRATEGIES` below is the only place that maps names
to classes): ddp wraps the model in DDP (ddp.py); fsdp shards it with FSDP2 (fsdp.py), which averages the
gradients the same way (a reduce-scatter divided by N instead of an all-reduce divided by N); tp splits
each layer (tp.py). The step asks the strategy, never which one it is.

The loss of a step is (sum of masked token losses on all ranks) / (global count of real target tokens),
so DP is exact even when ranks hold different numbers of real tokens (padding mode). Each rank scales
its loss by N / global_tokens; DDP then averages (divides the all-reduced sum by N).
Under tensor parallelism (tp.py) N is the data-parallel size, 1: every rank computes the whole loss and
holds the full gradient of its own pieces, so nothing is averaged.
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch
import torch.distributed as dist

from common.train.protocols import no_phase
from common.checkpoint.tensorsource import as_source
from common.model.weights import parameter_shapes

from .comm import communication_stream
from .ddp import Replicated, clip_by_norm, state_bytes
from .fsdp import Sharding
from .load import filled_like, read_local
from .model import Llama, cross_entropy, load_weights, token_loss_sum  # noqa: F401 (diagnose, tests)
from .pp import Pipeline
from .tp import TensorParallel
from .trace import Tracer

FRAMEWORK = "torch"
STRATEGIES = {"ddp": Replicated, "fsdp": Sharding, "tp": TensorParallel, "pp": Pipeline}


def strategy_for(cfg, world, device: torch.device):
    return STRATEGIES[cfg.strategy](cfg, world, device)


class Trainer:
    framework = FRAMEWORK
    tracer = Tracer  # --trace (common/train/trace.py)

    def __init__(self, cfg, spec, weights, world):
        self.rank, self.world_size, self.group = world.rank, world.size, world.group
        # Ranks that read different samples and average gradients: all of them, except under tp.
        self.dp_size = cfg.data_parallel_size
        self.device = torch.device(world.device)
        self.strategy = strategy_for(cfg, world, self.device)
        # Built on the meta device: the strategy shards it there, then allocates and loads only this rank's
        # part from the source (torch_impl/load.py), so a sharded rank never holds the whole model.
        with torch.device("meta"):
            self.model = Llama(spec, compute_dtype=cfg.dtype)
        self.grad_accum, self.grad_clip = cfg.grad_accum, cfg.grad_clip
        self.stream = communication_stream(cfg)  # None: gloo and NCCL choose their own (torch_impl/comm.py)
        self.wrapped = self.strategy.wrap(self.model, as_source(weights))
        if cfg.torch_compile:
            self.wrapped = torch.compile(self.wrapped)
        self.optimizer = torch.optim.AdamW(self.strategy.param_groups(self.model), lr=cfg.lr,
                                           betas=(cfg.beta1, cfg.beta2), eps=cfg.adam_eps,
                                           weight_decay=cfg.weight_decay)
        self.names = {p: n for n, p in self.model.named_parameters()}
        self.comm_bytes = None  # counted on the first step

    def train_step(self, batches, lr, global_tokens, sync=True, phase=no_phase, wait=False):
        """sync=False runs the bare model, whose gradient hooks never sync (time breakdown only: the ranks'
        weights part ways). `phase(name)` wraps each phase (common/train/protocols.py); wait=True ends each in a
        device sync: forward and backward per micro-batch, optimizer. DDP and FSDP sync the gradients inside
        the backward (their hooks), so there is no communication phase; the profiler shows it there."""
        scale = self.dp_size / global_tokens
        counter = self.strategy.comm_counter() if self.comm_bytes is None else contextlib.nullcontext()
        # The micro-batches' forward and backward: one after another (ddp.py's MicroSteps), or pp's schedule.
        loss_sum = self.strategy.forward_backward(self, batches, scale, phase, wait, sync=sync, counter=counter)
        if self.comm_bytes is None:
            self.comm_bytes = counter.bytes
        with phase("optimizer"):
            grad_norm = self._update(lr)
            self.wait(wait)
        if sync and (self.dp_size if self.strategy.loss_over == "data" else self.world_size) > 1:
            dist.all_reduce(loss_sum)  # pp: the last stage holds the sum, the others add 0
        loss = (loss_sum / global_tokens).item()  # .item() waits for the device: the step is done
        return loss, grad_norm.item()

    def _update(self, lr):
        # The norm in float64: clip_grad_norm_'s float32 norm of a big embedding gradient is off by ~3e-5
        # (measured on `small`), and the clip coefficient with it. MPS has no float64.
        wide = torch.float32 if self.device.type == "mps" else torch.float64
        params = list(self.model.parameters())
        # One global norm: replicated gradients counted once, shards and tp slices summed over ranks.
        grad_norm = self.strategy.global_norm(params, wide)
        if self.grad_clip > 0:
            clip_by_norm(params, self.grad_clip, grad_norm)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=not self.strategy.keeps_grads)
        return grad_norm

    def wait(self, wait=True):
        if not wait:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elif self.device.type == "mps":
            torch.mps.synchronize()

    @torch.no_grad()
    def eval_loss_sum(self, inputs, targets, mask):
        """This rank's part of the sum (under pp: the last stage's, 0 elsewhere; strategy.loss_over)."""
        return self.strategy.forward_backward(self, [(inputs, targets, mask)], None, backward=False).item()

    def all_sum(self, values, over="data"):
        """Sum over the data-parallel ranks (under tp: this rank alone, which holds the whole sum), or
        over="world": over every rank."""
        if (self.dp_size if over == "data" else self.world_size) == 1:
            return np.asarray(values)
        tensor = torch.tensor(np.asarray(values, dtype=np.float64), device=self.device)
        dist.all_reduce(tensor)
        return tensor.cpu().numpy()

    def export_state(self):
        """HF-named weights and AdamW moments, full (strategy.full_state_on_every_rank says on which ranks).
        Every rank calls it: collectives."""
        return self.strategy.export_state(*self._named_state())

    def local_state(self):
        """This rank's own pieces of the state, for a sharded checkpoint (strategy.local_state): no collectives."""
        return self.strategy.local_state(parameter_shapes(self.model.spec), *self._named_state())

    def _named_state(self):
        """(parameters, exp_avg, exp_avg_sq) as this rank holds them, under HF names."""
        exp_avg, exp_avg_sq = {}, {}
        for param, name in self.names.items():
            state = self.optimizer.state.get(param) or {"exp_avg": torch.zeros_like(param),
                                                        "exp_avg_sq": torch.zeros_like(param)}
            exp_avg[name], exp_avg_sq[name] = state["exp_avg"], state["exp_avg_sq"]
        return {name: param for param, name in self.names.items()}, exp_avg, exp_avg_sq

    def import_optimizer(self, exp_avg, exp_avg_sq, step):
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

    def peak_memory_bytes(self):
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        from common.metrics import peak_rss_bytes
        return peak_rss_bytes()  # on CPU the process's peak RSS is torch's peak

    def state_bytes(self):
        return state_bytes(self.model, self.optimizer)

    def comm_bytes_per_step(self):
        """Bytes given to all-reduce by one step's forward and backward passes (scalars left out)."""
        return self.comm_bytes

    def to_device(self, inputs, targets, mask):
        return (torch.from_numpy(inputs).long().to(self.device), torch.from_numpy(targets).long().to(self.device),
                torch.from_numpy(mask).to(self.device))
