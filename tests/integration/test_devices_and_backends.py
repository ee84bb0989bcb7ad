"""Macs and GPUs without the hardware: the stream MLX communicates on, the jaccl backends and both forms of
mlx.launch's hostfile, backends a build lacks, MPS with several torch ranks, and the end-of-run step check.
The command lines are checked as built; real runs here use the CPU."""
import json
import subprocess
import sys

import numpy as np
import pytest

from helpers import FAST, ROOT, dpcompare, losses

MESH = [  # what `mlx.distributed_config --backend jaccl` writes for three Macs cabled pairwise
    {"ssh": "mac1", "ips": ["10.0.0.1"], "rdma": [None, "rdma_en3", "rdma_en4"]},
    {"ssh": "mac2", "ips": ["10.0.0.2"], "rdma": ["rdma_en3", None, "rdma_en5"]},
    {"ssh": "mac3", "ips": ["10.0.0.3"], "rdma": ["rdma_en4", "rdma_en5", None]},
]


def write(path, data):
    path.write_text(json.dumps(data))
    return str(path)


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
def test_two_mlx_ranks_communicating_on_the_cpu_stream_train_like_one_rank(cache_dir, tmp_path):
    common = ("--framework", "mlx", "--steps", 6)
    dpcompare("run", *FAST, *common, "--nproc", 1, "--out", tmp_path / "one", cache_dir=cache_dir)
    dpcompare("run", *FAST, *common, "--nproc", 2, "--set", "communication_stream=cpu", "--out", tmp_path / "two",
              cache_dir=cache_dir)
    np.testing.assert_allclose(losses(tmp_path / "two"), losses(tmp_path / "one"), rtol=0, atol=1e-5)


# ---- jaccl, nccl and the hostfile forms --------------------------------------------------------


@pytest.mark.skipif(sys.platform == "darwin", reason="a Mac's MLX may have jaccl")
def test_a_backend_this_mlx_lacks_exits_2_with_one_line_before_anything_starts(cache_dir, tmp_path):
    two_macs = [{**MESH[0], "rdma": [None, "rdma_en3"]}, {**MESH[1], "rdma": ["rdma_en3", None]}]
    hostfile = write(tmp_path / "hosts.json", {"backend": "jaccl", "hosts": two_macs})
    proc = dpcompare("run", *FAST, "--framework", "mlx", "--nproc", 2, "--hostfile", hostfile, "--out",
                     tmp_path / "out", cache_dir=cache_dir, check=False)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "--backend jaccl" in proc.stderr and "has no jaccl backend" in proc.stderr
    assert not (tmp_path / "out").exists()
