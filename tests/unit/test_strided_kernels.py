"""The strided kernels' unit-stride inner loop (compare/machine/strided_kernels.py): the rewrite of MLX's source, and
the kernels it builds giving the same bits as MLX's own loop, built with the same flags."""
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from compare.machine.environment import mlx_cpu_jit
from compare.machine.strided_kernels import MARK, rewrite

ROOT = Path(__file__).resolve().parents[2]

# As MLX 0.32.4 writes the demo's logits less their row max (its cache folder, mlx/0.32.4/cpu).
SUBTRACT_ROW_MAX = """#include "mlx/backend/cpu/compiled_preamble.h"
using namespace mlx::core;
extern "C"  {
void Cf4IBroadcastBDf4OSubtractAC_VV_f4f4_6142509188972423790_strided_2(int* shape, int64_t** strides, void** args) {
  float* A = (float*)args[0];
  const int64_t* A_strides = strides[1];
  float* B = (float*)args[1];
  const int64_t* B_strides = strides[2];
  float* C = (float*)args[2];
  for (int i0 = 0; i0 < shape[0]; ++i0) {
  for (int i1 = 0; i1 < shape[1]; ++i1) {
  float tmp_A = *A;
  float tmp_B = *B;
  float tmp_D = static_cast<float>(tmp_B);
  float tmp_C = Subtract()(tmp_A, tmp_D);
  *C++ = tmp_C;
  A += A_strides[1];
  B += B_strides[1];
  }
  A += A_strides[0];
  A -= A_strides[1] * shape[1];
  B += B_strides[0];
  B -= B_strides[1] * shape[1];
  }
}
}"""


def test_a_strided_kernel_gains_a_unit_stride_loop_and_keeps_its_own():
    out = rewrite(SUBTRACT_ROW_MAX)
    assert MARK in out
    assert "(A_strides[1] == 0 || A_strides[1] == 1) && (B_strides[1] == 0 || B_strides[1] == 1)" in out
    assert "const float* __restrict__ pB_ = B_broadcast_ ? B_buf_ : B + c_;" in out
    assert "pC_[j_] = tmp_C;" in out
    # MLX's loop is the other branch, whole: any stride still runs as MLX wrote it
    assert "  } else {\n  for (int i1 = 0; i1 < shape[1]; ++i1) {\n  float tmp_A = *A;" in out
    assert out.count("{") == out.count("}")
    assert rewrite(out) == out  # a kernel is rewritten once


@pytest.mark.parametrize("change", [
    lambda s: s.replace("_strided_2", "_contiguous"),  # a contiguous kernel: g++ vectorises it already
    lambda s: s.replace("  B += B_strides[1];\n", ""),  # an input the inner loop does not step
    lambda s: s.replace("float tmp_D = static_cast<float>(tmp_B);", "float tmp_D = *(B + 1);"),  # another read
])
def test_a_kernel_of_another_form_is_left_as_mlx_wrote_it(change):
    source = change(SUBTRACT_ROW_MAX)
    assert rewrite(source) == source


CHILD = """
import sys
import mlx.core as mx
import numpy as np
sys.path.insert(0, {root!r})
from mlx_impl import kernels

rng = np.random.default_rng(0)
x = mx.array(rng.standard_normal((37, 300)).astype(np.float32) * 30)
y = mx.array(rng.standard_normal((300, 37)).astype(np.float32))
w = mx.array(rng.standard_normal((300,)).astype(np.float32))
keep = mx.array(rng.random((37, 1)) > 0.3)
peak = x.max(axis=-1, keepdims=True)
cases = {{
    "row max subtracted": mx.compile(lambda x, p: (x - p) * 1.5)(x, peak),
    "weight over rows": mx.compile(lambda x, w: x * w + 1.0)(x, w),
    "transposed input": mx.compile(lambda x, y: x * y.T - 2.0)(x, y),
    "fused exp, shift inside": mx.compile(lambda x, p: kernels._exp_minus(x, p, "fused"))(x, peak),
    "select by row": mx.compile(lambda k, x: mx.where(k, x, -mx.inf) + 0.5)(keep, x),
    "short rows": mx.compile(lambda x, p: (x - p) * 1.5)(x[:, :9], peak),
}}
np.savez({out!r}, **{{k: np.array(v) for k, v in cases.items()}})
"""


