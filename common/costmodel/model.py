"""A cost model of one optimizer step, calibrated on a measured run: time and memory per rank for any
(framework, strategy, N, link, dtype). Framework-neutral; `dpcompare plan` and `compare`'s `prediction`
use it, docs/scaling.md explains it with worked examples.

Time of one step at N ranks:

    step_s    = compute_s + exposed_comm_s
    compute_s = (forward + backward) x f_work(strategy, N) + optimizer x f_state(strategy, N) + other
    exposed_comm_s = (1 - overlap) x sum over the step's collectives of calls x t(collective) [+ sync_overhead_s]

  - forward, backward, optimizer, other: the calibration run's breakdown, scaled so that they add up to its
    measured step less its communication, then divided by its own f (so every phase is "one rank doing the
    whole global batch"). fsdp and tp run their collectives inside forward and backward (common/train/breakdown.py),
    so for such a calibration run the model's own estimate of those collectives is subtracted first.
  - f_work: the share of the global batch's matmul FLOPs (common/model/flops.py) one rank computes. ddp and fsdp
    split the batch: 1/N. tp splits the layers' matrices and attention heads over N but every rank runs
    the replicated lm_head over the whole batch: (6 P_layers / N + 12 L T d / N + 6 V d) / flops_per_token.
    Assumption: time is proportional to FLOPs, so smaller matmuls are taken to run as fast per FLOP.
  - f_state: the share of the parameters a rank updates (AdamW touches what it holds): 1 for ddp, the
    shard for fsdp, the split layers for tp. `other` (host overhead per step) is taken as constant.
  - overlap: measured from a calibration run at N > 1 with a known link, as 1 - exposed / modelled
    (the breakdown's `communication` is the synced minus the unsynced step; without a link record, against
    the loopback figures); a sync that costs more than the collectives alone is overlap 0 plus that excess
    as a fixed cost per step (sync_overhead_s: copies, threads waiting for a core). Unmeasured: DEFAULT_OVERLAP,
    0, measured on the reference machine (docs/benchmarks.md: the gradient sync of `small` at N=2 costs as
    much as the isolated all-reduce in MLX and more in torch: on 2 busy cores nothing overlaps). tp's
    all-reduces sit on the critical path and are never overlapped.

Collectives, ring algorithm over N ranks, link latency a per hop and bandwidth b per direction (bytes/s):

    all-reduce of S bytes        2 (N-1) a + 2 (N-1)/N x S / b
    all-gather / reduce-scatter  (N-1) a + (N-1)/N x S / b       (S: the full, gathered size)

    ddp   the fp32 gradients, one all-reduce per bucket (torch bucket_cap_mb, MLX all_reduce_size_mb)
    fsdp  per micro-step each unit's fp32 parameters gathered: a block twice in torch (FSDP2 frees it after
          its forward and gathers it again for the backward), the other units once (the head stays gathered
          from its forward to its backward, the embedding's backward needs no weights, the root is never
          freed after its forward: torch_impl/fsdp.py), every unit once in MLX (the backward reuses the
          gathered output); their gradients reduce-scattered (torch once per step, MLX once per micro-step,
          mlx_impl/fsdp.py); the all_sum + slice fallback (MLX ring and MPI) is an all-reduce,
          twice the traffic. Units: every block, the embedding and the head (each its own; torch's root
          unit holds a tied embedding), the final norm: MLX all-reduces its gradient as under ddp, FSDP2
          shards it as the root unit. Both pad the vocabulary to a multiple of N.
    tp    per layer and micro-step 4 all-reduces of the activations (B x T x dim) in the compute dtype
    pp    point to point, not a ring: per micro-step and piece (M pieces, --pp-microbatches) each stage
          boundary carries the piece's activations (rows x T x dim, compute dtype) down and their gradient
          back up, t_send = a + S / b each (boundaries work side by side). The slowest stage sets the pace:
          its share of the FLOPs (its blocks, plus the head on the last or the embedding on the first) is
          f_work, inflated by the bubble to (M + p - 1) / M slots of one piece each. A piece's slot is its
          stage compute, or 2 t_send when the link is slower (an activation and a gradient per piece cross
          every boundary); fill and drain add 2 (p - 1) t_send per micro-step. Nothing else overlaps.

A link measured as an all-reduce, t(S) ~= latency_s + S / bandwidth_Bps at N_m ranks, is inverted through
the ring formula (a = latency_s / 2(N_m - 1), b = bandwidth_Bps x 2(N_m - 1)/N_m), so the framework's own
overheads at N_m carry over to any N. A link given by hand (--link-gbps, --latency-us) is the wire itself.
An fsdp run also measures its own all-gather (common/costmodel/probe.py PROBES_ALL_GATHER), inverted the same way
(a = latency_s / (N_m - 1), b = bandwidth_Bps x (N_m - 1)/N_m) and used for the all-gathers only: gloo's
all_gather is CPU-bound where its all-reduce is not (docs/scaling.md), so one link figure for both
mispredicted torch fsdp over loopback by -27.5 %.

Memory per rank (bytes): params + grads + optimizer + activations + overhead

    params     4 x the parameters the rank holds (fp32 master weights under every dtype); grads the same;
               optimizer 2 x params (AdamW's two moments) -- as summary.json's state_bytes counts them
    activations one micro-batch's saved tensors, per token: per layer 7 d in the activation dtype, plus the
               head- and ffn-split ones (3 d + 3 kv + 2 h T + 4 ffn) / N_tp, plus 2 V fp32 logits (logits
               and their exponentials)
    gathered   fsdp: the whole parameters held beside the shards at the peak (gathered_bytes: two blocks and,
               at the head's backward, its whole weight and gradient, in both frameworks)
    overhead   the calibration run's peak (RSS on a CPU, the framework's allocator peak on a GPU) minus
               the above at the calibration point: the runtime, libraries, buffers, and the error of the
               activation count, taken as fixed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from common.errors import UserError
from common.model.flops import attention_flops_per_token, flops_per_token, matmul_parameters
from common.parallel.pipeline import stage_layers, stage_of
from common.model.spec import ModelSpec
from common.parallel.strategy import DTYPE_BYTES, STRATEGIES, check_strategy, tp_split_axis
from common.model.weights import parameter_shapes

MASTER_BYTES = 4          # master weights, gradients, AdamW state and the gradient reduction stay fp32
DEFAULT_OVERLAP = 0.0     # see the module docstring: measured here, nothing overlaps on 2 busy cores
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
FSDP_HIDDEN_SHARE = {"mlx": 0.2}
HEAP_RELEASE_BYTES_PER_S = {"torch": 2.5e9}
DEFAULT_BUCKET_BYTES = {"mlx": 32 * 2**20, "torch": 25 * 2**20}  # RunConfig's all_reduce_size_mb, bucket_cap_mb
# All-reduce at N=2 over loopback on the reference machine (docs/benchmarks.md, "All-reduce against message
# size": the 4 KB median and the 108 MB bandwidth), for runs whose summary.json has no `link` record.
LOOPBACK_ALLREDUCE = {"ring": (82e-6, 0.86e9), "mpi": (12e-6, 1.19e9), "gloo": (335e-6, 1.84e9)}


@dataclass(frozen=True)
class Link:
    """A ring's per-hop latency (s) and per-direction bandwidth (bytes/s), and where they come from; and,
    where the job's own all-gather was measured (fsdp runs, common/costmodel/probe.py), the hop figures its
    all-gathers showed, which gloo's CPU-bound all_gather makes worse than its all-reduce's."""
    name: str
    hop_latency_s: float
    bandwidth_Bps: float
    source: str = ""
    gather_hop_latency_s: float | None = None
    gather_bandwidth_Bps: float | None = None

    def __post_init__(self):
        if not (self.hop_latency_s >= 0 and self.bandwidth_Bps > 0 and math.isfinite(self.bandwidth_Bps)):
            raise UserError(f"link {self.name}: latency must be >= 0 and bandwidth positive, got "
                            f"{self.hop_latency_s!r} s and {self.bandwidth_Bps!r} B/s")

    @classmethod
    def from_allreduce(cls, name: str, latency_s: float, bandwidth_Bps: float, world_size: int,
                       source: str = "") -> "Link":
        """From a measured all-reduce t(S) ~= latency_s + S / bandwidth_Bps at `world_size` ranks."""
        n = max(2, int(world_size))
        steps = 2 * (n - 1)
        return cls(name, latency_s / steps, bandwidth_Bps * steps / n, source)

    def with_allgather(self, latency_s: float, bandwidth_Bps: float, world_size: int) -> "Link":
        """The same link with its all-gathers measured: t(S) ~= latency_s + S / bandwidth_Bps, S gathered."""
        n = max(2, int(world_size))
        return replace(self, gather_hop_latency_s=latency_s / (n - 1), gather_bandwidth_Bps=bandwidth_Bps * (n - 1) / n,
                       source=self.source + "; its all-gather measured too")

    @classmethod
    def wire(cls, gbit_per_s: float, latency_us: float, name: str = "") -> "Link":
        return cls(name or f"{gbit_per_s:g} Gbit/s, {latency_us:g} µs", latency_us * 1e-6, gbit_per_s * 1e9 / 8,
                   "given by hand (the wire: no framework overhead)")

    def all_reduce_s(self, nbytes: float, n: int) -> float:
        return 2 * (n - 1) * self.hop_latency_s + 2 * (n - 1) / n * nbytes / self.bandwidth_Bps

    def all_gather_s(self, nbytes: float, n: int) -> float:
        if self.gather_bandwidth_Bps:
            return (n - 1) * (self.gather_hop_latency_s or 0.0) + (n - 1) / n * nbytes / self.gather_bandwidth_Bps
        return self.reduce_scatter_s(nbytes, n)

    def reduce_scatter_s(self, nbytes: float, n: int) -> float:
        return (n - 1) * self.hop_latency_s + (n - 1) / n * nbytes / self.bandwidth_Bps

    def send_s(self, nbytes: float, n: int) -> float:
        """One point-to-point message to a neighbour (pp): one hop."""
        return self.hop_latency_s + nbytes / self.bandwidth_Bps


RING_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
               "reduce_scatter": lambda n: (n - 1) / n, "send": lambda n: 1.0}


@dataclass(frozen=True)
class Collective:
    kind: str      # all_reduce | all_gather | reduce_scatter | send (point to point)
    nbytes: int    # payload of one call (all-gather: the gathered size)
    calls: int     # per optimizer step
    what: str

    def seconds(self, link: Link, n: int) -> float:
        return self.calls * getattr(link, f"{self.kind}_s")(self.nbytes, n)

    def wire_bytes(self, n: int) -> float:
        """Bytes each rank sends per step for this collective."""
        return self.calls * RING_FACTOR[self.kind](n) * self.nbytes


@dataclass(frozen=True)
class Workload:
    """What a step trains: the model, the global batch, the precision and the framework's buckets."""
    spec: ModelSpec
    seq_len: int
    global_batch_size: int
    grad_accum: int = 1
    dtype: str = "float32"
    framework: str = "torch"
    bucket_bytes: int | None = None  # ddp's all-reduce chunks: MLX all_reduce_size_mb, torch bucket_cap_mb
    target_tokens: int | None = None  # real target tokens per step where a run counted them (padding has fewer)
    pp_microbatches: int = 4          # pp: pieces per micro-step (RunConfig.pp_microbatches)

    @property
    def tokens_per_step(self) -> int:
        return self.target_tokens or self.global_batch_size * self.seq_len

    def micro_rows(self, strategy: str, n: int) -> float:
        """Sequences per rank per micro-step: tp and pp ranks all read the whole batch."""
        return self.global_batch_size / ((1 if strategy in ("tp", "pp") else n) * self.grad_accum)


