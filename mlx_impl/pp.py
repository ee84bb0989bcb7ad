"""Pipeline parallelism in MLX, written out with `mx.distributed.send` / `recv`: one stage per rank.

The split and the schedules are common/parallel/pipeline.py's: a stage holds a contiguous run of blocks (the first also
the embedding, the last the final norm and the head) and runs `stage_ops`, one operation at a time:

    recv_act / send_act    the activations (micro-batch, T, dim) in the compute dtype, down the stages
    recv_grad / send_grad  their gradients, back up
    F / B                  a micro-batch's forward / backward on this stage

Each send and receive is evaluated on its own, in order (mx.eval of a list of independent receives ran them in
reverse and mixed micro-batches up: /work/shared/FACTS.md). MLX keeps no autograd tape, so a stage's backward
is `mx.vjp` of its forward. To avoid running that forward twice, a stage other than the last builds the vjp at
the forward, with the gradient's receive as its cotangent: MLX is lazy, so the receive does not run until it is
evaluated at its own place in the schedule (recv_grad), and evaluating the stage's output (to send it) runs the
forward alone. The forward's intermediates stay alive for the backward graph until B evaluates it, as
activations do in torch (gpipe keeps M micro-batches' worth, 1f1b at most p - s). Measured on a 4-layer dim-256
model at p = 2: 1.1-1.4x the tokens/s of recomputing the forward in B, and stage 1's idle time fell from 42-49 %
to 23-36 %. Under 1f1b the last stage computes its loss and the gradients in one compiled `mx.vjp` at the forward (its
backward follows at once); under gpipe it builds the vjp lazily too, evaluates the loss at F and the
gradients at B, so that it runs every forward first as the schedule says. Eval
runs the compiled forward only, each batch as one piece.

Exact loss: the last stage holds the masked token losses of the whole batch, the others none, so the Trainer
sums the loss over the world (`loss_over`). Gradients are those of (sum of token losses) x scale, scale =
1 / global tokens, as under ddp at one rank (nothing is averaged: the data-parallel size is 1). The global
norm adds each stage's sum of squares over the ranks (every parameter lives on exactly one stage, but a tied
matrix, counted on the first stage only). Checkpoints are whole HF-named files: the stages' parameters keep
their HF names (blocks of other stages are empty placeholders in the layer list), and export_state sums the
stages' dicts (zeros where a stage holds nothing) so every rank has the whole state.

Tied embeddings (common/parallel/embedding_group.py, Megatron-LM's embedding group): the first and the last
stage each hold the matrix, the last using it as its head, and forward_backward ends by summing its gradient
over the two (one all_sum; the time breakdown's communication), before the norm. Beyond 2 stages the two are a
split of the pipeline's group where the backend splits (MPI, nccl; on a mesh always); the ring backend cannot
split a group, so there the sum runs over the whole pipeline, the middle stages adding zeros. Split groups are
freed before MPI finalizes (launch.py).

The bubble, the layers and tensors a stage holds and its figures are common/parallel/pipeline_stage.py's
(`StageBookkeeping`, which `Pipeline` extends); the barriers around each training step are one-element all_sums.
Mirrors torch_impl/pp.py.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Mapping, Sequence

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from common.checkpoint.sharded import LocalState, local_pieces
from common.checkpoint.tensorsource import TensorSource
from common.config import MLX_SPLIT_BACKENDS, RunConfig
from common.parallel.embedding_group import TIED_MATRIX
from common.parallel.pipeline import stage_ops
from common.parallel.pipeline_stage import StageBookkeeping
from common.train.protocols import Batch, ForwardBackwardResult, Phase, StateStream, World, no_phase

from .comm import CommCounter
from .grads import squares_of
from .load import load_local
from .microsteps import Grads, Losses, StepFunctions, wait_for
from .model import cross_entropy
from .rank_state import as_float32, local_numpy, state_bytes


class Pipeline(StageBookkeeping):
    """The pp strategy (common/train/protocols.py): this rank's stage, its schedule, and the state across stages."""

    reduce_scatter = None
    full_state_on_every_rank = True  # export_state sums the stages' parts on every rank
    communicates = False             # no gradient is averaged; activations move inside forward_backward
    loss_over = "world"              # the last stage holds the loss sum

    def __init__(self, cfg: RunConfig, world: World, comm: CommCounter):
        self.group, self.comm, self.stream = world.group, comm, comm.stream
        self.splits = cfg.resolved_backend in MLX_SPLIT_BACKENDS  # Group.split works (the embedding group)
        super().__init__(cfg, self.group.rank(), self.group.size())
        self.ops = stage_ops(self.schedule, self.stage, self.n_stages, self.n_micro)
        # gpipe's last stage runs every forward before any backward, like the others: its fused compiled
        # forward-and-backward at F would make each piece cost F + B there while the stage above waits for the
        # first gradient until the last activation is in (simulated idle 0.41 at p=2, M=8; measured 0.39-0.43).
        self.defers_backward = self.last and self.schedule == "gpipe"

    def wrap(self, model: nn.Module, source: TensorSource) -> nn.Module:
        """Keep this stage's part of the unevaluated model, in place, and read only its tensors from the
        source (mlx_impl/load.py); the names stay HF's."""
        spec, inner = model.spec, model.model
        self.place(spec)
        inner.layers = [layer if i in self.layers else nn.Module() for i, layer in enumerate(inner.layers)]
        if not self.holds_embedding:  # the first stage's, and the last's copy of a tied one
            inner.pop("embed_tokens")
        if not self.last:
            inner.pop("norm")
            if "lm_head" in model:
                model.pop("lm_head")
        self._split_stage(model)
        self.model, self.dtype, self.dim = model, inner.compute_dtype, spec.dim
        self.tied_group = self._embedding_group()
        self.keys = [k for k, _ in tree_flatten(model.trainable_parameters())]
        # Compiled like the Trainer's micro-step: the parameters are inputs (set into the model while tracing,
        # put back after each call), so one trace serves every call of the same shapes.
        # The last stage's loss and gradients at once (1f1b), compiled as a micro-step is. Under pp x tp its tp
        # all-reduces run inside: counted at each call (each_call). Uncompiled there, pp=2,tp=2 of `tiny` took
        # 0.160 s a step against 0.101 compiled (4 MPI ranks on 2 cores, Zen 5; docs/notes/2026-11-plan-model.md).
        self._compiled_vjp = self.comm.each_call(mx.compile(self._stage_vjp))
        self._compiled_forward = mx.compile(self._stage_forward)
        load_local(model, source, self.local_index)
        return model

    def _split_stage(self, model: nn.Module) -> None:
        """Where a mesh's tp axis splits the stage's blocks, before their keys are listed and they are loaded
        (mlx_impl/mesh.py's TensorParallelStages); one-axis pp keeps them whole."""

    def _embedding_group(self) -> mx.distributed.Group:
        """The embedding group's communicator. At 2 stages the pipeline's own group (on a mesh, this pipeline's).
        Beyond, where the backend splits (MPI, nccl), the pipeline's group split in two: its ends (the group)
        and its middle stages (a group they never use); every stage of the pipeline calls the split. On ring,
        which cannot split, the pipeline's own group: the middle stages add zeros."""
        if not self.embedding.tied or self.embedding.spans_pipeline or not self.splits:
            return self.group
        return self.group.split(0 if self.holds_embedding else 1, self.stage)

    # ---- the schedule ---------------------------------------------------------------------------------------
    def forward_backward(self, step: StepFunctions, batches: Sequence[Batch], scale: float,
                         phase: Phase = no_phase, wait: bool = False,
                         sync: bool = True) -> ForwardBackwardResult[Losses, Grads]:
        """-> (the token losses of every micro-batch on the last stage, [] elsewhere; this stage's gradients
        of (sum of token losses) x scale). `step` goes unused: the stage runs its own compiled functions."""
        scale_array = mx.array(scale, dtype=mx.float32)  # as the Trainer's micro-step takes it (microsteps.py)
        token_losses: Losses = []
        grads: Grads | None = None
        sent = 0
        with self.step_window(self._barrier, instrumented=wait) as clock:
            for inputs, targets, mask in batches:
                losses, flush_grads, nbytes = self._flush(inputs, targets, mask, scale_array, phase, clock.busy)
                token_losses += losses
                sent += nbytes
                if flush_grads is not None:
                    grads = flush_grads if grads is None else tree_map(mx.add, grads, flush_grads)
        self.comm.per_call.setdefault("micro_step", sent // len(batches))  # bytes this stage sends per flush
        if sync and self.embedding.tied:
            with phase("communication"):
                grads = self._sum_tied_gradient(grads)
        assert grads is not None, "a step has at least one micro-batch"
        wait_for(wait, grads)
        return ForwardBackwardResult(token_losses, grads)

    def _sum_tied_gradient(self, grads: Grads | None) -> Grads | None:
        """The tied matrix's gradient summed over the embedding group (common/parallel/embedding_group.py), after
        the step's window (no bubble) and before the norm: each copy then holds the lookup's and the head's
        parts, as one rank's gradient does, and AdamW keeps the copies equal. Where the group could not be split
        (ring), beyond 2 stages the sum runs over the whole pipeline, the middle stages adding zeros."""
        if not self.holds_embedding and self.tied_group is not self.group:
            return grads  # a middle stage outside the group's own communicator
        embedding = grads["model"]["embed_tokens"] if grads is not None and self.holds_embedding else None
        mine = embedding["weight"] if embedding is not None else mx.zeros(self.shapes[TIED_MATRIX], mx.float32)
        self.comm.per_call.setdefault("step", mine.nbytes)
        summed = mx.distributed.all_sum(mine, group=self.tied_group, stream=self.stream)
        mx.eval(summed)  # now, on every stage: a middle stage keeps nothing of it
        if embedding is not None:
            embedding["weight"] = summed
        return grads

    def eval_losses(self, step: StepFunctions, batches: Sequence[Batch]) -> Losses:
        """The forward alone, each batch as one piece: the token losses on the last stage, [] elsewhere."""
        token_losses: Losses = []
        for inputs, targets, mask in batches:
            token_losses += self._flush(inputs, targets, mask, None, no_phase, None)[0]
        return token_losses

    def _flush(self, inputs, targets, mask, scale: mx.array | None, phase: Phase,
               busy: Callable[[], contextlib.AbstractContextManager[None]] | None):
        """One pass of the schedule over one micro-step's batch, cut into M micro-batches, each computation timed
        by `busy`; eval (busy None: forward only) takes the batch as one piece, whatever its size (the last eval
        batch may be short). -> (token losses, gradients, bytes sent)."""
        backward = busy is not None
        busy = busy or contextlib.nullcontext
        pieces = self.n_micro if backward else 1
        xs, ys, ms = (np.split(np.asarray(a), pieces) for a in (inputs, targets, mask))
        shape = (xs[0].shape[0], xs[0].shape[1], self.dim)
        acts: dict[int, mx.array] = {}     # received activations, by micro-batch
        outputs: dict[int, mx.array] = {}  # activations to send
        dx: dict[int, mx.array] = {}       # input gradients to send
        losses: dict[int, mx.array] = {}   # the last stage's token losses
        cots: dict[int, tuple[mx.array | None, list[mx.array]]] = {}  # (the gradient's receive, the vjps) for B
        grads: Grads | None = None
        sent = 0
        ops = self.ops if backward else [op for op in stage_ops(self.schedule, self.stage, self.n_stages, 1)
                                         if op[0] in ("recv_act", "F", "send_act")]
        for op in ops:
            kind, i = op[0], op[1]
            if kind == "recv_act":
                acts[i] = self._recv(shape, op[2])
            elif kind == "recv_grad":
                mx.eval(cots[i][0])  # the receive created with the forward's vjp, run now, in its place
            elif kind in ("send_act", "send_grad"):
                out = outputs.pop(i) if kind == "send_act" else dx.pop(i)
                sent += out.nbytes
                self._send(out, op[2])
            elif kind == "F":
                with busy(), phase("forward"):
                    x = mx.array(xs[i]) if self.first else acts.pop(i)
                    if not self.last and backward:
                        # The backward's graph is built now, on a receive not yet run (MLX is lazy): the
                        # forward's intermediates stay for it, so B recomputes nothing (see the docstring).
                        cot = mx.distributed.recv(shape, self.dtype, self.stage + 1, group=self.group,
                                                  stream=self.stream)
                        outputs[i], vjps = self._lazy_vjp(x, cot)
                        cots[i] = (cot, vjps)
                        mx.eval(outputs[i])  # the forward only: nothing in it reads the receive
                    elif not self.last:
                        outputs[i] = self._run_forward(x)
                        mx.eval(outputs[i])
                    elif not backward:  # eval
                        losses[i] = self._losses(self._forward(x), mx.array(ys[i]), mx.array(ms[i]))
                        mx.eval(losses[i])
                    elif self.defers_backward:  # the loss now, the backward's graph kept for B
                        losses[i], vjps = self._lazy_vjp(x, targets=mx.array(ys[i]), mask=mx.array(ms[i]))
                        cots[i] = (None, vjps)
                        mx.eval(losses[i])
                    else:  # the last stage: the loss and every gradient at once
                        losses[i], g, dx_i = self._vjp(x, None, mx.array(ys[i]), mx.array(ms[i]))
                        grads = self._accumulate(grads, g, scale)
                        if dx_i is not None:
                            dx[i] = dx_i
                        mx.eval(losses[i], grads, *([] if dx_i is None else [dx_i]))
            elif not self.last or self.defers_backward:  # "B"; on the last stage of 1f1b it was done at F
                with busy(), phase("backward"):
                    _, vjps = cots.pop(i)
                    n = len(self.keys)
                    g = tree_unflatten(list(zip(self.keys, vjps[:n])))
                    dx_i = None if self.first else vjps[n]
                    grads = self._accumulate(grads, g, scale)
                    if dx_i is not None:
                        dx[i] = dx_i
                    mx.eval(grads, *([] if dx_i is None else [dx_i]))
        return [losses[i] for i in sorted(losses)], grads, sent

    def _forward(self, x):
        """This stage's part of Llama.__call__ (mlx_impl/model.py): tokens or activations in, activations or
        logits out (causal mask: the model is always called without a padding mask)."""
        inner = self.model.model
        h = inner.embed_tokens(x).astype(self.dtype) if self.first else x
        for i in self.layers:
            h = inner.layers[i](h, "causal")
        if not self.last:
            return h
        return inner.embed_tokens.as_linear(inner.norm(h)) if self.embedding.tied else self.model.lm_head(inner.norm(h))

    @staticmethod
    def _losses(logits, targets, mask):
        return cross_entropy(logits.astype(mx.float32), targets) * mask

    def _vjp(self, x, cotangent, targets=None, mask=None):
        """(token losses on the last stage, the parameters' gradients, the input's gradient or None on the
        first stage) of this stage's forward; the last stage's cotangent is 1 for the loss sum. Compiled."""
        params = [v for _, v in tree_flatten(self.model.trainable_parameters())]
        rest = [x, targets, mask] if self.last else [x, cotangent]
        out = self._compiled_vjp(*params, *rest)
        self.model.update(tree_unflatten(list(zip(self.keys, params))))  # the real arrays back in place
        losses, vjps = (out[0], out[1:]) if self.last else (None, out)
        grads = tree_unflatten(list(zip(self.keys, vjps[:len(params)])))
        return losses, grads, (None if self.first else vjps[len(params)])

    def _stage_vjp(self, *arrays):
        """The compiled function of `_vjp`: parameters, then the input and either the cotangent or (last stage)
        the targets and the mask -> ([token losses,] the parameters' gradients..., [the input's gradient])."""
        n = len(self.keys)
        params, x = list(arrays[:n]), arrays[n]

        def stage(*primals):
            self.model.update(tree_unflatten(list(zip(self.keys, primals[:n]))))
            out = self._forward(x if self.first else primals[n])
            if not self.last:
                return [out]
            losses = self._losses(out, arrays[n + 1], arrays[n + 2])
            return [losses.sum(), losses]

        primals = params + ([] if self.first else [x])
        if self.last:
            cotangents = [mx.array(1.0, dtype=mx.float32), mx.zeros(arrays[n + 1].shape, dtype=mx.float32)]
        else:
            cotangents = [arrays[n + 1]]
        outputs, vjps = mx.vjp(stage, primals, cotangents)
        return ([outputs[1]] if self.last else []) + list(vjps)

    def _lazy_vjp(self, x, cot=None, targets=None, mask=None):
        """(this stage's output, or on the last stage its token losses; the vjps of its parameters and input),
        built lazily: evaluating the first runs the forward alone and keeps its intermediates for the backward.
        The cotangent is `cot`, a receive that has not run yet, or on the last stage 1 for the loss sum (gpipe).
        Not compiled: a compiled graph may fuse forward and backward operations into one kernel, and evaluating
        the output would then run the receive out of its place in the schedule."""
        params = [v for _, v in tree_flatten(self.model.trainable_parameters())]
        n = len(params)

        def stage(*primals):
            self.model.update(tree_unflatten(list(zip(self.keys, primals[:n]))))
            out = self._forward(x if self.first else primals[n])
            if not self.last:
                return [out]
            losses = self._losses(out, targets, mask)
            return [losses.sum(), losses]

        cotangents = ([mx.array(1.0, dtype=mx.float32), mx.zeros(targets.shape, dtype=mx.float32)] if self.last
                      else [cot])
        outs, vjps = mx.vjp(stage, params + ([] if self.first else [x]), cotangents)
        self.model.update(tree_unflatten(list(zip(self.keys, params))))
        return outs[-1], vjps

    def _run_forward(self, x):
        """This stage's forward alone, compiled: eval on the stages but the last (whose losses come from `_forward`)."""
        params = [v for _, v in tree_flatten(self.model.trainable_parameters())]
        out = self._compiled_forward(*params, x)
        self.model.update(tree_unflatten(list(zip(self.keys, params))))
        return out

    def _stage_forward(self, *arrays):
        n = len(self.keys)
        self.model.update(tree_unflatten(list(zip(self.keys, arrays[:n]))))
        return self._forward(arrays[n])

    @staticmethod
    def _accumulate(grads, micro, scale):
        micro = tree_map(lambda g: g * scale, micro)
        return micro if grads is None else tree_map(mx.add, grads, micro)

    def _send(self, x, dst):
        mx.eval(mx.distributed.send(x, dst, group=self.group, stream=self.stream))

    def _recv(self, shape, src):
        x = mx.distributed.recv(shape, self.dtype, src, group=self.group, stream=self.stream)
        mx.eval(x)
        return x

    def _barrier(self):
        mx.eval(mx.distributed.all_sum(mx.zeros((1,)), group=self.group, stream=self.stream))

    # ---- the rest of the Strategy protocol (local_index and figures: StageBookkeeping's) -------------------------
    def optimizer(self, base: optim.Optimizer) -> optim.Optimizer:
        return base  # the stage's whole parameters

    def state_bytes(self, model: nn.Module, optimizer: optim.Optimizer) -> dict[str, int]:
        return state_bytes(model, optimizer)

    def reduce_gradients(self, grads: Grads) -> Grads:
        return grads  # nothing to average: one replica (a tied matrix's gradient is summed in forward_backward)

    def global_norm(self, grads: Grads) -> mx.array:
        """Each stage's sum of squares, summed over the stages: every parameter lives on exactly one, a tied
        matrix counted on the first stage only."""
        squares = squares_of(g for k, g in tree_flatten(grads) if self.counts(k))
        return mx.sqrt(mx.distributed.all_sum(squares, group=self.group))

    def export_state(self, weights: Mapping[str, mx.array], exp_avg: Mapping[str, mx.array],
                     exp_avg_sq: Mapping[str, mx.array]) -> tuple[StateStream, StateStream, StateStream]:
        return self.gather(weights, self._all_sum, as_float32), self.gather(exp_avg, self._all_sum, as_float32), \
            self.gather(exp_avg_sq, self._all_sum, as_float32)

    def local_state(self, shapes: Mapping[str, tuple[int, ...]], weights: Mapping[str, mx.array],
                    exp_avg: Mapping[str, mx.array], exp_avg_sq: Mapping[str, mx.array]) -> LocalState:
        """--checkpoint-format sharded (common/checkpoint/sharded.py): (weights, exp_avg, exp_avg_sq, where) of
        this stage's own tensors, whole, under HF names (a tied matrix: the first stage's copy); no collectives."""
        own = (self.counted(local_numpy(weights)), self.counted(local_numpy(exp_avg)),
               self.counted(local_numpy(exp_avg_sq)))
        return local_pieces(self.stage, own, {}, shapes)

    def _all_sum(self, value: mx.array | None, shape: tuple[int, ...]) -> np.ndarray:
        """One tensor of export_state summed over the stages (StageBookkeeping.gather): zeros where not held."""
        mine = mx.array(as_float32(value)) if value is not None else mx.zeros(shape, dtype=mx.float32)
        return np.array(mx.distributed.all_sum(mine, group=self.group))
