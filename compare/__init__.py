"""The framework-neutral side of dpcompare. Nothing here imports mlx or torch.

The commands sit at the top (cli, flags, matrix, submit, diagnose, doctor, export); the rest is three parts:
  launch/   start a run's ranks as subprocesses and watch them (runner, launchers, spawn, watchdog, hosts;
            slurm and slurm_rank inside a Slurm allocation), and sample a finished run (sample)
  report/   judge parity and write the report, reading run directories only
  machine/  what this machine offers: BLAS, MPI, versions, matmul peaks, the fabric between ranks
"""
from __future__ import annotations

import importlib.machinery
import sys
from pathlib import Path

__version__ = "0.1.0"  # the package's version (pyproject.toml reads it from here); `dpcompare --version`

# dpcompare's top-level packages have plain names. Another `common` (or mlx_impl, torch_impl) earlier on
# sys.path, from PYTHONPATH say, would be imported in place of ours; the processes dpcompare starts already
# put our directory first (compare/machine/environment.py child_env), and this does the same here.
_ROOT = Path(__file__).resolve().parent.parent


def _ours_first() -> None:
    for name in ("common", "mlx_impl", "torch_impl"):
        found = importlib.machinery.PathFinder.find_spec(name)
        if found is not None and found.origin and Path(found.origin).resolve().parent.parent != _ROOT:
            sys.path.insert(0, str(_ROOT))
            return


_ours_first()
