import functools
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """One token cache and seed-checkpoint store for the whole session, as a user's cache would be."""
    return tmp_path_factory.mktemp("dpcompare-cache")


@functools.lru_cache(maxsize=1)
def cuda_gpus() -> int:
    """CUDA GPUs on this machine, from nvidia-smi (no framework import): 0 where there is none."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return 0
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in out.stdout.splitlines()) if out.returncode == 0 else 0


def pytest_runtest_setup(item):
    marker = item.get_closest_marker("gpu")
    if marker is not None:
        need = marker.args[0] if marker.args else 1
        if cuda_gpus() < need:
            pytest.skip(f"needs {need} CUDA GPU(s), this machine has {cuda_gpus()}")