NATIVE = pytest.mark.skipif(sys.platform != "linux" or platform.machine() != "x86_64" or not shutil.which("g++"),
                            reason="native MLX kernels are built on Linux x86-64 with a g++")


@pytest.fixture(scope="module")
def native(tmp_path_factory) -> dict:
    """The native wrapper's environment, built once for the module (its precompiled preamble takes 2 s)."""
    description, jit = mlx_cpu_jit("native", tmp_path_factory.mktemp("jit"))
    assert description.startswith("native")
    return jit


def _run(env: dict, out: Path) -> dict:
    subprocess.run([sys.executable, "-c", CHILD.format(root=str(ROOT), out=str(out))],
                   env={**os.environ, **env}, check=True, timeout=300)
    return dict(np.load(out))


@NATIVE
def test_rewritten_kernels_give_the_bits_of_mlxs_own_loop(tmp_path, native):
    pytest.importorskip("mlx.core")
    rewriting = native
    # The same wrapper without the rewrite: the same g++, flags and precompiled preamble.
    wrapper = Path(rewriting["PATH"].split(os.pathsep)[0]) / "g++"
    plain_root = tmp_path / "plain"
    (plain_root / "bin").mkdir(parents=True)
    plain_script = "\n".join(line for line in wrapper.read_text().splitlines() if not line.startswith("for a in"))
    (plain_root / "bin" / "g++").write_text(plain_script + "\n")
    (plain_root / "bin" / "g++").chmod(0o755)
    plain = {"PATH": os.pathsep.join([str(plain_root / "bin"), os.environ["PATH"]]), "TMPDIR": str(plain_root)}

    ours, mlx_own = _run(rewriting, tmp_path / "ours.npz"), _run(plain, tmp_path / "mlx.npz")
    for name in mlx_own:
        assert ours[name].view(np.uint32).tolist() == mlx_own[name].view(np.uint32).tolist(), name
    built = list((Path(rewriting["TMPDIR"]) / "mlx").rglob("*strided*.cpp"))
    assert built and all(MARK in f.read_text() for f in built), json.dumps([f.name for f in built])
    assert not any(MARK in f.read_text() for f in (plain_root / "mlx").rglob("*.cpp"))


@NATIVE
@pytest.mark.parametrize("rewritten", ["int broken(", "int f() { return 2; }\n"])
def test_the_wrapper_builds_mlxs_source_where_the_rewrite_does_not_compile(tmp_path, native, rewritten):
    script = (Path(native["PATH"].split(os.pathsep)[0]) / "g++").read_text()
    wrapper = tmp_path / "g++"
    fake = tmp_path / "fake_rewrite.py"  # stands in for strided_kernels.py: its source and .orig, as main() writes them
    fake.write_text("import sys, pathlib\np = pathlib.Path(sys.argv[1])\n"
                    "p.with_name(p.name + '.orig').write_text(p.read_text())\n"
                    f"p.write_text({rewritten!r})\n")
    assert str(Path(__file__).parents[2] / "compare" / "machine" / "strided_kernels.py") in script
    wrapper.write_text(script.replace(str(Path(__file__).parents[2] / "compare" / "machine" / "strided_kernels.py"),
                                      str(fake)))
    wrapper.chmod(0o755)
    source = tmp_path / "tmp_0123.cpp"  # MLX's temporary name; the wrapper hands only strided kernels to the rewrite
    source.write_text("int f() { return 1; }  // f_strided_1\n")
    built = subprocess.run([str(wrapper), "-std=c++17", "-O3", "-fPIC", "-shared", str(source), "-o",
                            str(tmp_path / "libkernel.so")], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    assert (tmp_path / "libkernel.so").is_file()
    assert not (tmp_path / "tmp_0123.cpp.orig").exists()
    # a rewrite that compiles is kept; one that does not gives MLX's source back, built as MLX wrote it
    assert source.read_text() == (rewritten if "return 2" in rewritten else "int f() { return 1; }  // f_strided_1\n")
