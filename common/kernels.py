"""Which kernels an MLX rank computes with, where the choice depends on the machine: the build of its compiled
CPU kernels (--mlx-cpu-jit, compare/machine/environment.py) and its exp (--mlx-exp, mlx_impl/fast_exp.py). Read
by the rank (mlx_impl/step.py) and by doctor and the report (compare/machine/environment.py) alike.
"""
from __future__ import annotations

import platform
import shutil
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from common.config import RunConfig


def native_cpu_kernels(choice: str) -> bool:
    """Whether --mlx-cpu-jit `choice` builds MLX's compiled CPU kernels with -march=native on this machine
    (compare/machine/environment.py mlx_cpu_jit: Linux x86-64 with a g++)."""
    return choice != "baseline" and sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64") \
        and shutil.which("g++") is not None


def resolved_mlx_exp(cfg: RunConfig, device: str, system: str, native_kernels: bool) -> str:
    """The exp MLX's softmax, cross-entropy and SiLU use: "fused" (mlx_impl/fast_exp.py) or "native" (mx.exp).

    auto picks what measured faster (benchmarks/bench_exp.py and the tokens/s sittings in
    docs/cpu-performance.md): on a Linux CPU, fused where MLX's compiled exp is its baseline build (a libm call
    per element: 2x slower than the fused one); MLX's own with -march=native kernels (native_kernels:
    --mlx-cpu-jit gave them), where the fused exp's extra array costs what its faster arithmetic saves; MLX's
    own on Metal and CUDA (fast already) and on macOS (Accelerate)."""
    if cfg.mlx_exp != "auto":
        return cfg.mlx_exp
    if device != "cpu" or not system.startswith("linux"):
        return "native"
    return "native" if native_kernels else "fused"
