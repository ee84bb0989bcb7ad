"""A model nobody trained here, timed by the block probe and turned into a calibration (`dpcompare plan --model`).

The probe ({mlx,torch}_impl/block_probe.py, a subprocess in the run's framework with its threads, BLAS and dtype)
times one transformer block of the model's real shapes on `rows` sequences of the micro-batch's length: its
forward, and its forward with the backward a step runs (every gradient; under LoRA the adapters' and the
activations'); the head (embedding lookup, final norm, head over `vocab_rows` of the vocabulary, cross-entropy)
the same two ways; and the step's update (the global norm, the clip, AdamW) over the model's own trained
tensors, up to OPTIMIZER_ELEMENTS of them. `phases` turns them into forward, backward and
optimizer seconds for one rank doing the whole global batch, as a Calibration holds them:

    forward   = rows_scale x (L x block_forward + head_forward x V / vocab_rows)
    fwd + bwd = rows_scale x (K x block_step + (L - K) x block_forward + head_step x V / vocab_rows)
    optimizer = optimizer_s / optimizer_elements x trained parameters
    fixed     = grad_accum x (the same sums of each call's part: every timing is made at rows and 2 x rows, twice
                             each, alternately: split_of_runs)

rows_scale = global batch / rows (time taken as linear in the rows at a fixed sequence length); K the blocks with
something to train at or below them (every block, or under LoRA on the last k blocks, k: the blocks below need
their forward only). `transfer` then takes from the calibration run what the probe does not see: the probe run
on the run's own model gives the run's forward + backward and update as the probe would time them; what the run
measured beyond that is a fixed cost per step (the step's own host work: the loss, the gradient scaling, the
data), added as is; where the run measured less (the whole step compiled into one call where the probe makes
one a piece), the difference is taken off, never below the ratio measured / probed of the new model's figures. `other` (host work per step), the link fits and the host work per byte
stay the run's. docs/plan-model.md says the same with the measured accuracy.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from common.costmodel.calibrate import Calibration
from common.costmodel.workload import Workload
from common.errors import UserError
from common.model.lora import Adapters, FullModel, Trained
from common.model.spec import ModelSpec
from common.model.weights import parameter_shapes

RESULT_PREFIX = "dpcompare-block-probe "
VOCAB_ROWS = 32768          # the head is timed over at most this many vocabulary rows, then scaled by V / rows
PROBE_FLOPS = 4e10          # rows are cut so that one block's forward + backward is about this many FLOPs (~1 s)
OPTIMIZER_ELEMENTS = 32 * 2**20  # the update is timed over at most this many of the model's own elements
BUDGET_S = 1.0              # a timing repeats (up to 7 calls) within this many seconds
MIN_CALLS = 3               # ... and this often at least, where they take under MIN_CALLS x BUDGET_S in all


def base_storage(bits: int, group_size: int):
    """common/model/quantize.py's storage object for `bits` (0: float32); a one-line error where it is absent."""
    try:
        from common.model.quantize import base_storage_of
    except ImportError:
        if bits:
            raise UserError("--quantize-base: this checkout has no quantized base (common/model/quantize.py)") \
                from None
        return None
    return base_storage_of(bits, group_size)


def storage_bits(storage) -> int:
    return getattr(storage, "bits", 32) if storage is not None else 32


