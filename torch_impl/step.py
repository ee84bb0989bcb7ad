"""One optimizer step in PyTorch: DDP with bucketed all-reduce, no_sync accumulation, clipped AdamW.

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
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from . import tp
from .model import Llama, load_weights, weights_of

FRAMEWORK = "torch"


def token_loss_sum(model, inputs, targets, mask):
    logits = model(inputs).float()
    losses = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
    return (losses * mask.reshape(-1)).sum()


class Trainer:
    framework = FRAMEWORK

    def __init__(self, cfg, spec, weights, world):
        self.rank, self.world_size, self.group = world.rank, world.size, world.group
        # Ranks that read different samples and average gradients: all of them, except under tp.
        self.strategy, self.dp_size = cfg.strategy, cfg.data_parallel_size
        self.device = torch.device(world.device)
        self.model = Llama(spec)
        load_weights(self.model, weights)
        self.model.to(self.device)
        self.tp = tp.TensorParallel(self.device) if cfg.strategy == "tp" else None
        if self.tp:
            self.tp.parallelize(self.model)
        self.autocast = cfg.dtype == "bfloat16" and self.device.type == "cuda"
        self.grad_accum, self.grad_clip = cfg.grad_accum, cfg.grad_clip
        self.wrapped = self.model
        if self.dp_size > 1:
            self.wrapped = DDP(self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                               bucket_cap_mb=cfg.bucket_cap_mb, gradient_as_bucket_view=True,
                               # no_sync() and a static graph do not mix; accumulation needs the former.
                               static_graph=cfg.grad_accum == 1)
        if cfg.torch_compile:
            self.wrapped = torch.compile(self.wrapped)
        # Sharded DTensors and plain tensors in separate groups: foreach kernels take one kind at a time.
        groups = [{"params": [p for p in self.model.parameters() if isinstance(p, tp.DTensor) == sharded]}
                  for sharded in (False, True)]
        self.optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                           eps=cfg.adam_eps, weight_decay=cfg.weight_decay)
        self.names = {p: n for n, p in self.model.named_parameters()}
        self.comm_bytes = None  # counted on the first step

    def _forward_loss(self, inputs, targets, mask):
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            return token_loss_sum(self.wrapped, inputs, targets, mask)

    def train_step(self, batches, lr, global_tokens):
        scale = self.dp_size / global_tokens
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        counter = tp.CommCounter() if self.comm_bytes is None and self.tp else contextlib.nullcontext()
        for i, (inputs, targets, mask) in enumerate(batches):
            last = i == len(batches) - 1
            # Communicate only on the micro-step that ends the optimizer step.
            sync = contextlib.nullcontext() if last or self.dp_size == 1 else self.wrapped.no_sync()
            with sync, counter:
                micro = self._forward_loss(*self._to_device(inputs, targets, mask))
                (micro * scale).backward()
            loss_sum += micro.detach().double()
        if self.comm_bytes is None and self.tp:
            self.comm_bytes = counter.bytes
        elif self.comm_bytes is None and self.strategy == "ddp":
            # DDP all-reduces every gradient once, in C++ buckets no dispatch mode sees: count their sizes.
            self.comm_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters()) * (self.dp_size > 1)
        if self.tp:
            grad_norm = self.tp.clip_grad_norm_(list(self.model.parameters()), self.grad_clip)
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                                       self.grad_clip if self.grad_clip > 0 else float("inf"))
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=self.dp_size == 1)  # DDP's bucket views must stay allocated
        if self.dp_size > 1:
            dist.all_reduce(loss_sum)
        loss = (loss_sum / global_tokens).item()  # .item() waits for the device: the step is done
        return loss, grad_norm.item()

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
        """Full HF-named weights and moments on every rank (every rank calls it: tp gathers)."""
        exp_avg, exp_avg_sq = {}, {}
        for param, name in self.names.items():
            state = self.optimizer.state.get(param, {})
            zeros = torch.zeros_like(param)
            exp_avg[name] = state["exp_avg"] if state else zeros
            exp_avg_sq[name] = state["exp_avg_sq"] if state else zeros
        if self.tp:
            params = {name: param for param, name in self.names.items()}
            return self.tp.gather(params), self.tp.gather(exp_avg), self.tp.gather(exp_avg_sq)
        numpy = lambda named: {n: t.detach().cpu().numpy() for n, t in named.items()}  # noqa: E731
        return weights_of(self.model), numpy(exp_avg), numpy(exp_avg_sq)

    def import_optimizer(self, exp_avg, exp_avg_sq, step):
        if self.tp:
            exp_avg, exp_avg_sq = self.tp.shard(exp_avg), self.tp.shard(exp_avg_sq)
        tensor = lambda v: torch.from_numpy(np.array(v)) if isinstance(v, np.ndarray) else v  # noqa: E731
        for param, name in self.names.items():
            self.optimizer.state[param] = {
                "step": torch.tensor(float(step)),
                "exp_avg": tensor(exp_avg[name]).to(self.device),
                "exp_avg_sq": tensor(exp_avg_sq[name]).to(self.device),
            }

    def peak_memory_bytes(self):
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        from common.metrics import peak_rss_bytes
        return peak_rss_bytes()  # on CPU the process's peak RSS is torch's peak

    def state_bytes(self):
        """Bytes of training state this rank holds: parameters, their gradients (as many, at the step's
        peak), optimizer moments."""
        params = sum(tp.local_nbytes(p) for p in self.model.parameters() if p.requires_grad)
        optimizer = sum(tp.local_nbytes(v) for state in self.optimizer.state.values() for v in state.values()
                        if torch.is_tensor(v))
        return {"params": params, "grads": params, "optimizer": optimizer}

    def comm_bytes_per_step(self):
        """Bytes given to all-reduce by one step's forward and backward passes (scalars left out)."""
        return self.comm_bytes

    def _to_device(self, inputs, targets, mask):
        return (torch.from_numpy(inputs).long().to(self.device), torch.from_numpy(targets).long().to(self.device),
                torch.from_numpy(mask).to(self.device))
