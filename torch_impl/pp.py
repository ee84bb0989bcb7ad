"""Pipeline parallelism in PyTorch, with `torch.distributed.pipelining`: one stage per rank.

The split is common/parallel/pipeline.py's (contiguous blocks; the embedding on the first stage, the final norm and the
head on the last). This rank's part of the Llama becomes a `PipelineStage`, and `ScheduleGPipe` or
`Schedule1F1B` runs the micro-batches of each micro-step's batch through the stages, on gloo or nccl (their
sends and receives are batched non-blocking operations, so the library needs no reordering; mlx_impl/pp.py
writes the same schedules out with blocking send/recv). What made it work here (FACTS.md): stage inputs must be
contiguous (PipelineStage checks strides), and `scale_grads=False`, since the loss below is already a sum
scaled by 1 / global tokens, as under ddp (`scale_grads=True` would divide by the micro-batch count again).

Exact loss: the loss function of the last stage sums the masked token losses of a micro-batch in float64 and
keeps the sum; the targets and the mask ride together as one float64 target tensor (B, 2, T), which the
schedule cuts into micro-batches along with the inputs (token ids are exact in float64). The other stages hold
no loss, so the Trainer sums the loss over the world (`loss_over`). Eval (forward only, the whole batch as one
piece) is written out with dist.send / dist.recv.

The bubble: every training step runs between two barriers (a one-element all_reduce), so all stages see the
same window. A stage's busy time is its forward (hooks around the stage module; on the last stage the loss
too) plus its backward, timed by identity autograd functions at both ends of the stage (the first marks the
moment the gradient reaches the stage's output, the last the moment it leaves the stage's input), and the idle
fraction is 1 - busy / window, beside (p - 1) / (M + p - 1). Activation bytes sent are counted in the
first step's point-to-point sends (`comm_counter`). Mirrors mlx_impl/pp.py.
"""
from __future__ import annotations

import time
from typing import Iterator

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.utils._python_dispatch import TorchDispatchMode

from common.parallel.pipeline import bubble_fraction, stage_layers, stage_of
from common.train.protocols import no_phase
from common.checkpoint.sharded import local_pieces

from .ddp import _local_numpy, as_float32
from .load import load_local
from .model import cross_entropy

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
SENDS = ("c10d::send",)


