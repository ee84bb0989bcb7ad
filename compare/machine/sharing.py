"""What sharing this machine's cores does to a run, said in one line before it starts: MLX's ring backend waits
by polling its sockets, so where its ranks already fill every core a waiting rank takes time from a computing one.

mlx 0.32's ring gives each socket a thread that, while a send or a receive is pending, calls the non-blocking
send and recv in a loop (mlx/distributed/ring/ring.cpp, SocketThread::worker), where MPI's waits cost a fraction
of the CPU. Measured on a 2-core AMD EPYC Zen 4 (tiny, 4 layers, 16 x 128 tokens, 30 steps, --profile-steps 0,
both with -march=native kernels, each pair alternated twice in one sitting):

| layout | ring: s per step, system CPU | mpi: s per step, system CPU |
|---|---|---|
| pp x4 | 0.328, 0.325; 23 s | 0.138, 0.138; 3.5 s |
| pp x2 | 0.147, 0.161; 3 s | 0.124, 0.119; 1 s |
| ddp x2 | 0.086, 0.115; 2-2.6 s | 0.074, 0.093; 0.9-1.2 s |
"""
from __future__ import annotations

from common.config import RunConfig
from common.costmodel.links import waits_poll

from . import environment as env

# The table's pp x4 row, as the note and the report's warning say it.
MEASURED = "pp x4 on 2 cores: 0.14 s a step on MPI against 0.33 s on the ring"


def polls_on_full_cores(framework: str, backend: str | None, ranks: int, threads: int, cores: int,
                        local: bool) -> bool:
    """Whether `ranks` of a backend that polls while it waits (common/costmodel/links.py waits_poll), all on one
    machine (`local`: no hostfile, one node), fill its `cores` with their compute threads, leaving none to the
    polling: the rule of the note below and of the report's warning (compare/report/findings.py)."""
    return local and ranks >= 2 and waits_poll(framework, backend) and ranks * threads >= cores


def ring_polling_note(cfg: RunConfig, cores: int | None = None) -> str | None:
    """One line before an MLX ring job that polls_on_full_cores; None elsewhere."""
    cores = env.cpu_count() if cores is None else cores
    if not polls_on_full_cores(cfg.framework, cfg.resolved_backend, cfg.world_size, cfg.threads_per_rank, cores,
                               local=not cfg.hostfile and cfg.nnodes == 1):
        return None
    instead = ("--backend mpi waits at a fraction of that CPU" if env.mpirun() is not None else
               "fewer ranks, or Open MPI and --backend mpi, avoid it")
    return (f"mlx x{cfg.world_size} on the ring backend: {cfg.nproc} ranks of {cfg.threads_per_rank} thread"
            f"{'s' * (cfg.threads_per_rank > 1)} fill this machine's {cores} cores, and a rank waiting on the ring "
            f"polls its sockets, taking a core from a rank that computes, so steps run slower than the cores "
            f"allow; {instead} ({MEASURED})")
