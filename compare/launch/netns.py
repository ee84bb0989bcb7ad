"""Emulated links (`--link RATE`, and two levels with `--link-inner RATE --group-size G`): every local rank in a
network namespace of its own, the namespaces joined by veth pairs and bridges shaped to the rates in each
direction, so ranks on one machine talk as machines of a cluster would. The pieces and the commands that make
them: compare/launch/topology.py.

The kernel's token bucket (tc tbf) shapes bandwidth. This kernel has no netem, so delay cannot be added:
the path's own latency is measured (compare/launch/linkprobe.py) and recorded beside the rate.

Needs Linux, root and iproute2's `ip` and `tc`; `check_can_emulate` says what is missing in one line
before anything starts. `EmulatedLink` is a context manager: the namespaces go (and with them every veth
end and the bridges) however the job ends, a normal end, a failed rank or a stop signal to dpcompare, since
the runner stops the job inside the `with`. Ranks enter their namespace through `ip netns exec`.

A dpcompare killed outright (SIGKILL, a power cut of the VM) runs no cleanup, so every name carries its
owner's pid (base 36, to fit interface names in 15 characters): the next link to start removes the
namespaces of owners that no longer run (`sweep_orphans`). A live pid keeps its namespaces, even if the
pid was reused by another program: leaving a stale namespace is safe, deleting a live one is not.
"""
from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field

from common.errors import UserError
from common.costmodel.rates import NO_DELAY_NOTE, describe_rate, parse_rate

from ..machine.environment import child_env
from .topology import Topology

_links = itertools.count()
TAG_PREFIX = "dpc"
# dpc<owner pid, base 36>x<link number>, then r<rank> (a rank's namespace), h (the hub's or router's) or
# g<group> (a group's bridge, two levels)
NAMESPACE = re.compile(rf"^{TAG_PREFIX}([0-9a-z]+)x\d+(?:r\d+|h|g\d+)$")


def _base36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, d = divmod(n, 36)
        out = digits[d] + out
        if n == 0:
            return out


def orphaned(names: list[str], alive=lambda pid: os.path.exists(f"/proc/{pid}")) -> list[str]:
    """The names among `names` (an `ip netns list`) that an emulated link made and whose owner is gone."""
    out = []
    for name in names:
        match = NAMESPACE.match(name)
        if match and not alive(int(match.group(1), 36)):
            out.append(name)
    return out


def netns_names() -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in listed.splitlines() if line.strip()]


def sweep_orphans() -> list[str]:
    """Delete the namespaces of emulated links whose dpcompare no longer runs; returns their names."""
    gone = orphaned(netns_names())
    for name in gone:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return gone


def check_can_emulate(rate: str) -> None:
    """One line naming what is missing, before anything is prepared."""
    parse_rate(rate)
    if not sys.platform.startswith("linux"):
        raise UserError(f"--link {rate}: emulated links need Linux network namespaces; this is {sys.platform}")
    if os.geteuid() != 0:
        raise UserError(f"--link {rate}: emulated links need root (network namespaces and tc); run as root "
                        "or drop --link")
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2")):
        if shutil.which(tool) is None:
            raise UserError(f"--link {rate}: `{tool}` not found (Debian: apt install {package})")


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise UserError(f"--link: `{' '.join(argv)}` failed: {done.stderr.strip() or done.stdout.strip()}")