def block_elements(shapes: dict, layer: int | None = None) -> int:
    """Parameter elements of transformer block `layer`, or of every block (None), from parameter_shapes."""
    prefix = "model.layers." if layer is None else f"model.layers.{layer}."
    return sum(math.prod(shape) for name, shape in shapes.items() if name.startswith(prefix))


def local_parameters(strategy: str, spec: ModelSpec, n: int, framework: str = "torch") -> float:
    """Parameters one rank holds (and updates) under a strategy at N ranks."""
    shapes = parameter_shapes(spec)
    total = sum(math.prod(s) for s in shapes.values())
    if strategy == "ddp" or n == 1:
        return total
    if strategy == "tp":
        split = sum(math.prod(s) for k, s in shapes.items() if tp_split_axis(k) is not None)
        return total - split + split / n
    if strategy == "pp":  # the stage holding the most: its blocks and the embedding, or the norm and the head
        return max(sum(math.prod(s) for k, s in shapes.items() if stage_of(k, spec.n_layers, n) == stage)
                   for stage in range(n))
    blocks = block_elements(shapes)
    vocab = sum(math.prod(s) for k, s in shapes.items() if k in ("model.embed_tokens.weight", "lm_head.weight"))
    rest = total - blocks - vocab  # the final norm: MLX keeps it replicated, FSDP2 shards the root unit
    matrices = 1 if spec.tie_embeddings else 2  # both pad V up to a multiple of N (mlx_impl/fsdp.py, FSDP2)
    return blocks / n + (rest if framework == "mlx" else rest / n) + matrices * math.ceil(spec.vocab_size / n) * spec.dim


