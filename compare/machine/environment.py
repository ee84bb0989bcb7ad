"""What this machine offers, found without importing a framework: BLAS, MPI, versions, free ports."""
from __future__ import annotations

import ctypes.util
import glob
import importlib.metadata
import os
import platform
import random
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from common.errors import UserError

def version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict:
    return {"python": platform.python_version(), "numpy": version("numpy"), "mlx": version("mlx"),
            "torch": version("torch"), "dpcompare": version("dpcompare")}


def system_openblas() -> str | None:
    from .blas import system_candidate

    found = system_candidate()
    return found.library if found else None


def mlx_blas(choice: str, cache_dir: Path | None = None) -> tuple[str, dict]:
    """(description, extra env) for MLX ranks: the BLAS --mlx-blas `choice` gives them (compare/machine/blas.py: on
    Linux an OpenBLAS preloaded in place of the mlx wheel's reference BLAS, chosen by measurement under auto);
    `cache_dir`: the run's cache folder, where its links and timings are kept (default_cache_dir where None)."""
    from .blas import choose

    chosen = choose(choice, cache_dir)
    return chosen.description, dict(chosen.env)


# A new kernel cache where an old one may hold kernels built otherwise: until stop 46 a local MPI job's ranks built
# theirs with the plain g++ into the native cache (mlx_mpirun: Open MPI's prefix put /usr/bin first on PATH), and
# MLX names a kernel by its graph, so a later native run read them back.
# "-3": the strided kernels' unit-stride inner loop (strided_kernels.py), which kernels built before it lack.
JIT_CACHE_GENERATION = "-3"


def mlx_cpu_jit(choice: str, cache_root: Path) -> tuple[str, dict]:
    """(description, extra env) for MLX ranks: the flags of the kernels MLX compiles for mx.compile.

    On a CPU, mx.compile fuses elementwise ops into C++ that MLX builds at run time with
    `g++ -std=c++17 -O3` for the baseline x86-64 ISA (SSE2), so its exp, for one, runs without AVX.
    "native" puts a `g++` first on the ranks' PATH that adds -march=native, and gives them a kernel cache
    of their own (MLX keeps built kernels in $TMPDIR/mlx/<version>/cpu, named by graph, not by flags),
    keyed by this CPU, so a cache on a shared home never serves one CPU's kernels to another.
    g++ 12 contracts a multiply and an add into an FMA even in -std=c++17 mode (seen in the native kernels'
    disassembly: x * c + d becomes vfmadd), so some results differ in the last bits (rsqrt too); losses agree
    to 1e-8, measured in docs/benchmarks.md."""
    baseline = "baseline (MLX's g++ -O3)"
    if choice == "baseline" or sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return baseline, {}
    compiler = shutil.which("g++")
    if compiler is None:
        if choice == "native":
            raise UserError("--mlx-cpu-jit native: g++ not found (Debian: apt install g++)")
        return baseline + "; no g++ found", {}
    root = Path(cache_root) / f"mlx-jit-native-{_cpu_signature()}{JIT_CACHE_GENERATION}"
    wrapper = root / "bin" / "g++"
    pch = precompiled_preamble(compiler, root)
    include = f' -I "{pch}"' if pch else ""
    # Each kernel's source is rewritten first: a strided kernel gets a unit-stride inner loop (strided_kernels.py).
    # Where g++ fails on a rewritten source, MLX's own (KERNEL.cpp.orig) goes back and is built as MLX wrote it.
    # Only MLX's strided kernels (their source names the function so; the file is a temporary name) are handed to
    # Python, and with -S (no site packages to import): 30 ms a kernel, against 0.2 s for g++.
    each_source = 'for a in "$@"; do case "$a" in *.cpp) '
    build = f'"{compiler}" -march=native{include} "$@"'
    script = (f'#!/bin/sh\n{each_source}if grep -q _strided_ "$a"; then "{sys.executable}" -S "{STRIDED_KERNELS}" '
              '"$a"; fi ;; esac; done\n'
              f'if {build}; then {each_source}rm -f "$a.orig" ;; esac; done; exit 0; fi\n'
              f'{each_source}if [ -f "$a.orig" ]; then mv "$a.orig" "$a"; fi ;; esac; done\n'
              f'exec {build}\n')
    try:
        wrapper.parent.mkdir(parents=True, exist_ok=True)
        if not wrapper.exists() or wrapper.read_text() != script:
            tmp = wrapper.with_suffix(f".{os.getpid()}")
            tmp.write_text(script)
            tmp.chmod(0o755)
            tmp.replace(wrapper)  # atomic: ranks of a concurrent run never see half a script
    except OSError as exc:
        if choice == "native":
            raise UserError(f"--mlx-cpu-jit native: cannot write {wrapper}: {exc.strerror}") from None
        return baseline + f"; cannot write {wrapper.parent}", {}
    path = os.pathsep.join([str(wrapper.parent), os.environ.get("PATH", "")])
    return (f"native (-march=native{', preamble precompiled' if pch else ''}, strided loops vectorised)",
            {"PATH": path, "TMPDIR": str(root)})


STRIDED_KERNELS = Path(__file__).resolve().parent / "strided_kernels.py"
# What MLX 0.32 compiles each fused CPU kernel with (mlx/backend/cpu/compiled.cpp), less -shared and the output.
MLX_KERNEL_FLAGS = ("-std=c++17", "-O3", "-Wall", "-fPIC")
PREAMBLE = Path("mlx") / "backend" / "cpu" / "compiled_preamble.h"


