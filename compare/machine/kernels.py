"""The launcher's side of `auto` for MLX's selectable CPU kernels (common/kernels.py): before the ranks start, the
candidates are timed once in a child with the ranks' environment (BLAS, kernel build, threads;
`python -m mlx_impl.kernel_choice`), unless the cache already holds them; the ranks then read the same cached
choice, and the BLAS line of summary.json, the report and doctor says what was chosen and why:
`exp: fused (measured: fused 5.5, native 7.3 ns per element)`.
"""
from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

from common.config import RunConfig
from common.errors import UserError
from common.kernels import CANDIDATES, PIN_ENV, Identity, KernelCache, describe, fixed_choice, measured_shape

from common.model.spec import ModelSpec

from . import environment as env

PROBE_TIMEOUT_S = 120  # a cold kernel cache builds a few kernels with g++ (0.2-0.8 s each)
LABELS = {"exp": "exp", "bf16_matmul": "bf16 matmul", "cross_entropy": "cross-entropy shift",
          "attention": "attention core"}
HOW = {"exp": {"native": "MLX's own", "fused": "range reduction and a polynomial, vectorised by mx.compile"},
       "bf16_matmul": {"native": "MLX's own bf16 kernel", "fp32": "exact upcast, sgemm, rounded once"},
       "cross_entropy": {"native": "MLX's row max, inside the exp"},
       "attention": {"whole": "all queries at once"}}


def mlx_device(cfg: RunConfig) -> str:
    """The device the MLX ranks compute on, as asked: a CPU unless a GPU is named (or on a Mac, by default)."""
    gpu = cfg.device in ("gpu", "cuda", "mps") or (sys.platform == "darwin" and cfg.device == "auto")
    return "gpu" if gpu else "cpu"


def described(cfg: RunConfig, kernel: str, spec: ModelSpec | None = None) -> str:
    """What `kernel` computes with in this run's MLX ranks, with the timings behind an `auto` choice. `spec`: the
    run's model, its vocabulary the tokenizer's (prepare_inputs); the cross-entropy's shape needs it."""
    fixed = fixed_choice(cfg, kernel, mlx_device(cfg), sys.platform)
    if fixed is not None:
        how = [HOW[kernel][fixed]] if fixed in HOW[kernel] else []
        if fixed_choice(cfg, kernel, mlx_device(cfg), sys.platform, pins=False) is None:
            how.append(f"pinned by {PIN_ENV}")
        return f"{fixed} ({'; '.join(how)})" if how else fixed
    if cfg.hostfile:  # other hosts: their ranks time it there, with their own CPU and kernels
        return "auto (timed by each host's ranks)"
    entry = _entry(cfg, kernel, spec)
    if entry is None:
        return "auto (timed by the ranks)"
    if "error" in entry:
        return f"auto (timed by the ranks; here: {entry['error']})"
    return describe(kernel, entry["choice"], entry)


def _entry(cfg: RunConfig, kernel: str, spec: ModelSpec | None) -> dict | None:
    """The cache entry of an `auto` kernel of this run (timed on a miss), None where its shape is not known here."""
    if kernel == "cross_entropy" and spec is None:
        return None  # its vocabulary is the tokenizer's, known once the inputs are prepared
    try:
        spec = spec or cfg.model_spec()
    except UserError:
        return None
    exp = "native"
    if kernel in ("cross_entropy", "attention"):  # timed with the run's exp
        exp = fixed_choice(cfg, "exp", mlx_device(cfg), sys.platform) or (_entry(cfg, "exp", spec) or {}).get(
            "choice", "native")
    shape = measured_shape(cfg, kernel, spec, exp)
    return _measured(cfg.mlx_cpu_jit, str(cfg.cache_path), cfg.mlx_blas, cfg.threads_per_rank, kernel, shape)


