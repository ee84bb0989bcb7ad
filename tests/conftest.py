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


# Under pytest-xdist (`make test` runs the integration lane on 2 workers) a session or module fixture is
# built once per worker that asks for it. So the unit of scheduling is a test file, except that the tests
# reading one of the session's shared runs (tests/integration/conftest.py) form one unit wherever they live:
# each shared run is trained once. (xdist's own --dist loadgroup would do this with markers, but xdist 3.8
# sets `item._nodeid`, which pytest 9 no longer reads, so its groups are silently ignored.)
SHARED_RUNS = ("matrix", "uninterrupted")


@functools.lru_cache(maxsize=None)
def _shared_run_users(path: str) -> dict[str, str]:
    """{test function name: the shared run it takes as an argument} for one test file."""
    import ast

    users = {}
    for node in ast.walk(ast.parse((HERE.parent / path).read_text())):
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
            shared = [a.arg for a in node.args.args if a.arg in SHARED_RUNS]
            if shared:
                users[node.name] = shared[0]
    return users


def scheduling_unit(nodeid: str) -> str:
    path, _, rest = nodeid.partition("::")
    return _shared_run_users(path).get(rest.split("[")[0], path) if path.endswith(".py") else path


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class SharedRunScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scheduling_unit(nodeid)

    return SharedRunScheduling(config, log)


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
