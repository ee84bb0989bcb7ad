"""pp: pipeline parallelism. Each rank holds a contiguous run of blocks (a stage, common/parallel/pipeline.py);
activations flow down the stages, their gradients back up, micro-batch by micro-batch. Every rank reads the
whole global batch (no data parallelism beside it), like tp. The framework code: mlx_impl/pp.py, torch_impl/pp.py.

Its cost (common/costmodel/, docs/scaling.md):

    f_work     the slowest stage's share of the FLOPs (its blocks, plus the head on the last; the embedding on
               the first is a lookup), inflated by the bubble to (M + p - 1) / M slots of one piece each
               (M pieces per micro-step, --pp-microbatches)
    f_state    the stage that holds the most: its blocks and the embedding, or the norm and the head (with
               tied embeddings the last stage holds a copy of the embedding as its head)
    traffic    point to point, not a ring: per micro-step and piece each stage boundary carries the piece's
               activations (rows x T x dim, compute dtype) down and their gradient back up, t_send = a + S / b
               each (boundaries work side by side). Tied embeddings add one all-reduce per optimizer step of
               the tied gradient (V x dim, float32) over the embedding group, the first and the last stage
               (common/parallel/embedding_group.py), after the backward: on the critical path
    memory     the first stage's blocks' activations, for every piece of a micro-step (as gpipe keeps them)
    exposed    only the critical path, played op by op (pipeline_timing.py): each stage runs its schedule's
               computations and sends in order, a piece's slot being the rank's own compute of it (in a mesh its
               data rank's rows and its share of the blocks, on shared cores as long as it runs there); a send is
               buffered and crosses its boundary's link, one message at a time per direction, each boundary at its
               own link (over two levels pp x4 on machines of two crosses one slow hop of three), in the order
               the framework posts them. What the sends add to the micro-step is the wait. Over two stages, sends
               shorter than a piece cost MLX's 1f1b 2M - 2 of them (a piece's gradient leaves the last stage after
               the next activation arrives), torch's M (it posts that gradient with the next receive), gpipe two
               (fill and drain); the closed form this replaced, two sends per slot where they outlasted it plus
               fill and drain, is in docs/scaling.md ("Sitting 16"). The tied gradient's all-reduce (2 ranks)
               adds its whole time. Nothing else overlaps.
"""
from __future__ import annotations

import math
from typing import ClassVar

from common.costmodel.links import Collective, Link
from common.costmodel.workload import Workload
from common.errors import UserError
from common.model.precision import policy
from common.model.spec import ModelSpec
from common.model.weights import parameter_shapes
from common.parallel.layout import (DTYPE_BYTES, Layout, Measured, largest_tensor_bytes, layer_and_head_flops,
                                    total_parameters)
from common.parallel.embedding_group import EmbeddingGroup
from common.parallel.pipeline import BATCHED_P2P, comm_bytes_per_step, sender_waits, stage_holds, stage_layers
from common.parallel.pipeline_timing import micro_step_s