@dataclass
class EmulatedLink:
    """The namespaces and shaped veth pairs of one job: rank r runs in `namespaces[r]` at `addresses[r]`,
    reaching the others through its interface `interfaces[r]`. With `inner_rate` and `group_size`, two
    levels: groups of `group_size` consecutive ranks at `inner_rate`, the groups joined at `rate`."""
    rate: str
    ranks: int
    inner_rate: str = ""
    group_size: int = 0
    namespaces: list[str] = field(default_factory=list)
    addresses: list[str] = field(default_factory=list)
    interfaces: list[str] = field(default_factory=list)
    hub: str | None = None
    created: list[str] = field(default_factory=list)

    @property
    def rate_bps(self) -> float:
        return parse_rate(self.rate)

    def __post_init__(self) -> None:
        # Names are fixed now (the launcher's command names them), the namespaces made on entering.
        n = next(_links)
        self.tag = f"{TAG_PREFIX}{_base36(os.getpid())}x{n}"
        self.topology = Topology(self.tag, self.ranks, self.rate, self.inner_rate, self.group_size)
        self.namespaces, self.interfaces = self.topology.namespaces, self.topology.interfaces
        self.hub = self.topology.hub
        self.addresses = [f"10.232.{(os.getpid() + n) % 250 + 1}.{r + 1}" for r in range(self.ranks)]

    def __enter__(self) -> "EmulatedLink":
        sweep_orphans()
        try:
            for argv in self.topology.commands(self.addresses):
                _run(*argv)
                if argv[:3] == ["ip", "netns", "add"]:
                    self.created.append(argv[3])
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def remove(self) -> None:
        """Delete every namespace this link made (their veth ends and the bridge go with them), first
        killing anything still running inside, so `ip netns list` is what it was before."""
        for name in reversed(self.created):
            pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self.created.clear()

    # ---- what the ranks and the summary need -----------------------------------------------------------
    def spawn_args(self) -> list[str]:
        """compare.launch.spawn's flags that put rank r in namespaces[r] (compare/launch/spawn.py)."""
        return ["--netns", ",".join(self.namespaces), "--addresses", ",".join(self.addresses),
                "--interfaces", ",".join(self.interfaces)]

    @property
    def outer_peer(self) -> int:
        """The rank whose path from rank 0 crosses the slow link: the first of the second group (two levels)."""
        return self.group_size if self.topology.two_level else 1

    def measure(self) -> dict:
        """TCP bandwidth and latency from rank 0's namespace to the outer peer's (compare/launch/linkprobe.py);
        with two levels, also to rank 1's, inside rank 0's group, as `inner`."""
        measured = self.measure_pair(self.outer_peer, self.rate_bps)
        if self.topology.two_level:
            measured["inner"] = self.measure_pair(1, parse_rate(self.inner_rate))
        return measured

    def measure_pair(self, peer: int, rate_bps: float) -> dict:
        """TCP bandwidth and latency between rank 0's and rank `peer`'s namespaces."""
        port = "45123"
        server = subprocess.Popen(["ip", "netns", "exec", self.namespaces[peer], sys.executable, "-m",
                                   "compare.launch.linkprobe", "serve", self.addresses[peer], port],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                  env=child_env())
        try:
            probe_bytes = int(min(32 * 2**20, max(2**20, rate_bps / 8 * 0.5)))
            done = subprocess.run(["ip", "netns", "exec", self.namespaces[0], sys.executable, "-m",
                                   "compare.launch.linkprobe", "probe", self.addresses[peer], port, str(probe_bytes)],
                                  capture_output=True, text=True, timeout=60, env=child_env())
            measured = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else {}
        except (subprocess.TimeoutExpired, ValueError, IndexError):
            measured = {}
        finally:
            server.kill()
            server.wait()
        return measured

    def record(self, measured: dict) -> dict:
        """summary.json's `link` (the runner adds the ranks' own all-reduce figures). With two levels the
        top-level figures are the slow link's, between groups (what the whole job's all-reduce crosses), and
        `inner` holds the fast link's, inside a group."""
        top = self.topology
        out = {"requested": self.rate, "rate_bps": self.rate_bps, "emulated": True,
               "tcp_bandwidth_Bps": measured.get("bandwidth_Bps"), "tcp_latency_s": measured.get("latency_s"),
               "tcp_message_Bps": measured.get("message_Bps"), "allreduce": None, "namespaces": top.all_namespaces}
        if not top.two_level:
            out["note"] = (f"{self.ranks} ranks in network namespaces joined by veth pairs"
                           f"{' and a bridge' if self.hub else ''} at {describe_rate(self.rate_bps)}; {NO_DELAY_NOTE}")
            return out
        inner_bps, inner = parse_rate(self.inner_rate), measured.get("inner") or {}
        out["group_size"] = self.group_size
        out["inner"] = {"requested": self.inner_rate, "rate_bps": inner_bps,
                        "tcp_bandwidth_Bps": inner.get("bandwidth_Bps"), "tcp_latency_s": inner.get("latency_s"),
                        "tcp_message_Bps": inner.get("message_Bps"), "allreduce": None}
        out["note"] = (f"{self.ranks} ranks in {top.groups} groups of {self.group_size} (one machine each): "
                       f"{describe_rate(inner_bps)} inside a group (a bridge per group), "
                       f"{describe_rate(self.rate_bps)} between groups (one uplink per group to a router's "
                       f"bridge, shared by the group's ranks); {NO_DELAY_NOTE}")
        return out


def loopback_record() -> dict:
    """summary.json's `link` for local ranks that talk over loopback, unshaped."""
    return {"requested": None, "rate_bps": None, "emulated": False, "tcp_bandwidth_Bps": None,
            "tcp_latency_s": None, "allreduce": None, "note": "local ranks over loopback, unshaped"}
