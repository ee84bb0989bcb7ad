"""tp: tensor parallelism (Megatron). Each layer's matrices are split over the ranks, and every rank reads the
whole global batch, so a tp run at N ranks computes what one ddp rank computes. The framework code:
mlx_impl/tp.py, torch_impl/tp.py; the split below is shared by both and by the checkpoint code.

Megatron's pairing: a column-parallel layer (output features split) feeds a row-parallel one (input features
split), so the activations between them stay on their rank and each pair needs one all-reduce forward (after
the row-parallel layer) and one backward (into the column-parallel layers' common input). q/k/v split by head,
so each rank runs n_heads/N query heads and n_kv_heads/N kv heads; with contiguous head blocks, rank r's query
heads are exactly those its kv heads serve (GQA).

The embedding, the norms and lm_head stay replicated: they are small next to the layers (except the vocabulary
matrices), their inputs are replicated anyway, and replicas get identical gradients with no communication.
Sharding the vocabulary would split embed_tokens by rows (a masked lookup plus an all-reduce) and lm_head by
output rows, with a vocab-parallel cross-entropy (all-reduces of the max and of the sum of exp over the shards)
so that full logits never exist on one rank: worth it when the vocabulary dominates memory (base: 2 x 50000 x
768 of its 86M parameters).

Its cost (common/costmodel/, docs/scaling.md):

    f_work     the split layers' and attention's FLOPs over N, plus the replicated lm_head over the whole batch:
               (6 P_layers / N + 12 L T d / N + 6 V d) / flops_per_token
    f_state    the split layers over N, the rest whole
    traffic    per layer and micro-step 4 all-reduces of the activations (B x T x dim) in the compute dtype
    memory     the heads' and the FFN's activations split over N, the rest whole, of the whole batch
    exposed    its all-reduces sit on the critical path: never overlapped
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
from common.parallel.layout import DTYPE_BYTES, Layout, Measured, largest_tensor_bytes, layer_and_head_flops

TP_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # weight (out, in): rows split
TP_ROW = ("o_proj", "down_proj")                                     # weight (out, in): columns split


def tp_split_axis(name: str) -> int | None:
    """The axis of an HF-named weight that tensor parallelism splits; None for a replicated one."""
    parts = name.split(".")
    layer = parts[-2] if len(parts) >= 2 else ""
    if layer in TP_COLUMN:
        return 0
    if layer in TP_ROW:
        return 1
    return None


def tp_shard(name: str, full, rank: int, world_size: int):
    """This rank's contiguous block of a full array (numpy or anything with the same slicing)."""
    index = tp_index(name, full.shape, rank, world_size)
    return full[index] if index else full


def tp_index(name: str, shape: tuple, rank: int, world_size: int) -> tuple:
    """The index (common/checkpoint/tensorsource.py's Index) of this rank's block of a whole tensor; () reads it all."""
    axis = tp_split_axis(name)
    if axis is None:
        return ()
    size = shape[axis] // world_size
    return (slice(None),) * axis + (slice(rank * size, (rank + 1) * size),)


class TpLayout(Layout):
    name: ClassVar[str] = "tp"
    reads_whole_batch: ClassVar[bool] = True

    def host_unit(self, framework: str) -> str:
        """torch's by the call: DTensor dispatches and redistributes around each all-reduce, whatever it carries,
        so a mesh's tp groups, which make as many calls on half the rows (dp=2,tp=2), pay what tp x2 paid. Over
        the 108 kept runs of docs/scaling.md's sittings 5-8, torch's tp meshes within 20 %: 10 of 14 per call, 7
        per byte (mean |error| 13.4 % against 19.9 %). MLX's all-reduces sit inside its graph, with no dispatch
        per call: per byte (its tp meshes 12 of 18 within 20 %, 10 per call)."""
        return "call" if framework == "torch" else "byte"

    def check(self, spec: ModelSpec, cp_attention: str = "ulysses") -> None:
        """TP splits heads, KV heads and the FFN width over the ranks: each must divide by N."""
        super().check(spec)
        n = self.ranks
        if n < 2:
            raise UserError("--strategy tp splits each layer over the ranks and needs at least 2 (--nproc 2); "
                            "use --strategy ddp for one rank")
        for field in ("n_heads", "n_kv_heads", "ffn_dim"):
            value = getattr(spec, field)
            if value % n:
                raise UserError(f"--strategy tp over {n} ranks splits model.{field} = {value}, which is "
                                f"not divisible by {n}: run on a number of ranks that divides {value}, or "
                                f"--set model.{field}=N with N a multiple of {n}")

    def local_parameters(self, spec: ModelSpec, framework: str = "torch") -> float:
        shapes = parameter_shapes(spec)
        total = sum(math.prod(s) for s in shapes.values())
        if self.ranks == 1:
            return total
        split = sum(math.prod(s) for k, s in shapes.items() if tp_split_axis(k) is not None)
        return total - split + split / self.ranks

    def work_fraction(self, w: Workload) -> float:
        n = self.ranks
        if n == 1:
            return 1.0 / n
        layers, head, total = layer_and_head_flops(w)
        return (layers / n + head) / total

    def all_reduce_bytes(self, rows: float, seq_len: int, spec: ModelSpec, dtype: str) -> float:
        """One all-reduce's payload: the activations (rows, T, dim) in the compute dtype."""
        return rows * seq_len * spec.dim * DTYPE_BYTES[policy(dtype).compute_dtype]

    def all_reduces_per_step(self, spec: ModelSpec, grad_accum: int) -> int:
        """Per layer and micro-step, 2 forward (after o_proj and down_proj) and 2 backward (into q/k/v's and
        gate/up's common input)."""
        return 4 * spec.n_layers * grad_accum

    def step_collectives(self, w: Workload, reduce_scatter: str) -> list[Collective]:
        act = self.all_reduce_bytes(w.micro_rows(self.dp_size), w.seq_len, w.spec, w.dtype)
        return [Collective("all_reduce", int(act), self.all_reduces_per_step(w.spec, w.grad_accum), "activations")]

    def payload_bytes_per_step(self, spec: ModelSpec, micro_batch_size: int, seq_len: int, grad_accum: int,
                               dtype: str) -> int:
        # The collectives' payload, calls x nbytes: 4 x layers x B x T x dim x compute bytes x grad_accum
        return int(self.all_reduces_per_step(spec, grad_accum) * self.all_reduce_bytes(micro_batch_size, seq_len,
                                                                                       spec, dtype))

    @property
    def activation_split(self) -> int:
        return self.ranks

    def streamed_checkpoint_bytes(self, w: Workload, rank: int) -> float:
        return largest_tensor_bytes(w.spec)  # every rank gathers one tensor at a time

    def exposed_comm_s(self, cal: Measured, colls: list[Collective], link: Link | None, comm_s: float) -> float:
        return float(comm_s)  # on the critical path: the next layer needs the sum