def precompiled_preamble(compiler: str, root: Path) -> Path | None:
    """A folder holding MLX's kernel preamble precompiled (g++'s .gch), built once per MLX version in this
    cache; the wrapper puts it first on the include path, so every kernel skips parsing the preamble: 0.78 s ->
    0.19 s per kernel, the same bytes out (AMD EPYC Zen 4). g++ ignores a .gch built with other flags or by
    another g++ and reads the header itself, so a stale one costs speed, never correctness. None where MLX's
    headers are not found or the build fails (then every kernel parses the preamble, as before)."""
    import contextlib
    import importlib.metadata
    import importlib.util
    import subprocess

    spec = importlib.util.find_spec("mlx")  # no import: this process stays framework-free
    if spec is None or not spec.submodule_search_locations:
        return None
    include = Path(list(spec.submodule_search_locations)[0]) / "include"
    if not (include / PREAMBLE).is_file():
        return None
    folder = root / "pch" / importlib.metadata.version("mlx")
    target = folder / PREAMBLE.with_suffix(".h.gch")
    if target.is_file():
        return folder
    tmp = target.with_name(f"{target.name}.{os.getpid()}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        built = subprocess.run([compiler, "-march=native", *MLX_KERNEL_FLAGS, "-x", "c++-header", "-I", str(include),
                                str(include / PREAMBLE), "-o", str(tmp)], capture_output=True, timeout=300)
        if built.returncode == 0:
            tmp.replace(target)  # atomic: a concurrent run's g++ sees the whole file or none
    except (OSError, subprocess.TimeoutExpired):
        pass  # no precompiled header: the kernels build as before
    with contextlib.suppress(OSError):
        tmp.unlink(missing_ok=True)
    return folder if target.is_file() else None


def _cpu_signature() -> str:
    """A short hash of this CPU's model and flags: kernels built with -march=native run only on such CPUs."""
    from common.kernels import cpu_signature

    return cpu_signature()


PROJECT_ROOT = Path(__file__).resolve().parents[2]


def child_env(extra: dict | None = None) -> dict:
    """This environment plus `extra`, with the project on PYTHONPATH: what every process dpcompare starts
    (ranks, probes, samples) needs to import common/ and the backends from any working directory."""
    return {**os.environ, **(extra or {}),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(PROJECT_ROOT), os.environ.get("PYTHONPATH")]))}


def thread_env(threads: int) -> dict:
    """Threads per rank, set the same way for both frameworks (torchrun alone would force 1)."""
    n = str(threads)
    return {"OMP_NUM_THREADS": n, "OPENBLAS_NUM_THREADS": n, "MKL_NUM_THREADS": n,
            "VECLIB_MAXIMUM_THREADS": n, "TOKENIZERS_PARALLELISM": "false"}


def malloc_env() -> dict:
    """glibc: serve big allocations from the heap and never trim it, so the arrays a step frees are
    reused by the next step instead of being unmapped and faulted in again (benchmarks/bench_malloc.py)."""
    if not sys.platform.startswith("linux"):
        return {}
    return {"MALLOC_MMAP_THRESHOLD_": str(4 * 2**30), "MALLOC_TRIM_THRESHOLD_": str(64 * 2**30)}


def mpirun() -> str | None:
    return shutil.which("mpirun")


def libmpi() -> str | None:
    """The Open MPI library MLX should dlopen (Debian names it libmpi.so.40)."""
    for pattern in ("/usr/lib/*-linux-gnu/libmpi.so.40", "/usr/lib/*-linux-gnu/libmpi.so",
                    "/opt/homebrew/lib/libmpi.dylib", "/usr/local/lib/libmpi*.dylib"):
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    name = ctypes.util.find_library("mpi")
    return name


def mpirun_is_openmpi() -> bool:
    exe = mpirun()
    if not exe:
        return False
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "Open MPI" in out or "OpenRTE" in out


# Listening ports are chosen below the kernel's ephemeral range (Linux's ip_local_port_range, 32768-60999 by default;
# macOS's starts at 49152), which it never hands out by itself. A block chosen inside that range is free when chosen
# yet any process's outgoing connection can take it before the ranks bind it: a fresh-clone CI run lost test_stop's
# MLX ring rank 1 so ("[ring] Couldn't bind socket (error: 98)", stop 66). Below it, only another listener that
# chose the same block can, one chance in thousands.
LISTEN_PORTS_FROM = 20000


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768 where the system does not say)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port_block(count: int) -> int:
    """A base port such that base .. base+count-1 are free now, below the ephemeral range where there is room
    (LISTEN_PORTS_FROM), so concurrent runs and outgoing connections do not take them before the ranks bind."""
    low = _ephemeral_low()
    draw = random.SystemRandom()
    for _ in range(200):
        if low - count > LISTEN_PORTS_FROM:
            base = draw.randrange(LISTEN_PORTS_FROM, low - count + 1)
        else:  # an ephemeral range that starts low: the kernel's choice, checked as before
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                base = probe.getsockname()[1]
        if base + count >= 65535:
            continue
        if all(_port_free(base + i) for i in range(count)):
            return base
    raise RuntimeError(f"no block of {count} free ports found")


def _port_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def mlx_launch_command() -> list[str]:
    script = Path(sys.executable).with_name("mlx.launch")
    if script.exists():
        return [str(script)]
    found = shutil.which("mlx.launch")
    if found:
        return [found]
    return [sys.executable, "-c", "import sys; from mlx._distributed_utils.launch import main; sys.exit(main())"]


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def machine() -> dict:
    return {"host": platform.node(), "platform": platform.platform(), "machine": platform.machine(),
            "processor": cpu_model(), "cpus": cpu_count()}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