class PpLayout(Layout):
    name: ClassVar[str] = "pp"
    reads_whole_batch: ClassVar[bool] = True

    def check(self, spec: ModelSpec, cp_attention: str = "ulysses") -> None:
        """One stage per rank, each with at least one transformer block. Tied embeddings are held by the first
        and the last stage, their gradient summed between them (common/parallel/embedding_group.py)."""
        super().check(spec)
        n = self.ranks
        if n < 2:
            raise UserError("--strategy pp puts one pipeline stage on each rank and needs at least 2 (--nproc 2); "
                            "use --strategy ddp for one rank")
        if spec.n_layers < n:
            raise UserError(f"--strategy pp over {n} stages needs at least one transformer block per stage, "
                            f"but model.n_layers = {spec.n_layers} < {n}: use --nproc {spec.n_layers} or fewer, "
                            f"or --set model.n_layers={n}")

    def check_batch(self, global_batch: int, grad_accum: int, pp_microbatches: int) -> None:
        """Each micro-step's batch (global batch / grad accum) is cut into --pp-microbatches equal pieces."""
        per_step = global_batch // grad_accum
        if pp_microbatches <= 0 or per_step % pp_microbatches:
            raise UserError(f"--pp-microbatches {pp_microbatches} must divide the batch of each micro-step: global "
                            f"batch size {global_batch} / grad accum {grad_accum} = {per_step} sequences; use a "
                            f"divisor of {per_step}")

    def local_parameters(self, spec: ModelSpec, framework: str = "torch") -> float:
        n = self.ranks
        if n == 1:
            return total_parameters(spec)
        shapes, group = parameter_shapes(spec), EmbeddingGroup.of(spec, n)
        return max(sum(math.prod(s) for k, s in shapes.items() if stage_holds(k, spec.n_layers, stage, group))
                   for stage in range(n))

    def work_fraction(self, w: Workload) -> float:
        return self.stage_work_fraction(w)

    def stage_work_fraction(self, w: Workload, block_split: int = 1) -> float:
        """The slowest stage's share of the FLOPs, inflated by the bubble; `block_split`: the ranks each stage's
        blocks are split over (a mesh's tp axis; the head stays whole on the last stage, as tp keeps it)."""
        n = self.ranks
        if n == 1:
            return 1.0 / n
        layers, head, total = layer_and_head_flops(w)
        per_block = layers / w.spec.n_layers / block_split
        slowest = max(len(stage_layers(w.spec.n_layers, n, s)) * per_block + (head if s == n - 1 else 0.0)
                      for s in range(n))
        m = w.pp_microbatches
        return slowest / total * (m + n - 1) / m

    def rank_work_fraction(self, w: Workload) -> float:
        """What one rank of a stage computes, the bubble included: in a mesh its stage's blocks are split over
        the tp axis and its rows are the data axis's slice (composed.py's work_fraction), so a piece's slot is
        that much shorter than the stage's whole piece; alone, the stage's work_fraction."""
        tp = self.mesh.axis("tp") if self.mesh.has("tp") else 1
        return self.stage_work_fraction(w, block_split=tp) / self.dp_size

    def busy_fraction(self, w: Workload) -> float:
        """The slowest stage's share without the bubble: its idle slots leave the core to other ranks."""
        return self.work_fraction(w) * w.pp_microbatches / (w.pp_microbatches + self.ranks - 1)

    def send_bytes(self, rows: float, seq_len: int, spec: ModelSpec, dtype: str) -> float:
        """One message across a boundary: the activations (rows, T, dim), or their gradient, in the compute dtype."""
        return rows * seq_len * spec.dim * DTYPE_BYTES[policy(dtype).compute_dtype]

    def step_collectives(self, w: Workload, reduce_scatter: str) -> list[Collective]:
        """One boundary's sends per step: each piece's activations down and their gradient up; with tied
        embeddings, the tied gradient's all-reduce over the embedding group."""
        piece = self.send_bytes(w.micro_rows(self.dp_size) / w.pp_microbatches, w.seq_len, w.spec, w.dtype)
        sends = [Collective("send", int(piece), 2 * w.pp_microbatches * w.grad_accum, "activations and their gradients")]
        tied = self.embedding_group(w.spec).gradient_bytes(w.spec)
        return sends + ([Collective("all_reduce", tied, 1, "the tied embedding's gradient, first + last stage")]
                        if tied else [])

    def embedding_group(self, spec: ModelSpec) -> EmbeddingGroup:
        return EmbeddingGroup.of(spec, self.ranks)

    def payload_bytes_per_step(self, spec: ModelSpec, micro_batch_size: int, seq_len: int, grad_accum: int,
                               dtype: str) -> int:
        # What the run counts: the bytes rank 0 (the first stage) sends, the whole global batch's activations to
        # the next stage (common/parallel/pipeline.py): one direction of one boundary, so half the payload of
        # `collectives`, which count the gradients coming back up too; and the tied gradient it all-reduces.
        return comm_bytes_per_step(micro_batch_size * grad_accum, seq_len, spec.dim,
                                   DTYPE_BYTES[policy(dtype).compute_dtype]) + \
            self.embedding_group(spec).gradient_bytes(spec)

    def activation_layers(self, spec: ModelSpec) -> int:
        return len(stage_layers(spec.n_layers, self.ranks, 0))

    def streamed_checkpoint_bytes(self, w: Workload, rank: int) -> float:
        # one gathered tensor at a time, and the zeros a rank adds for a tensor of another stage
        return 2 * largest_tensor_bytes(w.spec)

    def exposed_comm_s(self, cal: Measured, colls: list[Collective], link: Link | None, comm_s: float) -> float:
        """What its sends add to the critical path (module docstring): the micro-step played op by op with the
        sends and without (pipeline_timing.py), each boundary at its own link's pace (`Link.stage_hops`: one slow
        hop of three for pp x4 on machines of two), times the micro-steps; plus the tied gradient's all-reduce."""
        if not colls or link is None:
            return super().exposed_comm_s(cal, colls, link, comm_s)
        w, n = cal.workload, self.ranks
        # a piece's slot: the rank's own compute (its rows, its blocks' share), as long as it runs on shared cores
        compute_fwd_bwd_s = (cal.forward_s + cal.backward_s) * self.rank_work_fraction(w) * cal.cores_shared_by
        sends, m = [hop.send_s(colls[0].nbytes, n) for hop in link.stage_hops or (link,) * (n - 1)], w.pp_microbatches
        slot_s = compute_fwd_bwd_s / (w.grad_accum * (m + n - 1))
        # the tied gradient's all-reduce between the backward and the optimizer: nothing to hide it behind
        tied_s = sum(c.seconds(link, len(self.embedding_group(w.spec).stages)) for c in colls[1:])
        # the pieces' compute, split as the calibration's forward and backward are, played with and without
        # the sends (pipeline_timing.py): what the sends add is what the step waits for
        forward_share = cal.forward_s / (cal.forward_s + cal.backward_s) if cal.forward_s + cal.backward_s else 0.5
        f_s, b_s = slot_s * forward_share, slot_s * (1 - forward_share)
        batched = w.framework in BATCHED_P2P  # the order the framework posts its sends and receives
        # a piece past the backend's buffers holds its sender until the receiver posts: the waits that adds are the
        # sends' too, so the played step without sends stays buffered
        rendezvous = sender_waits(cal.backend, colls[0].nbytes)
        waits = (micro_step_s(w.pp_schedule, n, m, f_s, b_s, sends, batched, rendezvous)
                 - micro_step_s(w.pp_schedule, n, m, f_s, b_s, [0.0] * len(sends), batched))
        return w.grad_accum * waits + tied_s
