"""A step's collectives per mesh axis, each over the link its ranks share (levels.py): their seconds, what of
them the step waits for, and the bytes each rank sends. predict.py and calibrate.py ask this module, so a
strategy, a mesh of several, one link or two levels all go through the same sums.

A strategy object answers `axis_collectives` (common/parallel/layout.py): its collectives grouped by the mesh axis
they run on, with the size of that axis's groups. A one-strategy object has one axis; a mesh's composed object one
per axis, and `parts` (its per-axis objects), whose own rule says what of that axis's time is exposed (tp's
all-reduces all of it, pp its critical path, dp and fsdp what the calibration did not overlap).
"""
from __future__ import annotations

from dataclasses import dataclass

from common.costmodel.levels import AxisLink, Links, axis_link
from common.costmodel.links import Collective
from common.costmodel.workload import Workload
from common.parallel.layout import Layout, Measured


@dataclass(frozen=True)
class AxisCollectives:
    """The collectives a step runs on one mesh axis, each call within one group of `group_size` ranks."""
    axis: str
    group_size: int
    collectives: list[Collective]


@dataclass(frozen=True)
class AxisTime:
    """One axis's collectives over their link: the seconds they take and the bytes each rank sends."""
    axis: AxisCollectives
    link: AxisLink
    seconds: float
    wire_bytes: float


def axis_collectives(lay: Layout, w: Workload, reduce_scatter: str) -> list[AxisCollectives]:
    """`lay`'s collectives per axis: the object's own `axis_collectives` where it has one (a mesh), else its one
    axis, all of its collectives among its `ranks`."""
    own = getattr(lay, "axis_collectives", None)
    if own is not None:
        return [AxisCollectives(a.axis, a.group_size, list(a.collectives)) for a in own(w, reduce_scatter)]
    return [AxisCollectives(lay.mesh.names[0], lay.ranks, lay.collectives(w, reduce_scatter))]


def axis_times(lay: Layout, w: Workload, reduce_scatter: str, links: Links) -> list[AxisTime]:
    """Every axis's collectives timed over the link its groups cross (levels.py); axes without any left out."""
    out = []
    for axis in axis_collectives(lay, w, reduce_scatter):
        if not axis.collectives:
            continue
        on = axis_link(links, lay.mesh, axis.axis)
        out.append(AxisTime(axis, on, sum(c.seconds(on.link, axis.group_size) for c in axis.collectives),
                            sum(c.wire_bytes(axis.group_size) for c in axis.collectives)))
    return out


def exposed_comm_s(lay: Layout, cal: Measured, times: list[AxisTime]) -> float:
    """What the step waits for: each axis's time under its own strategy's rule (a mesh's part for that axis)."""
    parts = getattr(lay, "parts", None) or {}
    return sum(parts.get(t.axis.axis, lay).exposed_comm_s(cal, t.axis.collectives, t.link.link, t.seconds)
               for t in times)
