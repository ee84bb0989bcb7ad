"""--rank-shares (common/data/shares.py, docs/uneven.md): uneven shares of each global batch are whole sequences
cut deterministically, both data orders keep one global batch per step, and under global-tokens the ranks' scaled
gradients sum to one rank's whatever the shares (per-rank: they do not). No training process: the math in numpy."""
import numpy as np
import pytest

from common.config import RunConfig
from common.data.sampler import GlobalSampler, LengthSortedBatches, micro_batches
from common.data.shares import micro_sizes, parse_speeds, rank_sizes, speeds_to_shares
from common.errors import UserError
from common.train.normalization import GlobalTokens, PerRank


def test_shares_give_whole_sequences_in_proportion_with_the_remainder_placed_deterministically():
    assert rank_sizes(8, 2, (3, 1)) == (6, 2)
    assert rank_sizes(8, 2) == (4, 4)
    assert rank_sizes(7, 2, (1, 1)) == (4, 3)          # a tie: the lower rank takes the sequence left over
    assert rank_sizes(10, 3, (2, 1, 1)) == (5, 3, 2)   # 5, 2.5, 2.5: the tie again to the lower rank
    assert rank_sizes(9, 3, (1, 2, 3)) == (2, 3, 4)    # 1.5, 3, 4.5: the largest fractions first
    for g in range(2, 40):
        for shares in ((3, 1), (1, 2, 3), (0.7, 0.2, 0.1), (5, 5)):
            assert sum(rank_sizes(g, len(shares), shares)) == g


@pytest.mark.parametrize("order", ["dpcompare", "mlx-lm"])
def test_every_rank_takes_its_size_and_the_ranks_together_take_the_whole_global_batch(order):
    lengths = np.random.default_rng(0).integers(5, 50, size=64)
    sampler = (GlobalSampler(64, 8, seed=1) if order == "dpcompare"
               else LengthSortedBatches(64, 8, 1, lengths=lengths))
    for step in range(10):
        indices = sampler.global_batch_indices(step)
        sizes = rank_sizes(8, 2, (3, 1))
        parts = [sampler.rank_part(indices, r, 2, sizes) for r in range(2)]
        assert [len(p) for p in parts] == [6, 2]
        assert sorted(np.concatenate(parts)) == sorted(indices)
        # even shares are the old cut: a contiguous half, or mlx-lm's stride r, r + N, ...
        even = [sampler.rank_part(indices, r, 2) for r in range(2)]
        want = [indices[:4], indices[4:]] if order == "dpcompare" else [indices[0::2], indices[1::2]]
        for r, expected in enumerate(want):
            np.testing.assert_array_equal(even[r], expected)
            np.testing.assert_array_equal(sampler.rank_part(indices, r, 2, (4, 4)), expected)


