"""How a process that imported a framework ends: at once, once its output is flushed, without the interpreter's
teardown.

When a rank's work is done its files are written and closed, and what Python does next is only of use to a process
that lives on: a full garbage collection over every object torch and its imports made (about a million: torch,
torch._dynamo, sympy), then every module freed. On the AMD EPYC Zen 3 that took 0.6 s after `import torch,
torch._dynamo`, quiet, and more in a forked rank whose collection copies the pages it shares (py-spy of a torch x2
run of the suite's shapes under load: 3.0-3.2 s of each rank's 5 s in `gc_collect_main` after its last line of
Python); with gc.freeze before the fork (forkranks.py), a torch x2 run of the suite's shapes takes 1.3 CPU-s less,
quiet. Paid by every rank of every run, and by the sample, probe and diagnose processes. So their entry points leave through `exit_now`, as forkranks' forking process
already does. atexit handlers do not run: this project registers none, and torch's process group is destroyed
before (torch_impl/launch.py). A process that raises still ends the usual way, printing its traceback.
"""
from __future__ import annotations

import os
import sys


# Set in every rank mpirun (Open MPI, MPICH) or srun's PMI starts. MPI must be finalized before such a rank ends, or
# mpirun takes it for a crash and kills the job: MLX's MPI backend finalizes in the teardown this would skip (seen:
# 4-rank MLX meshes on MPI failing after their last step, their other ranks then SIGTERMed).
MPI_RANK_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")


def exit_now(code: int | None) -> None:
    """End this process with `code` (None: 0), stdout and stderr flushed, skipping the interpreter's teardown;
    an MPI rank ends the usual way (MPI_RANK_VARIABLES)."""
    if any(name in os.environ for name in MPI_RANK_VARIABLES):
        sys.exit(code)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can be said on it
            pass
    os._exit(code or 0)
