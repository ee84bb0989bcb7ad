"""fsdp: sharded data parallelism (ZeRO-3 / FSDP2). Like ddp for the data, but each rank keeps 1/N of the
parameters, gradients and optimizer state, gathering parameters for compute. The framework code:
mlx_impl/fsdp.py (nn.fully_shard), torch_impl/fsdp.py (FSDP2's fully_shard).

Its cost (common/costmodel/, docs/scaling.md):

    f_work     1/N;  f_state the shard
    traffic    per micro-step each unit's fp32 parameters gathered: a block twice in torch (FSDP2 frees it after
               its forward and gathers it again for the backward), the other units once (the head stays gathered
               from its forward to its backward, the embedding's backward needs no weights, the root is never
               freed after its forward: torch_impl/fsdp.py), every unit once in MLX (the backward reuses the
               gathered output); their gradients reduce-scattered (torch once per step, MLX once per micro-step,
               mlx_impl/fsdp.py); the all_sum + slice fallback (MLX ring and MPI) is an all-reduce, twice the
               traffic. Units: every block, the embedding and the head (each its own; torch's root unit holds a
               tied embedding), the final norm: MLX all-reduces its gradient as under ddp, FSDP2 shards it as
               the root unit. Both pad the vocabulary to a multiple of N. (FsdpFramework below.)
    memory     the shards, and `gathered_bytes`: the whole parameters held beside them at the peak
    exposed    as ddp's rule, and where the calibration ran on a CPU, the fitted framework terms below
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from common.costmodel.links import Collective, Link
from common.costmodel.workload import Workload
from common.errors import UserError
from common.model.spec import ModelSpec
from common.model.weights import parameter_shapes
from common.parallel.layout import (DTYPE_BYTES, MASTER_BYTES, VOCAB_MATRICES, Layout, Measured, block_elements,
                                    largest_tensor_bytes, total_parameters)

# fsdp's framework terms where the calibration ran on a CPU, fitted on `small` at N=2 on the reference machine
# (docs/scaling.md "How well it predicts here": loopback, 1gbit and 200mbit in one sitting, then checked in
# another); unmeasured on GPUs, where they are 0:
#   FSDP_HOST_S_PER_CALL  torch: FSDP2's host work per collective call on 2 busy cores (its hooks, DTensor
#                         dispatch, copies into and out of its flat buffers), beyond the link's time
#   FSDP_HIDDEN_SHARE     MLX: the share of the forward and backward during which fsdp's collectives, nodes of
#                         the step's graph on their own stream (mlx_impl/fsdp.py), run hidden
#   HEAP_RELEASE_BYTES_PER_S  torch: how fast the heap its fsdp gives back to the OS twice per backward
#                         (torch_impl/fsdp.py, common/train/heap.py) is returned and faulted in again, on Linux without
#                         --tune-malloc; fitted on `small` and `base` at 12 and 24 layers, N=2 (heap_release_bytes)
FSDP_HOST_S_PER_CALL = {"torch": 7e-3}
# What the head's backward holds beyond its whole parameter and gradient, in vocabulary matrices, while the blocks'
# activations are still held (common/costmodel/model_memory.py's head phase). torch: FSDP2's reduce-scatter copies
# the whole gradient into its flat input and writes the rank's shard (1 + 1/2). MLX: fitted, as the state and
# activations of the head phase left the peak RSS of `small` fsdp x2 short by 113-197 MB (two to four 51 MB
# matrices) at global batch 4, 8 and 16 (AMD EPYC Zen 5, 2026-11-29, ring): its all-sum of the whole gradient
# (mlx_impl/fsdp.py) writes a second whole one, and the head's gradient, which the one-rank probe does not
# separate from its logits at every shape, a third. With these the three batches come out within 6 % of the peak,
# torch's within 4 % of the step's (docs/notes/2026-11-plan-model.md).
FSDP_HEAD_MATRICES = {"mlx": 3.0, "torch": 1.5}
FSDP_HIDDEN_SHARE = {"mlx": 0.2}
HEAP_RELEASE_BYTES_PER_S = {"torch": 2.5e9}

# The backends on which a framework has a reduce-scatter of its own, where it lacks one on others: MLX 0.32.4
# has mx.distributed.sum_scatter on nccl only (mlx_impl/fsdp.py). torch has reduce_scatter_tensor, which FSDP2
# calls, on gloo and nccl.
SUM_SCATTER_BACKENDS = {"mlx": ("nccl",)}
# Backends whose own reduce-scatter moves an all-reduce's bytes: gloo's reduce_scatter_tensor, 32 MB at N=2 over
# 200mbit, took 1,436 ms against all_reduce's 1,409 (a ring reduce-scatter would take half; AMD EPYC Zen 5,
# docs/scaling.md).
ALL_REDUCE_BYTES_BACKENDS = ("gloo",)

# What sets axis 0 of each transformer-block parameter, for the message that says what to change.
_AXIS0_FIELD = {"input_layernorm": "model.dim", "post_attention_layernorm": "model.dim", "q_proj": "model.dim",
                "o_proj": "model.dim", "down_proj": "model.dim", "gate_proj": "model.ffn_dim",
                "up_proj": "model.ffn_dim", "k_proj": "model.n_kv_heads x head_dim",
                "v_proj": "model.n_kv_heads x head_dim"}


def reduce_scatter_kind(framework: str, backend: str) -> str:
    """The reduce-scatter fsdp's gradients go through: "native", the framework's own, or "all_sum_slice", an
    all-reduce and then the rank's slice, where the framework has none on that backend (MLX's ring and MPI).
    summary.json's `reduce_scatter` and the report name it."""
    backends = SUM_SCATTER_BACKENDS.get(framework)
    return "native" if backends is None or backend in backends else "all_sum_slice"


