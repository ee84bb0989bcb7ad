"""One optimizer step in PyTorch: DDP with bucketed all-reduce, no_sync accumulation, clipped AdamW.

Precision (common/precision.py): the model computes in cfg.dtype from float32 master weights, so the
gradients, their all-reduce, the loss and the AdamW state are float32 whatever the dtype (no autocast).

Strategy ddp wraps the model in DDP; fsdp shards it with FSDP2 (torch_impl/fsdp.py), which averages the
gradients the same way (a reduce-scatter divided by N instead of an all-reduce divided by N).

The loss of a step is (sum of masked token losses on all ranks) / (global count of real target tokens),
so DP is exact even when ranks hold different numbers of real tokens (padding mode). Each rank scales
its loss by N / global_tokens; DDP then averages (divides the all-reduced sum by N).
Under tensor parallelism (tp.py) N is the data-parallel size, 1: every rank computes the whole loss and
holds the full gradient of its own pieces, so nothing is averaged.
"""
from __future__ import annotations

import contextlib
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from . import fsdp, tp
from .comm import communication_stream
from .model import Llama, load_weights, weights_of
from .trace import Tracer

FRAMEWORK = "torch"


def token_loss_sum(model, inputs, targets, mask):
    """The sum of the masked token losses, in float64: a float32 sum of thousands of losses is off by
    ~1e-6 of the mean, as much as a real difference between world sizes. The gradients do not change:
    the float64 part only sums, and its gradient is cast back to float32 exactly."""
    losses = cross_entropy(model(inputs).float(), targets)
    wide = torch.float32 if losses.device.type == "mps" else torch.float64  # MPS has no float64
    return (losses.to(wide) * mask.reshape(-1)).sum()


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy, flattened. torch's log-softmax kernels are fused and vectorised already;
    mlx_impl/step.py writes its cross_entropy out so MLX's compiler can fuse it (and skip an exp pass)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")


