"""The commands that build an emulated link's namespaces, veth pairs, bridges and token buckets, as plain
argv lists: compare/launch/netns.py runs them (and removes what they made), tests/unit/test_link_topology.py
reads them without root.

One level (`--link RATE`):

    N = 2   rank0 [veth] ---- [veth] rank1                      one pair, shaped at both ends
    N > 2   rank_r [veth] ---- [veth] bridge (hub namespace)      a pair per rank, shaped at both ends

Two levels (`--link OUTER --link-inner INNER --group-size G`): groups of G consecutive ranks, each group one
machine of a cluster, its ranks on a fast switch, the machines joined by a slow one:

    rank_r [veth] --INNER-- [veth] bridge (group namespace g_k)  [veth] --OUTER-- [veth] bridge (router namespace)
      a pair per rank to its group's bridge,                      one uplink per group to the router's bridge,
      shaped at INNER at both ends                                shaped at OUTER at both ends

Every rank is on one subnet (bridges of bridges: one layer-2 domain), so the ranks' addresses do not change.
A packet between two ranks of a group crosses only their own pairs (INNER); between groups it also crosses both
groups' uplinks (OUTER, the slowest hop). The uplink is the machine's network card: the ranks of a group that
send to other groups at once share it, as the GPUs of a machine share its NIC (common/costmodel/levels.py
models that sharing).
"""
from __future__ import annotations

from dataclasses import dataclass

from common.costmodel.rates import parse_rate

TBF_LATENCY = "100ms"  # how long a packet may queue in the bucket before it is dropped
BUCKET_MIN_BYTES = 64 * 1024  # the token bucket's floor: one TSO segment (see bucket_bytes)


def bucket_bytes(rate_bps: float) -> int:
    """The bucket must hold a whole segment burst (64 KB with TSO) and a few ms at the rate, and no more: what
    it holds crosses at once after the link idles, which a real link never does. With 256 KB, a 20 Mbit/s link
    carried a 1.25 MB TCP probe at 1.18x its rate, and a rank that paused between steps got a 632 KB all-reduce
    up to 100 ms early (CI: a step 17 % under the link's time). With 64 KB the probe measures 1.00x; 16 KB
    lost rate (0.96x) and made steps erratic. The peak bucket (peak_bytes) keeps what it holds from crossing at
    once."""
    return max(BUCKET_MIN_BYTES, int(rate_bps / 8 * 0.004))


PEAK_FACTOR = 1.25       # the peak bucket's rate over the link's: above it, so the link's own bucket sets the rate
PEAK_WINDOW_S = 100e-6   # what the peak bucket holds, in time at the link's rate


def peak_bytes(rate_bps: float) -> int:
    """The second bucket (tbf's peakrate and mtu), which drains the first no faster than PEAK_FACTOR x the rate
    in bursts of 100 us at most (one 1514-byte frame at least). Without it a message that fits in the first
    bucket crossed at the veth's speed whenever the link had idled: on 100mbit a 64 KB message took 0.42 ms
    instead of 5.2 (12x the rate), so a pipeline's sends, a few tens of KB each between pieces of compute,
    crossed nearly free (pp=2,dp=2 over 100mbit between groups ran as fast as on loopback). With it: 5.3 ms
    (99 Mbit/s) on 100mbit, 23.5 ms (22) on 20mbit, 0.52 ms (1004) on 1gbit, and a 10 MB transfer as before
    (94, 19 and 860 Mbit/s); docs/links.md has the table. A whole frame per timer event caps a peak bucket of
    1514 bytes at ~450 Mbit/s (here), hence a window in time rather than one frame."""
    return max(1514, int(rate_bps / 8 * PEAK_WINDOW_S))


def shape(namespace: str, interface: str, rate_bps: float) -> list[str]:
    """A token bucket, and its peak bucket, on the egress of one veth end."""
    return ["ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", interface, "root", "tbf",
            "rate", f"{int(rate_bps)}bit", "burst", str(bucket_bytes(rate_bps)),
            "peakrate", f"{int(rate_bps * PEAK_FACTOR)}bit", "mtu", str(peak_bytes(rate_bps)), "latency", TBF_LATENCY]


