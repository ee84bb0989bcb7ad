"""Start N local ranks of one job:
`python -m compare.launch.spawn --ranks N (--ring-hostfile PATH | --torch) -- CMD...`.

MLX ring: what `mlx.launch -n N` does on one machine (MLX_RANK and an MLX_HOSTFILE of localhost ports
per rank), without its output relay, a loop that keeps one core busy (measured: 96% CPU for the launcher
during a 2-rank job on 2 cores, which halved the job's throughput). torch: what `torchrun --standalone`
gives a rank (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT for the env:// rendezvous), without its
agent, which imports torch before the ranks do (a 2-rank job starts 3.5-4.5 s sooner on a 2-core AMD
EPYC). This waits in os.wait() and lets the ranks write to the log directly. As mlx.launch does, when one rank fails the
others are stopped (unless --keep-survivors) and the exit code is the failed rank's.

--rank-speed R:F,... (docs/uneven.md): rank R computes at F of its speed, as on a slower machine: a thread here
stops it (SIGSTOP) for (1 - F) of every DUTY_PERIOD_S and lets it run (SIGCONT) for F. The whole process stops,
its threads, compute and waits alike, with nothing inside the step, so the losses cannot change; its phases of the
time breakdown stretch as its wall clock does, and the other ranks wait for it at the all-reduce.

--fork (torch on the CPU, outside namespaces): the rank command runs once, imports torch once and forks the
ranks (common/train/forkranks.py), which become this process's children: 2.1 CPU-seconds less per rank.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common.train.forkranks import ENV as FORK_ENV

from ..machine.environment import free_port_block

GRACE_S = 3.0
DUTY_PERIOD_S = 0.02  # much shorter than a step of `small` (about 0.1-1 s here), so each step slows alike


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m compare.launch.spawn")
    parser.add_argument("--ranks", type=int, required=True)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--ring-hostfile", help="where to write the MLX ring's MLX_HOSTFILE")
    which.add_argument("--torch", action="store_true", help="set torch's env:// rendezvous variables")
    # --link (compare/launch/netns.py): rank r runs in namespace r at address r, reaching the others through
    # its interface r; `ip netns exec` execs the rank, so its pid is the one signalled below.
    parser.add_argument("--netns", help="comma list: rank r's network namespace")
    parser.add_argument("--addresses", help="comma list: rank r's address in its namespace")
    parser.add_argument("--interfaces", help="comma list: rank r's interface toward the others")
    parser.add_argument("--keep-survivors", action="store_true",
                        help="do not stop the others when a rank fails: dpcompare's watchdog does, after a survivor "
                             "saved its last step (--max-restarts, common/train/rescue.py)")
    parser.add_argument("--fork", action="store_true", help="run the rank command once and let it fork the ranks "
                        "(common/train/forkranks.py); ignored with --netns")
    parser.add_argument("--rank-speed", default="", help="R:F,...: rank R runs F of the time (SIGSTOP/SIGCONT)")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    namespaces = args.netns.split(",") if args.netns else [None] * args.ranks
    envs = rank_envs(args)
    if args.fork and not args.netns:
        pids = forked_ranks(command, envs)
        if isinstance(pids, int):
            return pids  # the forking process failed before any rank existed
    else:
        # The Popen objects stay referenced: a collected one's pid may be reaped by the next Popen, not os.wait().
        procs = [subprocess.Popen((["ip", "netns", "exec", ns] if ns else []) + command, env=env)
                 for ns, env in zip(namespaces, envs)]
        pids = [proc.pid for proc in procs]
    ranks = {pid: r for r, pid in enumerate(pids)}
    for item in filter(None, args.rank_speed.split(",")):
        rank, factor = item.split(":")
        threading.Thread(target=duty_cycle, args=(pids[int(rank)], float(factor)), daemon=True).start()
    signal.signal(signal.SIGTERM, lambda *_: stop(ranks, signal.SIGTERM) or sys.exit(143))
    code = 0
    while ranks:
        try:
            pid, status = os.wait()
        except ChildProcessError:  # stop() below has reaped the others
            break
        rank = ranks.pop(pid, None)
        exit_code = os.waitstatus_to_exitcode(status)
        if rank is not None and exit_code != 0 and code == 0:
            print(f"[spawn] rank {rank} exited with code {exit_code}; "
                  f"{'dpcompare stops the others' if args.keep_survivors else 'stopping the others'}", file=sys.stderr,
                  flush=True)
            code = exit_code if exit_code > 0 else 128 - exit_code
            if not args.keep_survivors:
                stop(ranks, signal.SIGTERM)
    return code


def duty_cycle(pid: int, factor: float, period_s: float = DUTY_PERIOD_S) -> None:
    """Let `pid` run `factor` of every period and stop it for the rest, until it is gone."""
    try:
        while True:
            os.kill(pid, signal.SIGCONT)
            time.sleep(factor * period_s)
            if factor < 1:
                os.kill(pid, signal.SIGSTOP)
                time.sleep((1 - factor) * period_s)
    except ProcessLookupError:
        pass


def forked_ranks(command: list[str], envs: list[dict]) -> list[int] | int:
    """The ranks' pids, forked by one run of `command` (common/train/forkranks.py), or its exit code where it
    failed. As a child subreaper this process inherits them when that process exits."""
    import ctypes

    PR_SET_CHILD_SUBREAPER = 36
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError("prctl(PR_SET_CHILD_SUBREAPER) failed: run without --fork")
    with tempfile.TemporaryDirectory(prefix="dpcompare-fork-") as tmp:
        spec, pids = Path(tmp) / "ranks.json", Path(tmp) / "pids.json"
        spec.write_text(json.dumps({"envs": envs, "pids": str(pids)}))
        code = subprocess.run(command, env={**envs[0], FORK_ENV: str(spec)}).returncode
        if code != 0 or not pids.exists():
            return code or 1
        return json.loads(pids.read_text())


def rank_envs(args: argparse.Namespace) -> list[dict]:
    """Each rank's environment. Ports are chosen now, just before the ranks bind them."""
    addresses = args.addresses.split(",") if args.addresses else ["127.0.0.1"] * args.ranks
    # gloo finds its interface from the hostname otherwise, which resolves to no address in a namespace.
    interfaces = [{"GLOO_SOCKET_IFNAME": i} for i in args.interfaces.split(",")] if args.interfaces else \
        [{}] * args.ranks
    if args.torch:  # rank 0 hosts the TCP store at MASTER_PORT
        job = {**os.environ, "MASTER_ADDR": addresses[0], "MASTER_PORT": str(free_port_block(1)),
               "WORLD_SIZE": str(args.ranks), "LOCAL_WORLD_SIZE": str(args.ranks), "GROUP_RANK": "0"}
        return [{**job, **interfaces[r], "RANK": str(r), "LOCAL_RANK": str(r)} for r in range(args.ranks)]
    base = free_port_block(args.ranks)
    with open(args.ring_hostfile, "w") as f:
        json.dump([[f"{addresses[r]}:{base + r}"] for r in range(args.ranks)], f)
    return [{**os.environ, "MLX_HOSTFILE": args.ring_hostfile, "MLX_RANK": str(r)} for r in range(args.ranks)]


def stop(ranks: dict[int, int], sig: int) -> None:
    for pid in list(ranks):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    deadline = time.time() + GRACE_S
    while time.time() < deadline and any(_alive(pid) for pid in ranks):
        time.sleep(0.05)
    for pid in ranks:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _alive(pid: int) -> bool:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        return False


if __name__ == "__main__":
    sys.exit(main())
