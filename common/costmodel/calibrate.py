"""A measured run (its summary.json) reduced to per-phase seconds for one rank doing the whole global batch.

The phases (forward, backward, optimizer, other) are the run's time breakdown, scaled so that they add up to
its measured step less its communication, then divided by its own f_work and f_state (common/parallel/). A
strategy whose collectives run inside forward and backward (`collectives_inside_compute`: fsdp, tp, pp) has
the model's own estimate of them taken off the step first; one that syncs apart (ddp) measures its overlap.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from common.costmodel.axes import axis_times
from common.costmodel.levels import Links, links_from_record
from common.costmodel.links import loopback_link
from common.costmodel.memory import memory_bytes
from common.costmodel.workload import Workload, workload_of
from common.errors import UserError
from common.model.flops import flops_per_token
from common.model.spec import ModelSpec
from common.parallel import layout
from common.parallel.fsdp import reduce_scatter_traffic


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
    link: Links | None
    source: str = ""
    notes: list = field(default_factory=list)
    sync_overhead_s: float = 0.0    # what a measured ddp sync costs beyond its collectives, per step
    on_cpu: bool = False            # measured on a CPU (fsdp's FSDP_HOST_S_PER_CALL, FSDP_HIDDEN_SHARE apply)
    releases_heap: bool = False     # on Linux without --tune-malloc (fsdp's HEAP_RELEASE_BYTES_PER_S applies)
    # per mesh axis: host seconds per byte its collectives move, or per call where its strategy's host work goes
    # by the call (Layout.host_unit), fitted on an N=2 run of that axis's strategy (fit.py), and the run each came
    # from; an axis without one keeps its strategy's own constants
    host_s_per_byte: dict = field(default_factory=dict)
    fitted_on: dict = field(default_factory=dict)
    host_s_per_call: dict = field(default_factory=dict)
    # Where the step is predicted, not measured: ranks per core's worth of threads (predict.py's cores_shared_by).
    # A pipeline's slot is a piece's compute as it runs there (common/parallel/pp.py); 1 for the run itself.
    cores_shared_by: float = 1.0

    @property
    def host_s_fitted(self) -> dict:
        """Every fitted axis's seconds per unit of its strategy's host work (one of the two dicts holds it)."""
        return {**self.host_s_per_byte, **self.host_s_per_call}


def calibration_from_flops(w: Workload, achieved_flops_per_s: float, source: str) -> Calibration:
    """A calibration on paper, for a device nobody measured here: the global batch's forward + backward at
    `achieved_flops_per_s` (a peak times an assumed MFU), common/model/flops.py's count, the forward a third of it
    (the backward's 2x, as the count assumes); the optimizer, host overhead and memory overhead left at 0."""
    compute_s = w.tokens_per_step * flops_per_token(w.spec, w.seq_len) / achieved_flops_per_s
    return Calibration(w, "ddp", 1, "none", compute_s / 3, 2 * compute_s / 3, 0.0, 0.0, compute_s, None, 0.0,
                       "none (on paper)", None, source)


def calibrate(summary: dict, spec: ModelSpec, source: str = "") -> Calibration:
    """A run's summary.json (with its `breakdown`) and model spec -> Calibration."""
    bd = summary.get("breakdown") or {}
    if not all(isinstance(bd.get(k), (int, float)) for k in ("forward", "backward", "optimizer")):
        raise UserError(f"{source or 'the run'} has no time breakdown in summary.json (a finished run writes one; "
                        "--profile-steps 0 turns it off)")
    if summary.get("rank_speed") or (summary.get("rank_shares") and int(summary.get("world_size") or 1) > 1):
        raise UserError(f"{source or 'the run'} ran with --rank-shares or --rank-speed: plan calibrates on even shares "
                        "at full speed, and predicts uneven ranks from such a run with plan --rank-speed")
    w = workload_of(summary, spec)
    framework, strategy = w.framework, summary.get("strategy", "ddp")
    n, backend = int(summary.get("world_size") or 1), summary.get("backend") or "none"
    lay = layout(strategy, n, (summary.get("config") or {}).get("mesh") or "")
    step_s = bd.get("step_s") or summary.get("step_time_s")
    if not step_s:
        raise UserError(f"{source or 'the run'} has no measured step time in summary.json")
    notes = []
    on_gpu = str(summary.get("device", "")).startswith(("cuda", "gpu", "mps"))
    # torch fsdp gives its freed heap back in every backward on Linux unless --tune-malloc (torch_impl/fsdp.py)
    releases_heap = (not on_gpu and str((summary.get("machine") or {}).get("platform", "Linux")).startswith("Linux")
                     and not (summary.get("config") or {}).get("tune_malloc"))
    link = links_from_record(summary.get("link"), framework, backend)
    exposed = float(bd.get("communication") or 0.0)
    if n > 1 and lay.collectives_inside_compute:
        # Their collectives (pp: its sends) run inside forward and backward, where the breakdown cannot tell them from
        # compute: the model's own estimate of all of them (not overlapped) is taken off the step instead.
        rs = reduce_scatter_traffic(framework, backend)
        host = lay.host_s(w, lay.axis_collectives(w, rs), not on_gpu, releases_heap, {})
        exposed = sum(t.seconds for t in axis_times(lay, w, rs, link or loopback_link(backend))) + host
    compute = step_s - exposed
    if compute < 0.2 * step_s:  # the link estimate exceeds what was measured: keep a floor, and say so
        notes.append(f"modelled communication {exposed:.3g} s leaves under 20% of the measured step "
                     f"{step_s:.3g} s for compute; compute floored at 20%")
        compute = 0.2 * step_s
    phases = {k: float(bd[k]) for k in ("forward", "backward", "optimizer")}
    phases["other"] = float(bd.get("other") or 0.0)
    scale = compute / (sum(phases.values()) or 1.0)
    work, state = lay.work_fraction(w), lay.state_fraction(w)
    overlap, sync_overhead_s = None, 0.0
    if n > 1 and not lay.collectives_inside_compute:  # its sync timed apart: the breakdown's `communication`
        if link is None:
            notes.append(f"no link record: the overlap is measured against {loopback_link(backend).source}")
        full = sum(t.seconds for t in axis_times(lay, w, "native", link or loopback_link(backend)))
        overlap = min(1.0, max(0.0, 1.0 - exposed / full))
        # A sync that costs more than the collectives alone (torch on 2 busy cores: bucket copies, threads
        # waiting for a core, docs/benchmarks.md) is a fixed cost per step, not a share of the link's time.
        sync_overhead_s = max(0.0, exposed - full)
    peaks = summary.get("peak_mem_bytes" if on_gpu else "peak_rss_bytes") or []
    peak = max((p for p in peaks if p), default=None)
    overhead = 0.0
    if peak:
        overhead = max(0.0, peak - memory_bytes(lay, w)["total"])
    else:
        notes.append("no peak memory in summary.json: the fixed overhead is taken as 0")
    return Calibration(w, strategy, n, backend, phases["forward"] * scale / work, phases["backward"] * scale / work,
                       phases["optimizer"] * scale / state, phases["other"] * scale, float(step_s), overlap,
                       overhead, "framework peak" if on_gpu else "peak RSS", link, source, notes, sync_overhead_s,
                       on_cpu=not on_gpu, releases_heap=releases_heap)
