"""Which kernels a system OpenBLAS runs here, and the OPENBLAS_CORETYPE that fixes a wrong guess.

OpenBLAS built with DYNAMIC_ARCH (Debian's is) picks its kernels from CPUID at load time. A CPU it does not
know gets a generic core: on the Intel VM, which calls itself "Intel(R) Xeon(R) Processor", Debian's 0.3.21
chose Prescott (SSE3) and a 1024 fp32 matmul ran at 33 GFLOP/s instead of 151 with SKYLAKEX
(docs/cpu-performance.md). The core is asked of the library itself (`openblas_get_corename()`) in a child
process, with the environment MLX's ranks get, and a core below what the CPU's flags allow is replaced:
AVX-512 -> SKYLAKEX, AVX2 on AMD -> ZEN, AVX2 -> HASWELL. A user's own OPENBLAS_CORETYPE is never replaced.
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

# OpenBLAS's x86-64 cores by the widest vector kernels they use; a core not named is treated as pre-AVX2.
AVX512_CORES = frozenset({"skylakex", "cooperlake", "sapphirerapids"})
AVX2_CORES = frozenset({"haswell", "zen", "excavator", "skylake"})
PROBE_TIMEOUT_S = 30

_PROBE = ("import ctypes, sys; lib = ctypes.CDLL(sys.argv[1]); lib.openblas_get_corename.restype = ctypes.c_char_p;"
          " print(lib.openblas_get_corename().decode())")


def isa_level(flags: frozenset[str] | set[str]) -> int:
    """2: AVX-512 (the F, BW, DQ and VL parts SKYLAKEX's kernels use), 1: AVX2 with FMA, 0: older."""
    if {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= flags:
        return 2
    return 1 if {"avx2", "fma"} <= flags else 0


def core_level(core: str) -> int:
    name = core.lower()
    return 2 if name in AVX512_CORES else 1 if name in AVX2_CORES else 0


def choose_coretype(detected: str, flags: frozenset[str] | set[str], vendor: str) -> str | None:
    """The OPENBLAS_CORETYPE to set when OpenBLAS's own choice `detected` uses narrower kernels than this CPU
    has, else None. AMD's AVX2 CPUs get ZEN, Intel's HASWELL; every AVX-512 CPU SKYLAKEX (measured on Zen 4,
    whose own detection is Cooperlake: all AVX2 and AVX-512 cores within the run-to-run spread, Prescott
    a third of them; docs/cpu-performance.md)."""
    want = isa_level(flags)
    if core_level(detected) >= want:
        return None
    if want == 2:
        return "SKYLAKEX"
    return "ZEN" if vendor in ("AuthenticAMD", "HygonGenuine") else "HASWELL"


def cpu_flags_and_vendor() -> tuple[frozenset[str], str]:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return frozenset(), ""
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    vendor = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("vendor_id")), "")
    return frozenset(flags), vendor


@functools.lru_cache(maxsize=16)
def core_of(library: str, coretype: str | None) -> str | None:
    """The core `library` picks here with OPENBLAS_CORETYPE=coretype (None: its own detection); None when the
    library cannot be asked (not OpenBLAS, or it failed to load)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_CORETYPE", "LD_PRELOAD")}
    env["OPENBLAS_NUM_THREADS"] = "1"  # no thread pool for a question
    if coretype:
        env["OPENBLAS_CORETYPE"] = coretype
    try:
        out = subprocess.run([sys.executable, "-c", _PROBE, library], capture_output=True, text=True, env=env,
                             timeout=PROBE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    name = out.stdout.strip()
    return name if out.returncode == 0 and name else None


def kernels_for(library: str) -> tuple[str, dict]:
    """(description of the core the ranks will run, extra environment) for a preloaded `library`."""
    own = os.environ.get("OPENBLAS_CORETYPE")
    if own:
        core = core_of(library, own)
        return f"core {core or own} (OPENBLAS_CORETYPE={own}, yours){narrower_than_the_cpu(core)}", {}
    detected = core_of(library, None)
    if detected is None:
        return "core unknown (openblas_get_corename failed)", {}
    flags, vendor = cpu_flags_and_vendor()
    chosen = choose_coretype(detected, flags, vendor)
    if chosen is None:
        return f"core {detected}", {}
    core = core_of(library, chosen)
    if core is None or core_level(core) <= core_level(detected):  # this build lacks the core: keep its own
        return f"core {detected} (the CPU allows {chosen}; this OpenBLAS has no such core)", {}
    return f"core {core} (OPENBLAS_CORETYPE={chosen}: OpenBLAS's own detection chose {detected})", \
        {"OPENBLAS_CORETYPE": chosen}


def narrower_than_the_cpu(core: str | None) -> str:
    """", narrower than ..." where a user's own core uses narrower kernels than this CPU allows, else
    "". Their choice stands (they may have a reason); the line says what it costs to keep it: on the Zen 5, whose
    environment sets OPENBLAS_CORETYPE=Haswell, a 1024 fp32 matmul ran at 125 GFLOP/s against 226 with SKYLAKEX
    (docs/cpu-performance.md)."""
    if core is None:
        return ""
    flags, vendor = cpu_flags_and_vendor()
    wider = choose_coretype(core, flags, vendor)  # not asked of the library: the run does not switch to it
    if wider is None:
        return ""
    isa = "AVX-512" if isa_level(flags) == 2 else "AVX2"
    return f", narrower than this CPU's {isa}: unset it, or set {wider}"
