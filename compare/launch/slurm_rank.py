"""One task of a Slurm job step: `srun ... python -m compare.launch.slurm_rank CMD...` (compare/launch/slurm.py).

Sets the variables a rank reads, as torchrun and mlx.launch would set them, from Slurm's own, then execs CMD
(so the task's pid is the rank's, and srun's signals reach it): RANK, WORLD_SIZE, LOCAL_RANK and
LOCAL_WORLD_SIZE for torch, MLX_RANK and MLX_HOSTFILE for the MLX ring. An MPI rank learns its rank from
PMIx; RANK is set for it too, for its status file before MPI starts. Imports nothing heavy: it runs once per
rank before the framework does.
"""
from __future__ import annotations

import os
import re
import sys

RING_HOSTFILE_ENV = "DPCOMPARE_RING_HOSTFILE"  # compare/launch/slurm.py's name for it


def rank_env(environ: dict) -> dict[str, str]:
    """The variables this task adds: its rank in the step, the step's size, its rank on this node."""
    rank, size, local = environ["SLURM_PROCID"], environ["SLURM_NTASKS"], environ.get("SLURM_LOCALID", "0")
    on_node = expand_counts(environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE") or size)
    node = int(environ.get("SLURM_NODEID", "0"))
    added = {"RANK": rank, "WORLD_SIZE": size, "LOCAL_RANK": local, "MLX_RANK": rank,
             "LOCAL_WORLD_SIZE": str(on_node[node] if node < len(on_node) else 1)}
    if environ.get(RING_HOSTFILE_ENV):
        added["MLX_HOSTFILE"] = environ[RING_HOSTFILE_ENV]
    if environ.get("MASTER_ADDR") and int(environ.get("SLURM_STEP_NUM_NODES", "1")) > 1 \
            and not environ.get("GLOO_SOCKET_IFNAME"):
        # gloo binds to the address the host name resolves to, often a loopback one (Debian's /etc/hosts).
        from .hosts import interface_toward

        interface = interface_toward(environ["MASTER_ADDR"])
        if interface:
            added["GLOO_SOCKET_IFNAME"] = interface
    return added


def expand_counts(text: str) -> list[int]:
    """Slurm's compressed counts, one per node: "2(x3),1" -> [2, 2, 2, 1]."""
    counts = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item)
        if not match:
            raise ValueError(f"{text!r} is not a Slurm count list such as 2(x3),1")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def main(argv: list[str] | None = None) -> int:
    command = sys.argv[1:] if argv is None else argv
    if not command or "SLURM_PROCID" not in os.environ:
        print("usage: srun ... python -m compare.launch.slurm_rank CMD... (inside a Slurm job step)", file=sys.stderr)
        return 2
    os.execvpe(command[0], command, {**os.environ, **rank_env(dict(os.environ))})


if __name__ == "__main__":
    sys.exit(main())