def reduce_scatter_traffic(framework: str, backend: str) -> str:
    """What that reduce-scatter moves, for the cost model: "all_sum_slice" (an all-reduce's bytes, twice a ring
    reduce-scatter's) where it is an all-reduce or where the backend's own moves as many (gloo), else "native"."""
    if reduce_scatter_kind(framework, backend) == "all_sum_slice" or backend in ALL_REDUCE_BYTES_BACKENDS:
        return "all_sum_slice"
    return "native"


def fsdp_rows(length: int, rank: int, world_size: int) -> slice:
    """The rows of axis 0 (of `length`) a rank keeps under fsdp: torch.chunk's split, which FSDP2 uses.
    Every rank holds ceil(length / N) rows; the last ranks' blocks run short (or empty) where N does not
    divide, and the framework pads them with zero rows to the common size."""
    rows = -(-length // world_size)
    return slice(min(rank * rows, length), min((rank + 1) * rows, length))


@dataclass(frozen=True)
class FsdpFramework:
    """How a framework's fsdp shards and talks (the module docstring; mlx_impl/fsdp.py, torch_impl/fsdp.py)."""
    block_gathers: int               # gathers of a block per micro-step: MLX 1, FSDP2 2 (again for the backward)
    shards_root: bool                # FSDP2 shards the root unit (the final norm, and a tied embedding); MLX
    #                                  all-reduces the norm's gradient as ddp, its embedding a unit of its own
    scatters_every_micro_step: bool  # MLX reduce-scatters in every micro-step's backward; FSDP2 once a step
    gathers_in_compute_dtype: bool   # its gathered copies are in the compute dtype (MLX), or fp32 (FSDP2)
    gathers_tied_matrix_once: bool   # at the head's backward a tied matrix is held once (MLX), or as FSDP2's
    #                                  parameter and gradient


FSDP_FRAMEWORKS = {"mlx": FsdpFramework(1, False, True, True, True),
                   "torch": FsdpFramework(2, True, False, False, False)}


def fsdp_framework(framework: str) -> FsdpFramework:
    return FSDP_FRAMEWORKS.get(framework, FSDP_FRAMEWORKS["torch"])


class FsdpLayout(Layout):
    name: ClassVar[str] = "fsdp"
    # Its step is mostly all-gathers, so a run probes its own all-gather too: gloo's all_gather is CPU-bound
    # where its all-reduce is not (32 MB gathered at N=2 over loopback took 48 ms against the ring formula's
    # 16 ms from the all-reduce probe: docs/scaling.md), so the all-reduce alone mispredicts fsdp.
    measures_all_gather: ClassVar[bool] = True

    def check(self, spec: ModelSpec, cp_attention: str = "ulysses") -> None:
        """FSDP shards every transformer-block parameter along axis 0, so that axis must divide by N.

        MLX's nn.fully_shard cannot split an uneven axis; torch's FSDP2 could (it pads), but both frameworks
        run the same sharding. The embedding and the head need not divide: both frameworks pad the vocabulary
        to a multiple of N with zero rows (FSDP2 inside, mlx_impl/fsdp.py by hand), `fsdp_rows` above."""
        super().check(spec)
        n = self.ranks
        if n < 2:
            raise UserError("strategy fsdp shards the model over the ranks and needs 2 or more: pass --nproc 2 "
                            "(or more), or --strategy ddp")
        for name, shape in parameter_shapes(spec).items():
            if name.startswith("model.layers.") and shape[0] % n:
                field = _AXIS0_FIELD[name.split(".")[-2]]
                raise UserError(f"strategy fsdp cannot shard {name} of shape {shape} over {n} ranks: "
                                f"axis 0 ({shape[0]}, set by {field}) must divide by {n}; change "
                                f"{field} or --nproc, or use --strategy ddp")

    def local_parameters(self, spec: ModelSpec, framework: str = "torch") -> float:
        shapes, n = parameter_shapes(spec), self.ranks
        total = total_parameters(spec)
        if n == 1:
            return total
        blocks = block_elements(shapes)
        vocab = sum(math.prod(s) for k, s in shapes.items() if k in VOCAB_MATRICES)
        rest = total - blocks - vocab  # the final norm: MLX keeps it replicated, FSDP2 shards the root unit
        matrices = 1 if spec.tie_embeddings else 2  # both pad V up to a multiple of N (mlx_impl/fsdp.py, FSDP2)
        return (blocks / n + (rest / n if fsdp_framework(framework).shards_root else rest)
                + matrices * math.ceil(spec.vocab_size / n) * spec.dim)

    def work_fraction(self, w: Workload) -> float:
        return 1.0 / self.ranks

    def step_collectives(self, w: Workload, reduce_scatter: str) -> list[Collective]:
        shapes, n, fw = parameter_shapes(w.spec), self.ranks, fsdp_framework(w.framework)
        block = block_elements(shapes, 0) * MASTER_BYTES
        # the vocabulary matrices, padded to a multiple of N rows (mlx_impl/fsdp.py; FSDP2 pads the same)
        vocab = [math.ceil(s[0] / n) * n * s[1] * MASTER_BYTES for k, s in shapes.items() if k in VOCAB_MATRICES]
        norm = w.spec.dim * MASTER_BYTES
        # (unit's bytes, gathers per micro-step). MLX's gather is a node of the step's graph (mlx_impl/fsdp.py) and
        # its step times fit one gather per micro-step: measured on `small` at N=2 while two were counted, MLX fsdp
        # predicted +29 % over 1gbit and 200mbit, +33 % on loopback (docs/scaling.md); with one, within 15 % on
        # all three. FSDP2 frees a block after its forward and gathers it again for the backward; the other units
        # are gathered once (torch_impl/fsdp.py).
        blocks = [(block, fw.block_gathers)] * w.spec.n_layers
        if not fw.shards_root:  # MLX: blocks, and the embedding and head each on its own
            units = blocks + [(v, 1) for v in vocab]
            replicated = norm  # averaged after the backward, as ddp
        elif w.spec.tie_embeddings:  # FSDP2: the blocks, then the root unit (embedding, final norm)
            units, replicated = blocks + [(sum(vocab) + norm, 1)], 0
        else:  # FSDP2: the blocks, the embedding and the head each on its own, the root (final norm)
            units, replicated = blocks + [(v, 1) for v in vocab] + [(norm, 1)], 0
        gathers = sum(times for _, times in units)
        unit = int(sum(nbytes for nbytes, _ in units) / len(units))
        scatters = w.grad_accum if fw.scatters_every_micro_step else 1
        # one collective of the gathers' mean size: the bytes, the calls (latency) and the host work per call add up
        out = [Collective("all_gather", int(sum(nbytes * times for nbytes, times in units) / gathers),
                          gathers * w.grad_accum, "parameters gathered (forward" +
                          (")" if fw.block_gathers == 1 else "; the blocks again for the backward)"))]
        if reduce_scatter == "all_sum_slice":  # an all-reduce then the rank's slice: twice a reduce-scatter
            out.append(Collective("all_reduce", unit, scatters * len(units), "gradients (all_sum + slice)"))
        else:
            out.append(Collective("reduce_scatter", unit, scatters * len(units), "gradients"))
        if replicated:
            out.append(Collective("all_reduce", replicated, 1, "replicated gradients"))
        return out

    def payload_bytes_per_step(self, spec: ModelSpec, micro_batch_size: int, seq_len: int, grad_accum: int,
                               dtype: str) -> None:
        # No figure the runs count to compare with: MLX's counter sees only the replicated gradients' all-reduce,
        # torch's nothing (FSDP2's gathers run inside its hooks). benchmarks/bench_strategies.py shows the wire
        # bytes of `collectives` instead.
        return None

    def gathered_bytes(self, w: Workload) -> float:
        """The whole parameters (and gradients) a rank holds beyond its shards at the step's peak.

        torch (FSDP2): a block is gathered for its forward and freed after it (reshard_after_forward), gathered
        again for its backward, its whole gradient reduce-scattered: two blocks at a time (the one computing and
        the prefetch). The embedding and the head are units of their own (torch_impl/fsdp.py), padded to a
        multiple of N: at the head's backward its whole parameter and its whole gradient, 2 x one vocabulary
        matrix. MLX (nn.fully_shard, mlx_impl/fsdp.py) holds about as much, measured with its own allocator's
        peak (mx.get_peak_memory) on `base` at N=2: from 12 to 24 layers it grows by 953 MiB, 792 of them the
        shards' state and most of the rest activations, where keeping every gathered block from its forward to
        its backward, as this model once assumed (+21 % at 24 layers), would add 396 more (docs/benchmarks.md
        "Memory per rank"). Its peak RSS grows by 1.2 GiB: freed memory the process keeps, which the fitted
        factors absorb."""
        n = self.ranks
        if n == 1:
            return 0.0
        fw = fsdp_framework(w.framework)
        shapes = parameter_shapes(w.spec)
        blocks = [block_elements(shapes, i) for i in range(w.spec.n_layers)]
        matrix = math.ceil(w.spec.vocab_size / n) * n * w.spec.dim
        matrices = 1 if w.spec.tie_embeddings and fw.gathers_tied_matrix_once else 2
        return (2 * max(blocks) + matrices * matrix) * (DTYPE_BYTES[w.dtype] if fw.gathers_in_compute_dtype
                                                        else MASTER_BYTES)

    def head_gathered_bytes(self, w: Workload) -> float:
        """What the head's backward holds of its vocabulary matrix beyond gathered_bytes (its whole parameter and
        gradient) and beyond what the probe measured of the head at one rank: FSDP_HEAD_MATRICES matrices, where the
        head is a unit of its own (a tied matrix is reduced with the embedding's part, after the whole backward)."""
        if self.ranks == 1 or w.spec.tie_embeddings:
            return 0.0
        matrix = math.ceil(w.spec.vocab_size / self.ranks) * self.ranks * w.spec.dim * MASTER_BYTES
        return FSDP_HEAD_MATRICES.get(w.framework, 0.0) * matrix

    def streamed_checkpoint_bytes(self, w: Workload, rank: int) -> float:
        # Rank 0 holds one gathered tensor at a time (the largest sets the peak), the others nothing. Before the
        # stream it held the whole gathered state (3x the parameters), 0.9-1.0 GB above rank 1 on `base`
        # (docs/benchmarks.md).
        return 0.0 if rank > 0 else largest_tensor_bytes(w.spec)

    def heap_release_bytes(self, w: Workload) -> float:
        """torch fsdp: the freed heap its two releases per backward give back and the next micro-step faults in
        again (torch_impl/fsdp.py). Measured per step and rank at N=2 (common/train/heap.py's calls, RssAnon
        before and after): `small` 190-280 MiB, `base` 410-580 at 12 layers and 850-1,190 at 24; about one
        micro-batch's activations plus every block's whole weights (246, 584 and 1,120 MiB here), per
        micro-step."""
        return w.grad_accum * (self.activation_bytes(w) + block_elements(parameter_shapes(w.spec)) * MASTER_BYTES)

    def host_stretches(self, axis: str, framework: str) -> bool:
        """torch's: FSDP2 copies every gathered and reduce-scattered byte into and out of its flat buffers, work of
        the rank's own. Stretched on shared cores, measured on AMD EPYC Zen 4 (4 ranks on 2 cores, docs/scaling.md
        "Sitting 11"):
        - all 162 kept rows of sittings 5-10: 126 within 20 %, against 124;
        - held out, sitting 11's eight torch fsdp rows: mean |error| 7.1 %, against 12.4 %.
        MLX's gathers are nodes of its graph: not stretched (its fsdp rows moved away from 0)."""
        return framework == "torch"

    def unfitted_host_s(self, w: Workload, colls: list[Collective], on_cpu: bool, releases_heap: bool) -> float:
        """On a CPU: FSDP_HOST_S_PER_CALL per gather and reduce-scatter call, and where the run releases its heap
        (Calibration.releases_heap), the release and its faults (HEAP_RELEASE_BYTES_PER_S)."""
        if not (colls and on_cpu):
            return 0.0
        calls = FSDP_HOST_S_PER_CALL.get(w.framework, 0.0) * sum(c.calls for c in colls if c.kind != "all_reduce"
                                                                 or c.what.startswith("gradients"))
        rate = HEAP_RELEASE_BYTES_PER_S.get(w.framework)
        return calls + (self.heap_release_bytes(w) / rate if releases_heap and rate else 0.0)

    def exposed_comm_s(self, cal: Measured, colls: list[Collective], link: Link | None, comm_s: float) -> float:
        exposed = super().exposed_comm_s(cal, colls, link, comm_s)
        if colls and cal.on_cpu:  # MLX: part of the collectives runs hidden behind the forward and backward
            exposed = max(0.0, exposed - FSDP_HIDDEN_SHARE.get(cal.workload.framework, 0.0)
                          * (cal.forward_s + cal.backward_s) * self.work_fraction(cal.workload))
        return exposed
