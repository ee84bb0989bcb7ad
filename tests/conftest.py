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

from common.kernels import PIN_ENV

HERE = Path(__file__).resolve().parent
LANES = ("unit", "integration")
sys.path.insert(0, str(HERE))  # `from helpers import ...`, `from unit.fake_runs import ...`
# pytest rewrites every test module's asserts and caches the result beside it (__pycache__/*-pytest-*.pyc),
# unless PYTHONDONTWRITEBYTECODE is set, as on CI's machines: then every worker of every session rewrites all of
# them again, 2.2 s of each worker's collection of the unit lane (Intel Xeon VM). The tests' own bytecode is
# only a cache, so it is written here whatever the environment says (the ranks' processes keep their setting).
sys.dont_write_bytecode = False


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
    # The readers of the session's background builds run last, so that the workers do not wait for them (a
    # stable sort: every other test keeps its place).
    items.sort(key=lambda item: bool(BUILDS_FIXTURES & set(getattr(item, "fixturenames", ()))))


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


def _session_cache(tmp_path_factory, name: str = "dpcompare-cache") -> Path:
    """A cache folder of the session's: under xdist in the controller's basetemp, which its workers share (a
    worker's basetemp is popen-gwN inside the controller's)."""
    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name
    shared.mkdir(exist_ok=True)
    return shared


@pytest.hookimpl(trylast=True)  # after the tmp_path plugin has made its factory
def pytest_configure(config):
    """Whatever a test starts without naming a cache (the unit lane's kernel timings, MLX's compiled kernels) goes
    to the session's folder, never to the user's own ~/.cache/dpcompare: timings made by tests running side by side
    would otherwise be read by the user's next run. A folder apart from `cache_dir`'s, so that the shared runs do
    not read timings made beside other tests. Set before xdist starts its workers, which inherit it."""
    if not os.environ.get("DPCOMPARE_CACHE"):
        os.environ["DPCOMPARE_CACHE"] = str(_session_cache(config._tmp_path_factory, "dpcompare-default-cache"))
    # MLX's selectable kernels pinned to MLX's own for every run of the session (common/kernels.py PIN_ENV): a run
    # and its resume, or two runs a test compares bit for bit, made minutes apart while the other workers load the
    # cores, would otherwise be timed apart and could compute with different kernels (1.5e-7 apart in test_slurm,
    # 9.5e-5 in a bf16 resume, AMD EPYC Zen 3); and no test pays for timings it does not read. The tests of `auto`
    # itself, and the shared matrix that users' runs resemble, measure (the `kernels_measured` fixture).
    os.environ.setdefault(PIN_ENV, "native")


@pytest.fixture
def kernels_measured(monkeypatch):
    """This test's runs take MLX's kernels as `auto` measures them, as a user's run does."""
    monkeypatch.delenv(PIN_ENV, raising=False)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """One token cache and seed-checkpoint store for the whole session, as a user's cache would be; under
    xdist the workers share the one the matrix filled before they started (token cache, seed checkpoints,
    MLX's compiled kernels; each is written whole under a temporary name, so concurrent runs are safe)."""
    return _session_cache(tmp_path_factory)


def runs_integration(config) -> bool:
    lane = HERE / "integration"
    paths = [Path(str(a).split("::")[0]).resolve() for a in config.args] or [Path(config.rootpath)]
    return any(p == lane or lane.is_relative_to(p) or p.is_relative_to(lane) for p in paths)


BUILDS_FIXTURES = {"matrix", "shaped_link_run"}
_background: dict = {}


@pytest.hookimpl(tryfirst=True)  # before xdist starts its workers (its own pytest_sessionstart)
def pytest_sessionstart(session):
    """Under xdist, the xdist controller starts the integration lane's shared matrix and then the shaped-link runs
    in one process of their own, at once: the workers run every other test meanwhile (their readers are
    scheduled last: pytest_collection_modifyitems), so the build's N=1 runs no longer leave a core idle before
    any test starts. No test judges a time or rate that this load could move (tests/integration/test_link.py)."""
    config = session.config
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None) \
            or not runs_integration(config):
        return
    from helpers import can_emulate_links
    from integration.runs import BACKGROUND

    base = config._tmp_path_factory.getbasetemp()
    cache = base / "dpcompare-cache"
    cache.mkdir(exist_ok=True)
    builds = [b for b in BACKGROUND if b[1] != "shaped-link" or can_emulate_links()]
    root = base / "background"
    root.mkdir(exist_ok=True)
    code = ("import sys; from pathlib import Path; sys.path[:0] = [sys.argv[1]]; "
            "from integration.runs import build_in_background; "
            "build_in_background(Path(sys.argv[2]), Path(sys.argv[3]), "
            "[tuple(b.split(':')) for b in sys.argv[4:]])")
    log = open(root / "build.log", "w")
    proc = subprocess.Popen([sys.executable, "-c", code, str(HERE), str(root), str(cache),
                             *(f"{folder}:{builder}" for _, folder, _, builder in builds)],
                            cwd=HERE.parent, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    (root / "build.pid").write_text(str(proc.pid))
    _background.update(proc=proc, log=log, started=time.monotonic(), root=root)
    for title, folder, env_name, _ in builds:
        os.environ[env_name] = str(root / folder)
        print(f"\nbuilding {title} in the background ({root / folder})", flush=True)


def pytest_sessionfinish(session):
    """The background build is over by now, unless the session stopped early: then it is stopped with its ranks."""
    proc = _background.get("proc")
    if proc is None:
        return
    if proc.poll() is None:
        import signal

        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    _background["log"].close()
    built = [line for line in (_background["root"] / "build.log").read_text().splitlines() if line.startswith("built ")]
    print("\nbackground: " + ("; ".join(built) or "nothing built"), flush=True)


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
