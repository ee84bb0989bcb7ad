"""A step's collectives per mesh axis, each over the link its ranks share (levels.py): their seconds, what of
them the step waits for, and the bytes each rank sends. predict.py and calibrate.py ask this module, so a
strategy, a mesh of several, one link or two levels all go through the same sums.

A strategy object answers `axis_collectives` (common/parallel/layout.py): its collectives grouped by the mesh axis
they run on, with the size of that axis's groups (one axis for a strategy, one per axis for a mesh's composed
object), and `axis_exposed_comm_s`: what of one axis's time the step waits for, under that axis's strategy's rule
(tp's all-reduces all of it, pp its critical path, dp and fsdp what the calibration did not overlap).
"""
from __future__ import annotations

from dataclasses import dataclass

from common.costmodel.levels import AxisLink, Links, axis_link
from common.costmodel.workload import Workload
from common.parallel.layout import AxisCollectives, Layout, Measured


@dataclass(frozen=True)
class AxisTime:
    """One axis's collectives over their link: the seconds they take and the bytes each rank sends."""
    axis: AxisCollectives
    link: AxisLink
    seconds: float
    wire_bytes: float


def axis_times(lay: Layout, w: Workload, reduce_scatter: str, links: Links) -> list[AxisTime]:
    """Every axis's collectives timed over the link its groups cross (levels.py); axes without any left out."""
    out = []
    for axis in lay.axis_collectives(w, reduce_scatter):
        if not axis.collectives:
            continue
        on = axis_link(links, lay.mesh, axis.axis)
        out.append(AxisTime(axis, on, sum(c.seconds(on.link, axis.group_size) for c in axis.collectives),
                            sum(c.wire_bytes(axis.group_size) for c in axis.collectives)))
    return out


def exposed_comm_s(lay: Layout, cal: Measured, times: list[AxisTime]) -> float:
    """What the step waits for: each axis's time under its own strategy's rule (a mesh's part for that axis)."""
    return sum(lay.axis_exposed_comm_s(cal, t.axis, t.link.link, t.seconds) for t in times)
