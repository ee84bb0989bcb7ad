"""--mlx-cpu-jit: MLX's fused CPU kernels (mx.compile) built for this CPU, with losses unchanged."""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys

import pytest

from common.errors import UserError
from compare.machine import environment as env
from helpers import FAST, dpcompare_here

LINUX_X86 = sys.platform == "linux" and platform.machine() == "x86_64"
needs_gxx = pytest.mark.skipif(not (LINUX_X86 and shutil.which("g++")), reason="needs Linux x86-64 with g++")


@needs_gxx
def test_native_puts_a_march_native_compiler_first_on_the_path_and_a_kernel_cache_of_its_own(tmp_path):
    description, extra = env.mlx_cpu_jit("native", tmp_path)
    wrapper_dir = extra["PATH"].split(os.pathsep)[0]
    assert description.startswith("native")
    assert extra["TMPDIR"].startswith(str(tmp_path)) and wrapper_dir.startswith(extra["TMPDIR"])
    # What the wrapper compiles for: this CPU's architecture, not the x86-64 baseline MLX asks for.
    target = subprocess.run([os.path.join(wrapper_dir, "g++"), "-Q", "--help=target"], capture_output=True,
                            text=True, check=True).stdout
    march = next(line.split()[-1] for line in target.splitlines() if line.strip().startswith("-march="))
    assert march not in ("x86-64", "native"), march
    assert env.mlx_cpu_jit("auto", tmp_path) == (description, extra)  # idempotent: the same wrapper again
    assert env.mlx_cpu_jit("baseline", tmp_path)[1] == {}


def test_native_without_a_compiler_is_refused_and_auto_falls_back(tmp_path, monkeypatch):
    monkeypatch.setattr(env.shutil, "which", lambda name: None)
    if LINUX_X86:
        with pytest.raises(UserError, match="g\\+\\+ not found"):
            env.mlx_cpu_jit("native", tmp_path)
    description, extra = env.mlx_cpu_jit("auto", tmp_path)
    assert description.startswith("baseline") and extra == {}


def test_an_unknown_choice_exits_2_with_one_line(cache_dir, tmp_path):
    proc = dpcompare_here("run", "--framework", "mlx", "--mlx-cpu-jit", "fast", *FAST, "--steps", "1",
                          "--out", tmp_path / "r", cache_dir=cache_dir)
    assert proc.returncode == 2 and "mlx_cpu_jit" in proc.stderr.replace("-", "_") and "Traceback" not in proc.stderr