def work_fraction(strategy: str, w: Workload, n: int) -> float:
    """f_work: one rank's share of the global batch's forward + backward FLOPs (module docstring); under pp
    the slowest stage's, inflated by the bubble."""
    if strategy not in ("tp", "pp") or n == 1:
        return 1.0 / n
    head = 6.0 * w.spec.vocab_size * w.spec.dim
    layers = 6.0 * matmul_parameters(w.spec) - head + attention_flops_per_token(w.spec, w.seq_len)
    total = flops_per_token(w.spec, w.seq_len)
    if strategy == "tp":
        return (layers / n + head) / total
    per_block = layers / w.spec.n_layers  # the embedding is a lookup: no FLOPs on the first stage
    slowest = max(len(stage_layers(w.spec.n_layers, n, s)) * per_block + (head if s == n - 1 else 0.0)
                  for s in range(n))
    m = w.pp_microbatches
    return slowest / total * (m + n - 1) / m


def state_fraction(strategy: str, w: Workload, n: int) -> float:
    """f_state: the share of the parameters a rank updates."""
    total = local_parameters("ddp", w.spec, 1)
    return local_parameters(strategy, w.spec, n, w.framework) / total


# ---- bytes moved per step, per strategy ---------------------------------------------------------
def _ddp_collectives(w: Workload, n: int, reduce_scatter: str) -> list[Collective]:
    grad_bytes = local_parameters("ddp", w.spec, 1) * MASTER_BYTES
    bucket = w.bucket_bytes or DEFAULT_BUCKET_BYTES.get(w.framework, 25 * 2**20)
    return [Collective("all_reduce", int(grad_bytes / math.ceil(grad_bytes / bucket)),
                       math.ceil(grad_bytes / bucket), "gradients")]


