"""Which link each mesh axis's collectives cross: one link for every rank, or two levels, a fast one inside each
machine of `group_size` consecutive ranks and a slow one between machines (compare/launch/topology.py emulates
it; `dpcompare plan --link-gbps-inner`, `--fabric-inner` give it by hand or measured).

An axis whose every group (the ranks that talk on it: common/parallel/mesh.py) lies inside one machine uses the
inner link. One that crosses machines uses the outer link, whose bandwidth is shared: a machine's network card
carries, at once, the traffic of every group of the axis that has a rank on it (dp=2 x tp=2 on two machines of two:
both dp groups cross at the same time, each at half the card's rate). The ring's slowest hop sets its pace, so the
whole collective runs at that shared rate; the latency per hop is the outer link's.

Where the job measured those shared groups themselves (`across`: one rank per machine in each group, all groups at
once, common/costmodel/probe.py), a shared axis takes its rate from them rather than from the whole job's
all-reduce divided by the sharing: a backend's all-reduce need not move as many bytes a second per hop over two
ranks as over all of them (MPI's does not, and the two differed by -29 to +45 %: docs/scaling.md, "Sitting 13").

The rank layout is the mesh's (tp innermost, pp outermost), so tp lands inside a machine wherever it fits and pp
across machines: the level an axis gets follows from where its ranks are, never from its name.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from common.costmodel.links import Link, link_from_record
from common.errors import UserError
from common.parallel.mesh import Mesh


@dataclass(frozen=True)
class TwoLevelLink:
    """A fast link inside each machine of `group_size` consecutive ranks, a slow one between machines; `across`,
    where measured, is the outer link as each of `group_size` groups crossing it at once saw it (rank 0's figures),
    `across_last` the same calls' slowest rank, call by call (probe.py's last_rank_fit): what a collective of those
    groups waits for (Link.last_rank)."""
    inner: Link
    outer: Link
    group_size: int
    across: Link | None = None
    across_last: Link | None = None

    def __post_init__(self):
        if self.group_size < 1:
            raise UserError(f"a two-level link needs 1 or more ranks per machine, got {self.group_size}")

    @property
    def name(self) -> str:
        return f"{self.inner.name} inside groups of {self.group_size}, {self.outer.name} between them"

    @property
    def source(self) -> str:
        across = f"; shared between: {(self.across_last or self.across).source}" if self.across else ""
        return f"inside: {self.inner.source}; between: {self.outer.source}{across}"


Links = Link | TwoLevelLink


@dataclass(frozen=True)
class AxisLink:
    """The link one axis's collectives run over, as they see it: `level` says which ("inner", "outer" or "one
    link"), `share` how many of the axis's groups share a machine's card (the link's bandwidth is divided by it)."""
    axis: str
    link: Link
    level: str
    share: int = 1


def axis_link(links: Links, mesh: Mesh, axis: str) -> AxisLink:
    """The link `axis`'s collectives cross on `links` (the module docstring)."""
    if isinstance(links, Link):
        return AxisLink(axis, links, "one link")
    per_machine = links.group_size
    axis_groups = mesh.groups(axis)
    if all(len({rank // per_machine for rank in g}) == 1 for g in axis_groups):
        return AxisLink(axis, links.inner, "inner")
    machines = -(-mesh.size // per_machine)
    share = max(sum(1 for g in axis_groups if any(rank // per_machine == m for rank in g)) for m in range(machines))
    outer = links.outer
    if share > 1:  # the card's rate, shared: measured by group_size groups at once where the job timed them
        base, card_Bps = ((links.across, links.across.bandwidth_Bps * links.group_size) if links.across
                          else (outer, outer.bandwidth_Bps))
        gather_Bps = outer.gather_bandwidth_Bps / share if outer.gather_bandwidth_Bps else None
        outer = replace(base, name=f"{outer.name} shared by {share}", bandwidth_Bps=card_Bps / share,
                        gather_bandwidth_Bps=gather_Bps,
                        stream_Bps=outer.stream_Bps / share if outer.stream_Bps else None)
        if links.across_last:  # what the groups' collectives wait for: their slowest rank, call by call
            outer = replace(outer, last_rank=replace(
                links.across_last, name=f"{outer.name}, its slowest rank",
                bandwidth_Bps=links.across_last.bandwidth_Bps * links.group_size / share,
                gather_hop_latency_s=outer.gather_hop_latency_s, gather_bandwidth_Bps=gather_Bps))
    # Point to point (a pipeline), each boundary between neighbouring coordinates is its own hop: pp x4 on machines
    # of two crosses machines between stages 1 and 2 only, and its other boundaries stay inside a machine.
    crosses = [any(g[b] // per_machine != g[b + 1] // per_machine for g in axis_groups)
               for b in range(mesh.axis(axis) - 1)]
    if not all(crosses):
        outer = replace(outer, stage_hops=tuple(outer if c else links.inner for c in crosses))
    return AxisLink(axis, outer, "outer", share)


def describe_levels(links: Links, mesh: Mesh) -> str:
    """"tp inner, dp outer (shared by 2)": where each axis's collectives go, for the plan's table."""
    parts = []
    for name in mesh.names:
        a = axis_link(links, mesh, name)
        parts.append(f"{name} {a.level}" + (f" /{a.share}" if a.share > 1 else ""))
    return ", ".join(parts)


def links_from_record(record: dict | None, framework: str = "", backend: str = "") -> Links | None:
    """summary.json's `link` -> a Link, or with two levels (`inner`, `group_size`: compare/launch/netns.py) a
    TwoLevelLink: between groups the whole job's all-reduce (it crosses the slow link), inside a group the
    groups' own all-reduce where the ranks could split, else the TCP figures of that level."""
    outer = link_from_record(record, framework, backend)
    inner_record = (record or {}).get("inner")
    if outer is None or not inner_record or not record or not record.get("group_size"):
        return outer
    inner = link_from_record({**inner_record, "allreduce": inner_record.get("allreduce")
                              if (inner_record.get("allreduce") or {}).get("bandwidth_Bps") else None},
                             framework, backend)
    across_record = record.get("allreduce_across") or {}
    across = None
    if across_record.get("bandwidth_Bps") and across_record.get("latency_s") is not None:
        across = Link.from_allreduce(outer.name, across_record["latency_s"], across_record["bandwidth_Bps"],
                                     across_record.get("world_size") or 2,
                                     f"the job's {across_record.get('backend', backend)} all-reduce across machines, "
                                     f"{across_record.get('concurrent', record['group_size'])} groups at once, "
                                     "measured at its start")
    last = across_record.get("last_rank") or {}
    across_last = None
    if across is not None and last.get("bandwidth_Bps") and last.get("latency_s") is not None:
        across_last = Link.from_allreduce(outer.name, last["latency_s"], last["bandwidth_Bps"],
                                          across_record.get("world_size") or 2, across.source + ", its slowest rank")
    return TwoLevelLink(inner, outer, int(record["group_size"]), across, across_last) if inner else outer
