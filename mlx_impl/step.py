"""One optimizer step in MLX: compiled forward/backward, bucketed gradient averaging, clipped AdamW.

Precision (common/precision.py): the model computes in cfg.dtype from float32 master weights, so the
gradients, their all-reduce and the AdamW state are float32 whatever the dtype.

Strategy ddp replicates the model; fsdp shards it (mlx_impl/fsdp.py: sharded gradients arrive
reduce-scattered from the backward, only the replicated ones are averaged here).

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

import time

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from . import fsdp, tp
from .comm import average_gradients, communication_stream
from .model import Llama, load_weights, weights_of
from .trace import Tracer

FRAMEWORK = "mlx"


def token_loss_sum(model, inputs, targets, mask):
    """(float32 sum of the masked token losses, the masked token losses): the gradients come from the
    sum, the reported loss from the token losses (summed in float64 by `_exact_sum`)."""
    logits = model(inputs).astype(mx.float32)
    losses = cross_entropy(logits, targets) * mask
    return losses.sum(), losses


def cross_entropy(logits: mx.array, targets: mx.array) -> mx.array:
    """Per-token cross-entropy, logsumexp(logits) - logits[target], with the logsumexp written out.

    nn.losses.cross_entropy calls the LogSumExp primitive, whose gradient computes the softmax again: a
    second exponential of every logit, and on a CPU MLX's exp is the slowest part of the step (`small`:
    2048 x 50257 exponentials, ~1.3 s each; benchmarks/bench_ops.py). Written out, mx.compile fuses the
    subtraction and exp into one kernel and the backward reuses the forward's exponentials (the gradient of
    exp is its output). The max is a constant shift that cancels, so no gradient flows to it; the target
    logit is read from `logits`, not from the shifted array, which would then have to be materialised too."""
    peak = mx.stop_gradient(logits.max(axis=-1, keepdims=True))
    target_logits = mx.take_along_axis(logits, targets[..., None], axis=-1).squeeze(-1)
    return mx.log(mx.exp(logits - peak).sum(axis=-1)) + peak.squeeze(-1) - target_logits


def _sum_of_squares(x: mx.array, width: int = 4) -> mx.array:
    """Sum of x², as a tree of sums of `width` terms: a flat float32 sum over the millions of elements of
    an embedding gradient is off by ~4e-5, and the clip coefficient with it (measured on `small`)."""
    x = x.astype(mx.float32).reshape(-1)
    x = x * x
    while x.size > width:
        if x.size % width:
            x = mx.concatenate([x, mx.zeros((width - x.size % width,), dtype=x.dtype)])
        x = x.reshape(-1, width).sum(axis=1)
    return x.sum()


def _exact_sum(arrays) -> float:
    return float(sum(np.array(a, dtype=np.float64).sum() for a in arrays))


class Trainer:
    framework = FRAMEWORK
    tracer = Tracer  # --trace (common/trace.py)

    def __init__(self, cfg, spec, weights, world):
        self.rank, self.world_size, self.group = world.rank, world.size, world.group
        # Ranks that read different samples and average gradients: all of them, except under tp.
        self.dp_size = dp_size = cfg.data_parallel_size
        group = world.group
        self.comm = tp.CommCounter()
        self.device = "gpu" if mx.default_device() == mx.gpu else "cpu"
        self.model = Llama(spec, compute_dtype=cfg.dtype)
        load_weights(self.model, weights)
        self.sharding = sharding = (fsdp.shard_model(self.model, group, cfg.resolved_backend)
                                    if cfg.strategy == "fsdp" else None)
        self.reduce_scatter = sharding.reduce_scatter if sharding else None
        self.tp = tp.TensorParallel(group, self.comm) if cfg.strategy == "tp" else None
        if self.tp:
            self.tp.parallelize(self.model)
        self.optimizer = optim.AdamW(learning_rate=cfg.lr, betas=[cfg.beta1, cfg.beta2], eps=cfg.adam_eps,
                                     weight_decay=cfg.weight_decay, bias_correction=True)
        self.optimizer.init(self.model.trainable_parameters())
        mx.eval(self.model.parameters(), self.optimizer.state)
        self.grad_accum = cfg.grad_accum
        grad_clip, reduce_bytes = cfg.grad_clip, int(cfg.all_reduce_size_mb * 2**20)
        self.stream = stream = communication_stream(cfg)  # the CPU stream on a Metal GPU (mlx_impl/comm.py)
        loss_and_grad = nn.value_and_grad(self.model, token_loss_sum)

        def micro_step(inputs, targets, mask, scale):
            (_, losses), grads = loss_and_grad(self.model, inputs, targets, mask)
            return losses, tree_map(lambda g: g * scale, grads)

        def average(grads):
            """The gradient sync of a step."""
            if sharding is not None:  # the shards were reduce-scattered in the backward
                return sharding.average_gradients(grads, reduce_bytes, stream)
            if dp_size > 1:
                self.comm.add_all(v for _, v in tree_flatten(grads))
                return average_gradients(grads, group, reduce_bytes, stream)
            return grads

        def make_update(sync: bool):
            def update(grads):
                if sync:
                    grads = average(grads)
                # One global norm: replicated gradients counted once, shards and tp slices summed over ranks.
                if sharding is not None:
                    grad_norm = sharding.global_norm(grads, _sum_of_squares)
                elif self.tp:
                    grad_norm = self.tp.global_norm(grads, _sum_of_squares)
                else:
                    grad_norm = mx.sqrt(sum(_sum_of_squares(g) for _, g in tree_flatten(grads)))
                if grad_clip > 0:  # optim.clip_grad_norm's (and torch's) formula, with the precise norm
                    grads = tree_map(lambda g: g * mx.minimum(grad_clip / (grad_norm + 1e-6), 1.0), grads)
                self.optimizer.update(self.model, grads)
                return grad_norm
            return update

        # value_and_grad swaps traced parameters into the model, so every compiled function lists the
        # state as an output too: otherwise the model would be left holding placeholders.
        state = [self.model.state, self.optimizer.state]
        self._micro_step = self.comm.attribute("micro_step", mx.compile(micro_step, inputs=state, outputs=state))
        self._update = {True: self.comm.attribute("update", mx.compile(make_update(True), inputs=state, outputs=state)),
                        False: mx.compile(make_update(False), inputs=state, outputs=state)}
        # trace_step runs the sync apart from the update to time it (uncompiled: it stays out of the
        # per-call byte counts of comm_bytes_per_step).
        self._average = average if sharding is not None or dp_size > 1 else None
        self._eval_losses = mx.compile(lambda x, y, m: token_loss_sum(self.model, x, y, m)[1], inputs=state,
                                       outputs=state)

    def train_step(self, batches, lr, global_tokens, sync=True):
        """sync=False skips the gradient all-reduce (time breakdown only: the ranks' weights part ways)."""
        token_losses, grads = self._gradients(batches, global_tokens)
        self.optimizer.learning_rate = mx.array(lr, dtype=mx.float32)
        grad_norm = self._update[sync](grads)
        mx.eval(grad_norm, token_losses, self.model.state, self.optimizer.state)  # the step is done when timed
        local = np.array([_exact_sum(token_losses)])
        loss_sum = (self.all_sum(local) if sync else local)[0]
        return float(loss_sum / global_tokens), grad_norm.item()

    def _gradients(self, batches, global_tokens):
        """(this rank's masked token losses per micro-batch, its summed gradients, scaled), lazily."""
        # scale = N / T (N data-parallel ranks): after averaging, the gradient is that of (sum of losses) / T.
        scale = mx.array(self.dp_size / global_tokens, dtype=mx.float32)
        token_losses, grads = [], None
        for inputs, targets, mask in batches:
            losses, micro_grads = self._micro_step(mx.array(inputs), mx.array(targets), mx.array(mask), scale)
            token_losses.append(losses)
            # accumulate lazily; DDP communicates only in `update` (FSDP: see fsdp.py)
            grads = micro_grads if grads is None else tree_map(mx.add, grads, micro_grads)
        return token_losses, grads

    def profile_step(self, batches, lr, global_tokens):
        """One step without gradient sync that waits for each phase (common/breakdown.py): forward from a
        forward-only pass, backward as forward+backward minus it, then the update."""
        start = time.perf_counter()
        for inputs, targets, mask in batches:
            mx.eval(self._eval_losses(mx.array(inputs), mx.array(targets), mx.array(mask)))
        forward = time.perf_counter() - start
        t = time.perf_counter()
        token_losses, grads = self._gradients(batches, global_tokens)
        mx.eval(token_losses, grads)
        forward_backward = time.perf_counter() - t
        t = time.perf_counter()
        self.optimizer.learning_rate = mx.array(lr, dtype=mx.float32)
        mx.eval(self._update[False](grads), self.model.state, self.optimizer.state)
        optimizer = time.perf_counter() - t
        return {"forward": forward, "backward": max(0.0, forward_backward - forward), "optimizer": optimizer,
                "total": time.perf_counter() - start - forward}  # the extra forward pass is not part of a step

    def trace_step(self, batches, lr, global_tokens, span):
        """One synced step whose phases each run inside `span(name)` and end in mx.eval (common/trace.py):
        forward (a micro-batch's losses), backward (the rest of its gradients: the compiled micro-step's
        graph is evaluated in two parts, and kernels it fused across the two run in forward), communication
        (the gradient sync; under fsdp the shards' reduce-scatter is in backward), optimizer."""
        scale = mx.array(self.dp_size / global_tokens, dtype=mx.float32)
        token_losses, grads = [], None
        for inputs, targets, mask in batches:
            with span("forward"):
                losses, micro_grads = self._micro_step(mx.array(inputs), mx.array(targets), mx.array(mask), scale)
                mx.eval(losses)
            with span("backward"):
                grads = micro_grads if grads is None else tree_map(mx.add, grads, micro_grads)
                mx.eval(grads)
            token_losses.append(losses)
        if self._average is not None:
            with span("communication"):
                grads = self._average(grads)
                mx.eval(grads)
        with span("optimizer"):
            self.optimizer.learning_rate = mx.array(lr, dtype=mx.float32)
            grad_norm = self._update[False](grads)  # the sync already happened
            mx.eval(grad_norm, self.model.state, self.optimizer.state)
        loss_sum = self.all_sum(np.array([_exact_sum(token_losses)]))[0]
        return float(loss_sum / global_tokens), grad_norm.item()

    def eval_loss_sum(self, inputs, targets, mask):
        return _exact_sum([self._eval_losses(mx.array(inputs), mx.array(targets), mx.array(mask))])

    def all_sum(self, values, over="data"):
        """Sum over the data-parallel ranks (under tp: this rank alone, which holds the whole sum), or
        over="world": over every rank."""
        values = np.asarray(values, dtype=np.float64)
        if (self.dp_size if over == "data" else self.world_size) == 1:
            return values
        # float32 on the wire (not every backend reduces float64), yet exact: each rank sends its values
        # as float32 pairs (hi + lo = the float64 to 48 bits) in slots of its own, so the all-reduce
        # adds only zeros, and the host sums the ranks' pairs in float64.
        hi = values.astype(np.float32)
        slots = np.zeros((self.world_size, 2, *values.shape), dtype=np.float32)
        slots[self.rank] = hi, (values - hi).astype(np.float32)
        summed = mx.distributed.all_sum(mx.array(slots), group=self.group, stream=self.stream)
        return np.array(summed, dtype=np.float64).sum(axis=(0, 1))

    def export_state(self):
        """HF-named weights and AdamW moments: whole on every rank (tp gathers its slices), except under fsdp,
        where rank 0 gathers them and the other ranks get empty dicts. Every rank calls it: collectives."""
        weights, flat = weights_of(self.model), dict(tree_flatten(self.optimizer.state))
        if self.sharding is not None:
            weights, flat = self.sharding.full(weights), self.sharding.full(flat)
        # Views, not copies: MLX arrays are immutable, and a copy of the optimizer state costs its size again.
        exp_avg = {n: np.asarray(flat[f"{n}.m"]) for n in weights}
        exp_avg_sq = {n: np.asarray(flat[f"{n}.v"]) for n in weights}
        if self.tp:
            return self.tp.gather(weights), self.tp.gather(exp_avg), self.tp.gather(exp_avg_sq)
        return weights, exp_avg, exp_avg_sq

    def import_optimizer(self, exp_avg, exp_avg_sq, step):
        if self.sharding is not None:  # this rank's slices, under its parameter paths
            paths = [k for k, _ in tree_flatten(self.model.parameters())]
            exp_avg, exp_avg_sq = self.sharding.local(exp_avg, paths), self.sharding.local(exp_avg_sq, paths)
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
        """Bytes of parameters, gradients and optimizer state on this rank. A gradient has its parameter's
        shape on this rank (a shard under fsdp, a slice under tp), so the two take the same bytes."""
        params = _nbytes(self.model.trainable_parameters())
        return {"params": params, "grads": params, "optimizer": _nbytes(self.optimizer.state)}

    def comm_bytes_per_step(self):
        """Bytes given to all-reduce by one step's micro-steps and update (scalars left out)."""
        calls = self.comm.per_call
        return calls.get("micro_step", 0) * self.grad_accum + calls.get("update", 0)


def _nbytes(tree):
    return sum(a.nbytes for _, a in tree_flatten(tree) if isinstance(a, mx.array))


def _set_path(tree, path, value):
    for part in path[:-1]:
        tree = tree[int(part)] if isinstance(tree, list) else tree[part]
    tree[path[-1]] = value