def _fsdp_collectives(w: Workload, n: int, reduce_scatter: str) -> list[Collective]:
    shapes = parameter_shapes(w.spec)
    block = block_elements(shapes, 0) * MASTER_BYTES
    # the vocabulary matrices, padded to a multiple of N rows (mlx_impl/fsdp.py; FSDP2 pads the same)
    vocab = [math.ceil(s[0] / n) * n * s[1] * MASTER_BYTES for k, s in shapes.items()
             if k in ("model.embed_tokens.weight", "lm_head.weight")]
    norm = w.spec.dim * MASTER_BYTES
    # (unit's bytes, gathers per micro-step). MLX's gather is a node of the step's graph (mlx_impl/fsdp.py) and
    # its step times fit one gather per micro-step: measured on `small` at N=2 while two were counted, MLX fsdp
    # predicted +29 % over 1gbit and 200mbit, +33 % on loopback (docs/scaling.md); with one, within 15 % on
    # all three. FSDP2 frees a block after its forward and gathers it again for the backward; the other units
    # are gathered once (torch_impl/fsdp.py).
    blocks = [(block, 1 if w.framework == "mlx" else 2)] * w.spec.n_layers
    if w.framework == "mlx":  # blocks, and the embedding and head each on its own
        units = blocks + [(v, 1) for v in vocab]
        replicated = norm  # averaged after the backward, as ddp
    elif w.spec.tie_embeddings:  # FSDP2: the blocks, then the root unit (embedding, final norm)
        units, replicated = blocks + [(sum(vocab) + norm, 1)], 0
    else:  # FSDP2: the blocks, the embedding and the head each on its own, the root (final norm)
        units, replicated = blocks + [(v, 1) for v in vocab] + [(norm, 1)], 0
    gathers = sum(times for _, times in units)
    unit = int(sum(nbytes for nbytes, _ in units) / len(units))
    scatters = w.grad_accum if w.framework == "mlx" else 1  # MLX reduce-scatters in every micro-step's backward
    # one collective of the gathers' mean size: the bytes, the calls (latency) and the host work per call add up
    out = [Collective("all_gather", int(sum(nbytes * times for nbytes, times in units) / gathers),
                      gathers * w.grad_accum, "parameters gathered (forward" +
                      (")" if w.framework == "mlx" else "; the blocks again for the backward)"))]
    if reduce_scatter == "all_sum_slice":  # an all-reduce then the rank's slice: twice a reduce-scatter
        out.append(Collective("all_reduce", unit, scatters * len(units), "gradients (all_sum + slice)"))
    else:
        out.append(Collective("reduce_scatter", unit, scatters * len(units), "gradients"))
    if replicated:
        out.append(Collective("all_reduce", replicated, 1, "replicated gradients"))
    return out


def _tp_collectives(w: Workload, n: int, reduce_scatter: str) -> list[Collective]:
    act = w.micro_rows("tp", n) * w.seq_len * w.spec.dim * DTYPE_BYTES[w.dtype]
    return [Collective("all_reduce", int(act), 4 * w.spec.n_layers * w.grad_accum, "activations")]


def _pp_collectives(w: Workload, n: int, reduce_scatter: str) -> list[Collective]:
    """One boundary's sends per step: each piece's activations down and their gradient up."""
    piece = w.micro_rows("pp", n) / w.pp_microbatches * w.seq_len * w.spec.dim * DTYPE_BYTES[w.dtype]
    return [Collective("send", int(piece), 2 * w.pp_microbatches * w.grad_accum, "activations and their gradients")]


COLLECTIVES = {"ddp": _ddp_collectives, "fsdp": _fsdp_collectives, "tp": _tp_collectives, "pp": _pp_collectives}


def pipeline_exposed_s(w: Workload, n: int, link: Link, compute_fwd_bwd_s: float) -> float:
    """pp's communication on the critical path (module docstring): per micro-step, fill and drain cross
    2 (p - 1) boundaries, and a link slower than a piece's compute stretches every one of the M + p - 1 slots."""
    piece = _pp_collectives(w, n, "")[0].nbytes
    send_s, m = link.send_s(piece, n), w.pp_microbatches
    slot_s = compute_fwd_bwd_s / (w.grad_accum * (m + n - 1))
    return w.grad_accum * ((m + n - 1) * max(0.0, 2 * send_s - slot_s) + 2 * (n - 1) * send_s)


def fsdp_host_s(colls: list[Collective], w: Workload, n: int, releases_heap: bool) -> float:
    """fsdp's host time per step beyond the link's: FSDP_HOST_S_PER_CALL per gather and reduce-scatter call, and
    where the run releases its heap (Calibration.releases_heap), the release and its faults
    (HEAP_RELEASE_BYTES_PER_S)."""
    calls = FSDP_HOST_S_PER_CALL.get(w.framework, 0.0) * sum(c.calls for c in colls if c.kind != "all_reduce"
                                                             or c.what.startswith("gradients"))
    rate = HEAP_RELEASE_BYTES_PER_S.get(w.framework)
    return calls + (heap_release_bytes(w, n) / rate if releases_heap and rate else 0.0)


def heap_release_bytes(w: Workload, n: int) -> float:
    """torch fsdp: the freed heap its two releases per backward give back and the next micro-step faults in
    again (torch_impl/fsdp.py). Measured per step and rank at N=2 (common/train/heap.py's calls, RssAnon before and
    after): `small` 190-280 MiB, `base` 410-580 at 12 layers and 850-1,190 at 24; about one micro-batch's
    activations plus every block's whole weights (246, 584 and 1,120 MiB here), per micro-step."""
    return w.grad_accum * (activation_bytes("fsdp", w, n) + block_elements(parameter_shapes(w.spec)) * MASTER_BYTES)


