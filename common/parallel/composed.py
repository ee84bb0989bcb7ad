"""mesh: several strategies composed over the axes of one Mesh (`--mesh dp=2,tp=2`), as one Layout.

Each axis has its one-strategy object (ddp.py's over `dp`, fsdp.py's, tp.py's, pp.py's), built on the whole
mesh: it reads its own axis for its group size and the mesh's data axis for the rows each rank computes. The
composed object answers the same questions as they do (common/parallel/layout.py):

    data      the data axis (dp or fsdp) slices the batch; the model axes' ranks of one replica read one slice
    state     the model axis (tp or pp) leaves each rank a share of the model (its `local_parameters`); fsdp
              shards that share again over its axis (its padding of the vocabulary left out: a few rows)
    work      the model axis's share of one replica's FLOPs (the pp bubble included), over the data axis's size
    traffic   per axis (`axis_collectives`): the model axis's own (tp's activations, pp's sends) at the rows of
              one data rank, and the data axis's gradient reduction of the rank's model share: dp all-reduces
              its gradients, fsdp gathers and reduce-scatters it (its one-axis collectives scaled by the share)
    memory    tp splits the activations, pp keeps the first stage's, fsdp gathers its units of the share

pp x tp has two model axes: a rank holds its stage's tensors, the split ones over tp (`stage_share`); the
slowest stage's blocks' FLOPs are split over tp, its head is not (pp.py's stage_work_fraction); a tp group
all-reduces the activations of its own stage's blocks only (`stage_tp_collectives`), and pp sends whole
activations between the ranks of equal tp coordinate. pp x dp x tp is that per dp replica, on its rows: the work
over the data axis too, the traffic at one data rank's rows (as every axis's), dp's all-reduce of the stage share.

The frameworks compose the same way (mlx_impl/mesh.py, torch_impl/mesh.py): the model-parallel strategy runs on
its axis's sub-group, the data axis reduces its gradients over the data sub-group; under pp x tp the pipeline runs
on the pp sub-group and each stage's blocks are split over the tp sub-group.

cp beside a model axis (tp x cp, pp x cp) cuts the sequence of what that axis leaves each rank: the work and the
activations by cp (`sequence_split`), the all-to-alls (or ring passes) carry the rank's heads (1/tp of them) for
its blocks (the stage's under pp), and the cp group averages the gradients of the rank's model share
(`cp_collectives`); pp x dp x cp x tp is that per dp replica, on its rows, dp then averaging what cp averaged (the
frameworks' two all-reduces, each counted). dp x cp is ddp over the whole job, each rank on its slice: one all-reduce of the gradients over
dp x cp ranks, carried by the data axis (`data_joins_cp`), and cp's exchanges alone on cp.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import ClassVar, Mapping

from common.costmodel.links import Collective, Link
from common.costmodel.workload import Workload
from common.errors import UserError
from common.model.spec import ModelSpec
from common.model.weights import parameter_shapes
from common.parallel.cp import CpLayout
from common.parallel.ddp import DdpLayout, gradient_all_reduce
from common.parallel.fsdp import FsdpLayout
from common.parallel.layout import AxisCollectives, Layout, Measured, total_parameters
from common.parallel.embedding_group import EmbeddingGroup
from common.parallel.pipeline import stage_holds, stage_layers
from common.parallel.pp import PpLayout
from common.parallel.tp import TpLayout, tp_split_axis

AXIS_LAYOUTS: dict[str, type[Layout]] = {"dp": DdpLayout, "fsdp": FsdpLayout, "tp": TpLayout, "pp": PpLayout,
                                         "cp": CpLayout}
MODEL_AXES = ("tp", "pp", "cp")  # cp: whole model, its own collectives (cp.py), as a model axis here
# The compositions both frameworks run (mlx_impl/mesh.py, torch_impl/mesh.py), as sets of axes.
COMPOSITIONS = (frozenset({"dp", "tp"}), frozenset({"fsdp", "tp"}), frozenset({"dp", "pp"}), frozenset({"pp", "tp"}),
                frozenset({"pp", "dp", "tp"}), frozenset({"dp", "cp"}), frozenset({"tp", "cp"}), frozenset({"pp", "cp"}),
                frozenset({"pp", "dp", "cp", "tp"}))


def composition_names() -> str:
    order = ("pp", "dp", "fsdp", "cp", "tp")
    return ", ".join(" x ".join(sorted(c, key=order.index)) for c in COMPOSITIONS)


class MeshLayout(Layout):
    name: ClassVar[str] = "mesh"

    # ---- the parts ----------------------------------------------------------------------------------
    @property
    def ranks(self) -> int:
        return self.mesh.size

    @property
    def axis_name(self) -> str:
        return self.mesh.text

    @property
    def data_axis(self) -> str | None:
        return self.mesh.data_axis  # none: every rank reads the whole batch

    @property
    def parts(self) -> dict[str, Layout]:
        """One strategy object per axis, outermost first, each over the whole mesh."""
        return {name: AXIS_LAYOUTS[name](self.mesh) for name in self.mesh.names}

    @property
    def model_part(self) -> Layout | None:
        """The model-parallel axis's object (tp or pp; cp where it is the only one, whose work and traffic are its
        own), None where each rank holds the whole model."""
        axis = self.mesh.model_axis or ("cp" if self.mesh.has("cp") else None)
        return None if axis is None else self.parts[axis]

    @property
    def cp_beside(self) -> int:
        """cp's size beside a model axis (tp x cp, pp x cp), which cuts that axis's work by it; 1 otherwise."""
        return self.mesh.axis("cp") if self.mesh.has("cp") and self.mesh.model_axis else 1

    @property
    def data_joins_cp(self) -> int:
        """dp x cp: both frameworks average the gradients in ONE all-reduce over the job (dp x cp ranks, each on its
        slice of the sequence: ddp over every rank), which the data axis carries with groups of dp x cp and cp's
        own exchanges leave out; counted once per axis, it was two whole-model all-reduces (issue 77). cp's size
        there, 1 otherwise."""
        return self.mesh.axis("cp") if self.mesh.has("cp") and not self.mesh.model_axis and self.data_axis else 1

    @property
    def data_part(self) -> Layout | None:
        return self.parts[self.mesh.data_axis] if self.mesh.data_axis else None

    @property
    def tp_stages(self) -> bool:
        """pp x tp: two model axes, each pipeline stage's blocks split over a tp group."""
        return self.mesh.tp_stages

    def model_share(self, spec: ModelSpec, framework: str = "torch") -> float:
        """The share of the parameters the model axes leave the rank that holds the most (before fsdp)."""
        if self.mesh.has("pp"):
            return max(self.stage_share(spec, stage) for stage in range(self.mesh.axis("pp")))
        part = self.model_part
        return 1.0 if part is None else part.local_parameters(spec, framework) / total_parameters(spec)

    def rank0_model_share(self, spec: ModelSpec) -> float:
        """The same for rank 0, whose counts summary.json reports (under pp: the first stage's blocks)."""
        return self.stage_share(spec, 0) if self.mesh.has("pp") else self.model_share(spec)

    def stage_share(self, spec: ModelSpec, stage: int) -> float:
        """The share of the parameters a rank of pipeline stage `stage` holds: the stage's tensors (a tied
        matrix's copy on the last stage too), those tp splits over the tp axis where there is one."""
        pp, tp = self.mesh.axis("pp"), self.mesh.axis("tp") if self.mesh.has("tp") else 1
        group = EmbeddingGroup.of(spec, pp)
        held = sum(math.prod(s) / (tp if tp_split_axis(k) is not None else 1)
                   for k, s in parameter_shapes(spec).items() if stage_holds(k, spec.n_layers, stage, group))
        return held / total_parameters(spec)

    # ---- the run ------------------------------------------------------------------------------------
    def check(self, spec: ModelSpec, cp_attention: str = "ulysses") -> None:
        """Each axis's refusal, naming the mesh and the numbers: compositions both frameworks run, axes of two or
        more ranks, tp dividing the heads, kv heads and FFN width, a block per pp stage, fsdp dividing axis 0 of
        each block tensor as a tp rank holds it; under Ulysses (`cp_attention`), tp x cp dividing them too."""
        prefix, names = f"--mesh {self.mesh.text}", self.mesh.names
        if frozenset(names) not in COMPOSITIONS:
            raise UserError(f"{prefix}: composing {' x '.join(names)} is not supported; supported meshes: "
                            f"{composition_names()} (or one axis: --strategy)")
        for name, size in self.mesh.axes:
            if size < 2:
                raise UserError(f"{prefix}: axis {name}={size} splits nothing; leave it out")
        for name, part in self.parts.items():
            if not part.supports_biases and (spec.attention_bias or spec.mlp_bias):
                raise UserError(f"{prefix}: axis {name} does not support biases (model.attention_bias or "
                                "model.mlp_bias = true, from the checkpoint's config); use --strategy ddp")
        tp = self.mesh.axis("tp") if self.mesh.has("tp") else 1
        for field in ("n_heads", "n_kv_heads", "ffn_dim"):
            if getattr(spec, field) % tp:
                raise UserError(f"{prefix}: tp={tp} does not divide model.{field} = {getattr(spec, field)}")
        cp = self.mesh.axis("cp") if self.mesh.has("cp") and cp_attention == "ulysses" else 1
        for field in ("n_heads", "n_kv_heads"):  # Ulysses's split (ring passes whole blocks of a tp rank's heads)
            value = getattr(spec, field)
            if value % (tp * cp):
                raise UserError(f"{prefix}: Ulysses splits each tp rank's heads over cp, so tp x cp = {tp * cp} must "
                                f"divide model.{field} = {value}; use --cp-attention ring, pp=2,cp={cp} or dp=2,cp={cp}, "
                                f"or a model whose n_heads and n_kv_heads divide by {tp * cp}")
        if self.mesh.has("pp"):
            pp = self.mesh.axis("pp")
            if spec.n_layers < pp:
                raise UserError(f"{prefix}: pp={pp} stages need one transformer block each at least, but "
                                f"model.n_layers = {spec.n_layers} < {pp}")
            # its own further refusals; a tied model runs on every pipeline of the mesh, each with its own
            # embedding group (common/parallel/embedding_group.py job_groups)
            self.parts["pp"].check(spec)
        if self.mesh.has("fsdp"):
            fsdp = self.mesh.axis("fsdp")
            for name, shape in parameter_shapes(spec).items():
                rows = shape[0] // tp if tp_split_axis(name) == 0 else shape[0]
                if name.startswith("model.layers.") and rows % fsdp:
                    raise UserError(f"{prefix}: fsdp={fsdp} cannot shard {name}: axis 0 holds {rows} rows on each "
                                    f"tp rank ({shape[0]} / tp={tp}), not divisible by {fsdp}")

    def check_sequence(self, seq_len: int, padding_rule: str, cp_attention: str = "ulysses") -> None:
        for part in self.parts.values():
            part.check_sequence(seq_len, padding_rule, cp_attention)

    def check_batch(self, global_batch: int, grad_accum: int, pp_microbatches: int) -> None:
        """The model axis cuts the batch of one data rank (pp: into --pp-microbatches pieces)."""
        if self.model_part is not None:
            self.model_part.check_batch(global_batch // self.dp_size, grad_accum, pp_microbatches)

    # ---- the state and the work ---------------------------------------------------------------------
    def local_parameters(self, spec: ModelSpec, framework: str = "torch") -> float:
        held = self.model_share(spec, framework) * total_parameters(spec)
        return held / self.mesh.axis("fsdp") if self.mesh.has("fsdp") else held

    def work_fraction(self, w: Workload) -> float:
        if self.tp_stages:  # (pp x dp x tp: each dp replica's pipeline on its share of the rows)
            pp = self.parts["pp"]
            assert isinstance(pp, PpLayout)
            return pp.rank_work_fraction(w) / self.cp_beside
        model = self.model_part.work_fraction(w) if self.model_part is not None else 1.0
        return model / self.dp_size / self.cp_beside

    def busy_fraction(self, w: Workload) -> float:
        if self.tp_stages:  # without the bubble, as pp's own
            m = w.pp_microbatches
            return self.work_fraction(w) * m / (m + self.mesh.axis("pp") - 1)
        model = self.model_part.busy_fraction(w) if self.model_part is not None else 1.0
        return model / self.dp_size / self.cp_beside

    # ---- the traffic --------------------------------------------------------------------------------
    def axis_collectives(self, w: Workload, reduce_scatter: str = "native") -> list[AxisCollectives]:
        out = []
        for name, part in self.parts.items():
            size = self.mesh.axis(name)
            if name == "tp" and self.tp_stages:
                colls = self.stage_tp_collectives(part, w, reduce_scatter)
            elif name == "cp" and self.cp_beside > 1:
                colls = self.cp_collectives(part, w, reduce_scatter)
            elif name == "cp" and self.data_axis:  # dp x cp: its exchanges; the gradients go once, on the data axis
                *colls, _ = part.collectives(w, reduce_scatter)
            elif name in MODEL_AXES:  # tp's all-reduces, pp's sends: of the rank's T / cp tokens beside cp
                colls = [replace(c, nbytes=int(c.nbytes / self.cp_beside)) for c in part.collectives(w, reduce_scatter)]
            else:
                colls = self.data_collectives(part, w, reduce_scatter)
                size *= self.data_joins_cp
            out.append(AxisCollectives(name, size, colls))
        return out

    def stage_blocks(self, spec: ModelSpec, stage: int | None = None) -> int:
        """The transformer blocks of pipeline stage `stage` (None: of the stage that holds the most)."""
        pp = self.mesh.axis("pp")
        stages = range(pp) if stage is None else [stage]
        return max(len(stage_layers(spec.n_layers, pp, s)) for s in stages)

    def stage_tp_collectives(self, part: Layout, w: Workload, reduce_scatter: str) -> list[Collective]:
        """pp x tp: a tp group all-reduces the activations of its stage's blocks only (the fullest stage's), once
        per pipeline piece: M calls of a piece's rows where tp alone makes one of the micro-step's. Counted per
        micro-step, as tp alone, the calls' latency was M times short, and pp x tp was predicted 20-54 % short in
        every sitting of stop 47-49 (issue 56)."""
        share = self.stage_blocks(w.spec) / w.spec.n_layers
        m = max(1, w.pp_microbatches)  # (beside cp: of the rank's T / cp tokens)
        return [replace(c, nbytes=int(c.nbytes / m / self.cp_beside), calls=round(c.calls * share) * m,
                        what=c.what + f" (of the stage's blocks, per piece of {m})")
                for c in part.collectives(w, reduce_scatter)]

    def cp_collectives(self, part: Layout, w: Workload, reduce_scatter: str) -> list[Collective]:
        """cp beside tp or pp: its exchanges of the heads a tp rank holds, in the blocks its stage holds (once per
        pipeline piece, as stage_tp_collectives), then the cp group's all-reduce of the gradients of the rank's model
        share (in place of cp's own over the whole model)."""
        tp = self.mesh.axis("tp") if self.mesh.has("tp") else 1
        pp = self.mesh.has("pp")
        blocks, m = (self.stage_blocks(w.spec) / w.spec.n_layers, max(1, w.pp_microbatches)) if pp else (1.0, 1)
        *exchanges, _ = part.collectives(w, reduce_scatter)
        share = self.model_share(w.spec, w.framework)
        return [replace(c, nbytes=int(c.nbytes / tp / m), calls=round(c.calls * blocks) * m) for c in exchanges] + \
            [gradient_all_reduce(share * DdpLayout(self.mesh).gradient_bytes(w.spec, w.dtype), w)]

    def data_collectives(self, part: Layout, w: Workload, reduce_scatter: str) -> list[Collective]:
        """The data axis's gradient reduction of the rank's model share (the module docstring)."""
        share = self.model_share(w.spec, w.framework)
        if isinstance(part, DdpLayout):
            return [gradient_all_reduce(share * part.gradient_bytes(w.spec, w.dtype), w)]
        return [replace(c, nbytes=int(c.nbytes * share), what=c.what + " (of the rank's model share)")
                for c in part.collectives(w, reduce_scatter)]

    def step_collectives(self, w: Workload, reduce_scatter: str) -> list[Collective]:
        return [c for axis in self.axis_collectives(w, reduce_scatter) for c in axis.collectives]

    def payload_bytes_per_step(self, spec: ModelSpec, micro_batch_size: int, seq_len: int, grad_accum: int,
                               dtype: str) -> int | None:
        """What rank 0 counts: its model axis's payload (at one data rank's micro-batch) plus dp's all-reduce of
        its gradients; None with fsdp, whose collectives the runs do not count (fsdp.py)."""
        if self.mesh.has("fsdp") or self.mesh.has("cp"):  # cp's all-to-alls: not counted yet (cp.py)
            return None
        model = self.model_part
        total = 0 if model is None else model.payload_bytes_per_step(spec, micro_batch_size, seq_len, grad_accum,
                                                                     dtype)
        if total is None:
            return None
        data = self.data_part
        if isinstance(data, DdpLayout):
            total += int(self.rank0_model_share(spec) * data.gradient_bytes(spec, dtype))
        if self.tp_stages:  # rank 0's tp group all-reduces the activations of the first stage's blocks
            tp = self.parts["tp"]
            assert isinstance(tp, TpLayout)
            total += int(4 * self.stage_blocks(spec, 0) * grad_accum
                         * tp.all_reduce_bytes(micro_batch_size, seq_len, spec, dtype))
        return total

    # ---- the memory ---------------------------------------------------------------------------------
    @property
    def activation_split(self) -> int:
        return self.mesh.axis("tp") if self.mesh.has("tp") else 1

    @property
    def sequence_split(self) -> int:
        return self.mesh.axis("cp") if self.mesh.has("cp") else 1

    def activation_layers(self, spec: ModelSpec) -> int:
        return self.model_part.activation_layers(spec) if self.model_part is not None else spec.n_layers

    def gathered_bytes(self, w: Workload) -> float:
        fsdp = self.parts.get("fsdp")
        return 0.0 if fsdp is None else fsdp.gathered_bytes(w) * self.model_share(w.spec, w.framework)

    def head_gathered_bytes(self, w: Workload) -> float:
        fsdp = self.parts.get("fsdp")
        return 0.0 if fsdp is None else fsdp.head_gathered_bytes(w) * self.model_share(w.spec, w.framework)

    @property
    def copies_gradients_for_reduce(self) -> bool:
        return self.mesh.has("dp")

    # ---- the time -----------------------------------------------------------------------------------
    def axis_exposed_comm_s(self, cal: Measured, axis: AxisCollectives, link: Link | None, comm_s: float) -> float:
        """Each axis's time under its own strategy's rule: tp's all-reduces all exposed, pp its critical path, the
        data axis what the calibration did not overlap (common/costmodel/axes.py sums them)."""
        return self.parts[axis.axis].exposed_comm_s(cal, axis.collectives, link, comm_s)

    def axis_host_s(self, w: Workload, axis: AxisCollectives, on_cpu: bool, releases_heap: bool,
                    fitted: Mapping[str, float]) -> float:
        """Each axis's host work under its own strategy's rule (its fit, or fsdp's constants)."""
        return self.parts[axis.axis].axis_host_s(w, axis, on_cpu, releases_heap, fitted)

    def host_stretches(self, axis: str, framework: str) -> bool:
        return self.parts[axis].host_stretches(axis, framework)

    def streamed_checkpoint_bytes(self, w: Workload, rank: int) -> float:
        return max(part.checkpoint_bytes(w, rank) for part in self.parts.values())

    def prediction_caveat(self) -> str | None:
        if not self.tp_stages:
            return None
        # Within 20 % by the median since stop 68 (MLX's last stage compiled, sends at the stream's rate), but the
        # widest spread of the meshes sitting to sitting: 16 sittings on the Zen 5, MLX -11.6 to +30.7 %, torch -6.2
        # to +25.3 % (docs/scaling.md; before, MLX -40 to -51 % on loopback, torch -27 to -54 % until stop 62).
        return ("pp x tp: within 20 % by the median of the latest sittings, but single runs with more ranks than "
                "cores missed by up to 31 % (MLX) and 25 % (torch) (docs/scaling.md)")
