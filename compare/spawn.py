"""Start N local ranks of an MLX ring job: `python -m compare.spawn --ranks N --ring-hostfile PATH -- CMD...`.

What `mlx.launch -n N` does on one machine (MLX_RANK and an MLX_HOSTFILE of localhost ports per rank),
without its cost: mlx.launch relays the ranks' output in a loop that keeps one core busy (measured: 96%
CPU for the launcher during a 2-rank job on 2 cores, which halved the job's throughput). This waits in
os.wait() and lets the ranks write to the log directly. As mlx.launch does, when one rank fails the
others are stopped and the exit code is the failed rank's.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

from .environment import free_port_block

GRACE_S = 3.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m compare.spawn")
    parser.add_argument("--ranks", type=int, required=True)
    parser.add_argument("--ring-hostfile", required=True, help="where to write the ring's MLX_HOSTFILE")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    base = free_port_block(args.ranks)  # chosen now, just before the ranks bind them
    with open(args.ring_hostfile, "w") as f:
        json.dump([[f"127.0.0.1:{base + r}"] for r in range(args.ranks)], f)
    env = {**os.environ, "MLX_HOSTFILE": args.ring_hostfile}
    procs = [subprocess.Popen(command, env={**env, "MLX_RANK": str(r)}) for r in range(args.ranks)]
    ranks = {proc.pid: r for r, proc in enumerate(procs)}
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
            print(f"[spawn] rank {rank} exited with code {exit_code}; stopping the others", file=sys.stderr,
                  flush=True)
            code = exit_code if exit_code > 0 else 128 - exit_code
            stop(ranks, signal.SIGTERM)
    return code


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
