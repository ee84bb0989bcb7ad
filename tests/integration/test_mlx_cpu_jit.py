"""--mlx-cpu-jit: MLX's fused CPU kernels (mx.compile) built for this CPU, and --mlx-exp: MLX's exp or the fused
one (mlx_impl/fast_exp.py), with losses unchanged."""
from __future__ import annotations

import platform
import re
import shutil
import subprocess
import sys

import pytest

from helpers import FAST, dpcompare, losses, summary

LINUX_X86 = sys.platform == "linux" and platform.machine() == "x86_64"
needs_gxx = pytest.mark.skipif(not (LINUX_X86 and shutil.which("g++")), reason="needs Linux x86-64 with g++")


def without_exp(folder, names):
    return [name for name in names if "Exp" in name]


def copy_if_there(src: str, dst: str) -> None:
    """shutil.copy2, passing over a file that vanished since the folder was listed: another worker's MLX compiling
    into the shared cache writes and removes g++'s temporaries there (ccZiWf4g.cdtor.o; a CI failure, stop 62)."""
    try:
        shutil.copy2(src, dst)
    except FileNotFoundError:
        pass


@needs_gxx
def test_native_kernels_use_avx_and_both_exps_train_to_the_same_losses(cache_dir, tmp_path):
    """Two runs on tiny, 6 steps: baseline kernels with the fused exp, native kernels with MLX's own exp. Their
    losses agree to 3.0e-9 relative (measured, Zen 4; native against baseline kernels alone: 8e-9, a few
    kernels such as rsqrt differ in the last bit); the tolerance 1e-5 is the MLX-vs-torch per-step tolerance.
    So both exps run and train to the same losses, and the native kernels are the ones with AVX.

    The native run's cache starts as a copy of the session's native kernels (--mlx-cpu-jit auto built them for
    the other MLX runs) less every kernel with an exp (the softmax, SiLU and cross-entropy ones every step
    runs), so that it builds those few rather than all of them (about 13 s of g++ on 2 cores without the
    precompiled preamble): the kernels judged are the ones this run built."""
    copied = tmp_path / "cache-native"
    for kernels in cache_dir.glob("mlx-jit-native-*/mlx"):  # and the precompiled preamble beside them (pch/)
        shutil.copytree(kernels.parent, copied / kernels.parent.name, ignore=without_exp, copy_function=copy_if_there)
    assert not list(copied.glob("mlx-jit-native-*/mlx/*/cpu/*Exp*"))
    runs = {}
    for choice, exp in (("baseline", "fused"), ("native", "native")):
        out = tmp_path / choice
        dpcompare("run", "--framework", "mlx", "--mlx-cpu-jit", choice, "--mlx-exp", exp, *FAST, "--steps", "6",
                  "--out", out, cache_dir=tmp_path / f"cache-{choice}",
                  env={"DPCOMPARE_CACHE": str(tmp_path / f"cache-{choice}")})
        runs[choice] = losses(out)
        assert f"fused CPU kernels: {choice}" in summary(out)["blas"]
        assert f"exp: {exp} (" in summary(out)["blas"]
    kernels = sorted(copied.glob("mlx-jit-native-*/mlx/*/cpu/*Exp*.so"))
    assert kernels, "MLX built no kernel in dpcompare's cache: TMPDIR was not passed to the rank"
    assert not list((tmp_path / "cache-baseline").glob("mlx-jit-native-*"))
    if shutil.which("objdump"):
        code = "".join(subprocess.run(["objdump", "-d", str(k)], capture_output=True, text=True).stdout
                       for k in kernels)
        # VEX-encoded SIMD (vmulps, vfmadd...): AVX, which the baseline x86-64 ISA lacks. Not only %ymm: GCC's
        # tuning for some CPUs (AMD Zen 1: 128-bit AVX units) vectorises with AVX on %xmm registers.
        assert re.search(r"\tv[a-z0-9]+\s+[^\n]*%[xyz]mm", code), "no AVX instruction in the native kernels"
    print("native kernels and exp vs baseline kernels and fused exp, max relative loss difference:",
          max(abs(a - b) / abs(b) for a, b in zip(runs["native"], runs["baseline"])))
    assert runs["native"] == pytest.approx(runs["baseline"], rel=1e-5)