@dataclass(frozen=True)
class Topology:
    """The names of one link's pieces, fixed before anything is made (the launcher's command names them)."""
    tag: str                 # dpc<owner pid, base 36>x<link number>
    ranks: int
    rate: str                # the link between groups (one level: between every pair of ranks)
    inner_rate: str = ""     # the link inside a group; "" for one level
    group_size: int = 0      # ranks per group; 0 for one level

    @property
    def two_level(self) -> bool:
        return bool(self.inner_rate and self.group_size)

    @property
    def groups(self) -> int:
        return self.ranks // self.group_size if self.two_level else 1

    @property
    def namespaces(self) -> list[str]:
        return [f"{self.tag}r{r}" for r in range(self.ranks)]

    @property
    def interfaces(self) -> list[str]:
        return [f"{self.tag}v{r}" for r in range(self.ranks)]

    @property
    def hub(self) -> str | None:
        """The namespace that holds the bridge every path crosses: one level's hub, or two levels' router."""
        return f"{self.tag}h" if self.two_level or self.ranks > 2 else None

    @property
    def group_namespaces(self) -> list[str]:
        return [f"{self.tag}g{k}" for k in range(self.groups)] if self.two_level else []

    @property
    def all_namespaces(self) -> list[str]:
        """Every namespace, in the order they are made: the ranks', then the router's or hub's, then the groups'."""
        return self.namespaces + ([self.hub] if self.hub else []) + self.group_namespaces

    def commands(self, addresses: list[str]) -> list[list[str]]:
        """Every command, in order, that builds this link with rank r at addresses[r] (a /24)."""
        cmds: list[list[str]] = []
        for name in self.all_namespaces:
            cmds += [["ip", "netns", "add", name], ["ip", "-n", name, "link", "set", "lo", "up"]]
        shaped: list[tuple[str, str, float]] = []  # (namespace, interface, rate): each end's egress
        if self.two_level:
            inner, outer = parse_rate(self.inner_rate), parse_rate(self.rate)
            cmds += self._bridge(self.hub or "")
            for k, group in enumerate(self.group_namespaces):
                cmds += self._bridge(group)
                uplink, router_port = f"{self.tag}u{k}", f"{self.tag}q{k}"
                cmds += self._port(group, uplink, router_port, self.hub or "")
                shaped += [(group, uplink, outer), (self.hub or "", router_port, outer)]
            for r, (name, interface) in enumerate(zip(self.namespaces, self.interfaces)):
                group = self.group_namespaces[r // self.group_size]
                port = f"{self.tag}p{r}"
                cmds += self._port(name, interface, port, group, rank_end=True)
                shaped += [(name, interface, inner), (group, port, inner)]
        elif self.ranks == 2:
            (a, ia), (b, ib) = zip(self.namespaces, self.interfaces)
            cmds.append(["ip", "link", "add", ia, "netns", a, "type", "veth", "peer", "name", ib, "netns", b])
            shaped += [(a, ia, parse_rate(self.rate)), (b, ib, parse_rate(self.rate))]
        else:  # a bridge in a hub namespace, one shaped pair per rank
            hub = self.hub or ""
            cmds += self._bridge(hub)
            for r, (name, interface) in enumerate(zip(self.namespaces, self.interfaces)):
                port = f"{self.tag}p{r}"
                cmds += self._port(name, interface, port, hub, rank_end=True)
                shaped += [(name, interface, parse_rate(self.rate)), (hub, port, parse_rate(self.rate))]
        for name, interface, address in zip(self.namespaces, self.interfaces, addresses):
            cmds += [["ip", "-n", name, "addr", "add", f"{address}/24", "dev", interface],
                     ["ip", "-n", name, "link", "set", interface, "up"]]
        cmds += [shape(name, interface, rate) for name, interface, rate in shaped]
        return cmds

    @staticmethod
    def _bridge(namespace: str) -> list[list[str]]:
        return [["ip", "-n", namespace, "link", "add", "br0", "type", "bridge"],
                ["ip", "-n", namespace, "link", "set", "br0", "up"]]

    @staticmethod
    def _port(namespace: str, interface: str, port: str, bridge_namespace: str,
              rank_end: bool = False) -> list[list[str]]:
        """A veth pair from `interface` in `namespace` to `port` on the bridge of `bridge_namespace`. A group's
        uplink is a port of both bridges: its own end is enslaved to the group's bridge too."""
        cmds = [["ip", "link", "add", interface, "netns", namespace, "type", "veth", "peer", "name", port,
                 "netns", bridge_namespace],
                ["ip", "-n", bridge_namespace, "link", "set", port, "master", "br0"],
                ["ip", "-n", bridge_namespace, "link", "set", port, "up"]]
        if not rank_end:
            cmds += [["ip", "-n", namespace, "link", "set", interface, "master", "br0"],
                     ["ip", "-n", namespace, "link", "set", interface, "up"]]
        return cmds
