"""Which cores a rank runs on, framework-neutral: where one machine's ranks outnumber its cores, either where the
kernel puts them ("kernel") or one core each, round-robin ("round-robin": rank r on core r mod cores, so that
consecutive ranks, a tp pair or ring neighbours, never share one). Each framework's launch.py names its policy
(SHARED_CORES) with the runs that chose it: the kernel's placement of MLX's ranks is a coin flip that a tp pair on
one core loses by half a step, and pinning torch's puts gloo's threads in the queue behind the rank's compute.

Only a job on one machine is placed (across hosts each machine has its own ranks and its own cores), only where the
ranks' threads do not each have a core already, and `--no-pin-ranks` leaves it to the kernel.
"""
from __future__ import annotations

import os
from pathlib import Path

ROUND_ROBIN = "round-robin"
KERNEL = "kernel"
_pinned: set[int] | None = None  # what place_rank gave this process, for its rank status (pinned_cores)


def rank_from_environment() -> int:
    """This rank as its launcher said it: torch's launchers (RANK), mpirun (OMPI_COMM_WORLD_RANK), mlx.launch
    (MLX_RANK); 0 for a job of one rank started by plain python."""
    return int(os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("MLX_RANK", 0))))


def cores_for(rank: int, ranks: int, threads: int, available: list[int]) -> set[int] | None:
    """The cores of `available` rank `rank` of `ranks` (each of `threads` threads) is pinned to, round-robin; None
    where every rank's threads have cores of their own, or a rank's threads want every core (the kernel's choice)."""
    if ranks < 2 or ranks * threads <= len(available) or threads >= len(available):
        return None
    return {available[(rank * threads + j) % len(available)] for j in range(threads)}


def place_rank(run_dir: str, policy: str) -> set[int] | None:
    """Pin this process under `policy` before its framework starts threads (they inherit the mask); the cores,
    or None where it is left to the kernel: another policy, no affinity call (macOS), a job across machines (a
    hostfile, --nnodes, an srun step over several nodes), `--no-pin-ranks`, or a plan this rank cannot read
    (rank_main reports that)."""
    if policy != ROUND_ROBIN or not hasattr(os, "sched_setaffinity"):
        return None
    from common.runplan import RunPlan

    try:
        cfg = RunPlan.read(Path(run_dir)).config
    except Exception:  # noqa: BLE001 - the rank's own start reads the plan again and says what is wrong
        return None
    if not cfg.pin_ranks or cfg.nnodes > 1 or cfg.hostfile or int(os.environ.get("SLURM_STEP_NUM_NODES", 1)) > 1:
        return None  # ranks across machines (an srun step over several nodes too): each machine has its own cores
    cores = cores_for(rank_from_environment(), cfg.world_size, cfg.threads_per_rank, sorted(os.sched_getaffinity(0)))
    if cores is not None:
        try:
            os.sched_setaffinity(0, cores)
        except OSError:  # a core the job's cgroup took away since: the kernel's choice
            return None
    global _pinned
    _pinned = cores
    return cores


def pinned_cores() -> list[int] | None:
    """The cores place_rank pinned this process to (its rank status's `cores`, summary.json's `pinned_cores`), or
    None where the kernel places it."""
    return sorted(_pinned) if _pinned else None
