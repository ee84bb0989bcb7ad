"""--mlx-cpu-jit: MLX's fused CPU kernels (mx.compile) built for this CPU, with losses unchanged."""
from __future__ import annotations

import importlib.util
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


@needs_gxx
def test_native_kernels_read_mlxs_preamble_precompiled_and_come_out_the_same_bytes(tmp_path):
    """The wrapper puts a .gch of MLX's kernel preamble first on the include path: a kernel as MLX writes one
    (its preamble, then an extern "C" function) compiled with MLX's flags uses it (`g++ -H` marks it `!`), and
    the library is byte for byte the one built from the header (every kernel of a `tiny` run: 33 of 33,
    0.78 s -> 0.19 s each, AMD EPYC Zen 4)."""
    _, extra = env.mlx_cpu_jit("native", tmp_path)
    wrapper = os.path.join(extra["PATH"].split(os.pathsep)[0], "g++")
    gch = list(tmp_path.glob("mlx-jit-native-*/pch/*/mlx/backend/cpu/compiled_preamble.h.gch"))
    assert len(gch) == 1 and gch[0].stat().st_size > 0
    include = os.path.join(list(importlib.util.find_spec("mlx").submodule_search_locations)[0], "include")
    kernel = tmp_path / "kernel.cpp"
    kernel.write_text('#include "mlx/backend/cpu/compiled_preamble.h"\nusing namespace mlx::core;\n'
                      'extern "C" void twice(float* x, int n) { for (int i = 0; i < n; ++i) x[i] = x[i] * 2.0f; }\n')
    flags = [*env.MLX_KERNEL_FLAGS, "-shared", "-I", include, str(kernel)]
    used = subprocess.run([wrapper, *flags, "-H", "-o", str(tmp_path / "a.so")], capture_output=True, text=True)
    assert used.returncode == 0 and f"! {gch[0]}" in used.stderr, used.stderr[-2000:]
    subprocess.run(["g++", "-march=native", *flags, "-o", str(tmp_path / "b.so")], capture_output=True, check=True)
    assert (tmp_path / "a.so").read_bytes() == (tmp_path / "b.so").read_bytes()
    assert env.mlx_cpu_jit("native", tmp_path)[1] == extra  # built once: the same wrapper and folder again


@needs_gxx
def test_a_precompiled_header_that_cannot_be_built_leaves_the_kernels_building_as_before(tmp_path):
    """A file where the header's folder should be (an unwritable cache alike): the run goes on without it."""
    root = tmp_path / f"mlx-jit-native-{env._cpu_signature()}{env.JIT_CACHE_GENERATION}"
    root.mkdir()
    (root / "pch").write_text("not a folder")
    description, extra = env.mlx_cpu_jit("native", tmp_path)
    wrapper = os.path.join(extra["PATH"].split(os.pathsep)[0], "g++")
    assert description == "native (-march=native, strided loops vectorised)" and " -I " not in open(wrapper).read()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MLX builds CPU kernels with g++ on Linux only")
def test_a_run_on_a_cold_kernel_cache_says_so_in_one_line_and_a_warm_one_does_not(tmp_path):
    from common.config import RunConfig
    from common.kernels import mlx_version
    from compare.machine.kernels import cold_start_line

    cfg = RunConfig(framework="mlx", cache_dir=str(tmp_path), mlx_cpu_jit="native")
    line = cold_start_line(cfg)
    assert line and "builds its CPU kernels" in line and "\n" not in line
    root = env.mlx_cpu_jit("native", tmp_path)[1].get("TMPDIR") or os.environ.get("TMPDIR", "/tmp")
    if not str(root).startswith(str(tmp_path)):
        pytest.skip("no g++: the kernels are built in the shared TMPDIR")
    folder = tmp_path.joinpath(root, "mlx", mlx_version(), "cpu")
    folder.mkdir(parents=True)
    (folder / "libkernel.so").write_bytes(b"")
    assert cold_start_line(cfg) is None
    assert cold_start_line(RunConfig(framework="torch", cache_dir=str(tmp_path))) is None
