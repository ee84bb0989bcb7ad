# Two lanes, as torchtitan has them: tests/unit starts no training process (`make test-fast`, under a
# minute), tests/integration starts real ranks through the CLI (marked slow). The rule for the slow lane:
# a new slow test replaces or extends an existing run (the session's `matrix` in
# tests/integration/conftest.py, or a run a test already makes); it does not add one.
import functools
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
LANES = ("unit", "integration")
sys.path.insert(0, str(HERE))  # `from helpers import ...`, `from unit.fake_runs import ...`


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


# Under pytest-xdist (`make test` runs the integration lane on 2 workers) a module fixture is built once per
# worker that asks for it, so a file with one is a unit of scheduling (all its tests on one worker); every
# other test is a unit of its own, so that the two workers stay busy to the end. The session's shared runs
# are trained once whatever the worker (tests/integration/conftest.py: the matrix before the workers start,
# the others under a lock). (xdist's own --dist loadgroup would do this with markers, but xdist 3.8 sets
# `item._nodeid`, which pytest 9 no longer reads, so its groups are silently ignored.)


@functools.lru_cache(maxsize=None)
def _has_module_fixture(path: str) -> bool:
    """Whether a test file defines a fixture of module scope."""
    import ast

    for node in ast.walk(ast.parse((HERE.parent / path).read_text())):
        if isinstance(node, ast.FunctionDef):
            for dec in node.decorator_list:
                if isinstance(dec, ast.Call) and any(k.arg == "scope" and getattr(k.value, "value", None) == "module"
                                                     for k in dec.keywords):
                    return True
    return False


def scheduling_unit(nodeid: str) -> str:
    path = nodeid.partition("::")[0]
    return path if not path.endswith(".py") or _has_module_fixture(path) else nodeid


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class SharedRunScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scheduling_unit(nodeid)

    return SharedRunScheduling(config, log)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """One token cache and seed-checkpoint store for the whole session, as a user's cache would be; under
    xdist the workers share the one the matrix filled before they started (token cache, seed checkpoints,
    MLX's compiled kernels; each is written whole under a temporary name, so concurrent runs are safe)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = tmp_path_factory.getbasetemp().parent / "dpcompare-cache"  # a worker's basetemp is popen-gwN
        shared.mkdir(exist_ok=True)
        return shared
    return tmp_path_factory.mktemp("dpcompare-cache")


def runs_integration(config) -> bool:
    lane = HERE / "integration"
    paths = [Path(str(a).split("::")[0]).resolve() for a in config.args] or [Path(config.rootpath)]
    return any(p == lane or lane.is_relative_to(p) or p.is_relative_to(lane) for p in paths)


@pytest.hookimpl(tryfirst=True)  # before xdist starts its workers (its own pytest_sessionstart)
def pytest_sessionstart(session):
    """Under xdist, the xdist controller trains the integration lane's shared matrix before any worker
    exists, so that it trains alone (its time breakdown is judged to 15 %) and fills the workers' cache;
    then the shaped-link compare, whose step the cost model's prediction is judged against (also 15 %), and the
    two-level link's run, whose all-reduce gives each level's rate (20 %)."""
    config = session.config
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None) \
            or not runs_integration(config):
        return
    from helpers import can_emulate_links
    from integration.runs import LINK_RUN_ENV, MATRIX_ENV, build_link_run, build_matrix

    base = config._tmp_path_factory.getbasetemp()
    cache = base / "dpcompare-cache"
    cache.mkdir(exist_ok=True)
    alone = [("the shared matrix", "matrix", MATRIX_ENV, build_matrix)]
    if can_emulate_links():
        alone.append(("the shaped-link compare and two-level run", "shaped-link", LINK_RUN_ENV, build_link_run))
    for title, folder, env_name, build in alone:
        root = base / folder
        root.mkdir(exist_ok=True)
        print(f"\ntraining {title} before the workers start ({root})", flush=True)
        started = time.monotonic()
        try:
            build(root, cache)
        except AssertionError:
            pass  # written to root/error.txt: its readers fail with it, the other tests run
        print(f"{title} took {time.monotonic() - started:.0f} s", flush=True)
        os.environ[env_name] = str(root)


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
