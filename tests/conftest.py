# Two lanes, as torchtitan has them: tests/unit starts no training process (`make test-fast`, under a
# minute), tests/integration starts real ranks through the CLI (marked slow). The rule for the slow lane:
# a new slow test replaces or extends an existing run (the session's `matrix` in
# tests/integration/conftest.py, or a run a test already makes); it does not add one.
import functools
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
LANES = ("unit", "integration")
sys.path.insert(0, str(HERE))  # `from helpers import ...`, `from unit.test_parity import ...`


def pytest_collect_file(file_path, parent):
    """A test file outside the two lanes is an error, so a new file cannot dodge the split."""
    if file_path.suffix == ".py" and file_path.name.startswith("test_"):
        try:
            lane = file_path.resolve().relative_to(HERE).parts[0]
        except ValueError:
            return None
        if lane not in LANES:
            raise pytest.UsageError(f"{file_path}: test files live in tests/unit (no training process) or "
                                    "tests/integration (the rest)")
    return None


def pytest_collection_modifyitems(items):
    for item in items:
        if Path(str(item.path)).resolve().is_relative_to(HERE / "integration"):
            item.add_marker(pytest.mark.slow)


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
