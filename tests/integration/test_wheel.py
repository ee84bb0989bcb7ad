"""The wheel as a user installs it: built from the checkout, installed by pip into a fresh virtual environment
with constraints.txt, and run from a scratch directory outside the checkout with a relative --out.

What it proves is the wheel: its packages, the data they ship, its entry point and the child processes it
starts. The fresh venv sees the third-party packages `make install` put in the project's venv from the same
constraints (a .pth file naming that venv's site-packages, whose own .pth files, the editable install among
them, are not read): pip installing torch and the rest again cost 35 of this test's 54 s in CI.

It shares the session's cache (tests/conftest.py cache_dir): the token cache, the seed checkpoint and MLX's
compiled kernels of the matrix's shapes, which the xdist controller built before the workers started. Cold,
the same compare spends about 35 of its 46 s compiling MLX kernels (AMD EPYC Zen 4, 2 cores, idle).
"""
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from helpers import FAST, ROOT

pytestmark = pytest.mark.slow


def build_wheel(into) -> str:
    """`pip wheel` of the tracked and new files, copied out first so that setuptools' build/ and egg-info
    stay out of the checkout."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    src = into / "src"
    with tarfile.open(into / "src.tar", "w") as tar:
        for name in filter(None, files):
            if (ROOT / name).exists():
                tar.add(ROOT / name, arcname=name, recursive=False)
    with tarfile.open(into / "src.tar") as tar:
        tar.extractall(src, filter="tar")
    # -v shows the build backend's own output, where setuptools prints its deprecation warnings (a license
    # written as a TOML table was one, on every build).
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--wheel-dir", into / "dist", src],
                           check=True, capture_output=True, text=True)
    warned = [line for line in (built.stdout + built.stderr).splitlines() if "deprecat" in line.lower()]
    assert not warned, "\n".join(warned)
    (wheel,) = (into / "dist").glob("dpcompare-*.whl")
    return str(wheel)


def test_the_wheel_in_a_fresh_venv_compares_from_a_scratch_directory_with_a_relative_out(tmp_path, cache_dir):
    wheel = build_wheel(tmp_path)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    site = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    ours, theirs = (subprocess.run([python, "-c", site], capture_output=True, text=True, check=True).stdout.strip()
                    for python in (venv / "bin" / "python", sys.executable))
    (Path(ours) / "_dpcompare_test_deps.pth").write_text(theirs + "\n")  # the third-party packages (docstring)
    # Without the checkout on PYTHONPATH (a developer's shell may set it): pip would find its dpcompare.egg-info
    # there, call the wheel installed and write no `dpcompare` script.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    install = subprocess.run([venv / "bin" / "python", "-m", "pip", "install", "--quiet", "--no-compile", "-c",
                              ROOT / "constraints.txt", wheel], capture_output=True, text=True, env=env)
    assert install.returncode == 0, install.stderr[-3000:]
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    env.update(DPCOMPARE_CACHE=str(cache_dir), PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}")

    def dpcompare(*args):
        return subprocess.run(["dpcompare", *map(str, args)], cwd=scratch, env=env, capture_output=True, text=True,
                              timeout=600)

    version = re.search(r'^__version__ = "([^"]+)"', (ROOT / "compare" / "__init__.py").read_text(), re.M)
    assert dpcompare("--version").stdout.strip() == f"dpcompare {version.group(1)}"
    where = subprocess.run([venv / "bin" / "python", "-c", "import common, compare; print(common.__file__); "
                            "print(compare.__file__)"], cwd=scratch, env=env, capture_output=True, text=True)
    assert all(path.startswith(str(venv)) for path in where.stdout.split()), where.stdout  # not the checkout

    # FAST's shapes: the matrix now builds beside the other tests, so its compiled kernels are no reason to share
    # its larger ones; the wheel is what is checked, not the training.
    proc = dpcompare("compare", *FAST, "--steps", 6, "--profile-steps", 0, "--no-op-profile", "--nproc", "2",
                     "--out", "rel")
    assert proc.returncode == 0 and "verdict: parity PASS" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((scratch / "rel" / "summary.json").read_text())
    # two ranks of each framework: the wheel's launchers start ranks, and MLX vs torch is judged
    assert {r["label"] for r in summary["runs"]} == {"mlx x2", "torch x2"}
    for run in ("mlx-n2", "torch-n2"):  # the greedy continuation: a child of the wheel too
        assert json.loads((scratch / "rel" / run / "sample.json").read_text()).get("text"), run
    # The wheel brings MLX an OpenBLAS as the checkout does (compare/machine/blas.py), where the registry has one.
    mlx_run = json.loads((scratch / "rel" / "mlx-n2" / "summary.json").read_text())
    if sys.platform.startswith("linux") and os.uname().machine == "x86_64":
        assert mlx_run["blas_kind"] == "openblas" and mlx_run["blas_chosen"] == "auto", mlx_run["blas"]
