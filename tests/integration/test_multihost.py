"""Several hosts: two network namespaces joined by a veth pair stand in for two machines. Each "host" runs
its own `dpcompare run --nnodes 2 --node-rank R` (MLX ring without ssh, torchrun with a static
rendezvous, gloo over the veth link); the job equals one process with the same global batch, and
cutting the link mid-run ends both nodes with an error naming a rank, within the collective timeout.

One dpcompare can also start both hosts through mlx.launch and a hostfile, as on two Macs: it runs in host 0's
namespace (host 0 is 127.0.0.1, which mlx.launch runs locally) and reaches host 1 through an `ssh` stand-in
(`fake_ssh`) that answers only where a TCP connection to the host's address gets a reply over the link, then
runs the command inside the host's namespace. That is the path of --max-restarts over a hostfile.

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


FAKE_SSH = """#!{python}
# ssh HOST CMD as a user's ssh would do it between two machines: connect to HOST's address (a reply, even a
# refusal, means the host answers), then run CMD there, here inside the host's namespace.
import json, os, socket, sys
args, timeout_s = sys.argv[1:], 5.0
while args[0].startswith("-"):
    flag = args.pop(0)
    if flag == "-o":
        key, _, value = args.pop(0).partition("=")
        timeout_s = float(value) if key == "ConnectTimeout" else timeout_s
host, command = args[0], " ".join(args[1:])
ns, address = json.loads(os.environ["FAKE_SSH_HOSTS"])[host]
try:
    socket.create_connection((address, 22), timeout=timeout_s).close()
except ConnectionRefusedError:
    pass
except OSError as err:
    sys.exit(print(f"ssh: connect to host {{host}} port 22: {{err.strerror or 'Connection timed out'}}",
                   file=sys.stderr) or 255)
os.execvp("ip", ["ip", "netns", "exec", ns, "bash", "-c", command])
"""


def fake_ssh(folder: Path, hosts: TwoHosts) -> dict:
    """The environment of a dpcompare whose `ssh` reaches host 1 (named by its namespace) over the veth link."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "ssh").write_text(FAKE_SSH.format(python=sys.executable))
    (folder / "ssh").chmod(0o755)
    return {"PATH": f"{folder}:{os.environ['PATH']}", "FAKE_SSH_HOSTS": json.dumps({hosts.ns[1]: [hosts.ns[1], hosts.ips[1]]})}


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


def over_hostfile(hosts: TwoHosts, tmp_path: Path, cache_dir: Path, *args, env: dict | None = None):
    """One dpcompare in host 0's namespace starting a 2-rank MLX job over both hosts (mlx.launch, `fake_ssh`):
    (the process, its run directory, its stderr file, the hostfile)."""
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([{"ssh": "127.0.0.1", "ips": [hosts.ips[0]]},
                                    {"ssh": hosts.ns[1], "ips": [hosts.ips[1]]}]))
    out, stderr_path = tmp_path / "run", tmp_path / "stderr"
    cmd = ["ip", "netns", "exec", hosts.ns[0], sys.executable, "-m", "compare.cli", "run", *FAST, "--framework", "mlx",
           "--nproc", 2, "--hostfile", hostfile, "--collective-timeout-s", 5, "--out", out, *args]
    env = {**os.environ, **fake_ssh(tmp_path / "bin", hosts), "DPCOMPARE_CACHE": str(cache_dir), **(env or {})}
    with open(stderr_path, "w") as stderr:
        proc = subprocess.Popen(list(map(str, cmd)), cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=stderr, text=True)
    return proc, out, stderr_path, hostfile


def cut_at_step(hosts: TwoHosts, proc, out: Path, stderr: Path, rank: int, step: int) -> float:
    """Cut host 1's link once `rank` of the job reached `step`; the time of the cut."""
    deadline = time.time() + 150
    while step_of(out, rank) < step:
        assert proc.poll() is None, f"ended before the cut: {stderr.read_text()}"
        assert time.time() < deadline, f"rank {rank} never reached step {step}"
        time.sleep(0.05)
    hosts.cut()
    return time.time()


@pytest.mark.slow
def test_a_hostfile_restart_with_min_nproc_goes_on_with_the_host_that_answers(hosts, uninterrupted, cache_dir,
                                                                                tmp_path):
    """Rank 1 hangs before step 6 and host 1's link is cut: the restart asks both hosts, skips host 1, and goes
    on at one rank on host 0 (grad accum 2) from the step rank 0 saved, on the uninterrupted curve."""
    steps, every, at = 12, 4, 6
    proc, out, stderr, hostfile = over_hostfile(
        hosts, tmp_path, cache_dir, *HORIZON, "--steps", steps, "--checkpoint-every", every, "--max-restarts", 1,
        "--min-nproc", 1, env={"DPCOMPARE_INJECT_FAULT": f"framework=mlx,rank=1,step={at},signal=STOP"})
    try:
        cut_at_step(hosts, proc, out, stderr, 1, at - 1)
        assert proc.wait(timeout=120) == 0, stderr.read_text() + (out / "log.txt").read_text()[-3000:]
    finally:
        proc.kill()
    print(stderr.read_text())
    np.testing.assert_allclose(losses(out), losses(uninterrupted("mlx", "ddp", 1))[:steps], rtol=0, atol=1e-6)
    [record] = summary(out)["restarts"]
    assert (record["hosts_skipped"], record["nproc_after"], record["grad_accum_after"]) == ([hosts.ns[1]], 1, 2)
    # ddp: rank 0 (host 0) saved step 5 before the job was stopped, so no step is computed twice
    assert (record["how"], record["resumed_from"], record["steps_lost"]) == ("survivor_checkpoint", at - 1, 0)
    assert summary(out)["steps"] == steps and summary(out)["world_size"] == 1
    assert json.loads(hostfile.read_text())[1]["ssh"] == hosts.ns[1], "the user's hostfile is left as it was"
    assert hosts.pids() == [], "nothing of the job is left on either host"


@pytest.mark.slow
def test_a_hostfile_restart_without_min_nproc_waits_for_a_cut_host_then_ends_in_one_line(hosts, cache_dir, tmp_path):
    """One dpcompare over the two hosts (mlx.launch); host 1's link is cut mid-run. The restart asks the hosts
    whether they answer, waits DPCOMPARE_HOST_WAIT_S for host 1, says so, and ends in one line."""
    wait_s = 3
    proc, out, stderr, hostfile = over_hostfile(hosts, tmp_path, cache_dir, "--steps", 100000, "--max-restarts", 1,
                                                env={"DPCOMPARE_HOST_WAIT_S": str(wait_s)})
    try:
        cut_at = cut_at_step(hosts, proc, out, stderr, 0, 3)
        assert proc.wait(timeout=90) == 1
        elapsed = time.time() - cut_at
    finally:
        proc.kill()
    lines = stderr.read_text().splitlines()
    print(f"cut -> one line in {elapsed:.1f} s (collective timeout 5 s, wait {wait_s} s):", *lines, sep="\n")
    waiting = [line for line in lines if line.startswith("dpcompare: waiting")]
    errors = [line for line in lines if line.startswith("dpcompare: error:")]
    assert len(waiting) == 1 and f"waiting up to {wait_s} s" in waiting[0] and hosts.ns[1] in waiting[0], lines
    assert len(errors) == 1 and f"host {hosts.ns[1]} of {hostfile} did not answer within {wait_s} s" in errors[0], lines
    assert elapsed > wait_s and summary(out)["status"] == "failed"
    assert hosts.pids() == [], "nothing of the job is left on either host"