def timing_environment(cpu_jit: str, cache_dir: str, blas: str, threads: int) -> dict:
    """What the timing child adds to this environment: the ranks' threads, BLAS and kernel build, and the cache."""
    extra = {**env.thread_env(threads), **env.mlx_blas(blas, Path(cache_dir))[1], **env.mlx_cpu_jit(cpu_jit, Path(cache_dir))[1]}
    extra["DPCOMPARE_CACHE"] = cache_dir  # the child's cache folder (common/config.py default_cache_dir)
    return extra


@functools.lru_cache(maxsize=32)
def _measured(cpu_jit: str, cache_dir: str, blas: str, threads: int, kernel: str, shape: tuple[int, ...]) -> dict:
    """The cache entry of `kernel` at `shape`; timed in a child with the ranks' environment on a miss."""
    extra = timing_environment(cpu_jit, cache_dir, blas, threads)
    entry = KernelCache(cache_dir).get(Identity.here(cpu_jit, env.child_env(extra)), kernel, shape)
    if entry is not None:
        return entry
    argv = [sys.executable, "-m", "mlx_impl.kernel_choice", "--mlx-cpu-jit", cpu_jit,
            "--measure", f"{kernel}={','.join(map(str, shape))}"]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, env=env.child_env(extra), cwd=env.PROJECT_ROOT,
                             timeout=PROBE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": f"{type(exc).__name__}"}
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or ["no output"])[-1][:200]}
    try:
        return json.loads(out.stdout.strip().splitlines()[-1])[kernel]
    except (IndexError, KeyError, json.JSONDecodeError):
        return {"error": f"unreadable output: {out.stdout[-200:]!r}"}


def kernels_line(cfg: RunConfig, spec: ModelSpec | None = None) -> str:
    """The selectable kernels' part of the BLAS line: `exp: ...`, in a bfloat16 run `bf16 matmul: ...`, the
    cross-entropy's shift (timed at `spec`'s vocabulary: the run's model, where the launcher knows it), and in a
    float32 run the attention core's blocks."""
    kernels = [k for k in CANDIDATES if (k != "bf16_matmul" or cfg.dtype == "bfloat16")
               and (k != "attention" or cfg.dtype == "float32")]
    return "; ".join(f"{LABELS[k]}: {described(cfg, k, spec)}" for k in kernels)


# A cold start measured on a fresh clone (docs/install.md; AMD EPYC Zen 3, 2 cores): the demo's MLX x1 run for 2 steps
# took 20.7 s with no kernels built against 1.9 s with them, with g++'s precompiled preamble (native), and 42.7 s
# without it (baseline: g++ parses MLX's header again for every kernel).
COLD_BUILD_S = {"native": 20, "baseline": 45}


def cold_start_line(cfg: RunConfig) -> str | None:
    """One line before an MLX run whose CPU kernels are not built yet on this machine (MLX keeps what mx.compile
    builds in $TMPDIR/mlx/VERSION/cpu: the native build's TMPDIR is its own cache, environment.py mlx_cpu_jit), so
    that the minute of g++ before the first step is not a silent one; None where the cache holds kernels already,
    or the ranks build elsewhere (a hostfile, a GPU, macOS)."""
    import os
    import tempfile

    from common.kernels import mlx_version

    if cfg.framework != "mlx" or cfg.hostfile or mlx_device(cfg) != "cpu" or not sys.platform.startswith("linux"):
        return None
    build, jit_env = env.mlx_cpu_jit(cfg.mlx_cpu_jit, cfg.cache_path)
    root = jit_env.get("TMPDIR") or os.environ.get("TMPDIR") or tempfile.gettempdir()
    folder = Path(root) / "mlx" / mlx_version() / "cpu"
    if any(folder.glob("lib*.so")):
        return None
    seconds = COLD_BUILD_S["native" if build.startswith("native") else "baseline"]
    return (f"first MLX run with this kernel cache: MLX builds its CPU kernels with g++ before the first step "
            f"(about {seconds} s on 2 cores, once; kept in {folder})")
