"""CUDA: torch DDP over nccl, MLX on the GPU (mlx[cuda]) and over its nccl backend, and doctor --fabric's
nccl rows. Marked `gpu(n)`: skipped where fewer than n CUDA GPUs are present (tests/conftest.py), so they
run on a CUDA box and nowhere else. NCCL needs one GPU per rank, hence gpu(2) for two ranks."""
import re
import subprocess
import sys

import numpy as np
import pytest

from helpers import FAST, ROOT, dpcompare, losses, summary

pytestmark = pytest.mark.slow
STEPS = ("--steps", 6, "--lr", "1e-3")


def mlx_has_cuda() -> bool:
    code = "import mlx.core as mx; print(int(mx.cuda.is_available()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    return out.stdout.strip().endswith("1")


@pytest.mark.gpu(2)
def test_two_torch_ranks_train_with_nccl_on_cuda_like_one_rank(cache_dir, tmp_path):
    common = ("--framework", "torch", "--device", "cuda", *STEPS)
    dpcompare("run", *FAST, *common, "--nproc", 1, "--out", tmp_path / "one", cache_dir=cache_dir)
    dpcompare("run", *FAST, *common, "--nproc", 2, "--out", tmp_path / "two", cache_dir=cache_dir)
    s = summary(tmp_path / "two")
    assert s["backend"] == "nccl" and s["device"].startswith("cuda") and "device_note" not in s
    np.testing.assert_allclose(losses(tmp_path / "two"), losses(tmp_path / "one"), rtol=0, atol=1e-4)


@pytest.mark.gpu(1)
def test_mlx_trains_on_the_cuda_gpu_like_torch(cache_dir, tmp_path):
    if not mlx_has_cuda():
        pytest.skip("this MLX has no CUDA backend (pip install 'mlx[cuda]')")
    dpcompare("run", *FAST, "--framework", "mlx", "--device", "cuda", *STEPS, "--out", tmp_path / "mlx",
              cache_dir=cache_dir)
    dpcompare("run", *FAST, "--framework", "torch", "--device", "cuda", *STEPS, "--out", tmp_path / "torch",
              cache_dir=cache_dir)
    assert summary(tmp_path / "mlx")["device"] == "gpu"
    np.testing.assert_allclose(losses(tmp_path / "mlx"), losses(tmp_path / "torch"), rtol=0, atol=1e-3)


@pytest.mark.gpu(2)
def test_two_mlx_ranks_train_over_mlx_nccl_through_mlx_launch(cache_dir, tmp_path):
    if not mlx_has_cuda():
        pytest.skip("this MLX has no CUDA backend (pip install 'mlx[cuda]')")
    common = ("--framework", "mlx", "--device", "cuda", *STEPS)
    dpcompare("run", *FAST, *common, "--nproc", 1, "--out", tmp_path / "one", cache_dir=cache_dir)
    dpcompare("run", *FAST, *common, "--nproc", 2, "--out", tmp_path / "two", cache_dir=cache_dir)
    assert summary(tmp_path / "two")["backend"] == "nccl"
    np.testing.assert_allclose(losses(tmp_path / "two"), losses(tmp_path / "one"), rtol=0, atol=1e-4)


@pytest.mark.gpu(2)
def test_doctor_fabric_measures_nccl_between_two_gpus(cache_dir):
    proc = dpcompare("doctor", "--fabric", "--backend", "torch:nccl", "--max-mb", 8, "--time-budget-s", 50,
                     cache_dir=cache_dir, timeout=90)
    assert re.search(r"^torch nccl\s+2\s+cuda:0\s+[\d,]+ µs\s+[\d.]+ GB/s", proc.stdout, re.M), proc.stdout
