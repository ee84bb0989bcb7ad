"""Links and collectives: what one collective call costs over a link, and the links a run's summary.json
records (or, for an older run without a record, the loopback figures measured here).

Ring algorithm over N ranks, link latency a per hop and bandwidth b per direction (bytes/s):

    all-reduce of S bytes        2 (N-1) a + 2 (N-1)/N x S / b
    all-gather / reduce-scatter  (N-1) a + (N-1)/N x S / b       (S: the full, gathered size)
    send (point to point)        a + S / b                        (pp: one hop to a neighbour)

A link measured as an all-reduce, t(S) ~= latency_s + S / bandwidth_Bps at N_m ranks, is inverted through
the ring formula (a = latency_s / 2(N_m - 1), b = bandwidth_Bps x 2(N_m - 1)/N_m), so the framework's own
overheads at N_m carry over to any N. A link given by hand (--link-gbps, --latency-us) is the wire itself.
An fsdp run also measures its own all-gather (common/parallel/fsdp.py `measures_all_gather`), inverted the
same way (a = latency_s / (N_m - 1), b = bandwidth_Bps x (N_m - 1)/N_m) and used for the all-gathers only:
gloo's all_gather is CPU-bound where its all-reduce is not (docs/scaling.md), so one link figure for both
mispredicted torch fsdp over loopback by -27.5 %.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from common.errors import UserError

# All-reduce at N=2 over loopback on the reference machine (docs/benchmarks.md, "All-reduce against message
# size": the 4 KB median and the 108 MB bandwidth), for runs whose summary.json has no `link` record.
LOOPBACK_ALLREDUCE = {"ring": (82e-6, 0.86e9), "mpi": (12e-6, 1.19e9), "gloo": (335e-6, 1.84e9)}
# Backends whose waiting ranks poll their sockets and so keep a core busy while they wait (mlx 0.32's ring:
# ring.cpp SocketThread::worker; compare/machine/sharing.py has the measurements): where ranks share cores, a
# pipeline stage's idle slots do not leave its core to another rank.
POLLING_WAITS = frozenset({("mlx", "ring")})
# How many threads such a waiting rank keeps busy: the ring's one SocketThread per socket, one to each neighbour
# (2 at any N >= 2 with one address per rank). Seen on the Zen 3 (docs/notes/2026-12-uneven-polling.md): an MLX
# rank waiting for a slow peer at 160 % of a core, in its two socket threads, on 2 cores.
POLLING_THREADS = {("mlx", "ring"): 2}


def waits_poll(framework: str, backend: str | None) -> bool:
    return (framework, backend) in POLLING_WAITS


def polling_threads(framework: str, backend: str | None) -> int:
    """Threads a rank waiting at a collective keeps busy: 0 for a backend whose waits block."""
    return POLLING_THREADS.get((framework, backend or ""), 0) if waits_poll(framework, backend) else 0


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
    # A pipeline's boundaries in stage order where they cross different links (a two-level link: levels.py);
    # empty where every boundary is this link. A pipeline's sends cross one boundary each, not the slowest one.
    stage_hops: tuple["Link", ...] = ()
    # Where several groups cross this link at once (an outer mesh axis, levels.py): the same calls as their slowest
    # rank saw them. A collective's groups are tied together (by tp inside each machine, or by the step's next
    # sync), so each call waits for the last of them: MLX's and torch's dp=2,tp=2 over two levels waited for it
    # (docs/scaling.md, "Sitting 15"). A pipeline's sends are not: each pipeline waits on its own neighbour, and
    # over its many sends a step it is paced by their usual time (rank 0's), not by each one's slowest.
    last_rank: "Link | None" = None
    # One TCP stream's rate on this path where the job measured it (an emulated link: compare/launch/linkprobe.py),
    # shared like `bandwidth_Bps`: what a point-to-point send gets. The all-reduce's figure carries the backend's
    # all-reduce overheads, which a send does not pay: MPI's across two machines of two ranks gave 4.1 MB/s per
    # group where one TCP stream had 12.1 MB/s for both, and pp=2,tp=2's sends crossed at 6 (docs/scaling.md).
    stream_Bps: float | None = None

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
        """One point-to-point message to a neighbour (pp): one hop, at a TCP stream's rate where it was measured."""
        return self.hop_latency_s + nbytes / (self.stream_Bps or self.bandwidth_Bps)


RING_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
               "reduce_scatter": lambda n: (n - 1) / n, "send": lambda n: 1.0}


@dataclass(frozen=True)
class Collective:
    """One kind of call a step makes (a strategy object's `collectives`, common/parallel/)."""
    kind: str      # all_reduce | all_gather | reduce_scatter | send (point to point)
    nbytes: int    # payload of one call (all-gather: the gathered size)
    calls: int     # per optimizer step
    what: str

    def seconds(self, link: Link, n: int) -> float:
        on = link.last_rank if link.last_rank and self.kind != "send" else link  # Link.last_rank
        return self.calls * getattr(on, f"{self.kind}_s")(self.nbytes, n)

    def wire_bytes(self, n: int) -> float:
        """Bytes each rank sends per step for this collective."""
        return self.calls * RING_FACTOR[self.kind](n) * self.nbytes


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
        return replace(link, stream_Bps=record.get("tcp_bandwidth_Bps") or None)
    if record.get("tcp_bandwidth_Bps"):
        return Link(name, record.get("tcp_latency_s") or 0.0, record["tcp_bandwidth_Bps"],
                    "the path's TCP throughput and latency, measured")
    if record.get("rate_bps"):
        return Link(name, record.get("tcp_latency_s") or 0.0, record["rate_bps"] / 8, "the shaped rate (not measured)")
    return None


def hop_bandwidth_Bps(allreduce: dict | None) -> float | None:
    """The per-hop bandwidth (bytes/s each way) a measured all-reduce record ({"latency_s", "bandwidth_Bps",
    "world_size"}) gives through the ring formula: the figure to set beside a link's shaped rate."""
    if not allreduce or not allreduce.get("bandwidth_Bps"):
        return None
    return Link.from_allreduce("", allreduce.get("latency_s") or 0.0, allreduce["bandwidth_Bps"],
                               allreduce.get("world_size") or 2).bandwidth_Bps


def loopback_link(backend: str) -> Link:
    latency_s, bandwidth_Bps = LOOPBACK_ALLREDUCE.get(backend, LOOPBACK_ALLREDUCE["gloo"])
    return Link.from_allreduce(f"loopback ({backend}, assumed)", latency_s, bandwidth_Bps, 2,
                               "docs/benchmarks.md's loopback all-reduce at N=2 (no link record in the run)")
