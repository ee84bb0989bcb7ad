"""Macs and GPUs without the hardware: the stream MLX communicates on, the jaccl backends and both forms of
mlx.launch's hostfile, backends a build lacks, MPS with several torch ranks, and the end-of-run step check.
The command lines are checked as built; real runs here use the CPU."""
import subprocess
import sys

import numpy as np
import pytest

from helpers import FAST, ROOT, dpcompare, losses
from integration.runs import HORIZON


# ---- the communication stream -------------------------------------------------------------------


SPLIT_BY_DTYPE = """
import mlx.core as mx
from mlx_impl.comm import average_gradients
group = mx.distributed.init(backend="ring", strict=True)
r = group.rank() + 1.0
grads = {"w": mx.full((3,), r, dtype=mx.bfloat16), "layers": [{"b": mx.full((2,), 2 * r)}], "loss": mx.array(r)}
out = average_gradients(grads, group, 1 << 20, mx.cpu)
assert out["w"].dtype == mx.bfloat16 and out["layers"][0]["b"].dtype == mx.float32
assert out["w"].tolist() == [1.5] * 3 and out["layers"][0]["b"].tolist() == [3.0] * 2 and out["loss"].item() == 1.5
"""


def test_mixed_dtype_gradients_are_averaged_on_the_chosen_stream_keeping_tree_and_dtypes(tmp_path):
    # MLX itself falls back to one all-reduce per array for mixed dtypes and drops the stream there.
    cmd = [sys.executable, "-m", "compare.launch.spawn", "--ranks", "2", "--ring-hostfile", str(tmp_path / "ring.json"),
           "--", sys.executable, "-c", SPLIT_BY_DTYPE]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.slow
def test_two_mlx_ranks_communicating_on_the_cpu_stream_train_like_one_rank(uninterrupted, cache_dir, tmp_path):
    # one rank: the first 6 steps of the session's 20-step mlx run of the same LR horizon (conftest.py)
    one = losses(uninterrupted("mlx", "ddp", 1))[:6]
    dpcompare("run", *FAST, "--framework", "mlx", "--steps", 6, *HORIZON, "--nproc", 2,
              "--set", "communication_stream=cpu", "--out", tmp_path / "two", cache_dir=cache_dir)
    np.testing.assert_allclose(losses(tmp_path / "two"), one, rtol=0, atol=1e-5)


# ---- jaccl, nccl and the hostfile forms --------------------------------------------------------
