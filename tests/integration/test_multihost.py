"""Several hosts: two network namespaces joined by a veth pair stand in for two machines. Each "host" runs
its own `dpcompare run --nnodes 2 --node-rank R` (MLX ring without ssh, torchrun with a static
rendezvous, gloo over the veth link); the job equals one process with the same global batch, and
cutting the link mid-run ends both nodes with an error naming a rank, within the collective timeout.

Needs root and iproute2 (`ip netns`); skipped with the reason otherwise. The configuration checks at
the end need neither.
"""
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from helpers import FAST, ROOT, losses, summary
from integration.runs import HORIZON

_pairs = itertools.count()


@dataclass
class TwoHosts:
    """Two namespaces ("hosts") and the veth link between them: host R is `ns[R]` at `ips[R]`."""
    ns: tuple[str, str]
    ips: tuple[str, str]
    veth: tuple[str, str]

    def start(self, node: int, framework: str, out: Path, cache_dir: Path, *args, hostfile: Path | None = None):
        """This host's share of a 2-node job, started inside its namespace as a user would on a machine."""
        if framework == "torch":
            where = ["--rdzv-endpoint", f"{self.ips[0]}:29500"]
        else:
            where = ["--hostfile", hostfile]
        cmd = ["ip", "netns", "exec", self.ns[node], sys.executable, "-m", "compare.cli", "run", *FAST,
               "--framework", framework, "--nproc", 1, "--nnodes", 2, "--node-rank", node, *where,
               "--out", out, *args]
        env = {**os.environ, "DPCOMPARE_CACHE": str(cache_dir)}
        env.pop("GLOO_SOCKET_IFNAME", None)  # the launcher must find the interface toward node 0 itself
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(f"{out}.stderr", "w") as stderr:  # the child keeps its own copy of the descriptor
            return subprocess.Popen(list(map(str, cmd)), cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=stderr, text=True)

    def cut(self) -> None:
        ip("netns", "exec", self.ns[1], "ip", "link", "set", self.veth[1], "down")

    def pids(self) -> list[int]:
        found = []
        for ns in self.ns:
            proc = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            found += [int(p) for p in proc.stdout.split()]
        return found

    def kill_leftovers(self) -> None:
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def ip(*args) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=True)


@pytest.fixture
def hosts():
    if not sys.platform.startswith("linux"):
        pytest.skip("network namespaces are Linux-only")
    if os.geteuid() != 0:
        pytest.skip("needs root to create network namespaces (ip netns)")
    if shutil.which("ip") is None:
        pytest.skip("iproute2's `ip` is not installed")
    n = next(_pairs)
    tag = f"dpc{os.getpid()}{n}"
    pair = TwoHosts(ns=(f"{tag}a", f"{tag}b"), veth=(f"{tag}a", f"{tag}b"),
                    ips=tuple(f"10.231.{(os.getpid() + n) % 254 + 1}.{i}" for i in (1, 2)))
    created = []
    try:
        for ns in pair.ns:
            made = subprocess.run(["ip", "netns", "add", ns], capture_output=True, text=True)
            if made.returncode != 0:
                pytest.skip(f"`ip netns add` failed: {made.stderr.strip()}")
            created.append(ns)
        try:
            ip("link", "add", pair.veth[0], "netns", pair.ns[0], "type", "veth",
               "peer", "name", pair.veth[1], "netns", pair.ns[1])
        except subprocess.CalledProcessError as err:
            pytest.skip(f"cannot create a veth pair: {err.stderr.strip()}")
        for ns, veth, address in zip(pair.ns, pair.veth, pair.ips):
            ip("-n", ns, "addr", "add", f"{address}/24", "dev", veth)
            ip("-n", ns, "link", "set", "lo", "up")
            ip("-n", ns, "link", "set", veth, "up")
        yield pair
    finally:
        pair.kill_leftovers()
        for ns in created:  # deleting a namespace deletes its end of the veth pair, and with it the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def ring_hostfile(path: Path, hosts: TwoHosts, form: str) -> Path:
    if form == "launch":  # mlx.launch's own hostfile; ports are mlx.launch's, 32323 upwards
        path.write_text(json.dumps([{"ssh": ns, "ips": [address]} for ns, address in zip(hosts.ns, hosts.ips)]))
    else:
        path.write_text(json.dumps([[f"{address}:41000"] for address in hosts.ips]))
    return path


