"""Both backends train for real: multi-rank launches, DP and accumulation invariance, cross-framework
parity, switching framework at a checkpoint. Runs are real processes through the CLI, many of them the
session's `matrix` (conftest.py)."""
import json
import random

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


def prompt_completion_records(path, count=64):
    """Prompts of 0 to 30 words and completions of 1 to 12: each rank's share of a step holds its own number of
    completion targets, and some records are cut at --seq-len 32."""
    rng = random.Random(0)
    words = "the cat sat on a mat and then a dog ran to the park with a red ball".split()
    rows = [{"prompt": " ".join(rng.choice(words) for _ in range(rng.randint(0, 30))),
             "completion": " " + " ".join(rng.choice(words) for _ in range(rng.randint(1, 12)))} for _ in range(count)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_masked_prompts_two_ranks_equal_one_rank_under_global_tokens(framework, cache_dir, tmp_path):
    """--mask-prompt: each rank holds a different number of completion targets, and the loss over the global count
    (real_target_count, which every rank computes alone) is still what one rank computes."""
    from common.data.sampler import GlobalSampler
    from common.data.sequences import SequenceView
    from common.data.tokencache import TokenCache

    data = prompt_completion_records(tmp_path / "pairs.jsonl")
    flags = ("--framework", framework, "--dataset", data, "--mask-prompt", "--steps", 4, "--lr", "3e-3",
             "--profile-steps", 0)
    one, two = run(cache_dir, tmp_path / "n1", *flags), run(cache_dir, tmp_path / "n2", *flags, "--nproc", 2)
    np.testing.assert_allclose(two, one, rtol=0, atol=1e-5)
    # the steps' token counts are the completions' alone: the prompts were masked
    cache = json.loads((tmp_path / "n2" / "run_config.json").read_text())["token_cache"]
    view = SequenceView(TokenCache.open(cache).split("train"), 32, mask_prompt=True)
    steps = [GlobalSampler(view.num_samples, 8, 0).global_batch_indices(step) for step in range(4)]
    masked = [view.real_target_count(indices) for indices in steps]
    assert summary(tmp_path / "n2")["tokens_per_step"] == masked[-1]
    assert masked[-1] < SequenceView(view.split, 32).real_target_count(steps[-1])
    halves = [view.real_target_count(part) for part in np.split(steps[0], 2)]
    assert halves[0] != halves[1], "the ranks should hold different numbers of targets"
    assert summary(tmp_path / "n1")["truncated_records"] == view.truncated_records > 0


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
