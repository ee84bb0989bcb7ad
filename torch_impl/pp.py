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

The bubble, the layers and tensors a stage holds and its figures are common/parallel/pipeline_stage.py's
(`StageBookkeeping`, which `Pipeline` extends); the barriers around each training step are one-element
all_reduces. A stage's busy time is its forward (the stage module; on the last stage the loss too) plus its
backward, timed by identity autograd functions at both ends of the stage (the first marks the moment the
gradient reaches the stage's output, the last the moment it leaves the stage's input). Activation bytes sent
are counted in the first step's point-to-point sends (torch_impl/comm.py's SendCounter). Mirrors mlx_impl/pp.py.

Tied embeddings (common/parallel/embedding_group.py, Megatron-LM's embedding group): the first and the last
stage each hold the matrix, the last using it as its head, and forward_backward ends by summing its gradient
over the two (one all_reduce; the time breakdown's communication), before the norm; beyond 2 stages over a
sub-group of the two ranks (`dist.new_group`, every pipeline's built by every rank at wrap, on a mesh too),
where MLX's ring, which cannot split a group, sums over the whole pipeline.
"""
from __future__ import annotations

import time
from typing import Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

from common.checkpoint.sharded import LocalState, local_pieces
from common.checkpoint.tensorsource import TensorSource
from common.config import RunConfig
from common.parallel.pipeline_stage import BusyClock, StageBookkeeping
from common.train.protocols import Batch, ForwardBackwardResult, Phase, StateStream, World, no_phase

from .comm import CommCounter, SendCounter
from .load import load_local
from .microsteps import Grads, StepFunctions, to_device, wait_for
from .model import Llama, cross_entropy
from .grads import norm_dtype
from .adamw import AdamW
from .rank_state import as_float32, local_numpy, state_bytes

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


class Pipeline(StageBookkeeping):
    """The pp strategy (common/train/protocols.py): this rank's stage, its schedule, and the state across stages."""

    reduce_scatter = None
    full_state_on_every_rank = True  # export_state sums the stages' parts on every rank
    communicates = False             # no gradient is averaged; activations move inside forward_backward
    keeps_grads = False
    loss_over = "world"              # the last stage holds the loss sum

    def __init__(self, cfg: RunConfig, world: World, comm: CommCounter):
        super().__init__(cfg, world.rank, world.size)  # the job, or a mesh's pp axis (torch_impl/mesh.py)
        self.device, self.comm, self.group = torch.device(world.device), comm, world.group
        self.phase: Phase = no_phase
        self.clock = BusyClock()     # the step's busy time, which the stage module and BackwardMark add to
        self.pipe: PipelineScheduleSingle | None = None  # built at the first step (it needs a micro-batch's shape)
        self.sums: list[torch.Tensor] = []  # the last stage's loss sums of the step's micro-batches

    def wrap(self, model: Llama, source: TensorSource) -> Llama:
        """Keep this stage's part of the model while it is on the meta device, then allocate and load only that
        (torch_impl/load.py); the names stay HF's."""
        spec, inner = model.spec, model.model
        self.place(spec)
        inner.layers = nn.ModuleList(layer if i in self.layers else nn.Module() for i, layer in enumerate(inner.layers))
        if not self.holds_embedding:  # the first stage's, and the last's copy of a tied one
            del inner.embed_tokens
        if not self.last:
            del inner.norm
            if hasattr(model, "lm_head"):
                del model.lm_head
        self._split_stage(model)
        load_local(model, self.device, source, self.local_index)
        self.model, self.dtype, self.dim, self.vocab_size = model, inner.compute_dtype, spec.dim, spec.vocab_size
        self.module = Stage(self)
        self.tied_group = self._embedding_group()
        return model

    def _split_stage(self, model: Llama) -> None:
        """Where a mesh's tp axis splits the stage's blocks, before they are loaded (torch_impl/mesh.py's
        TensorParallelStages); one-axis pp keeps them whole."""

    def _embedding_group(self) -> dist.ProcessGroup | None:
        """The embedding group's process group. At 2 stages the pipeline's own group (on a mesh, this pipeline's,
        not the world's: the world's would also add the other dp replicas' gradients). Beyond, a group of the
        two ranks: new_group must be called by every rank of the job for every group, in one order, so each
        rank builds every pipeline's (EmbeddingGroup.job_groups) and keeps its own; a middle stage keeps none."""
        if not self.embedding.tied or self.embedding.spans_pipeline:
            return self.group
        rank, mine = dist.get_rank(), None
        for ranks in self.embedding.job_groups(self.mesh):
            group = dist.new_group(ranks)
            mine = group if rank in ranks else mine
        return mine

    # ---- the schedule ---------------------------------------------------------------------------------------
    def forward_backward(self, step: StepFunctions, batches: Sequence[Batch], scale: float,
                         phase: Phase = no_phase, wait: bool = False,
                         sync: bool = True) -> ForwardBackwardResult[torch.Tensor, Grads]:
        """-> (the float64 sum of the token losses (the last stage's; 0 elsewhere), the stage's gradients of
        (sum of token losses) x scale, accumulated in the parameters' .grad). `step` goes unused: the stage runs
        its own module."""
        self.scale, self.sums, self.phase = scale, [], phase
        pipe = self.pipe
        with self.comm.first_step(SendCounter):
            with self.step_window(self._barrier, instrumented=wait) as clock:
                self.clock = clock
                for batch in batches:
                    inputs, targets, mask = to_device(self.device, *batch)
                    if pipe is None:
                        pipe = self.pipe = self._build(inputs)
                    target = torch.stack([targets.double(), mask.double()], dim=1).contiguous()  # (B, 2, T)
                    # forward and backward interleave inside: Stage and BackwardMark open their phases
                    if self.first:
                        pipe.step(inputs.contiguous(), return_outputs=False)
                    elif self.last:
                        pipe.step(target=target, return_outputs=False)
                    else:
                        pipe.step(return_outputs=False)
                    wait_for(wait, self.device)
            if sync and self.embedding.tied:
                with phase("communication"):
                    self._sum_tied_gradient()
                    wait_for(wait, self.device)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        # the schedule's losses are the last ones (the library's shape inference, skipped by _build, would add one)
        if self.sums:
            loss_sum = loss_sum + sum(self.sums[-self.n_micro * len(batches):])
        return ForwardBackwardResult(loss_sum, [p.grad for p in self.model.parameters() if p.grad is not None])

    @torch.no_grad()
    def _sum_tied_gradient(self) -> None:
        """The tied matrix's gradient summed over the embedding group, after the step's window (no bubble) and
        before the norm: each copy then holds the lookup's and the head's parts, as one rank's gradient does,
        and AdamW keeps the copies equal. A middle stage is not in the group and does nothing."""
        if not self.holds_embedding:
            return
        grad = self.model.model.embed_tokens.weight.grad
        assert grad is not None, "both ends of the pipeline use the tied matrix every step"
        dist.all_reduce(grad, group=self.tied_group)

    def _build(self, inputs: torch.Tensor) -> PipelineScheduleSingle:
        """The schedule over this rank's PipelineStage, shaped by a micro-batch of `inputs`."""
        micro, seq_len = inputs.shape[0] // self.n_micro, inputs.shape[1]
        example = (inputs[:micro].contiguous() if self.first else
                   torch.zeros((micro, seq_len, self.dim), dtype=self.dtype, device=self.device, requires_grad=True))
        # The output given too (activations, or the last stage's logits, in the compute dtype; requiring a gradient,
        # which the schedule then passes back): the stages skip the library's shape inference, which would run a
        # micro-batch's forward more in the first step (and on a mesh's tp axis its all-reduces, which that
        # step's count would take for every step's).
        output = torch.zeros((micro, seq_len, self.vocab_size if self.last else self.dim), dtype=self.dtype,
                             device=self.device, requires_grad=True)
        self.stage_runner = PipelineStage(self.module, self.stage, self.n_stages, self.device, input_args=(example,),
                                          output_args=(output,), group=self.group)
        return SCHEDULES[self.schedule](self.stage_runner, n_microbatches=self.n_micro,
                                        loss_fn=self._loss, scale_grads=False)  # on every stage: it turns the backward on

    def _loss(self, logits, target):
        """The last stage's loss of one micro-batch: the float64 sum of its masked token losses, times scale
        (its gradient is cast back to float32 exactly, as in torch_impl/step.py)."""
        with self.clock.busy(), self.phase("forward"):
            losses = cross_entropy(logits.float(), target[:, 0].long())
            total = (losses.double() * target[:, 1].reshape(-1)).sum()
            self.sums.append(total.detach())
            out = BackwardMark.apply(total * self.scale, self, True)
        return out

    @torch.no_grad()
    def eval_losses(self, step: StepFunctions, batches: Sequence[Batch]) -> torch.Tensor:
        """Forward only, each batch as one piece: activations down with dist.send / dist.recv."""
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for batch in batches:
            inputs, targets, mask = to_device(self.device, *batch)
            if self.first:
                x = inputs
            else:
                x = torch.empty((inputs.shape[0], inputs.shape[1], self.dim), dtype=self.dtype, device=self.device)
                dist.recv(x, group=self.group, group_src=self.stage - 1)
            out = self.module.run(x)
            if self.last:
                loss_sum += (cross_entropy(out.float(), targets).double() * mask.reshape(-1)).sum()
            else:
                dist.send(out.contiguous(), group=self.group, group_dst=self.stage + 1)
        return loss_sum

    def _barrier(self):
        dist.all_reduce(torch.zeros(1, device=self.device), group=self.group)

    # ---- the rest of the Strategy protocol (local_index and figures: StageBookkeeping's) -------------------------
    @torch.no_grad()
    def optimizer(self, base: AdamW) -> AdamW:
        return base  # the stage's whole parameters

    def state_bytes(self, model: nn.Module, optimizer: AdamW) -> dict[str, int]:
        return state_bytes(model, optimizer)

    def global_norm(self, grads: Grads) -> torch.Tensor:
        """Each stage's sum of squares, summed over the stages: every parameter lives on exactly one, a tied
        matrix counted on the first stage only."""
        dtype = norm_dtype(self.device)
        uncounted = self._uncounted_grads()
        norms = [torch.linalg.vector_norm(g, dtype=dtype) for g in grads if id(g) not in uncounted]
        squares = torch.stack(norms).square().sum() if norms else torch.zeros((), dtype=dtype, device=self.device)
        dist.all_reduce(squares, group=self.group)
        return squares.sqrt()

    def export_state(self, weights: Mapping[str, torch.Tensor], exp_avg: Mapping[str, torch.Tensor],
                     exp_avg_sq: Mapping[str, torch.Tensor]) -> tuple[StateStream, StateStream, StateStream]:
        return self.gather(weights, self._all_sum, as_float32), self.gather(exp_avg, self._all_sum, as_float32), \
            self.gather(exp_avg_sq, self._all_sum, as_float32)

    def local_state(self, shapes: Mapping[str, tuple[int, ...]], weights: Mapping[str, torch.Tensor],
                    exp_avg: Mapping[str, torch.Tensor], exp_avg_sq: Mapping[str, torch.Tensor]) -> LocalState:
        """--checkpoint-format sharded (common/checkpoint/sharded.py): (weights, exp_avg, exp_avg_sq, where) of
        this stage's own tensors, whole, under HF names (a tied matrix: the first stage's copy); no collectives."""
        own = (self.counted(local_numpy(weights)), self.counted(local_numpy(exp_avg)),
               self.counted(local_numpy(exp_avg_sq)))
        return local_pieces(self.stage, own, {}, shapes)

    def _uncounted_grads(self) -> set[int]:
        """The gradients this stage holds but does not count in the norm: its copy of a tied matrix (last stage)."""
        return {id(p.grad) for name, p in self.model.named_parameters() if not self.counts(name) and p.grad is not None}

    def _all_sum(self, value: torch.Tensor | None, shape: tuple[int, ...]) -> np.ndarray:
        """One tensor of export_state summed over the stages (StageBookkeeping.gather): zeros where not held."""
        mine = (value.detach().float().clone() if value is not None else
                torch.zeros(shape, dtype=torch.float32, device=self.device))
        dist.all_reduce(mine, group=self.group)
        return as_float32(mine)


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
        return self.head(inner.norm(h)) if pp.last else h

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """The last stage's output head: lm_head, or its copy of the tied embedding."""
        inner = self.llama.model
        return inner.embed_tokens.as_linear(h) if self.pipeline[0].embedding.tied else self.llama.lm_head(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pp, inner = self.pipeline[0], self.llama.model
        with pp.clock.busy(), pp.phase("forward"):
            h = BackwardMark.apply(inner.embed_tokens(x).to(pp.dtype) if pp.first else x, pp, False)
            for i in pp.layers:
                h = inner.layers[i](h, None)
            out = self.head(inner.norm(h)) if pp.last else BackwardMark.apply(h, pp, True)
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
            pp.clock.busy_s += now - pp.backward_start
            pp.backward_phase.__exit__(None, None, None)
        return grad, None, None