def stderr_of(out: Path) -> str:
    return Path(f"{out}.stderr").read_text()


def step_of(out: Path, rank: int) -> int:
    try:
        return json.loads((out / "ranks" / f"rank{rank}.json").read_text()).get("step", 0)
    except (OSError, json.JSONDecodeError):
        return 0


@pytest.mark.slow
@pytest.mark.parametrize("framework, form", [("mlx", "ring"), ("torch", None)], ids=["mlx-ring", "torch-gloo"])
def test_a_two_host_job_across_a_veth_link_equals_one_process(framework, form, hosts, uninterrupted, cache_dir,
                                                               tmp_path):
    # One process: the first 8 steps of the session's 20-step ddp x1 run on the same LR horizon (conftest.py).
    steps = ("--steps", 8, *HORIZON)
    one = losses(uninterrupted(framework, "ddp", 1))[:8]
    hostfile = ring_hostfile(tmp_path / "hosts.json", hosts, form) if framework == "mlx" else None
    outs = [tmp_path / f"node{node}" for node in (0, 1)]
    procs = [hosts.start(node, framework, outs[node], cache_dir, *steps, hostfile=hostfile) for node in (0, 1)]
    try:
        for node, proc in enumerate(procs):
            assert proc.wait(timeout=180) == 0, (f"node {node} exited {proc.returncode}: {stderr_of(outs[node])}"
                                                 + (outs[node] / "log.txt").read_text()[-3000:])
    finally:
        for proc in procs:
            proc.kill()
    np.testing.assert_allclose(losses(outs[0]), one, rtol=0, atol=1e-5)
    for node, out in enumerate(outs):
        s = summary(out)
        assert s["status"] == "ok" and s["world_size"] == 2 and s["node_rank"] == node and s["steps"] == 8
        assert s["node_ranks"] == [node] and s["peak_rss_bytes"][node] > 0
    assert not (outs[1] / "metrics.jsonl").exists(), "node 0 alone writes the metrics"
    assert abs(summary(outs[1])["final_loss"] - one[-1]) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("framework", ["mlx", "torch"])
def test_cutting_the_link_mid_run_ends_both_nodes_within_the_timeout_naming_a_rank(framework, hosts, cache_dir,
                                                                                    tmp_path):
    timeout_s = 5  # as the single-host collective-timeout test: the property is "within the timeout"
    # mlx.launch's hostfile form here, the explicit ring list in the test above: both forms are covered.
    hostfile = ring_hostfile(tmp_path / "hosts.json", hosts, "launch") if framework == "mlx" else None
    outs = [tmp_path / f"node{node}" for node in (0, 1)]
    procs = [hosts.start(node, framework, outs[node], cache_dir, "--steps", 100000, "--collective-timeout-s",
                         timeout_s, hostfile=hostfile) for node in (0, 1)]
    try:
        deadline = time.time() + 150
        while min(step_of(outs[0], 0), step_of(outs[1], 1)) < 3:
            ended = [n for n, p in enumerate(procs) if p.poll() is not None]
            assert not ended, f"node {ended[0]} ended before the cut: {stderr_of(outs[ended[0]])}"
            assert time.time() < deadline, "the two nodes never reached step 3 together"
            time.sleep(0.05)
        cut_at = time.time()
        hosts.cut()
        elapsed = [None, None]
        while None in elapsed and time.time() < cut_at + 90:
            for node, proc in enumerate(procs):
                if elapsed[node] is None and proc.poll() is not None:
                    elapsed[node] = time.time() - cut_at
            time.sleep(0.05)
        print(f"{framework}: link cut -> node 0 exits in {elapsed[0]:.1f} s, node 1 in {elapsed[1]:.1f} s "
              f"(collective timeout {timeout_s} s)" if None not in elapsed else f"{framework}: {elapsed}")
        for node, proc in enumerate(procs):
            message = stderr_of(outs[node])
            assert elapsed[node] is not None and elapsed[node] < 60, f"node {node} still running: {message}"
            assert proc.returncode != 0, message
            assert re.search(r"rank \d", message), message
            assert summary(outs[node])["status"] == "failed"
        assert hosts.pids() == [], "no process of either node is left"
    finally:
        for proc in procs:
            proc.kill()
        hosts.kill_leftovers()