class Trainer:
    framework = FRAMEWORK
    tracer = Tracer  # --trace (common/trace.py)

    def __init__(self, cfg, spec, weights, world):
        self.rank, self.world_size, self.group = world.rank, world.size, world.group
        # Ranks that read different samples and average gradients: all of them, except under tp.
        self.strategy, self.dp_size = cfg.strategy, cfg.data_parallel_size
        self.device = torch.device(world.device)
        self.model = Llama(spec, compute_dtype=cfg.dtype)
        load_weights(self.model, weights)
        self.model.to(self.device)
        self.grad_accum, self.grad_clip = cfg.grad_accum, cfg.grad_clip
        self.stream = communication_stream(cfg)  # None: gloo and NCCL choose their own (torch_impl/comm.py)
        self.sharding = (fsdp.shard_model(self.model, self.device, cfg.resolved_backend)
                         if cfg.strategy == "fsdp" else None)
        self.reduce_scatter = self.sharding.reduce_scatter if self.sharding else None
        self.tp = tp.TensorParallel(self.device) if cfg.strategy == "tp" else None
        if self.tp:
            self.tp.parallelize(self.model)
        self.wrapped = self.model
        if self.dp_size > 1 and cfg.strategy == "ddp":
            self.wrapped = DDP(self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                               bucket_cap_mb=cfg.bucket_cap_mb, gradient_as_bucket_view=True,
                               # no_sync() and a static graph do not mix; accumulation needs the former.
                               static_graph=cfg.grad_accum == 1)
        if cfg.torch_compile:
            self.wrapped = torch.compile(self.wrapped)
        # tp: sharded DTensors and plain tensors in separate groups (foreach kernels take one kind at a time).
        groups = [{"params": [p for p in self.model.parameters() if isinstance(p, tp.DTensor) == sharded]}
                  for sharded in (False, True)] if self.tp else [{"params": list(self.model.parameters())}]
        self.optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr,
                                           betas=(cfg.beta1, cfg.beta2), eps=cfg.adam_eps,
                                           weight_decay=cfg.weight_decay)
        self.names = {p: n for n, p in self.model.named_parameters()}
        self.comm_bytes = None  # counted on the first step

    def train_step(self, batches, lr, global_tokens, sync=True):
        """sync=False skips the gradient all-reduce (time breakdown only: the ranks' weights part ways)."""
        loss_sum = self._gradients(batches, global_tokens, self.wrapped if sync else self.model)
        grad_norm = self._update(lr)
        if self.dp_size > 1 and sync:
            dist.all_reduce(loss_sum)
        loss = (loss_sum / global_tokens).item()  # .item() waits for the device: the step is done
        return loss, grad_norm.item()

    def _gradients(self, batches, global_tokens, model):
        """`model`: the DDP wrapper, or the bare model, which runs no gradient hooks and so never syncs."""
        scale = self.dp_size / global_tokens
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        counter = tp.CommCounter() if self.comm_bytes is None and self.tp else contextlib.nullcontext()
        for i, (inputs, targets, mask) in enumerate(batches):
            last = i == len(batches) - 1
            # Communicate only on the micro-step that ends the optimizer step.
            sync = (contextlib.nullcontext() if last or model is not self.wrapped or self.dp_size == 1
                    else (self.sharding or self.wrapped).no_sync())
            with sync, counter:
                micro = token_loss_sum(model, *self._to_device(inputs, targets, mask))
                (micro * scale).backward()
            loss_sum += micro.detach()
        if self.comm_bytes is None and self.tp:
            self.comm_bytes = counter.bytes
        elif self.comm_bytes is None and self.strategy == "ddp":
            # DDP all-reduces every gradient once, in C++ buckets no dispatch mode sees: count their sizes.
            self.comm_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters()) * (self.dp_size > 1)
        return loss_sum

    def _update(self, lr):
        # The norm in float64: clip_grad_norm_'s float32 norm of a big embedding gradient is off by ~3e-5
        # (measured on `small`), and the clip coefficient with it. MPS has no float64.
        wide = torch.float32 if self.device.type == "mps" else torch.float64
        params = list(self.model.parameters())
        if self.tp:  # tp slices' squares summed over the ranks, replicated ones counted once; clips in place
            grad_norm = self.tp.clip_grad_norm_(params, self.grad_clip, wide)
        else:
            if self.sharding is not None:  # the shards' squares summed over the ranks: each element once
                grad_norm = self.sharding.global_norm(params, wide)
            else:
                grad_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad, dtype=wide)
                                                                  for p in params if p.grad is not None]))
            if self.grad_clip > 0:
                torch.nn.utils.clip_grads_with_norm_(params, self.grad_clip, grad_norm)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        # DDP's bucket views must stay allocated; FSDP2 frees its sharded gradients.
        self.optimizer.zero_grad(set_to_none=self.strategy != "ddp" or self.dp_size == 1)
        return grad_norm

    def profile_step(self, batches, lr, global_tokens):
        """One step without gradient sync that waits for each phase (common/breakdown.py): forward from a
        forward-only pass, backward as forward+backward minus it, then the update."""
        start = time.perf_counter()
        with torch.no_grad():
            for inputs, targets, mask in batches:
                token_loss_sum(self.model, *self._to_device(inputs, targets, mask)).item()
        forward = time.perf_counter() - start
        t = time.perf_counter()
        self._gradients(batches, global_tokens, self.model).item()
        self._wait()
        forward_backward = time.perf_counter() - t
        t = time.perf_counter()
        self._update(lr).item()
        self._wait()
        optimizer = time.perf_counter() - t
        return {"forward": forward, "backward": max(0.0, forward_backward - forward), "optimizer": optimizer,
                "total": time.perf_counter() - start - forward}  # the extra forward pass is not part of a step

    def trace_step(self, batches, lr, global_tokens, span):
        """One synced step whose phases each run inside `span(name)` and end in a device sync
        (common/trace.py): forward and backward per micro-batch, optimizer. DDP and FSDP sync the gradients
        inside the backward (their hooks), so there is no communication phase; the profiler shows it there."""
        scale = self.dp_size / global_tokens
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for i, (inputs, targets, mask) in enumerate(batches):
            last = i == len(batches) - 1
            sync = (contextlib.nullcontext() if last or self.dp_size == 1
                    else (self.sharding or self.wrapped).no_sync())
            with sync:
                with span("forward"):
                    micro = token_loss_sum(self.wrapped, *self._to_device(inputs, targets, mask))
                    self._wait()
                with span("backward"):
                    (micro * scale).backward()
                    self._wait()
            loss_sum += micro.detach()
        with span("optimizer"):
            grad_norm = self._update(lr)
            self._wait()
        if self.dp_size > 1:
            dist.all_reduce(loss_sum)
        return (loss_sum / global_tokens).item(), grad_norm.item()

    def _wait(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elif self.device.type == "mps":
            torch.mps.synchronize()

    @torch.no_grad()
    def eval_loss_sum(self, inputs, targets, mask):
        return token_loss_sum(self.model, *self._to_device(inputs, targets, mask)).item()

    def all_sum(self, values, over="data"):
        """Sum over the data-parallel ranks (under tp: this rank alone, which holds the whole sum), or
        over="world": over every rank."""
        if (self.dp_size if over == "data" else self.world_size) == 1:
            return np.asarray(values)
        tensor = torch.tensor(np.asarray(values, dtype=np.float64), device=self.device)
        dist.all_reduce(tensor)
        return tensor.cpu().numpy()

    def export_state(self):
        """HF-named weights and AdamW moments: whole on every rank (tp gathers its slices), except under fsdp,
        where rank 0 gathers them and the other ranks get empty dicts. Every rank calls it: collectives."""
        exp_avg, exp_avg_sq = {}, {}
        for param, name in self.names.items():
            state = self.optimizer.state.get(param) or {"exp_avg": torch.zeros_like(param),
                                                        "exp_avg_sq": torch.zeros_like(param)}
            exp_avg[name], exp_avg_sq[name] = state["exp_avg"], state["exp_avg_sq"]
        params = {name: param for param, name in self.names.items()}
        if self.sharding is not None:
            full = self.sharding.full
            return full(params), full(exp_avg), full(exp_avg_sq)
        if self.tp:
            return self.tp.gather(params), self.tp.gather(exp_avg), self.tp.gather(exp_avg_sq)
        return weights_of(self.model), _numpy(exp_avg), _numpy(exp_avg_sq)

    def import_optimizer(self, exp_avg, exp_avg_sq, step):
        if self.sharding is not None:  # this rank's shards, placed as the parameters are
            params = {n: p for p, n in self.names.items()}
            exp_avg, exp_avg_sq = self.sharding.local(exp_avg, params), self.sharding.local(exp_avg_sq, params)
        if self.tp:
            exp_avg, exp_avg_sq = self.tp.shard(exp_avg), self.tp.shard(exp_avg_sq)
        for param, name in self.names.items():
            self.optimizer.state[param] = {
                "step": torch.tensor(float(step)),
                "exp_avg": _tensor(exp_avg[name]).to(self.device),
                "exp_avg_sq": _tensor(exp_avg_sq[name]).to(self.device),
            }

    def peak_memory_bytes(self):
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        from common.metrics import peak_rss_bytes
        return peak_rss_bytes()  # on CPU the process's peak RSS is torch's peak

    def state_bytes(self):
        """Bytes of parameters, gradients and optimizer state on this rank. A gradient has its parameter's
        shape on this rank (a shard under fsdp, a slice under tp), so the two take the same bytes."""
        optimizer = sum(_local(t).nbytes for state in self.optimizer.state.values() for t in state.values()
                        if isinstance(t, torch.Tensor))
        params = sum(_local(p).nbytes for p in self.model.parameters() if p.requires_grad)
        return {"params": params, "grads": params, "optimizer": optimizer}

    def comm_bytes_per_step(self):
        """Bytes given to all-reduce by one step's forward and backward passes (scalars left out)."""
        return self.comm_bytes

    def _to_device(self, inputs, targets, mask):
        return (torch.from_numpy(inputs).long().to(self.device), torch.from_numpy(targets).long().to(self.device),
                torch.from_numpy(mask).to(self.device))


def _local(tensor):
    """What this rank holds of a tensor: its shard of a DTensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _numpy(flat):
    return {k: v.detach().cpu().numpy() for k, v in flat.items()}


def _tensor(value):
    return value if isinstance(value, torch.Tensor) else torch.from_numpy(np.array(value))
