"""One step of a strategy at N ranks over a link, from a calibration: its time, memory and what limits it
(the equations: common/costmodel/__init__.py; each strategy's terms: its object in common/parallel/)."""
from __future__ import annotations

from dataclasses import dataclass, replace

from common.costmodel.axes import AxisTime, axis_times, exposed_comm_s
from common.costmodel.calibrate import Calibration
from common.costmodel.levels import Links
from common.costmodel.links import waits_poll
from common.costmodel.memory import memory_bytes
from common.errors import UserError
from common.parallel import layout
from common.parallel.layout import AxisCollectives, Layout
from common.parallel.fsdp import reduce_scatter_traffic


@dataclass
class Prediction:
    framework: str
    strategy: str
    world_size: int
    mesh: str
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
    levels: dict                     # per axis: the link level its collectives cross ("inner", "outer", ...)
    caveat: str | None = None        # how measured runs of this layout missed the prediction (Layout.prediction_caveat)

    def to_dict(self) -> dict:
        out = dict(vars(self))
        out["collectives"] = [vars(c) for c in self.collectives]
        return out


def predict(cal: Calibration, strategy: str, n: int, link: Links | None, device_memory_bytes: float | None = None,
            backend: str | None = None, mesh: str = "", cores_shared_by: float = 1.0) -> Prediction:
    """One step of `strategy` at `n` ranks (strategy "mesh": the axes of `mesh`, "dp=2,tp=2") over `link` (one
    Link, or a TwoLevelLink: common/costmodel/levels.py; None at N=1), from a calibration. Raises UserError when
    the strategy cannot split this model over n ranks (its object's `check`, common/parallel/). `cores_shared_by`:
    ranks per core's worth of threads where the ranks share one CPU (4 one-thread ranks on 2 cores: 2), which
    stretches their busy compute that much (pp's bubble leaves the core to others: `busy_fraction`); 1 where each
    rank has its own (a cluster, the plan's assumption 2)."""
    lay = layout(strategy, n, mesh)
    lay.check(cal.workload.spec)
    backend = backend or cal.backend
    # where the exposure rules' compute runs (pp's slot), and on what (pp's sends: pipeline.py's BUFFERED_BYTES)
    cal = replace(cal, cores_shared_by=cores_shared_by, backend=backend)
    w = cal.workload
    compute = ((cal.forward_s + cal.backward_s) * lay.work_fraction(w)
               + cal.optimizer_s * lay.state_fraction(w) + cal.other_s)
    rs = reduce_scatter_traffic(w.framework, backend)
    colls = lay.collectives(w, rs)
    if colls and link is None:
        raise UserError(f"predicting {strategy} at N={n} needs a link (its latency and bandwidth)")
    times = axis_times(lay, w, rs, link) if link is not None else []
    comm = sum(t.seconds for t in times)  # no link: no collectives
    exposed = exposed_comm_s(lay, cal, times)
    axes = lay.axis_collectives(w, rs)
    host = host_s(lay, cal, axes, times)
    compute += host
    if cores_shared_by > 1:  # ranks take turns on the cores: their busy time, not their idle slots, is stretched
        # A backend that polls while it waits keeps the core through pp's idle slots too (links.py POLLING_WAITS):
        # MLX pp x4 on 2 cores, ring, fitted: -57 % -> -37 % and -46 % -> -25 % on loopback, -6 % -> +14 % over two
        # levels (docs/scaling.md).
        held = lay.work_fraction(w) if waits_poll(w.framework, backend) else lay.busy_fraction(w)
        busy = (cal.forward_s + cal.backward_s) * held + cal.optimizer_s * lay.state_fraction(w) + cal.other_s
        # The host work is added once, not stretched: most of it is a rank waiting on its peers inside a
        # collective, which leaves the core to another rank. Measured (docs/scaling.md, N=4 on 2 cores, loopback,
        # fitted on N=2): 7 of 15 layouts within 20 % stretched, 13 of 15 not.
        # Except host work that is the rank's own CPU work (Layout.host_stretches: torch FSDP2's copies), which takes
        # its turns on the core as the compute does: (shared - 1) times it more (docs/scaling.md, "Sitting 11").
        compute = max(compute, busy * cores_shared_by + host + stretched_host_s(lay, cal, axes) * (cores_shared_by - 1))
    step = compute + exposed
    one = (cal.forward_s + cal.backward_s + cal.optimizer_s + cal.other_s)  # ddp at N=1: the scaling baseline
    memory = memory_bytes(lay, w, cal.overhead_bytes)
    fits = None if device_memory_bytes is None else memory["total"] <= device_memory_bytes
    pred = Prediction(w.framework, strategy, n, mesh, link.name if (link and colls) else "none", compute, comm, exposed,
                      step, w.tokens_per_step / step, one / (n * step), exposed / step,
                      sum(t.wire_bytes for t in times), colls, memory, fits, "",
                      {t.axis.axis: t.link.level + (f" shared by {t.link.share}" if t.link.share > 1 else "")
                       for t in times}, lay.prediction_caveat())
    pred.bottleneck = bottleneck(pred, device_memory_bytes)
    return pred


def host_s(lay: Layout, cal: Calibration, axes: list[AxisCollectives], times: list[AxisTime]) -> float:
    """Each axis's host work (Layout.axis_host_s). A fitted one is mostly a rank waiting inside a collective, so
    on an axis that crosses the slow link between machines (a two-level link's outer level) that link's own time
    already holds it: only what exceeds the axis's exposed time there is added. Measured (docs/scaling.md, N=4
    over 100mbit between machines of 1gbit, fitted on loopback): 12 of 16 layouts within 20 % so, 8 of 16 added
    whole; on loopback hiding it behind every axis's time lost 6 of 13 rows."""
    outer = outer_waits(lay, cal, times)
    total = 0.0
    for axis in axes:
        if axis.collectives:
            seconds = lay.axis_host_s(cal.workload, axis, cal.on_cpu, cal.releases_heap, cal.host_s_fitted)
            total += max(0.0, seconds - outer[axis.axis]) if axis.axis in outer and axis.axis in cal.host_s_fitted \
                else seconds
    return total


def stretched_host_s(lay: Layout, cal: Calibration, axes: list[AxisCollectives]) -> float:
    """The fitted host work of the axes whose host work is CPU work of the rank's own (Layout.host_stretches)."""
    return sum(lay.axis_host_s(cal.workload, axis, cal.on_cpu, cal.releases_heap, cal.host_s_fitted)
               for axis in axes if axis.collectives and axis.axis in cal.host_s_fitted
               and lay.host_stretches(axis.axis, cal.workload.framework))


def outer_waits(lay: Layout, cal: Calibration, times: list[AxisTime]) -> dict[str, float]:
    """Per axis across a two-level link's slow level: the time the step waits for its collectives there."""
    return {t.axis.axis: lay.axis_exposed_comm_s(cal, t.axis, t.link.link, t.seconds) for t in times
            if t.link.level == "outer"}


def bottleneck(p: Prediction, device_memory_bytes: float | None = None) -> str:
    """One sentence naming what limits the step."""
    if p.fits is False and device_memory_bytes is not None:
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