def collectives(strategy: str, w: Workload, n: int, reduce_scatter: str = "native") -> list[Collective]:
    """The step's collectives (none at N=1); `reduce_scatter`: "native" or MLX's "all_sum_slice"."""
    if strategy not in COLLECTIVES:
        raise UserError(f"the cost model knows no strategy {strategy!r}; allowed: {', '.join(COLLECTIVES)}")
    return [] if n < 2 else COLLECTIVES[strategy](w, n, reduce_scatter)


def reduce_scatter_kind(framework: str, backend: str) -> str:
    """How many bytes a reduce-scatter moves: "all_sum_slice" costs an all-reduce. mlx_impl/fsdp.py: MLX
    0.32.4's ring and MPI lack sum_scatter and all-reduce. torch's gloo has reduce_scatter_tensor, but it moves
    an all-reduce's bytes: 32 MB at N=2 over 200mbit took 1,436 ms against all_reduce's 1,409 (a ring
    reduce-scatter would take half; AMD EPYC Zen 5, docs/scaling.md)."""
    if framework == "mlx":
        return "native" if backend == "nccl" else "all_sum_slice"
    return "all_sum_slice" if backend == "gloo" else "native"


# ---- memory per rank ----------------------------------------------------------------------------
def activation_bytes(strategy: str, w: Workload, n: int) -> float:
    """One micro-batch's saved activations on one rank (module docstring); a rough count whose error the
    calibrated overhead absorbs at the calibration point."""
    s = w.spec
    tp_n = n if strategy == "tp" else 1
    kv = s.n_kv_heads * s.head_dim
    per_token_layer = 7 * s.dim + (3 * s.dim + 3 * kv + 2 * s.n_heads * w.seq_len + 4 * s.ffn_dim) / tp_n
    tokens = w.micro_rows(strategy, n) * w.seq_len
    stage_blocks = len(stage_layers(s.n_layers, n, 0)) if strategy == "pp" else s.n_layers
    layers = tokens * stage_blocks * per_token_layer * DTYPE_BYTES[w.dtype]  # pp: every piece's, as gpipe keeps
    logits = tokens * 2 * s.vocab_size * 4
    return layers + logits


