"""One optimizer step in MLX: compiled forward/backward, bucketed gradient averaging, clipped AdamW.

The loss of a step is (sum of masked token losses on all ranks) / (global count of real target tokens),
so DP is exact even when ranks hold different numbers of real tokens (padding mode). Each rank scales
its gradients by N / global_tokens; `nn.average_gradients` then divides the all-reduced sum by N.
Under tensor parallelism (tp.py) N is the data-parallel size, 1: every rank computes the whole loss and
holds the full gradient of its own pieces, so nothing is averaged.
"""
from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from . import tp
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
        # Ranks that read different samples and average gradients: all of them, except under tp.
        self.dp_size = dp_size = cfg.data_parallel_size
        group = world.group
        self.comm = tp.CommCounter()
        self.device = "gpu" if mx.default_device() == mx.gpu else "cpu"
        self.model = Llama(spec)
        load_weights(self.model, weights)
        self.tp = tp.TensorParallel(group, self.comm) if cfg.strategy == "tp" else None
        if self.tp:
            self.tp.parallelize(self.model)
        self.optimizer = optim.AdamW(learning_rate=cfg.lr, betas=[cfg.beta1, cfg.beta2], eps=cfg.adam_eps,
                                     weight_decay=cfg.weight_decay, bias_correction=True)
        self.optimizer.init(self.model.trainable_parameters())
        mx.eval(self.model.parameters(), self.optimizer.state)
        self.grad_accum = cfg.grad_accum
        grad_clip, reduce_bytes = cfg.grad_clip, int(cfg.all_reduce_size_mb * 2**20)
        loss_and_grad = nn.value_and_grad(self.model, token_loss_sum)

        def micro_step(inputs, targets, mask, scale):
            loss_sum, grads = loss_and_grad(self.model, inputs, targets, mask)
            return loss_sum, tree_map(lambda g: g * scale, grads)

        def update(grads, loss_sum):
            grads = dict(grads, **{LOSS_KEY: loss_sum})
            if dp_size > 1:
                self.comm.add_all(v for k, v in tree_flatten(grads) if k != LOSS_KEY)
                grads = nn.average_gradients(grads, group=group, all_reduce_size=reduce_bytes)
            loss = grads.pop(LOSS_KEY)
            if self.tp:
                grads, grad_norm = self.tp.clip_grad_norm(grads, grad_clip)
            elif grad_clip > 0:
                grads, grad_norm = optim.clip_grad_norm(grads, grad_clip)
            else:
                grad_norm = mx.sqrt(sum((g * g).sum() for _, g in tree_flatten(grads)))
            self.optimizer.update(self.model, grads)
            return loss, grad_norm

        # value_and_grad swaps traced parameters into the model, so every compiled function lists the
        # state as an output too: otherwise the model would be left holding placeholders.
        state = [self.model.state, self.optimizer.state]
        self._micro_step = self.comm.attribute("micro_step", mx.compile(micro_step, inputs=state, outputs=state))
        self._update = self.comm.attribute("update", mx.compile(update, inputs=state, outputs=state))
        self._eval_sum = mx.compile(lambda x, y, m: token_loss_sum(self.model, x, y, m), inputs=state,
                                    outputs=state)

    def train_step(self, batches, lr, global_tokens):
        # scale = N / T: after averaging over N ranks the gradient is that of (sum of losses) / T.
        scale = mx.array(self.dp_size / global_tokens, dtype=mx.float32)
        loss_sum, grads = None, None
        for inputs, targets, mask in batches:
            micro_loss, micro_grads = self._micro_step(mx.array(inputs), mx.array(targets), mx.array(mask), scale)
            micro_loss = micro_loss * scale
            if grads is None:
                loss_sum, grads = micro_loss, micro_grads
            else:  # accumulate lazily; communication happens only in `update`
                loss_sum, grads = loss_sum + micro_loss, tree_map(mx.add, grads, micro_grads)
        self.optimizer.learning_rate = mx.array(lr, dtype=mx.float32)
        loss, grad_norm = self._update(grads, loss_sum)
        mx.eval(loss, grad_norm, self.model.state, self.optimizer.state)  # the step is done when timed
        return loss.item(), grad_norm.item()

    def eval_loss_sum(self, inputs, targets, mask):
        return self._eval_sum(mx.array(inputs), mx.array(targets), mx.array(mask)).item()

    def all_sum(self, values, over="data"):
        """Sum over the data-parallel ranks (under tp: this rank alone, which holds the whole sum), or
        over="world": over every rank."""
        if (self.dp_size if over == "data" else self.world_size) == 1:
            return np.asarray(values)
        # float32 on the wire: not every backend reduces float64.
        summed = mx.distributed.all_sum(mx.array(np.asarray(values, dtype=np.float32)), group=self.group)
        return np.array(summed, dtype=np.float64)

    def export_state(self):
        """Full HF-named weights and moments on every rank (every rank calls it: tp gathers)."""
        flat = dict(tree_flatten(self.optimizer.state))
        weights = weights_of(self.model)
        exp_avg = {n: np.array(flat[f"{n}.m"]) for n in weights}
        exp_avg_sq = {n: np.array(flat[f"{n}.v"]) for n in weights}
        if self.tp:
            return self.tp.gather(weights), self.tp.gather(exp_avg), self.tp.gather(exp_avg_sq)
        return weights, exp_avg, exp_avg_sq

    def import_optimizer(self, exp_avg, exp_avg_sq, step):
        if self.tp:
            exp_avg, exp_avg_sq = self.tp.shard(exp_avg), self.tp.shard(exp_avg_sq)
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
        """Bytes of training state this rank holds: parameters, their gradients (as many, at the step's
        peak), optimizer moments."""
        params = sum(v.nbytes for _, v in tree_flatten(self.model.trainable_parameters()))
        optimizer = sum(v.nbytes for _, v in tree_flatten(self.optimizer.state))
        return {"params": params, "grads": params, "optimizer": optimizer}

    def comm_bytes_per_step(self):
        """Bytes given to all-reduce by one step's micro-steps and update (scalars left out)."""
        calls = self.comm.per_call
        return calls.get("micro_step", 0) * self.grad_accum + calls.get("update", 0)


def _set_path(tree, path, value):
    for part in path[:-1]:
        tree = tree[int(part)] if isinstance(tree, list) else tree[part]
    tree[path[-1]] = value
