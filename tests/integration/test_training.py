"""Both backends train for real: multi-rank launches, DP and accumulation invariance, cross-framework
parity, switching framework at a checkpoint. Runs are real processes through the CLI, many of them the
session's `matrix` (conftest.py)."""

import numpy as np
import pytest

from helpers import FAST, dpcompare, losses, summary
from integration.runs import resumed_from, rewound
from compare.machine import environment

pytestmark = pytest.mark.slow
FRAMEWORKS = ["mlx", "torch"]


def run(cache_dir, out, *extra):
    dpcompare("run", *FAST, "--out", out, *extra, cache_dir=cache_dir)
    return losses(out)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_two_rank_run_trains_and_writes_the_schema(framework, cache_dir, tmp_path):
    out = tmp_path / "run"
    curve = run(cache_dir, out, "--framework", framework, "--nproc", 2, "--steps", 40, "--lr", "3e-3",
                "--eval-every", 20)
    assert len(curve) == 40
    assert np.mean(curve[-5:]) < np.mean(curve[:5]) - 0.5, "the loss should fall clearly"
    s = summary(out)
    assert s["status"] == "ok" and s["world_size"] == 2 and s["framework"] == framework
    assert s["backend"] == {"mlx": "ring", "torch": "gloo"}[framework]
    assert len(s["peak_rss_bytes"]) == 2 and all(v > 0 for v in s["peak_rss_bytes"])
    assert len(s["peak_mem_bytes"]) == 2 and all(v > 0 for v in s["peak_mem_bytes"])
    assert s["tokens_per_s"] > 0 and s["final_eval_loss"] is not None
    assert (out / "checkpoints" / "step_000040" / "model.safetensors").exists()
    # FAST's --no-link-probe: no all-reduce timed before training (the matrix's runs, which time theirs, are read
    # by test_plan.py, and a shaped link's by test_link.py and test_faults.py)
    assert s["config"]["link_probe"] is False and s["link"]["allreduce"] is None


@pytest.mark.skipif(environment.mpirun() is None, reason="Open MPI (mpirun) is not installed")
def test_two_rank_mlx_mpi_run_trains(cache_dir, tmp_path):
    curve = run(cache_dir, tmp_path / "mpi", "--framework", "mlx", "--nproc", 2, "--backend", "mpi",
                "--steps", 6)
    assert len(curve) == 6 and summary(tmp_path / "mpi")["backend"] == "mpi"


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("sequence", ["packing", "padding"])
def test_dp_invariance_two_ranks_equal_one_rank_with_the_same_global_batch(framework, sequence, matrix, padded):
    if sequence == "packing":  # the session's matrix packs, at 1 and 2 ranks
        one, two = losses(matrix.run(framework, 1)), losses(matrix.run(framework, 2))
    else:  # padded sequences, each rank accumulating 2 micro-batches (the session's runs: conftest.py)
        one, two = losses(padded(framework, 1, 2)), losses(padded(framework, 2, 2))
    np.testing.assert_allclose(two, one, rtol=0, atol=1e-5)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_accumulation_invariance_two_half_micro_batches_equal_one_batch(framework, padded):
    plain, accum = losses(padded(framework, 1, 1)), losses(padded(framework, 1, 2))  # padded sequences
    np.testing.assert_allclose(accum, plain, rtol=0, atol=1e-5)


@pytest.mark.parametrize("world", [1, 2])
def test_mlx_and_torch_agree_step_by_step_from_the_same_seed_checkpoint(world, matrix):
    mlx, torch = losses(matrix.run("mlx", world)), losses(matrix.run("torch", world))
    np.testing.assert_allclose(mlx, torch, rtol=0, atol=1e-4)


@pytest.mark.parametrize("first, second", [("mlx", "torch"), ("torch", "mlx")])
def test_switching_framework_at_a_checkpoint_continues_the_same_curve(first, second, uninterrupted, cache_dir,
                                                                    tmp_path):
    horizon = ("--lr-decay-steps", 20, "--lr", "1e-3")
    straight = losses(uninterrupted(second, "ddp", 1))  # 20 steps on the same horizon
    switched = rewound(uninterrupted(first, "ddp", 1), tmp_path / "switched")  # `first`'s first 10 steps
    resumed = run(cache_dir, switched, "--framework", second, "--steps", 20, "--resume", *horizon)
    assert len(resumed) == 20 and resumed_from(switched) == 10
    np.testing.assert_allclose(resumed, straight, rtol=0, atol=1e-4)