def test_uneven_micro_steps_keep_every_sequence_the_first_ones_one_longer():
    assert micro_sizes(6, 4) == (2, 2, 1, 1)
    parts = micro_batches(np.arange(6), 4)
    assert [list(p) for p in parts] == [[0, 1], [2, 3], [4], [5]]
    assert [list(p) for p in micro_batches(np.arange(8), 2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def _token_grads(rows, weights, targets_per_row):
    """Per-token gradient of a softmax regression's cross-entropy: the tiny model of a rank's backward."""
    x, y, mask = rows
    logits = x @ weights
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    p[np.arange(len(y)), y] -= 1
    return x.T @ (p * mask[:, None]), float(mask.sum())


@pytest.mark.parametrize("shares, grad_accum", [((3, 1), 1), ((3, 1), 2), ((2, 1, 1), 1), ((5, 2, 1), 2)])
def test_global_tokens_sum_over_uneven_ranks_equals_one_rank_and_per_rank_does_not(shares, grad_accum):
    rng = np.random.default_rng(3)
    g, seq = 16, 6
    x, y = rng.normal(size=(g, seq, 5)), rng.integers(0, 7, size=(g, seq))
    mask = (rng.random((g, seq)) < 0.6).astype(np.float64)  # masked prompts: unequal counts per rank
    w = rng.normal(size=(5, 7))
    rows = lambda idx: (x[idx].reshape(-1, 5), y[idx].reshape(-1), mask[idx].reshape(-1))  # noqa: E731
    whole, total = _token_grads(rows(np.arange(g)), w, None)
    one_rank = whole / total
    n, sizes = len(shares), rank_sizes(g, len(shares), shares)
    starts = np.cumsum((0,) + sizes)
    summed = {"global-tokens": 0.0, "per-rank": 0.0}
    for r in range(n):
        mine = np.arange(starts[r], starts[r + 1])
        micro = [_token_grads(rows(m), w, None) for m in micro_batches(mine, grad_accum)]
        grad, own = sum(gm for gm, _ in micro), sum(t for _, t in micro)
        for norm in (GlobalTokens(), PerRank()):
            summed[norm.name] = summed[norm.name] + grad * norm.gradient_scale(total, own, n) / n  # all-reduce mean
    np.testing.assert_allclose(summed["global-tokens"], one_rank, rtol=1e-12, atol=1e-14)
    assert np.abs(summed["per-rank"] - one_rank).max() > 1e-4


def _cfg(**kw):
    return RunConfig.from_dict({"nproc": 2, "global_batch_size": 8, **kw})


def test_the_config_gives_each_rank_its_size_and_the_largest_micro_batch():
    cfg = _cfg(rank_shares="3,1", grad_accum=2)
    assert cfg.rank_batch_sizes == (6, 2) and cfg.micro_batch_size == 3
    assert _cfg().rank_batch_sizes == (4, 4)
    assert _cfg(nproc=1, rank_shares="3,1").rank_batch_sizes == (8,)  # the N=1 reference of a comparison
    _cfg(rank_shares="3,1", lora_rank=4)  # LoRA under ddp takes shares
    _cfg(global_batch_size=7, rank_shares="4,3")  # no even split needed


@pytest.mark.parametrize("values, message", [
    ({"rank_shares": "3,1,1"}, "gives 3 shares for 2 ranks"),
    ({"rank_shares": "3,0"}, "every share must be positive"),
    ({"rank_shares": "3,-1"}, "every share must be positive"),
    ({"rank_shares": "3,x"}, "one positive weight per rank"),
    ({"rank_shares": "20,1"}, "leaves rank 1 0 of the 8 sequences"),
    ({"rank_shares": "3,1", "grad_accum": 2, "global_batch_size": 4}, "leaves rank 1 1 of the 4 sequences of a "
                                                                       "batch, fewer than its 2 micro-step"),
    ({"rank_shares": "3,1", "strategy": "fsdp"}, "ddp only .* --strategy fsdp"),
    ({"rank_shares": "3,1", "max_restarts": 1}, "ddp only .* --max-restarts"),
    ({"rank_speed": "2:0.5"}, "rank 2 is not one of the 2 ranks"),
    ({"rank_speed": "1:0"}, r"speed factor must be in \[0.05, 1\]"),
    ({"rank_speed": "1-0.5"}, "RANK:FACTOR"),
])
def test_bad_shares_and_speeds_are_user_errors_before_anything_starts(values, message):
    with pytest.raises(UserError, match=message):
        _cfg(**values)


def test_the_cli_exits_2_with_one_line_for_a_share_of_the_wrong_count(cache_dir, tmp_path):
    from helpers import dpcompare_here

    proc = dpcompare_here("run", "--framework", "torch", "--nproc", "2", "--rank-shares", "1,1,1", "--out",
                          tmp_path / "r", cache_dir=cache_dir)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, (proc.returncode, proc.stderr)
    assert not (tmp_path / "r").exists()


def test_auto_shares_follow_measured_speed_and_keep_a_sequence_per_micro_step():
    assert speeds_to_shares([0.1, 0.2], 12, 1) == (8, 4)
    assert speeds_to_shares([0.1, 10.0], 8, 2) == (6, 2)  # a very slow rank keeps one sequence per micro-step
    assert parse_speeds("1:0.5", 2) == {1: 0.5}


def test_rank_speed_goes_to_the_spawner_and_the_one_rank_reference_runs_at_full_speed(tmp_path):
    from compare.launch.launchers import build_command

    argv, _, _ = build_command(_cfg(framework="torch", rank_speed="1:0.5"), tmp_path)
    assert argv[argv.index("--rank-speed") + 1] == "1:0.5" and "compare.launch.spawn" in argv
    argv, _, _ = build_command(_cfg(framework="torch", rank_speed="1:0.5", nproc=1), tmp_path)
    assert "--rank-speed" not in argv


def test_the_report_names_the_slow_rank_and_the_shares_that_balance_it():
    from compare.report.uneven import balancing_sizes, rank_lines

    row = {"label": "torch x2", "rank_compute_s": [0.10, 0.20], "rank_wait_s": [0.11, 0.01], "rank_batch_sizes": [4, 4]}
    lines = rank_lines([row])
    assert lines[0].startswith("Ranks, torch x2: compute 100.0 / 200.0 ms, wait at the all-reduce 110.0 / 10.0 ms")
    assert "the slowest rank (1) costs 48% of the step" in lines[0]
    assert "rank 1 computes 2.00x as long as rank 0; --rank-shares 5,3 would balance them" in lines[1]
    assert balancing_sizes([0.3, 0.1], [6, 2]) == (4, 4)  # 20 sequences/s each: equally fast ranks, even shares
    assert len(rank_lines([{**row, "rank_compute_s": [0.10, 0.11], "rank_batch_sizes": [5, 3]}])) == 1  # no finding
    assert not rank_lines([{**row, "rank_compute_s": [0.10, 0.11]}])  # even shares, ranks of one speed: silent


def test_the_plan_predicts_even_and_best_shares_and_whether_the_slow_rank_is_worth_keeping():
    from compare.plan.uneven import uneven_plan, uneven_lines

    rows = [{"strategy": "ddp", "world_size": 1, "compute_s": 0.2, "step_s": 0.2},
            {"strategy": "ddp", "world_size": 2, "compute_s": 0.1, "step_s": 0.12}]
    plan = uneven_plan(rows, {1: 0.5}, 2, 12)
    assert plan["even_sizes"] == [6, 6] and plan["best_sizes"] == [8, 4]
    assert plan["even_step_s"] == pytest.approx(0.1 / 0.5 + 0.02)       # the slow rank sets the pace
    assert plan["best_step_s"] == pytest.approx(0.1 * 8 / 6 + 0.02)     # both ranks done together
    assert plan["without_step_s"] == pytest.approx(0.2) and plan["keep_slowest"]
    assert "best shares 8/4" in uneven_lines(plan)[0] and "keep it" in uneven_lines(plan)[1]
    assert not uneven_plan(rows, {1: 0.1}, 2, 12)["keep_slowest"]  # a tenth of the speed: leave it out


def test_a_polling_wait_slows_the_ranks_that_share_its_machine_and_no_others():
    from common.costmodel.links import polling_threads
    from compare.plan.command import shared_machines
    from compare.plan.uneven import Machines, finish_s, uneven_plan

    shared = Machines(ranks_per_machine=2, cores=2, threads=1, polling=2)
    # both compute on their own core for 1 s; then rank 1's one thread shares the 2 cores with rank 0's 2 pollers
    assert finish_s([1.0, 2.0], shared) == pytest.approx(1.0 + 1.0 / (2 / 3))
    assert finish_s([2.0, 2.0], shared) == pytest.approx(2.0)  # done together: nobody waits
    assert finish_s([1.0, 2.0], Machines()) == finish_s([1.0, 2.0], Machines(2, 2, 1, 0)) == 2.0  # cluster; blocking
    assert finish_s([1.0, 2.0], Machines(2, 4, 1, 2)) == 2.0  # cores to spare for the pollers
    # four ranks, two machines: rank 0's pollers slow rank 1 on its machine, not rank 3 on the other
    assert finish_s([1.0, 2.0, 2.0, 2.0], Machines(2, 2, 1, 2)) == pytest.approx(1.0 + 1.0 / (2 / 3))
    assert finish_s([1.0, 1.0, 1.0, 2.0], Machines(2, 2, 1, 2)) == pytest.approx(1.0 + 1.0 / (2 / 3))
    rows = [{"strategy": "ddp", "world_size": 1, "compute_s": 0.2, "step_s": 0.2},
            {"strategy": "ddp", "world_size": 2, "compute_s": 0.1, "step_s": 0.12}]
    plan = uneven_plan(rows, {1: 0.5}, 2, 12, shared)
    assert plan["even_step_s"] == pytest.approx(0.1 + 0.1 / (2 / 3) + 0.02)  # rank 1 waited on for its second half
    assert plan["best_step_s"] == uneven_plan(rows, {1: 0.5}, 2, 12)["best_step_s"]  # 8/4: done together
    assert polling_threads("mlx", "ring") > 0 and polling_threads("mlx", "mpi") == polling_threads("torch", "gloo") == 0
    summary = {"framework": "mlx", "machine": {"cpus": 2}, "threads_per_rank": 1, "device": "cpu"}
    assert shared_machines(summary, 2, "ring") == Machines(2, 2, 1, polling_threads("mlx", "ring"))
    assert shared_machines(summary, 1, "ring") == Machines()  # one rank per machine: a cluster
    assert shared_machines({**summary, "device": "cuda:0"}, 2, "ring") == Machines()
