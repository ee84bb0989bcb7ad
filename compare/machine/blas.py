"""MLX's BLAS on Linux, chosen by measurement: the OpenBLAS wheel installed with dpcompare, a system OpenBLAS, or
MLX's own reference BLAS.

MLX's Linux wheel links a reference BLAS (4-7 GFLOP/s on one core, against 80-110 for OpenBLAS), so a bare machine
ran MLX 8x slower than torch and the verdict blamed MLX's matmul. `make install` brings `ngsolve-openblas` from the
package registry: a DYNAMIC_ARCH OpenBLAS with unprefixed cblas_* symbols that needs no root and no compiler. It
needs libgfortran.so.5, which a bare Debian lacks but the venv has under hashed names (mlx_cpu.libs/, numpy.libs/);
a private folder in the cache holds links to the wheel's library and to those, so the wheel's own RPATH ($ORIGIN,
which the loader resolves to the folder of the link) finds them, and the ranks get LD_PRELOAD alone.

Every candidate is checked in a child (blas_probe.py) before any rank starts: a library built for another CPU dies
there with SIGILL, one with a missing dependency fails to load, and neither is ever picked. The survivors' sgemm
is timed there too, MLX's own beside them, and `auto` takes the fastest; the timings are cached per CPU, MLX version
and set of libraries in kernel-choice.json like the other kernel choices (common/kernels.py), with the CPU share
and load they were taken under, and timed again where that timing shared its CPU.
"""
from __future__ import annotations

import functools
import glob
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from common.config import default_cache_dir
from common.errors import UserError
from common.kernels import MAX_TRIES, Identity, KernelCache, cpu_signature, mlx_version, was_contended

from .openblas import kernels_for

WHEEL = "ngsolve-openblas"
WHEEL_MODULE = "ngsolve_openblas"
PROBE = Path(__file__).with_name("blas_probe.py")
PROBE_TIMEOUT_S = 60
SYSTEM_CANDIDATES = (
    "/usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/*-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas*.so.0",
)
FIX_PIP = f"pip install {WHEEL} (make install does it), then --mlx-blas auto"
FIX_APT = "apt install libopenblas0-pthread (Debian), then --mlx-blas auto"


@dataclass(frozen=True)
class Candidate:
    name: str      # "wheel", "system" or "bundled"
    library: str   # the file the ranks preload (bundled: MLX's own, timed but never preloaded)
    origin: str    # where it came from, for the BLAS line


@dataclass(frozen=True)
class BlasChoice:
    """What MLX's ranks compute their matmuls with: the BLAS line, the environment, and what the verdict reads."""
    description: str
    env: dict = field(default_factory=dict)
    kind: str = "reference"        # "reference" (MLX's bundled BLAS), "openblas" or "accelerate"
    chosen: str = "auto"           # "auto" (measured here) or "flag" (--mlx-blas named it)
    fix: str | None = None         # the one command that gives MLX a fast BLAS, where it has none
    gflops: dict = field(default_factory=dict)  # each candidate's measured sgemm, where measured


def system_candidate() -> Candidate | None:
    for pattern in SYSTEM_CANDIDATES:
        found = sorted(glob.glob(pattern))
        if found:
            return Candidate("system", found[0], found[0])
    return None


def bundled_candidate() -> Candidate | None:
    """MLX's own reference BLAS (mlx_cpu.libs/libblas-*.so*), found without importing mlx."""
    folder = _site_folder("mlx")
    found = sorted(glob.glob(str(folder / "mlx_cpu.libs" / "libblas*.so*"))) if folder else []
    return Candidate("bundled", found[0], "mlx wheel's reference BLAS") if found else None


def wheel_candidate(cache_root: Path) -> Candidate | None:
    """The OpenBLAS wheel, reached through a private folder of links (the module's docstring says why); None where
    the wheel is not installed (macOS, arm64: the registry has no such wheel) or the folder cannot be written."""
    spec = importlib.util.find_spec(WHEEL_MODULE)  # no import: importing it loads the library into this process
    if spec is None or not spec.submodule_search_locations:
        return None
    package = Path(list(spec.submodule_search_locations)[0])
    libraries = sorted(glob.glob(str(package / "libopenblas*.so*")))
    if not libraries:
        return None
    version = importlib.metadata.version(WHEEL)
    folder = Path(cache_root) / "blas" / f"{WHEEL}-{version}-{_digest(str(package))}"
    links = {"libopenblas.so.0": Path(libraries[0]), **_fortran_runtime(package.parent)}
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for name, target in links.items():
            _link(folder / name, target)
    except OSError:
        return None
    return Candidate("wheel", str(folder / "libopenblas.so.0"), f"{WHEEL} {version}")


