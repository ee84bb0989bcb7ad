"""Emulated links (`--link RATE`): every local rank in a network namespace of its own, the namespaces joined
by veth pairs shaped to RATE in each direction, so two ranks on one machine talk as two machines would.

    N = 2   rank0 [veth] ---- [veth] rank1                  one pair, shaped at both ends
    N > 2   rank_r [veth] ---- [veth] bridge (hub namespace)  a pair per rank, shaped at both ends

The kernel's token bucket (tc tbf) shapes bandwidth. This kernel has no netem, so delay cannot be added:
the path's own latency is measured (compare/launch/linkprobe.py) and recorded beside the rate.

Needs Linux, root and iproute2's `ip` and `tc`; `check_can_emulate` says what is missing in one line
before anything starts. `EmulatedLink` is a context manager: the namespaces go (and with them every veth
end and the bridge) however the job ends, a normal end, a failed rank or a stop signal to dpcompare, since
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

_links = itertools.count()
TBF_LATENCY = "100ms"  # how long a packet may queue in the bucket before it is dropped
BUCKET_MIN_BYTES = 64 * 1024  # the token bucket's floor: one TSO segment (see _shape)
TAG_PREFIX = "dpc"
# dpc<owner pid, base 36>x<link number>, then r<rank> (a rank's namespace) or h (the hub's)
NAMESPACE = re.compile(rf"^{TAG_PREFIX}([0-9a-z]+)x\d+(?:r\d+|h)$")


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
    reaching the others through its interface `interfaces[r]`."""
    rate: str
    ranks: int
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
        self.namespaces = [f"{self.tag}r{r}" for r in range(self.ranks)]
        self.interfaces = [f"{self.tag}v{r}" for r in range(self.ranks)]
        self.addresses = [f"10.232.{(os.getpid() + n) % 250 + 1}.{r + 1}" for r in range(self.ranks)]

    def __enter__(self) -> "EmulatedLink":
        sweep_orphans()
        try:
            self._build(self.tag)
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def _add_namespace(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self.created.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def _shape(self, namespace: str, interface: str) -> None:
        rate_Bps = self.rate_bps / 8
        # The bucket must hold a whole segment burst (64 KB with TSO) and a few ms at the rate, and no
        # more: what it holds crosses at once after the link idles, which a real link never does. With
        # 256 KB, a 20 Mbit/s link carried a 1.25 MB TCP probe at 1.18x its rate, and a rank that paused
        # between steps got a 632 KB all-reduce up to 100 ms early (CI: a step 17 % under the link's
        # time). With 64 KB the probe measures 1.00x; 16 KB lost rate (0.96x) and made steps erratic.
        burst = max(BUCKET_MIN_BYTES, int(rate_Bps * 0.004))
        _run("ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", interface, "root", "tbf",
             "rate", f"{int(self.rate_bps)}bit", "burst", str(burst), "latency", TBF_LATENCY)

    def _build(self, tag: str) -> None:
        for name in self.namespaces:
            self._add_namespace(name)
        if self.ranks == 2:
            ends = list(zip(self.namespaces, self.interfaces))
            _run("ip", "link", "add", ends[0][1], "netns", ends[0][0], "type", "veth",
                 "peer", "name", ends[1][1], "netns", ends[1][0])
        else:  # a bridge in a hub namespace, one shaped pair per rank
            self.hub = f"{tag}h"
            self._add_namespace(self.hub)
            _run("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self.hub, "link", "set", "br0", "up")
            ends = []
            for r, (name, interface) in enumerate(zip(self.namespaces, self.interfaces)):
                port = f"{tag}p{r}"
                _run("ip", "link", "add", interface, "netns", name, "type", "veth", "peer", "name", port,
                     "netns", self.hub)
                _run("ip", "-n", self.hub, "link", "set", port, "master", "br0")
                _run("ip", "-n", self.hub, "link", "set", port, "up")
                ends += [(name, interface), (self.hub, port)]
        for name, interface, address in zip(self.namespaces, self.interfaces, self.addresses):
            _run("ip", "-n", name, "addr", "add", f"{address}/24", "dev", interface)
            _run("ip", "-n", name, "link", "set", interface, "up")
        for name, interface in ends:  # egress of each end: both directions of every path are shaped
            self._shape(name, interface)

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

    def measure(self) -> dict:
        """TCP bandwidth and latency between rank 0's and rank 1's namespaces (compare/launch/linkprobe.py)."""
        port = "45123"
        server = subprocess.Popen(["ip", "netns", "exec", self.namespaces[1], sys.executable, "-m",
                                   "compare.launch.linkprobe", "serve", self.addresses[1], port],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                  env=child_env())
        try:
            probe_bytes = int(min(32 * 2**20, max(2**20, self.rate_bps / 8 * 0.5)))
            done = subprocess.run(["ip", "netns", "exec", self.namespaces[0], sys.executable, "-m",
                                   "compare.launch.linkprobe", "probe", self.addresses[1], port, str(probe_bytes)],
                                  capture_output=True, text=True, timeout=60, env=child_env())
            measured = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else {}
        except (subprocess.TimeoutExpired, ValueError, IndexError):
            measured = {}
        finally:
            server.kill()
            server.wait()
        return measured

    def record(self, measured: dict) -> dict:
        """summary.json's `link` (the runner adds the ranks' own all-reduce figures)."""
        return {"requested": self.rate, "rate_bps": self.rate_bps, "emulated": True,
                "tcp_bandwidth_Bps": measured.get("bandwidth_Bps"), "tcp_latency_s": measured.get("latency_s"),
                "allreduce": None, "namespaces": list(self.namespaces) + ([self.hub] if self.hub else []),
                "note": f"{self.ranks} ranks in network namespaces joined by veth pairs"
                        f"{' and a bridge' if self.hub else ''} at {describe_rate(self.rate_bps)}; {NO_DELAY_NOTE}"}


def loopback_record() -> dict:
    """summary.json's `link` for local ranks that talk over loopback, unshaped."""
    return {"requested": None, "rate_bps": None, "emulated": False, "tcp_bandwidth_Bps": None,
            "tcp_latency_s": None, "allreduce": None, "note": "local ranks over loopback, unshaped"}