class Pipeline:
    """The pp strategy (common/train/protocols.py): this rank's stage, its schedule, and the state across stages."""

    reduce_scatter = None
    full_state_on_every_rank = True  # export_state sums the stages' parts on every rank
    communicates = False             # no gradient is averaged; activations move inside forward_backward
    keeps_grads = False
    loss_over = "world"              # the last stage holds the loss sum

    def __init__(self, cfg, world, device: torch.device):
        self.device, self.stage, self.n_stages = device, dist.get_rank(), dist.get_world_size()
        self.first, self.last = self.stage == 0, self.stage == self.n_stages - 1
        self.n_micro, self.schedule = cfg.pp_microbatches, cfg.pp_schedule
        self.idle: list[float] = []  # per training step: this stage's measured idle fraction
        self.phase = no_phase
        self.pipe = None             # the schedule, built at the first step (it needs a micro-batch's shape)

    def wrap(self, model, source):
        """Keep this stage's part of the model while it is on the meta device, then allocate and load only that
        (torch_impl/load.py); the names stay HF's."""
        spec, inner = model.spec, model.model
        self.n_layers, self.layers = spec.n_layers, stage_layers(spec.n_layers, self.n_stages, self.stage)
        inner.layers = nn.ModuleList(layer if i in self.layers else nn.Module() for i, layer in enumerate(inner.layers))
        if not self.first:
            del inner.embed_tokens
        if not self.last:
            del inner.norm
            if hasattr(model, "lm_head"):
                del model.lm_head
        load_local(model, self.device, source, self.local_index)
        self.model, self.dtype, self.dim = model, inner.compute_dtype, spec.dim
        self.module = Stage(self)
        return model

    def local_index(self, name: str, shape: tuple) -> tuple | None:
        return () if stage_of(name, self.n_layers, self.n_stages) == self.stage else None

    def param_groups(self, model) -> list[dict]:
        return [{"params": list(model.parameters())}]

    def no_sync(self):
        raise AssertionError("pp accumulates in its own schedule")  # never asked: forward_backward is its own

    def comm_counter(self):
        return SendCounter()

    # ---- the schedule ---------------------------------------------------------------------------------------
    def forward_backward(self, trainer, batches, scale, phase=no_phase, wait=False, sync=True, counter=None,
                         backward=True):
        """-> the float64 sum of the token losses (the last stage's; 0 elsewhere). The gradients of (sum of
        token losses) x scale accumulate in the parameters' .grad."""
        if not backward:
            return self._eval(trainer, batches)
        self._barrier()
        start = time.perf_counter()
        self.busy, self.scale, self.sums, self.phase = 0.0, scale, [], phase
        with counter or NoCount():
            for inputs, targets, mask in batches:
                inputs, targets, mask = trainer.to_device(inputs, targets, mask)
                if self.pipe is None:
                    self._build(inputs)
                target = torch.stack([targets.double(), mask.double()], dim=1).contiguous()  # (B, 2, T)
                # forward and backward interleave inside: Stage and BackwardMark open their phases
                if self.first:
                    self.pipe.step(inputs.contiguous(), return_outputs=False)
                elif self.last:
                    self.pipe.step(target=target, return_outputs=False)
                else:
                    self.pipe.step(return_outputs=False)
                trainer.wait(wait)
        self._barrier()
        window = time.perf_counter() - start
        if not wait:  # the time breakdown's instrumented steps wait after every phase: not a bubble
            self.idle.append(max(0.0, 1.0 - self.busy / window) if window > 0 else 0.0)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        # the first step's shape inference runs the loss once more, on a micro-batch: the schedule's are the last
        return loss_sum + sum(self.sums[-self.n_micro * len(batches):]) if self.sums else loss_sum

    def _build(self, inputs):
        micro = inputs.shape[0] // self.n_micro
        example = (inputs[:micro].contiguous() if self.first else
                   torch.zeros((micro, inputs.shape[1], self.dim), dtype=self.dtype, device=self.device))
        self.stage_runner = PipelineStage(self.module, self.stage, self.n_stages, self.device, input_args=(example,))
        self.pipe = SCHEDULES[self.schedule](self.stage_runner, n_microbatches=self.n_micro,
                                             loss_fn=self._loss, scale_grads=False)  # on every stage: it turns the backward on

    def _loss(self, logits, target):
        """The last stage's loss of one micro-batch: the float64 sum of its masked token losses, times scale
        (its gradient is cast back to float32 exactly, as in torch_impl/step.py)."""
        t0 = time.perf_counter()
        with self.phase("forward"):
            losses = cross_entropy(logits.float(), target[:, 0].long())
            total = (losses.double() * target[:, 1].reshape(-1)).sum()
            self.sums.append(total.detach())
            out = BackwardMark.apply(total * self.scale, self, True)
        self.busy += time.perf_counter() - t0
        return out

    @torch.no_grad()
    def _eval(self, trainer, batches):
        """Forward only, each batch as one piece: activations down with dist.send / dist.recv."""
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for inputs, targets, mask in batches:
            inputs, targets, mask = trainer.to_device(inputs, targets, mask)
            if self.first:
                x = inputs
            else:
                x = torch.empty((inputs.shape[0], inputs.shape[1], self.dim), dtype=self.dtype, device=self.device)
                dist.recv(x, self.stage - 1)
            out = self.module.run(x)
            if self.last:
                loss_sum += (cross_entropy(out.float(), targets).double() * mask.reshape(-1)).sum()
            else:
                dist.send(out.contiguous(), self.stage + 1)
        return loss_sum

    def _barrier(self):
        dist.all_reduce(torch.zeros(1, device=self.device))

    # ---- the rest of the Strategy protocol -------------------------------------------------------------------
    @torch.no_grad()
    def global_norm(self, params, dtype: torch.dtype) -> torch.Tensor:
        """Each stage's sum of squares, summed over the stages: every parameter lives on exactly one."""
        norms = [torch.linalg.vector_norm(p.grad, dtype=dtype) for p in params if p.grad is not None]
        squares = torch.stack(norms).square().sum() if norms else torch.zeros((), dtype=dtype, device=self.device)
        dist.all_reduce(squares)
        return squares.sqrt()

    def export_state(self, params: dict, exp_avg: dict, exp_avg_sq: dict):
        return self.gather(params), self.gather(exp_avg), self.gather(exp_avg_sq)

    def local_state(self, shapes: dict, params: dict, exp_avg: dict, exp_avg_sq: dict):
        """--checkpoint-format sharded (common/checkpoint/sharded.py): (weights, exp_avg, exp_avg_sq, where) of
        this stage's own tensors, whole, under HF names; no collectives."""
        return local_pieces(self.stage, tuple(map(_local_numpy, (params, exp_avg, exp_avg_sq))), {}, shapes)

    def gather(self, named: dict[str, torch.Tensor]) -> Iterator[tuple[str, np.ndarray]]:
        """The whole model's arrays on every rank from each stage's own: an all_reduce per array, zeros from
        the stages that do not hold it (x + 0 is exact). Every rank calls it: collectives, in one order."""
        from common.model.weights import parameter_shapes

        for name, shape in parameter_shapes(self.model.spec).items():
            mine = stage_of(name, self.n_layers, self.n_stages) == self.stage
            value = (named[name].detach().float().clone() if mine else
                     torch.zeros(shape, dtype=torch.float32, device=self.device))
            dist.all_reduce(value)
            yield name, as_float32(value)

    def figures(self) -> dict:
        """The bubble: this stage's median idle fraction over the steps after the first (warm caches, the
        schedule's shape inference; the time breakdown's uninstrumented steps count too), beside the analytic
        value; and what the stage held."""
        steady = self.idle[1:] or self.idle
        return {"pp_bubble": float(np.median(steady)) if steady else None,
                "pp_bubble_analytic": bubble_fraction(self.n_stages, self.n_micro),
                "pp_schedule": self.schedule, "pp_microbatches": self.n_micro,
                "pp_layers": [self.layers.start, self.layers.stop]}


