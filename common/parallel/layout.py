"""What every strategy object answers (`Layout`), and the counts they share.

A strategy is one object here (common/parallel/ddp.py, fsdp.py, tp.py, pp.py, registered in
common/parallel/__init__.py's STRATEGIES) plus one class per framework (mlx_impl/, torch_impl/). The object
holds everything the framework-neutral code knows about the strategy, so nothing in common/ tests its name:

    the run          check (refusals), check_batch, data_parallel (which slice of the batch a rank reads)
    the state        local_parameters (what a rank holds and updates), state_fraction
    the work         work_fraction (f_work: one rank's share of the global batch's FLOPs)
    the traffic      collectives (per optimizer step), axis_collectives (the same per mesh axis, with the size of
                     its groups), comm_bytes_per_step_estimate (summary.json)
    the memory       activation_bytes, gathered_bytes, checkpoint_bytes, copies_gradients_for_reduce
    the time         exposed_comm_s (what the link adds to the step), host_s (host work beyond the link's:
                     fitted per byte moved on an N=2 run where there is one, common/costmodel/fit.py)

The cost model (common/costmodel/, docs/scaling.md) composes these into a step's time and memory. An object
is built on a Mesh (common/parallel/mesh.py) and reads its own axis, named after it (ddp's is `dp`). A run of one
strategy has a mesh of one axis, so its `ranks` is the world size; `--mesh` composes several objects over the
axes of one Mesh (common/parallel/composed.py's MeshLayout), each reading its own axis and the mesh's data axis.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Mapping, Protocol

from common.costmodel.links import Collective, Link
from common.costmodel.workload import Workload
from common.errors import UserError
from common.model.flops import attention_flops_per_token, flops_per_token, matmul_parameters
from common.model.spec import ModelSpec
from common.model.weights import parameter_shapes
from common.parallel.mesh import STRATEGY_AXIS, Mesh

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
MASTER_BYTES = 4          # master weights, gradients, AdamW state and the gradient reduction stay fp32
# The share of a step's collectives hidden behind compute where no calibration run measured it: 0, measured on
# the reference machine (docs/benchmarks.md: the gradient sync of `small` at N=2 costs as much as the isolated
# all-reduce in MLX and more in torch: on 2 busy cores nothing overlaps).
DEFAULT_OVERLAP = 0.0
VOCAB_MATRICES = ("model.embed_tokens.weight", "lm_head.weight")


class Measured(Protocol):
    """What a calibration says of one step (common/costmodel/calibrate.py's Calibration), as far as a strategy's
    exposed-communication rule reads it (read-only: a Calibration is frozen)."""
    @property
    def workload(self) -> Workload: ...
    @property
    def forward_s(self) -> float: ...
    @property
    def backward_s(self) -> float: ...
    @property
    def overlap(self) -> float | None: ...
    @property
    def sync_overhead_s(self) -> float: ...
    @property
    def on_cpu(self) -> bool: ...
    @property
    def cores_shared_by(self) -> float: ...
    @property
    def backend(self) -> str: ...


def total_parameters(spec: ModelSpec) -> int:
    return sum(math.prod(s) for s in parameter_shapes(spec).values())


def block_elements(shapes: dict, layer: int | None = None) -> int:
    """Parameter elements of transformer block `layer`, or of every block (None), from parameter_shapes."""
    prefix = "model.layers." if layer is None else f"model.layers.{layer}."
    return sum(math.prod(shape) for name, shape in shapes.items() if name.startswith(prefix))


def largest_tensor_bytes(spec: ModelSpec) -> int:
    return max(math.prod(s) for s in parameter_shapes(spec).values()) * MASTER_BYTES


def layer_and_head_flops(w: Workload) -> tuple[float, float, float]:
    """Per token, forward + backward: (every block's FLOPs, the head's, the whole model's), from
    common/model/flops.py's count. The embedding is a lookup: no FLOPs."""
    head = 6.0 * w.spec.vocab_size * w.spec.dim
    layers = 6.0 * matmul_parameters(w.spec) - head + attention_flops_per_token(w.spec, w.seq_len)
    return layers, head, flops_per_token(w.spec, w.seq_len)


@dataclass(frozen=True)
class AxisCollectives:
    """The collectives a step runs on one mesh axis: each call runs within one group of `group_size` ranks
    (common/parallel/mesh.py `groups`), every group of the axis at the same time."""
    axis: str
    group_size: int
    collectives: list[Collective]


@dataclass(frozen=True)
class Layout(ABC):
    """One strategy over a mesh: its checks, its data slicing, and its cost terms (module docstring)."""
    mesh: Mesh

    name: ClassVar[str]                                # --strategy, and the mesh axis it splits over
    reads_whole_batch: ClassVar[bool] = False          # one model replica between the ranks (nothing averaged)
    supports_biases: ClassVar[bool] = False            # Linear biases (model.attention_bias, model.mlp_bias)
    measures_all_gather: ClassVar[bool] = False        # a run probes its own all-gather too (common/train/loop.py)
    # Its collectives run inside forward and backward, where the time breakdown (common/train/breakdown.py)
    # cannot tell them from compute: a calibration run takes the model's estimate of them off its step instead
    # of measuring an overlap from the breakdown's `communication`.
    collectives_inside_compute: ClassVar[bool] = True
    # Every rank holds the whole training state after each step: when one rank is lost, a survivor can save
    # the last completed step without any collective (common/train/rescue.py), so a restart loses no step.
    state_survives_a_lost_rank: ClassVar[bool] = False
    # LoRA adapters beside a frozen base (common/model/lora.py): a strategy that splits or shards the model would
    # have to split the adapters with it; only ddp, which replicates both, trains them for now.
    trains_adapters: ClassVar[bool] = False
    # --rank-shares: ranks take uneven shares of each batch (common/data/shares.py); only ddp, whose one all-reduce of
    # gradients scaled by N / T is exact for any shares, takes them for now (docs/uneven.md).
    takes_uneven_shares: ClassVar[bool] = False
    # --checkpoint-format sharded: each rank writes its own pieces (zero1, zero2 refuse it: their moments are rows
    # of every tensor, and every rank holds the whole weights).
    writes_sharded_checkpoints: ClassVar[bool] = True

    @property
    def axis_name(self) -> str:
        """Its axis in a mesh: the strategy's name, except ddp's, `dp` (common/parallel/mesh.py)."""
        return STRATEGY_AXIS.get(self.name, self.name)

    @property
    def ranks(self) -> int:
        """The ranks this strategy splits over: its axis of the mesh."""
        return self.mesh.axis(self.axis_name)

    # ---- the run ------------------------------------------------------------------------------------
    def check(self, spec: ModelSpec, cp_attention: str = "ulysses") -> None:
        """Refuse, before anything is written, a run whose strategy cannot split this model over these ranks."""
        if not self.supports_biases and (spec.attention_bias or spec.mlp_bias):
            # tp's sharding plans and pp's stages are written for bias-free Linears; fsdp's parity with biases is
            # untested: refused rather than trusted.
            field = "attention_bias" if spec.attention_bias else "mlp_bias"
            raise UserError(f"--strategy {self.name} does not support biases (model.{field} = true, from the "
                            "checkpoint's config); use --strategy ddp")

    def check_sequence(self, seq_len: int, padding_rule: str, cp_attention: str = "ulysses") -> None:
        """Refuse a sequence this strategy cannot cut (cp: its slices); a mesh asks each axis's object."""

    def check_batch(self, global_batch: int, grad_accum: int, pp_microbatches: int) -> None:
        """Refuse a batch this strategy cannot cut (RunConfig's global batch, --grad-accum, --pp-microbatches)."""

    @property
    def data_axis(self) -> str | None:
        """The mesh axis whose ranks read different samples: the mesh's dp or fsdp axis; on a mesh without one,
        this strategy's own unless its ranks all read the whole batch (tp, pp)."""
        if self.mesh.data_axis or self.reads_whole_batch:
            return self.mesh.data_axis
        return self.axis_name

    @property
    def dp_size(self) -> int:
        """Ranks that read different samples: 1 where every rank reads the whole batch."""
        return self.mesh.axis(self.data_axis) if self.data_axis else 1

    def data_parallel(self, rank: int) -> tuple[int, int]:
        """(data-parallel rank, data-parallel size): which slice of the global batch `rank` reads: its
        coordinate on the data axis (in a mesh, the tp and pp ranks of one replica read the same slice)."""
        if not self.data_axis:
            return 0, 1
        return self.mesh.coordinate(rank, self.data_axis), self.dp_size

    # ---- the state and the work ---------------------------------------------------------------------
    @abstractmethod
    def local_parameters(self, spec: ModelSpec, framework: str = "torch") -> float:
        """Parameters one rank holds (and updates)."""

    def state_elements(self, spec: ModelSpec, framework: str = "torch") -> dict[str, float]:
        """{"params", "grads", "optimizer"}: elements one rank holds of each (the optimizer's two moments both),
        as summary.json's state_bytes counts them / 4 (fp32). By default all follow local_parameters; zero1 and
        zero2 hold whole parameters beside sharded moments (common/parallel/zero.py)."""
        held = self.local_parameters(spec, framework)
        return {"params": held, "grads": held, "optimizer": 2 * held}

    def trained_payload_bytes(self, shapes: Mapping[str, tuple[int, ...]], dtype: str = "float32") -> int:
        """comm_bytes_per_step_estimate where only `shapes` train (LoRA's adapters, common/model/lora.py): their
        float32 gradients all-reduced once, as ddp does; zero1 and zero2 add their gather."""
        return sum(math.prod(s) for s in shapes.values()) * MASTER_BYTES

    def state_fraction(self, w: Workload) -> float:
        """f_state: the share of the parameters a rank updates (AdamW touches what it holds)."""
        return self.local_parameters(w.spec, w.framework) / total_parameters(w.spec)

    @abstractmethod
    def work_fraction(self, w: Workload) -> float:
        """f_work: one rank's share of the global batch's forward + backward FLOPs (common/model/flops.py).
        Assumption: time is proportional to FLOPs, so smaller matmuls are taken to run as fast per FLOP."""

    def busy_fraction(self, w: Workload) -> float:
        """The share of the global batch's FLOPs one rank computes, without the time it idles (pp's bubble): what
        its compute asks of a core that other ranks share (common/costmodel/predict.py's cores_shared_by)."""
        return self.work_fraction(w)

    # ---- the traffic --------------------------------------------------------------------------------
    def axis_collectives(self, w: Workload, reduce_scatter: str = "native") -> list[AxisCollectives]:
        """`collectives` per mesh axis, each with the size of the groups that run it (a mesh's tp all-reduces
        run among tp ranks only), so the cost model can put each axis on its own link."""
        return [AxisCollectives(self.axis_name, self.ranks, self.collectives(w, reduce_scatter))]

    def collectives(self, w: Workload, reduce_scatter: str = "native") -> list[Collective]:
        """The step's collectives, none on one rank. `reduce_scatter` says what a reduce-scatter moves
        (common/parallel/fsdp.py reduce_scatter_traffic): "native", or "all_sum_slice", an all-reduce's bytes."""
        return [] if self.ranks < 2 else self.step_collectives(w, reduce_scatter)

    @abstractmethod
    def step_collectives(self, w: Workload, reduce_scatter: str) -> list[Collective]:
        """`collectives` at two ranks or more."""

    def comm_bytes_per_step_estimate(self, spec: ModelSpec, micro_batch_size: int, seq_len: int, grad_accum: int,
                                     dtype: str = "float32") -> int | None:
        """summary.json's comm_bytes_per_step_estimate: the payload a step hands to the collectives the run
        counts (comm_bytes_per_step), from the shapes alone; 0 on one rank. Scalars (loss, grad-norm partial
        sums) are left out. `dtype` is the run's --dtype (common/model/precision.py's policy)."""
        return 0 if self.ranks < 2 else self.payload_bytes_per_step(spec, micro_batch_size, seq_len, grad_accum,
                                                                   dtype)

    @abstractmethod
    def payload_bytes_per_step(self, spec: ModelSpec, micro_batch_size: int, seq_len: int, grad_accum: int,
                               dtype: str) -> int | None:
        """comm_bytes_per_step_estimate at two ranks or more; None where the run counts no comparable figure."""

    # ---- the memory ---------------------------------------------------------------------------------
    @property
    def activation_split(self) -> int:
        """Ranks that split the heads and the FFN width (tp)."""
        return 1

    @property
    def sequence_split(self) -> int:
        """Ranks that split each sequence (cp): a rank keeps the activations of seq_len / sequence_split tokens."""
        return 1

    def activation_layers(self, spec: ModelSpec) -> int:
        """Blocks whose activations a rank keeps."""
        return spec.n_layers

    def activation_bytes(self, w: Workload) -> float:
        """One micro-batch's saved activations on one rank: per token and layer 7 d in the activation dtype,
        plus the head- and ffn-split ones (3 d + 3 kv + 2 h T + 4 ffn) / activation_split, plus 2 V fp32 logits
        (logits and their exponentials). A rough count whose error the calibrated overhead absorbs at the
        calibration point."""
        s = w.spec
        kv = s.n_kv_heads * s.head_dim
        per_token_layer = (7 * s.dim + (3 * s.dim + 3 * kv + 2 * s.n_heads * w.seq_len + 4 * s.ffn_dim)
                           / self.activation_split)
        tokens = w.micro_rows(self.dp_size) * w.seq_len / self.sequence_split  # the scores' T stays whole (cp.py)
        layers = tokens * self.activation_layers(s) * per_token_layer * DTYPE_BYTES[w.dtype]
        return layers + 2 * self.logits_bytes(w)

    def logits_bytes(self, w: Workload) -> float:
        """One float32 logits array of a micro-batch on one rank (its tokens x the vocabulary)."""
        return w.micro_rows(self.dp_size) * w.seq_len / self.sequence_split * w.spec.vocab_size * 4

    def gathered_bytes(self, w: Workload) -> float:
        """Whole parameters (and gradients) a rank holds beyond its own at the step's peak (fsdp)."""
        return 0.0

    def head_gathered_bytes(self, w: Workload) -> float:
        """What the head's backward holds whole beyond gathered_bytes and what the probe measured of the head at one
        rank (model_memory's head phase): the reduction's copies of the vocabulary matrices' gradients (fsdp)."""
        return 0.0

    @property
    def copies_gradients_for_reduce(self) -> bool:
        """Whether the gradient reduction copies the gradients (common/costmodel/memory.py REDUCE_FACTOR)."""
        return False

    def checkpoint_bytes(self, w: Workload, rank: int = 0, checkpoint_format: str = "hf") -> float:
        """What saving a checkpoint holds beside the rank's state (after a step: its activations are freed).
        sharded: every rank writes its own arrays, from views of them: nothing. hf: the state streams into the
        files one tensor at a time (common/checkpoint/store.py HFCheckpointWriter): streamed_checkpoint_bytes."""
        if checkpoint_format == "sharded" or self.ranks == 1:
            return 0.0
        return self.streamed_checkpoint_bytes(w, rank)

    @abstractmethod
    def streamed_checkpoint_bytes(self, w: Workload, rank: int) -> float:
        """checkpoint_bytes of the hf format at two ranks or more."""

    # ---- the time -----------------------------------------------------------------------------------
    def exposed_comm_s(self, cal: Measured, colls: list[Collective], link: Link | None, comm_s: float) -> float:
        """The communication a step waits for: what the calibration run did not overlap (its measured
        overlap, else DEFAULT_OVERLAP) of the collectives' `comm_s` over `link`."""
        overlap = cal.overlap if cal.overlap is not None else DEFAULT_OVERLAP
        return (1.0 - overlap) * comm_s

    def axis_exposed_comm_s(self, cal: Measured, axis: AxisCollectives, link: Link | None, comm_s: float) -> float:
        """exposed_comm_s of one axis's collectives over the link that axis crosses (common/costmodel/levels.py):
        a one-axis object's own rule; a mesh asks the object of that axis (common/parallel/composed.py)."""
        return self.exposed_comm_s(cal, axis.collectives, link, comm_s)

    def host_s(self, w: Workload, axes: list[AxisCollectives], on_cpu: bool, releases_heap: bool,
               fitted: Mapping[str, float]) -> float:
        """Host work per step beyond the link's time, added to compute: each axis's under its own rule."""
        return sum(self.axis_host_s(w, axis, on_cpu, releases_heap, fitted) for axis in axes if axis.collectives)

    def axis_host_s(self, w: Workload, axis: AxisCollectives, on_cpu: bool, releases_heap: bool,
                    fitted: Mapping[str, float]) -> float:
        """One axis's host work: `fitted[axis]` seconds per unit of it (`host_unit`: a byte its collectives move,
        or a call), where an N=2 run of that axis's strategy was fitted (common/costmodel/fit.py), else the
        strategy's own constants (`unfitted_host_s`)."""
        if axis.axis in fitted:
            return fitted[axis.axis] * self.host_quantity(axis.collectives, w.framework)
        return self.unfitted_host_s(w, axis.collectives, on_cpu, releases_heap)

    def host_unit(self, framework: str) -> str:
        """What this strategy's host work grows with: "byte", the bytes its collectives move (copies into buckets
        and flat buffers, serialised sends), or "call", a cost each call pays whatever it carries."""
        return "byte"

    def host_quantity(self, colls: list[Collective], framework: str) -> float:
        """How many units of `host_unit` a step's `colls` make."""
        per_byte = self.host_unit(framework) == "byte"
        return sum(c.calls * (c.nbytes if per_byte else 1) for c in colls)

    def host_stretches(self, axis: str, framework: str) -> bool:
        """Whether axis `axis`'s fitted host work is the rank's own CPU work, which ranks sharing a core take turns
        on as on their compute (common/costmodel/predict.py), rather than a wait inside a collective, which leaves
        the core to another rank: a wait by default."""
        return False

    def unfitted_host_s(self, w: Workload, colls: list[Collective], on_cpu: bool, releases_heap: bool) -> float:
        """Host work no run of this strategy measured: 0 (fsdp on a CPU has constants of its own)."""
        return 0.0

    def prediction_caveat(self) -> str | None:
        """How measured runs missed this object's predicted step the same way every time (docs/scaling.md),
        shown beside its predictions so that a plan naming it fastest is read with that in mind; None where the
        misses went both ways."""
        return None
