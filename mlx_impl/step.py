"""One optimizer step in MLX: compiled forward/backward, bucketed gradient averaging, clipped AdamW.

Strategy ddp replicates the model; fsdp shards it (mlx_impl/fsdp.py: sharded gradients arrive
reduce-scattered from the backward, only the replicated ones are averaged here).

The loss of a step is (sum of masked token losses on all ranks) / (global count of real target tokens),
so DP is exact even when ranks hold different numbers of real tokens (padding mode). Each rank scales
its gradients by N / global_tokens; `nn.average_gradients` then divides the all-reduced sum by N.
"""
from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from . import fsdp
from .model import Llama, load_weights, weights_of

FRAMEWORK = "mlx"
LOSS_KEY = "__loss_sum__"  # rides along in the gradient all-reduce instead of a collective of its own


def token_loss_sum(model, inputs, targets, mask):
    logits = model(inputs).astype(mx.float32)
    return (nn.losses.cross_entropy(logits, targets, reduction="none") * mask).sum()


class Trainer:
    framework = FRAMEWORK

    def __init__(self, cfg, spec, weights, world):
        self.rank, self.world_size, self.group = world.rank, world.size, world.group
        world_size, group = world.size, world.group
        self.device = "gpu" if mx.default_device() == mx.gpu else "cpu"
        self.model = Llama(spec)
        load_weights(self.model, weights)
        self.sharding = sharding = (fsdp.shard_model(self.model, group, cfg.resolved_backend)
                                    if cfg.strategy == "fsdp" else None)
        self.reduce_scatter = sharding.reduce_scatter if sharding else None
        self._grad_bytes = 0
        self.optimizer = optim.AdamW(learning_rate=cfg.lr, betas=[cfg.beta1, cfg.beta2], eps=cfg.adam_eps,
                                     weight_decay=cfg.weight_decay, bias_correction=True)
        self.optimizer.init(self.model.trainable_parameters())
        mx.eval(self.model.parameters(), self.optimizer.state)
        grad_clip, reduce_bytes = cfg.grad_clip, int(cfg.all_reduce_size_mb * 2**20)
        loss_and_grad = nn.value_and_grad(self.model, token_loss_sum)

        def micro_step(inputs, targets, mask, scale):
            loss_sum, grads = loss_and_grad(self.model, inputs, targets, mask)
            return loss_sum, tree_map(lambda g: g * scale, grads)

        def update(grads, loss_sum):
            grads = dict(grads, **{LOSS_KEY: loss_sum})
            if sharding is not None:
                grads = sharding.average_gradients(grads, reduce_bytes)
            elif world_size > 1:
                grads = nn.average_gradients(grads, group=group, all_reduce_size=reduce_bytes)
            loss = grads.pop(LOSS_KEY)
            if sharding is not None:  # one global norm over shards and replicated gradients
                grads, grad_norm = sharding.clip_grad_norm(grads, grad_clip)
            elif grad_clip > 0:
                grads, grad_norm = optim.clip_grad_norm(grads, grad_clip)
            else:
                grad_norm = mx.sqrt(sum((g * g).sum() for _, g in tree_flatten(grads)))
            self.optimizer.update(self.model, grads)
            return loss, grad_norm

        # value_and_grad swaps traced parameters into the model, so every compiled function lists the
        # state as an output too: otherwise the model would be left holding placeholders.
        state = [self.model.state, self.optimizer.state]
        self._micro_step = mx.compile(micro_step, inputs=state, outputs=state)
        self._update = mx.compile(update, inputs=state, outputs=state)
        self._eval_sum = mx.compile(lambda x, y, m: token_loss_sum(self.model, x, y, m), inputs=state,
                                    outputs=state)

    def train_step(self, batches, lr, global_tokens):
        # scale = N / T: after averaging over N ranks the gradient is that of (sum of losses) / T.
        scale = mx.array(self.world_size / global_tokens, dtype=mx.float32)
        loss_sum, grads = None, None
        for inputs, targets, mask in batches:
            micro_loss, micro_grads = self._micro_step(mx.array(inputs), mx.array(targets), mx.array(mask), scale)
            micro_loss = micro_loss * scale
            if grads is None:
                loss_sum, grads = micro_loss, micro_grads
            else:  # accumulate lazily; DDP communicates only in `update` (FSDP: see fsdp.py)
                loss_sum, grads = loss_sum + micro_loss, tree_map(mx.add, grads, micro_grads)
        self._grad_bytes = _nbytes(grads)
        self.optimizer.learning_rate = mx.array(lr, dtype=mx.float32)
        loss, grad_norm = self._update(grads, loss_sum)
        mx.eval(loss, grad_norm, self.model.state, self.optimizer.state)  # the step is done when timed
        return loss.item(), grad_norm.item()

    def eval_loss_sum(self, inputs, targets, mask):
        return self._eval_sum(mx.array(inputs), mx.array(targets), mx.array(mask)).item()

    def all_sum(self, values):
        if self.world_size == 1:
            return np.asarray(values)
        # float32 on the wire: not every backend reduces float64.
        summed = mx.distributed.all_sum(mx.array(np.asarray(values, dtype=np.float32)), group=self.group)
        return np.array(summed, dtype=np.float64)

    def export_state(self):
        weights, flat = weights_of(self.model), dict(tree_flatten(self.optimizer.state))
        if self.sharding is not None:  # rank 0 gathers the shards, under HF names; the others get nothing
            weights, flat = self.sharding.full(weights), self.sharding.full(flat)
        # Views, not copies: MLX arrays are immutable, and a copy of the optimizer state costs its size again.
        exp_avg = {n: np.asarray(flat[f"{n}.m"]) for n in weights}
        exp_avg_sq = {n: np.asarray(flat[f"{n}.v"]) for n in weights}
        return weights, exp_avg, exp_avg_sq

    def import_optimizer(self, exp_avg, exp_avg_sq, step):
        if self.sharding is not None:  # this rank's slices, under its parameter paths
            paths = [k for k, _ in tree_flatten(self.model.parameters())]
            exp_avg, exp_avg_sq = self.sharding.local(exp_avg, paths), self.sharding.local(exp_avg_sq, paths)
        moments = [(f"{n}.m", mx.array(v)) for n, v in exp_avg.items()]
        moments += [(f"{n}.v", mx.array(v)) for n, v in exp_avg_sq.items()]
        state = self.optimizer.state
        for key, value in tree_flatten(tree_unflatten(moments)):
            _set_path(state, key.split("."), value)
        state["step"] = mx.array(step, dtype=mx.uint64)
        mx.eval(state)

    def peak_memory_bytes(self):
        return int(mx.get_peak_memory())

    def state_bytes(self):
        """Bytes of parameters, gradients (as the last update saw them) and optimizer state on this rank."""
        return {"params": _nbytes(self.model.parameters()), "grads": self._grad_bytes,
                "optimizer": _nbytes(self.optimizer.state)}


def _nbytes(tree):
    return sum(a.nbytes for _, a in tree_flatten(tree) if isinstance(a, mx.array))


def _set_path(tree, path, value):
    for part in path[:-1]:
        tree = tree[int(part)] if isinstance(tree, list) else tree[part]
    tree[path[-1]] = value