class Stage(nn.Module):
    """This rank's part of Llama.forward (torch_impl/model.py): tokens or activations in, activations or
    logits out (causal mask: the model is always called without a padding mask), timed for the bubble."""

    def __init__(self, pipeline: Pipeline):
        super().__init__()
        self.llama, self.pipeline = pipeline.model, [pipeline]  # a list: not a submodule

    def run(self, x: torch.Tensor) -> torch.Tensor:
        pp, inner = self.pipeline[0], self.llama.model
        h = inner.embed_tokens(x).to(pp.dtype) if pp.first else x
        for i in pp.layers:
            h = inner.layers[i](h, None)
        return self.llama.lm_head(inner.norm(h)) if pp.last else h

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pp, inner = self.pipeline[0], self.llama.model
        t0 = time.perf_counter()
        with pp.phase("forward"):
            h = BackwardMark.apply(inner.embed_tokens(x).to(pp.dtype) if pp.first else x, pp, False)
            for i in pp.layers:
                h = inner.layers[i](h, None)
            out = self.llama.lm_head(inner.norm(h)) if pp.last else BackwardMark.apply(h, pp, True)
        pp.busy += time.perf_counter() - t0
        return out


class BackwardMark(torch.autograd.Function):
    """Identity; its backward times the stage's backward: the mark at the output starts the clock and opens the
    "backward" phase, the mark at the input stops both (the embedding's own backward, a scatter-add, falls
    outside)."""

    @staticmethod
    def forward(ctx, x, pipeline, at_output):
        ctx.pipeline, ctx.at_output = pipeline, at_output
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        now = time.perf_counter()
        pp = ctx.pipeline
        if ctx.at_output:
            pp.backward_start, pp.backward_phase = now, pp.phase("backward")
            pp.backward_phase.__enter__()
        else:
            pp.busy += now - pp.backward_start
            pp.backward_phase.__exit__(None, None, None)
        return grad, None, None


class SendCounter(TorchDispatchMode):
    """Bytes given to point-to-point sends by the ops run under it (the activations and their gradients)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.name() in SENDS:  # floating point only: the first step's shape inference sends pickled bytes
            tensors = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            self.bytes += sum(t.numel() * t.element_size() for t in tensors if t.is_floating_point())
        return func(*args, **(kwargs or {}))


class NoCount:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