def gathered_bytes(strategy: str, w: Workload, n: int) -> float:
    """fsdp: the whole parameters (and gradients) a rank holds beyond its shards at the step's peak.

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
    if strategy != "fsdp" or n == 1:
        return 0.0
    shapes = parameter_shapes(w.spec)
    blocks = [block_elements(shapes, i) for i in range(w.spec.n_layers)]
    matrix = math.ceil(w.spec.vocab_size / n) * n * w.spec.dim
    if w.framework == "mlx":
        return (2 * max(blocks) + (1 if w.spec.tie_embeddings else 2) * matrix) * DTYPE_BYTES[w.dtype]
    return (2 * max(blocks) + 2 * matrix) * MASTER_BYTES


def memory_bytes(strategy: str, w: Workload, n: int, overhead_bytes: float = 0.0) -> dict:
    """Bytes per rank at the step's peak: the state the rank holds, one micro-batch's activations, fsdp's
    gathered vocabulary, AdamW's update (it writes new parameters before the old ones are freed: one more
    copy of the rank's parameters, measured below), and a fixed overhead (the caller's)."""
    params = local_parameters(strategy, w.spec, n, w.framework) * MASTER_BYTES
    parts = {"params": params, "grads": params, "optimizer": 2 * params,
             "activations": activation_bytes(strategy, w, n), "gathered": gathered_bytes(strategy, w, n),
             "update": params, "overhead": overhead_bytes}
    return {**parts, "total": sum(parts.values())}


# The predicted peak's framework terms, fitted (relative least squares) to the peak RSS of 21 runs on the
# reference machine (AMD EPYC Zen 5, 2 cores, shared: docs/benchmarks.md "Memory per rank, predicted and
# measured"): `small` with a 512-token and with GPT-2's vocabulary and `base`, 4 steps at seq 128 and global
# batch 8, ddp at N=1 and 2, fsdp and tp at 2, both frameworks. Fitted: MLX activations x0.80, update x1.46,
# 60 MB; torch x0.97, x0.15, 73 MB; rounded below. MLX's update and reduce terms were fitted again once the
# sharded strategies stopped building the whole model (issue 25: those runs' peaks had been start-up's):
# 16 runs of `base` at 12 and 24 layers, ddp at N=1 and 2, fsdp and tp at 2 (bench_memory.py
# --with-one-rank): update x0.94, reduce x0.67 (every run then within 9 %), rounded below.
#   activations  the share of activation_bytes' count a framework keeps: MLX's compiled step fuses some of it
#   update       copies of the rank's parameters alive in the update: MLX's AdamW writes new parameters and
#                moments before the old ones are freed; torch's foreach AdamW updates in place
#   reduce       ddp at N > 1: copies of the gradients the all-reduce makes: MLX's nn.average_gradients
#                concatenates them into all_reduce_size groups and all-sums those. torch's DDP reduces in
#                its buckets, which the gradients are views of (gradient_as_bucket_view), yet from the third
#                step on its rank holds 0.8x its parameters more than the rest of this model counts (`base`,
#                12 layers: 3,848-3,914 MiB at 3 to 12 steps against 3,542 at 2, and flat from 4 to 12 steps
#                at N=1; most likely the buckets DDP builds again after its first step, the first ones freed
#                into the heap): fitted to the runs of 3 or more steps, so 2-step runs come out 9-12 % high
#   workspace    the allocator's and the compiled graph's buffers, the token cache's mapped pages
ACTIVATION_FACTOR = {"mlx": 0.8, "torch": 1.0}
UPDATE_FACTOR = {"mlx": 1.0, "torch": 0.0}
REDUCE_FACTOR = {"mlx": 0.7, "torch": 0.8}
WORKSPACE_BYTES = {"mlx": 60e6, "torch": 70e6}


def checkpoint_bytes(strategy: str, w: Workload, n: int, rank: int = 0, checkpoint_format: str = "hf") -> float:
    """What saving a checkpoint holds beside the rank's state (after a step: its activations are freed).

    hf: the state streams into the files one tensor at a time (common/checkpoint/store.py HFCheckpointWriter):
    fsdp's rank 0 and every tp and pp rank hold one gathered tensor at a time (the largest sets the peak;
    pp's ranks also hold the zeros they add for a tensor of another stage), ddp writes views of its own.
    Before the stream, fsdp's rank 0 held the whole gathered state (3x the parameters), 0.9-1.0 GB above
    rank 1 on `base` (docs/benchmarks.md). sharded: every rank writes its own arrays, from views of them."""
    shapes = parameter_shapes(w.spec)
    largest = max(math.prod(s) for s in shapes.values()) * MASTER_BYTES
    if checkpoint_format == "sharded":
        return 0.0
    if n == 1 or strategy == "ddp" or (strategy == "fsdp" and rank > 0):
        return 0.0
    return 2 * largest if strategy == "pp" else largest


def predicted_peak(strategy: str, w: Workload, n: int, fixed_bytes: float, rank: int = 0,
                   checkpoint_format: str = "hf") -> dict:
    """A rank's peak RSS from the shapes and its measured fixed footprint alone (nothing calibrated on the
    run's own peak): the larger of the step's (memory_bytes with the framework's factors, the fixed footprint
    and the workspace) and the checkpoint's (the state, the fixed footprint, the workspace and what saving
    holds; `peak_at` says which). The start-up is not counted: a sharded rank reads only its own part of the
    model (issue 25), less than it holds in a step."""
    parts = memory_bytes(strategy, w, n)
    framework = w.framework if w.framework in WORKSPACE_BYTES else "torch"
    parts.update(fixed=fixed_bytes, workspace=WORKSPACE_BYTES[framework],
                 activations=parts["activations"] * ACTIVATION_FACTOR[framework],
                 update=parts["params"] * UPDATE_FACTOR[framework],
                 reduce=parts["grads"] * REDUCE_FACTOR[framework] if strategy == "ddp" and n > 1 else 0.0)
    del parts["overhead"], parts["total"]
    step = sum(parts.values())
    parts["checkpoint"] = checkpoint_bytes(strategy, w, n, rank, checkpoint_format)
    saving = (fixed_bytes + parts["workspace"] + parts["params"] + parts["grads"] + parts["optimizer"]
              + parts["checkpoint"])
    return {**parts, "step": step, "saving": saving, "peak_at": "step" if step >= saving else "checkpoint",
            "total": max(step, saving)}


# ---- calibration and prediction -----------------------------------------------------------------
@dataclass(frozen=True)
class Calibration:
    """A measured run reduced to per-phase seconds for one rank doing the whole global batch."""
    workload: Workload
    strategy: str
    world_size: int
    backend: str
    forward_s: float
    backward_s: float
    optimizer_s: float
    other_s: float
    step_s: float                   # the run's measured step
    overlap: float | None           # measured (ddp at N > 1), or None
    overhead_bytes: float
    memory_basis: str
    link: Link | None
    source: str = ""
    notes: list = field(default_factory=list)
    sync_overhead_s: float = 0.0    # what a measured ddp sync costs beyond its collectives, per step
    on_cpu: bool = False            # measured on a CPU (fsdp's FSDP_HOST_S_PER_CALL, FSDP_HIDDEN_SHARE apply)
    releases_heap: bool = False     # on Linux without --tune-malloc (fsdp's HEAP_RELEASE_BYTES_PER_S applies)


def calibration_from_flops(w: Workload, achieved_flops_per_s: float, source: str) -> Calibration:
    """A calibration on paper, for a device nobody measured here: the global batch's forward + backward at
    `achieved_flops_per_s` (a peak times an assumed MFU), common/model/flops.py's count, the forward a third of it
    (the backward's 2x, as the count assumes); the optimizer, host overhead and memory overhead left at 0."""
    compute_s = w.tokens_per_step * flops_per_token(w.spec, w.seq_len) / achieved_flops_per_s
    return Calibration(w, "ddp", 1, "none", compute_s / 3, 2 * compute_s / 3, 0.0, 0.0, compute_s, None, 0.0,
                       "none (on paper)", None, source)


def link_from_record(record: dict | None, framework: str = "", backend: str = "") -> Link | None:
    """The `link` record of summary.json -> a Link: the job's own all-reduce when measured, else the TCP
    path's figures; None when there is no record or it measured nothing."""
    if not record:
        return None
    name = record.get("requested") or "loopback"
    ar, ag = record.get("allreduce") or {}, record.get("allgather") or {}
    if ar.get("latency_s") is not None and ar.get("bandwidth_Bps"):
        link = Link.from_allreduce(name, ar["latency_s"], ar["bandwidth_Bps"], ar.get("world_size") or 2,
                                   f"the job's {ar.get('backend', backend)} all-reduce, measured at its start")
        if ag.get("latency_s") is not None and ag.get("bandwidth_Bps"):
            link = link.with_allgather(ag["latency_s"], ag["bandwidth_Bps"], ag.get("world_size") or 2)
        return link
    if record.get("tcp_bandwidth_Bps"):
        return Link(name, record.get("tcp_latency_s") or 0.0, record["tcp_bandwidth_Bps"],
                    "the path's TCP throughput and latency, measured")
    if record.get("rate_bps"):
        return Link(name, record.get("tcp_latency_s") or 0.0, record["rate_bps"] / 8, "the shaped rate (not measured)")
    return None


def loopback_link(backend: str) -> Link:
    latency_s, bandwidth_Bps = LOOPBACK_ALLREDUCE.get(backend, LOOPBACK_ALLREDUCE["gloo"])
    return Link.from_allreduce(f"loopback ({backend}, assumed)", latency_s, bandwidth_Bps, 2,
                               "docs/benchmarks.md's loopback all-reduce at N=2 (no link record in the run)")


def workload_of(summary: dict, spec: ModelSpec) -> Workload:
    """The Workload a run's summary.json describes."""
    cfg = summary.get("config") or {}
    framework = summary.get("framework", cfg.get("framework", "torch"))
    bucket_mb = cfg.get("all_reduce_size_mb" if framework == "mlx" else "bucket_cap_mb")
    return Workload(spec, int(cfg.get("seq_len", 128)), int(cfg.get("global_batch_size", 8)),
                    int(cfg.get("grad_accum", 1)), summary.get("dtype", cfg.get("dtype", "float32")), framework,
                    int(bucket_mb * 2**20) if bucket_mb else None, summary.get("tokens_per_step"),
                    int(cfg.get("pp_microbatches", 4)))


def calibrate(summary: dict, spec: ModelSpec, source: str = "") -> Calibration:
    """A run's summary.json (with its `breakdown`) and model spec -> Calibration."""
    bd = summary.get("breakdown") or {}
    if not all(isinstance(bd.get(k), (int, float)) for k in ("forward", "backward", "optimizer")):
        raise UserError(f"{source or 'the run'} has no time breakdown in summary.json (a finished run writes one; "
                        "--profile-steps 0 turns it off)")
    w = workload_of(summary, spec)
    framework, strategy = w.framework, summary.get("strategy", "ddp")
    n, backend = int(summary.get("world_size") or 1), summary.get("backend") or "none"
    step_s = bd.get("step_s") or summary.get("step_time_s")
    if not step_s:
        raise UserError(f"{source or 'the run'} has no measured step time in summary.json")
    notes = []
    on_gpu = str(summary.get("device", "")).startswith(("cuda", "gpu", "mps"))
    # torch fsdp gives its freed heap back in every backward on Linux unless --tune-malloc (torch_impl/fsdp.py)
    releases_heap = (not on_gpu and str((summary.get("machine") or {}).get("platform", "Linux")).startswith("Linux")
                     and not (summary.get("config") or {}).get("tune_malloc"))
    link = link_from_record(summary.get("link"), framework, backend)
    exposed = float(bd.get("communication") or 0.0)
    if n > 1 and strategy in ("fsdp", "tp", "pp"):
        # Their collectives (pp: its sends) run inside forward and backward, where the breakdown cannot tell them from
        # compute: the model's own estimate of all of them (not overlapped) is taken off the step instead.
        used = link or loopback_link(backend)
        colls = collectives(strategy, w, n, reduce_scatter_kind(framework, backend))
        host = fsdp_host_s(colls, w, n, releases_heap) if strategy == "fsdp" and not on_gpu else 0.0
        exposed = sum(c.seconds(used, n) for c in colls) + host
    compute = step_s - exposed
    if compute < 0.2 * step_s:  # the link estimate exceeds what was measured: keep a floor, and say so
        notes.append(f"modelled communication {exposed:.3g} s leaves under 20% of the measured step "
                     f"{step_s:.3g} s for compute; compute floored at 20%")
        compute = 0.2 * step_s
    phases = {k: float(bd[k]) for k in ("forward", "backward", "optimizer")}
    phases["other"] = float(bd.get("other") or 0.0)
    scale = compute / (sum(phases.values()) or 1.0)
    work, state = work_fraction(strategy, w, n), state_fraction(strategy, w, n)
    overlap, sync_overhead_s = None, 0.0
    if n > 1 and strategy == "ddp":
        if link is None:
            notes.append(f"no link record: the overlap is measured against {loopback_link(backend).source}")
        full = sum(c.seconds(link or loopback_link(backend), n) for c in collectives("ddp", w, n))
        overlap = min(1.0, max(0.0, 1.0 - exposed / full))
        # A sync that costs more than the collectives alone (torch on 2 busy cores: bucket copies, threads
        # waiting for a core, docs/benchmarks.md) is a fixed cost per step, not a share of the link's time.
        sync_overhead_s = max(0.0, exposed - full)
    peaks = summary.get("peak_mem_bytes" if on_gpu else "peak_rss_bytes") or []
    peak = max((p for p in peaks if p), default=None)
    overhead = 0.0
    if peak:
        overhead = max(0.0, peak - memory_bytes(strategy, w, n)["total"])
    else:
        notes.append("no peak memory in summary.json: the fixed overhead is taken as 0")
    return Calibration(w, strategy, n, backend, phases["forward"] * scale / work, phases["backward"] * scale / work,
                       phases["optimizer"] * scale / state, phases["other"] * scale, float(step_s), overlap,
                       overhead, "framework peak" if on_gpu else "peak RSS", link, source, notes, sync_overhead_s,
                       on_cpu=not on_gpu, releases_heap=releases_heap)


@dataclass
class Prediction:
    framework: str
    strategy: str
    world_size: int
    link: str
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    step_s: float
    tokens_per_s: float
    efficiency: float
    exposed_share: float
    wire_bytes_per_rank: float
    collectives: list
    memory_bytes: dict               # per rank: params, grads, optimizer, activations, overhead, total
    fits: bool | None
    bottleneck: str

    def to_dict(self) -> dict:
        out = dict(vars(self))
        out["collectives"] = [vars(c) for c in self.collectives]
        return out


def predict(cal: Calibration, strategy: str, n: int, link: Link | None, device_memory_bytes: float | None = None,
            backend: str | None = None) -> Prediction:
    """One step of `strategy` at `n` ranks over `link` (None at N=1), from a calibration. Raises UserError
    when the strategy cannot split this model over n ranks (common/parallel/strategy.py's checks)."""
    if strategy not in STRATEGIES:
        raise UserError(f"unknown strategy {strategy!r}; allowed: {', '.join(STRATEGIES)}")
    if n > 1 or strategy != "ddp":
        check_strategy(strategy, cal.workload.spec, n)
    w = cal.workload
    backend = backend or cal.backend
    compute = ((cal.forward_s + cal.backward_s) * work_fraction(strategy, w, n)
               + cal.optimizer_s * state_fraction(strategy, w, n) + cal.other_s)
    colls = collectives(strategy, w, n, reduce_scatter_kind(w.framework, backend))
    if colls and link is None:
        raise UserError(f"predicting {strategy} at N={n} needs a link (its latency and bandwidth)")
    comm = sum(c.seconds(link, n) for c in colls)
    overlap = 0.0 if strategy == "tp" else (cal.overlap if cal.overlap is not None else DEFAULT_OVERLAP)
    exposed = (1.0 - overlap) * comm + (cal.sync_overhead_s if colls and strategy == "ddp" else 0.0)
    if strategy == "fsdp" and colls and cal.on_cpu:
        compute += fsdp_host_s(colls, w, n, cal.releases_heap)
        exposed = max(0.0, exposed - FSDP_HIDDEN_SHARE.get(w.framework, 0.0) * (cal.forward_s + cal.backward_s)
                      * work_fraction(strategy, w, n))
    if strategy == "pp" and colls:  # its sends overlap other pieces' compute: only the critical path counts
        exposed = pipeline_exposed_s(w, n, link, (cal.forward_s + cal.backward_s) * work_fraction(strategy, w, n))
    step = compute + exposed
    one = (cal.forward_s + cal.backward_s + cal.optimizer_s + cal.other_s)  # ddp at N=1: the scaling baseline
    memory = memory_bytes(strategy, w, n, cal.overhead_bytes)
    fits = None if device_memory_bytes is None else memory["total"] <= device_memory_bytes
    pred = Prediction(w.framework, strategy, n, link.name if (link and colls) else "none", compute, comm, exposed,
                      step, w.tokens_per_step / step, one / (n * step), exposed / step,
                      sum(c.wire_bytes(n) for c in colls), colls, memory, fits, "")
    pred.bottleneck = bottleneck(pred, device_memory_bytes)
    return pred


def bottleneck(p: Prediction, device_memory_bytes: float | None = None) -> str:
    """One sentence naming what limits the step."""
    if p.fits is False:
        return (f"memory: {p.memory_bytes['total'] / 1e9:.2f} GB per rank does not fit in {device_memory_bytes / 1e9:.3g} GB "
                f"(optimizer state {p.memory_bytes['optimizer'] / 1e9:.2f} GB, activations "
                f"{p.memory_bytes['activations'] / 1e9:.2f} GB)")
    if p.collectives and p.exposed_comm_s >= p.compute_s:
        biggest = max(p.collectives, key=lambda c: c.calls * c.nbytes)
        moved = sum(c.calls * c.nbytes for c in p.collectives if c.what == biggest.what)
        return (f"the link: {p.link} needs {p.comm_s:.3g} s per step for {moved / 1e6:,.1f} MB of {biggest.what} "
                f"({p.wire_bytes_per_rank / 1e6:,.1f} MB sent per rank), against {p.compute_s:.3g} s of compute")
    tail = (f"; communication adds {p.exposed_comm_s:.3g} s ({100 * p.exposed_share:.0f}% of the step)"
            if p.collectives else "")
    return f"compute: {p.compute_s:.3g} s per step per rank{tail}"