def _fortran_runtime(site: Path) -> dict[str, Path]:
    """libgfortran.so.5 (and the libquadmath it names) from a wheel's vendored libraries, MLX's first; empty where
    none is found (then a system libgfortran is the loader's only hope, and the probe says whether there is one)."""
    for vendor in ("mlx_cpu.libs", "numpy.libs", "scipy.libs"):
        fortran = sorted(glob.glob(str(site / vendor / "libgfortran*.so.5*")))
        if fortran:
            quadmath = sorted(glob.glob(str(site / vendor / "libquadmath*.so*")))
            return {"libgfortran.so.5": Path(fortran[0]), **{Path(q).name: Path(q) for q in quadmath}}
    return {}


def _link(path: Path, target: Path) -> None:
    """`path` -> `target`, replaced atomically where it points elsewhere (a moved venv), so concurrent launchers
    never see a missing link."""
    if path.is_symlink() and os.readlink(path) == str(target):
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target)
    tmp.replace(path)


def _site_folder(module: str) -> Path | None:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]).parent


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def probe(candidate: Candidate, extra_env: dict) -> dict:
    """The child's verdict on `candidate` with the ranks' `extra_env`: its JSON (core, gflops, relative_error,
    cpu_share), or {"error": one line} where it crashed, failed to load or computed wrong."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "OPENBLAS_CORETYPE")}
    env.update({"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", **extra_env})
    if candidate.name != "bundled":
        env["LD_PRELOAD"] = candidate.library  # as the ranks load it: a failure to preload shows here
    try:
        out = subprocess.run([sys.executable, str(PROBE), candidate.library, "1"], capture_output=True, text=True,
                             env=env, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {PROBE_TIMEOUT_S} s"}
    except OSError as exc:
        return {"error": exc.strerror or str(exc)}
    if out.returncode < 0:
        name = signal.Signals(-out.returncode).name
        why = " (built for another CPU)" if name == "SIGILL" else ""
        return {"error": f"killed by {name}{why}"}
    if out.returncode != 0:
        lines = [line for line in out.stderr.strip().splitlines() if line.strip()] or ["no output"]
        missing = next((line for line in lines if "cannot open shared object" in line), None)
        return {"error": "missing dependency: " + missing.split(":")[-3].strip() if missing and
                missing.count(":") >= 3 else lines[-1][:200]}
    try:
        result = json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"error": f"unreadable output: {out.stdout[-200:]!r}"}
    if not result.get("relative_error", 1.0) < 1e-4:  # float32 sgemm of this shape: ~1e-7 (also NaN fails)
        return {"error": f"wrong results (relative error {result.get('relative_error')})"}
    return result


def choose(choice: str, cache_dir: str | Path | None = None) -> BlasChoice:
    """MLX's BLAS for `choice` (--mlx-blas): auto, wheel, system or bundled, with `cache_dir` the run's cache
    (default_cache_dir where None). A named library that does not work here is a UserError; `auto` never picks
    one. Decided once per process and cache folder: the BLAS line, the ranks and summary.json agree."""
    return _choose(choice, str(cache_dir or default_cache_dir()))


@functools.lru_cache(maxsize=8)
def _choose(choice: str, cache_dir: str) -> BlasChoice:
    if sys.platform == "darwin":
        return BlasChoice("accelerate (macOS)", kind="accelerate", chosen="flag" if choice != "auto" else "auto")
    cache_root = Path(cache_dir)
    if choice == "bundled":
        return BlasChoice("bundled (mlx wheel's reference BLAS; --mlx-blas bundled)", chosen="flag", fix=_fix_flag())
    candidates = [c for c in (wheel_candidate(cache_root), system_candidate()) if c is not None]
    if choice in ("wheel", "system"):
        named = next((c for c in candidates if c.name == choice), None)
        if named is None:
            raise UserError(f"--mlx-blas {choice}: no {'OpenBLAS wheel' if choice == 'wheel' else 'system OpenBLAS'}"
                            f" found (fix: {FIX_PIP if choice == 'wheel' else FIX_APT}); use --mlx-blas auto")
        core, core_env = kernels_for(named.library)
        result = probe(named, core_env)
        if "error" in result:
            raise UserError(f"--mlx-blas {choice}: {named.library} does not work here: {result['error']}; "
                            "use --mlx-blas auto")
        return _preloaded(named, core, core_env, "flag", {named.name: result["gflops"]})
    return _auto(candidates, cache_root)


def _auto(candidates: list[Candidate], cache_root: Path) -> BlasChoice:
    # Keyed by the libraries (path and size) and the user's own OPENBLAS_CORETYPE: a hit starts no child at all.
    identity = Identity(cpu_signature(), mlx_version(), "blas-" + _digest(json.dumps(
        [[c.name, c.library, _size(c.library)] for c in candidates] + [os.environ.get("OPENBLAS_CORETYPE", "")])))
    cache, shape = KernelCache(cache_root), (1,)
    entry = cache.get(identity, "blas", shape, contended=True)
    # An entry timed beside other work is kept where its margin is more than such load can flip (load_explains),
    # else timed again at most MAX_TRIES times in all: under CI's load it would otherwise be timed at every launch.
    if entry is None or (load_explains(entry) and entry.get("tries", 1) < MAX_TRIES):
        entry = _timed(candidates, cache, identity, entry or {})
    by_name = {c.name: c for c in candidates}
    cores = entry.get("cores", {})
    gflops, rejected = entry.get("gflops", {}), entry.get("rejected", {})
    measured = ", ".join(f"{name} {value:.1f}" for name, value in sorted(gflops.items(), key=lambda kv: -kv[1]))
    why = f"measured sgemm 512x2048x512, 1 thread: {measured} GFLOP/s" if measured else "nothing measured"
    why += "".join(f"; {name} rejected: {error}" for name, error in rejected.items())
    if entry["choice"] in by_name:
        chosen = by_name[entry["choice"]]
        core, core_env = cores.get(chosen.name) or kernels_for(chosen.library)
        return _preloaded(chosen, core, dict(core_env), "auto", gflops, why)
    fix = FIX_APT if "wheel" in by_name or platform.machine() not in ("x86_64", "AMD64") else FIX_PIP
    none = "no OpenBLAS works here" if candidates else "no OpenBLAS found"
    return BlasChoice(f"bundled (mlx wheel's reference BLAS; {none}; {why}; fix: {fix})", fix=fix, gflops=gflops)


def _timed(candidates: list[Candidate], cache: KernelCache, identity: Identity, before: dict) -> dict:
    """Probe every candidate and MLX's own BLAS, and store the entry: each library's best GFLOP/s over this timing
    and the ones `before` (a load can slow a timing, never speed it up), its core, and the rejected ones."""
    cores = {c.name: kernels_for(c.library) for c in candidates}
    results = {c.name: probe(c, cores[c.name][1]) for c in candidates}
    bundled = bundled_candidate()
    if bundled is not None:
        results["bundled"] = probe(bundled, {})
    gflops = {name: max(r["gflops"], before.get("gflops", {}).get(name, 0.0))
              for name, r in results.items() if "error" not in r}
    timings = {name: 2e3 / value for name, value in gflops.items()} or {"bundled": float("inf")}
    share = min((r.get("cpu_share") or 1.0 for r in results.values() if "error" not in r), default=None)
    return cache.put(identity, "blas", (1,), timings, share, extra={
        "gflops": {name: round(value, 1) for name, value in gflops.items()},
        "rejected": {name: r["error"] for name, r in results.items() if "error" in r},
        "cores": {name: list(core) for name, core in cores.items()}})


def load_explains(entry: dict) -> bool:
    """Whether the load a choice was timed under could have made it: a timing that ran `cpu_share` of its wall
    time can read up to 1 / cpu_share slower, so a winner by less than that over the runner-up is timed again
    (the wheel against a system OpenBLAS: within 20 % of each other), a winner by more is not (either against MLX's
    reference BLAS: 15-20x). Not shared at all (cpu_share >= 0.8, common/kernels.py was_contended): never."""
    share = entry.get("cpu_share")
    if not was_contended(share):
        return False
    times = sorted(entry.get("timings", {}).values())
    return len(times) > 1 and times[1] < times[0] / share


def _preloaded(chosen: Candidate, core: str, core_env: dict, how: str, gflops: dict, why: str = "") -> BlasChoice:
    preload = " ".join(filter(None, [chosen.library, os.environ.get("LD_PRELOAD", "")]))
    label = {"wheel": "openblas wheel", "system": "openblas"}[chosen.name]
    where = chosen.origin if chosen.name == "wheel" else chosen.library
    return BlasChoice(f"{label} ({where}, preloaded; {core}{'; ' + why if why else ''})",
                      {"LD_PRELOAD": preload, **core_env}, "openblas", how, None, gflops)


def _fix_flag() -> str:
    return "--mlx-blas auto (drop --mlx-blas bundled: auto preloads the fastest OpenBLAS that works here)"


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return -1


def summary_fields(framework: str, choice: str, cache_dir: str | None = None) -> dict:
    """What summary.json records of a run's BLAS for the verdict (compare/report): MLX's as chosen here; torch's
    is its own build's (MKL or oneDNN on x86, Accelerate on a Mac), never a reference BLAS on a machine it ships to."""
    if framework != "mlx":
        return {"blas_kind": "framework's own", "blas_chosen": "framework", "blas_fix": None, "blas_gflops": {}}
    try:
        chosen = choose(choice, cache_dir)
    except UserError:  # the launch already refused such a choice; a report rebuilt elsewhere must not fail here
        return {}
    return {"blas_kind": chosen.kind, "blas_chosen": chosen.chosen, "blas_fix": chosen.fix,
            "blas_gflops": chosen.gflops}