@dataclass(frozen=True)
class ProbeRequest:
    """What the probe times: one block of `spec` on `rows` x `seq_len`, the head over `vocab_rows`."""
    spec: ModelSpec
    rows: int
    seq_len: int
    dtype: str
    trained: Trained
    quantize: tuple[int, int] = (0, 64)   # (bits, group size); 0 bits: float32
    vocab_rows: int = VOCAB_ROWS
    optimizer_elements: int = OPTIMIZER_ELEMENTS
    exp: str = "native"
    budget_s: float = BUDGET_S
    cross_entropy: str = "native"  # MLX's cross-entropy shift as the run chose it (model.set_cross_entropy)
    attention: str = "auto"  # MLX's attention blocks: "auto" times them at the probe's own shapes, as a run would

    @property
    def probe_spec(self) -> ModelSpec:
        return self.spec.with_(n_layers=1, vocab_size=self.vocab_rows)

    @property
    def storage(self):
        from common.model.quantize import FullPrecision, base_storage_of

        return base_storage_of(*self.quantize) if self.quantize[0] else FullPrecision()

    def optimizer_tensors(self) -> list[int]:
        """The update's tensors: the sizes of what trains, in the model's order, until optimizer_elements (the
        last cut to what is left). The update's cost per element grows with its tensors and their total (the
        moments of a block's matrices stay in the cache, a model's do not): over `small`'s 28M elements torch's
        update took 10.7 ns an element against 4.1 over 64 block-sized tensors of 8M in all, which had made
        the probe's update a third of the measured one (issue 56). No tensor takes more than half of them: MLX's
        compiled update of one tensor alone runs at twice its per-element time beside any other (32M elements:
        24.9 ns an element alone, 10.8 with a 1,024-element tensor beside it, 11.3 as two of 16M; Intel Xeon VM),
        and `base`'s first tensor, its 38.6M-element embedding, had been the whole sample: its update predicted at
        5.3 s against 2.7 measured."""
        left, sizes = self.optimizer_elements, []
        for shape in self.trained.state_shapes(self.spec).values():
            if left <= 0:
                break
            sizes.append(min(math.prod(shape), left, max(1, self.optimizer_elements // 2)))
            left -= sizes[-1]
        return sizes or [1]

    def to_json(self) -> dict:
        trained = self.trained.describe() if isinstance(self.trained, Adapters) else None
        return {"spec": self.spec.to_dict(), "rows": self.rows, "seq_len": self.seq_len, "dtype": self.dtype,
                "trained": trained, "quantize": list(self.quantize), "vocab_rows": self.vocab_rows,
                "optimizer_elements": self.optimizer_elements, "exp": self.exp, "budget_s": self.budget_s,
                "cross_entropy": self.cross_entropy, "attention": self.attention}


def read_request(path: str) -> ProbeRequest:
    d = json.loads(Path(path).read_text())
    t = d.get("trained")
    trained: Trained = FullModel() if not t else Adapters(int(t["rank"]), float(t["alpha"]), tuple(t["targets"]),
                                                         int(t.get("layers") or 0))
    return ProbeRequest(ModelSpec.from_dict(d["spec"]), int(d["rows"]), int(d["seq_len"]), d["dtype"], trained,
                        (int(d["quantize"][0]), int(d["quantize"][1])), int(d["vocab_rows"]),
                        int(d["optimizer_elements"]), d.get("exp", "native"), float(d.get("budget_s", BUDGET_S)),
                        d.get("cross_entropy", "native"), d.get("attention", "auto"))


def block_flops_per_token(spec: ModelSpec, seq_len: int) -> float:
    """One block's forward + backward FLOPs per token: 6 x its matmul weights + attention's 12 T d."""
    weights = sum(math.prod(s) for n, s in parameter_shapes(spec.with_(n_layers=1)).items()
                  if n.startswith("model.layers.") and len(s) == 2)
    return 6.0 * weights + 12.0 * seq_len * spec.n_heads * spec.head_dim


def request_for(w: Workload, trained: Trained, quantize: tuple[int, int], exp: str = "native",
                cross_entropy: str = "native") -> ProbeRequest:
    """The probe of workload `w`: a micro-batch's rows (the global batch over grad_accum), cut to about
    PROBE_FLOPS per block (one row at least)."""
    micro_rows = max(1, int(w.micro_rows(1)))
    per_row = block_flops_per_token(w.spec, w.seq_len) * w.seq_len
    rows = max(1, min(micro_rows, int(PROBE_FLOPS // per_row)))
    return ProbeRequest(w.spec, rows, w.seq_len, w.dtype, trained, quantize, min(VOCAB_ROWS, w.spec.vocab_size),
                        min(OPTIMIZER_ELEMENTS, max(trained.trained_parameters(w.spec), 2**16)), exp,
                        cross_entropy=cross_entropy)


def head_held(figures: dict, req: ProbeRequest) -> tuple[float, float] | None:
    """What the head holds at its peak (split_per_call's `head_logits` and `head_fixed_bytes`): (float32
    logits-sized buffers of a micro-batch, bytes beside them whatever the tokens, at the model's whole vocabulary:
    its vocabulary matrices' gradients); None where the probe could not measure it."""
    if figures.get("head_logits") is None:
        return None
    return figures["head_logits"], figures["head_fixed_bytes"] * req.spec.vocab_size / req.vocab_rows


@dataclass(frozen=True)
class Phases:
    """Forward, backward and optimizer seconds of one rank doing the whole global batch; `fixed_s` what each rank
    pays per step whatever its rows (a quantized base's dequantization, once a call: split_per_call)."""
    forward_s: float
    backward_s: float
    optimizer_s: float
    fixed_s: float = 0.0

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s


PER_CALL = ("block_forward_s", "block_step_s", "head_forward_s", "head_step_s")


def fastest_of(runs: list[dict]) -> dict:
    """The first of several probe runs of one request, each timing (PER_CALL's and the update's) the fastest any of
    them measured; the resident peaks stay the first run's."""
    timings = [key for key in (*PER_CALL, "optimizer_s") if all(key in r for r in runs)]
    return {**runs[0], **{key: min(r[key] for r in runs) for key in timings}}


def split_of_runs(rows_runs: list[dict], twice_runs: list[dict], rows: int, logits_per_row: int = 0) -> dict:
    """split_per_call over several runs at `rows` and at twice them: each timing's per-call share from the fastest
    runs of each size, its level at `rows` their mean (a step meets the machine as it typically runs, not at its
    fastest: taken as the level, the fastest runs put MLX's `small` x1 up to 3 % shorter still).

    split_per_call reads the difference of two runs, so a slow spell of the machine in one became a per-call cost that
    every rank pays whatever N splits: on the AMD EPYC Zen 3 (2026-12-07, quiet) `small`'s head forward timed 0.63 s
    at 8 rows in one run against 0.45-0.47 in others, and the split charged 0.36 s of it to each call; five plans of
    the same kept runs, one run of each size each, put a rank's per-call part between 0.005 and 0.43 s a step, and
    one read MLX's ddp x2 +51 % (issue 72). A slow spell only ever slows a timing: the fastest runs split cleanly."""
    fast = split_per_call(fastest_of(rows_runs), fastest_of(twice_runs), rows, logits_per_row)
    out = dict(fast)
    for key in (*PER_CALL, "optimizer_s"):
        fastest = min(r[key] for r in rows_runs)
        level = sum(r[key] for r in rows_runs) / len(rows_runs) / fastest if fastest > 0 else 1.0
        out[key] = fast[key] * level
        if key in PER_CALL:
            out[key[:-2] + "_fixed_s"] = fast[key[:-2] + "_fixed_s"] * level
    return out


def split_per_call(once: dict, twice: dict, rows: int, logits_per_row: int = 0) -> dict:
    """The probe's figures at `rows` (once) and at 2 x rows (twice): each block and head timing split into what
    `rows` rows add (kept under its name) and what a call pays whatever its rows (`*_fixed_s`). A quantized base
    dequantizes its matrices once a call: scaled with the rows, 1B's 4-bit LoRA step (probed on one row, trained on
    four) came out 1.9x the measured one in MLX and 3.4x in torch (issue 56). A float32 one pays less, but pays:
    a product of one row's 128 tokens runs below the BLAS's rate at four rows' 512, and torch's 1B block timed 0.281
    s a call at one row, 0.476 at two, 0.902 at four, which the pair (0.086 + 0.195 a row) puts at 0.866 where one
    row scaled said 1.124 (Intel Xeon VM; MLX 0.245, 0.435, 0.797: 0.815 against 0.979). The rows' part is kept
    between none and all of the timing (a noisy pair never makes either negative).

    The head's resident peak (`head_peak_bytes`) splits the same way: what the rows add is the cross-entropy's
    logits-sized buffers (`head_logits`, in float32 logits of `rows`), the rest the vocabulary matrices' gradients
    (`head_fixed_bytes`). One figure could not tell them apart: at `small`'s probe of 2 rows of 32 tokens the
    matrices' gradients (67 MB) made it 10 logits, where a step of 8 rows of 128 holds about 3 (issue 56)."""
    out = dict(once)
    for key in PER_CALL:
        grows = min(once[key], max(0.0, twice[key] - once[key]))
        out[key], out[key[:-2] + "_fixed_s"] = grows, once[key] - grows
    one, two = once.get("head_peak_bytes"), twice.get("head_peak_bytes")
    logits = rows * logits_per_row * 4  # bytes of one float32 logits array of `rows` (seq x vocabulary rows each)
    if one and two and logits:
        grows = min(one, max(0.0, two - one))
        out["head_logits"], out["head_fixed_bytes"] = grows / logits, one - grows
    return out


def trained_blocks(trained: Trained, spec: ModelSpec) -> int:
    """Blocks whose backward runs: every block, or under LoRA from the lowest adapted block up."""
    return len(trained.blocks(spec)) if isinstance(trained, Adapters) else spec.n_layers


def phases(figures: dict, req: ProbeRequest, w: Workload) -> Phases:
    """The probe's figures (block_forward_s, block_step_s, head_forward_s, head_step_s, optimizer_s,
    optimizer_elements) as one rank's whole global batch of workload `w` (module docstring)."""
    scale = w.global_batch_size / req.rows
    vocab = w.spec.vocab_size / req.vocab_rows
    layers, k = w.spec.n_layers, trained_blocks(req.trained, w.spec)
    forward = scale * (layers * figures["block_forward_s"] + vocab * figures["head_forward_s"])
    total = scale * (k * figures["block_step_s"] + (layers - k) * figures["block_forward_s"]
                     + vocab * figures["head_step_s"])
    per_element = figures["optimizer_s"] / max(1, figures["optimizer_elements"])
    fixed = w.grad_accum * (k * figures.get("block_step_fixed_s", 0.0)
                            + (layers - k) * figures.get("block_forward_fixed_s", 0.0)
                            + vocab * figures.get("head_step_fixed_s", 0.0))  # each rank, each micro-step
    return Phases(forward, max(0.0, total - forward), per_element * req.trained.trained_parameters(w.spec), fixed)


@dataclass(frozen=True)
class Transfer:
    """What the calibration run measured beyond the probe of its own model, as seconds per step (negative where
    it measured less: the probe's calls each pay a dispatch the whole compiled step pays once), and the ratio
    measured / probed (at most 1) below which a smaller model is not taken; one each for forward + backward and
    for the update. Added, not scaled: the probe of a small model is milliseconds, and a ratio of them carried
    one noisy timing into every figure of the target (tiny's head 9 against 16 ms on a loaded machine made
    torch's `small` 23 % short; MLX's probe of tiny, 1.5x its step, made `small` 42 % short; issue 56)."""
    compute_fixed_s: float
    compute_ratio: float
    optimizer_fixed_s: float
    optimizer_ratio: float

    def apply(self, p: Phases) -> Phases:
        share = p.forward_s / p.compute_s if p.compute_s else 0.5
        compute = max(p.compute_s + self.compute_fixed_s, p.compute_s * self.compute_ratio)
        optimizer = max(p.optimizer_s + self.optimizer_fixed_s, p.optimizer_s * self.optimizer_ratio)
        return Phases(share * compute, (1 - share) * compute, optimizer, p.fixed_s)

    def to_dict(self) -> dict:
        return dict(vars(self))


def transfer(cal: Calibration, probed_own: Phases) -> Transfer:
    """The calibration run's phases against the probe of its own model (module docstring)."""
    measured = cal.forward_s + cal.backward_s - probed_own.fixed_s

    def split(seen: float, probed: float) -> tuple[float, float]:
        return seen - probed, min(1.0, seen / probed) if probed > 0 else 1.0
    c_fixed, c_ratio = split(measured, probed_own.compute_s)
    o_fixed, o_ratio = split(cal.optimizer_s, probed_own.optimizer_s)
    return Transfer(c_fixed, c_ratio, o_fixed, o_ratio)


def calibration_for(cal: Calibration, w: Workload, p: Phases, source: str) -> Calibration:
    """The run's calibration with model `w`'s probed phases in place of its own: its other, link, overlap, sync
    overhead and fitted host work kept (they do not depend on the shapes); the memory overhead is the caller's."""
    other = cal.other_s + p.fixed_s  # per rank per step: not divided among the ranks as the compute is
    step = p.forward_s + p.backward_s + p.optimizer_s + other
    return replace(cal, workload=w, forward_s=p.forward_s, backward_s=p.backward_s, optimizer_s=p.optimizer_s,
                   other_s=other, step_s=step, source=source, notes=list(cal.notes))
