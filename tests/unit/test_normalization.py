"""The two loss normalizations (common/train/normalization.py) against what one rank computes over the whole batch:
global-tokens reproduces it at any split of the targets over the ranks, per-rank only where the ranks hold equal
counts (mlx-lm's choice; the N-vs-1 verdict labels the difference)."""
import numpy as np
import pytest

from common.train.normalization import NORMALIZATIONS, local_tokens, loss_parts, normalization


def split_losses(counts, seed=0):
    """Each rank's token losses, `counts[r]` of them."""
    rng = np.random.default_rng(seed)
    return [rng.uniform(0.5, 3.0, size=c) for c in counts]


def step_loss(name, per_rank):
    """The step's loss as the Trainers compute it: each rank's parts summed over the ranks, then normalized."""
    norm, dp = normalization(name), len(per_rank)
    global_tokens = sum(len(x) for x in per_rank)
    summed = sum(loss_parts(float(x.sum()), len(x)) for x in per_rank)
    return norm.loss(summed, global_tokens, dp)


def gradient_weights(name, counts):
    """The weight each token's loss gets in the averaged gradient: scale on its rank, divided by N."""
    norm, total = normalization(name), sum(counts)
    return [norm.gradient_scale(total, c, len(counts)) / len(counts) for c in counts]


@pytest.mark.parametrize("counts", [[5, 5], [3, 9], [1, 7, 2, 6]])
def test_global_tokens_computes_what_one_rank_computes_at_any_split(counts):
    per_rank = split_losses(counts)
    whole = np.concatenate(per_rank)
    assert step_loss("global-tokens", per_rank) == pytest.approx(whole.mean(), rel=1e-12)
    assert gradient_weights("global-tokens", counts) == pytest.approx([1 / sum(counts)] * len(counts))


def test_per_rank_equals_one_rank_only_where_the_counts_are_equal():
    equal, unequal = split_losses([6, 6]), split_losses([2, 10])
    assert step_loss("per-rank", equal) == pytest.approx(np.concatenate(equal).mean(), rel=1e-12)
    assert step_loss("per-rank", unequal) == pytest.approx((unequal[0].mean() + unequal[1].mean()) / 2, rel=1e-12)
    assert abs(step_loss("per-rank", unequal) - np.concatenate(unequal).mean()) > 1e-3
    # a token of the rank with 2 targets weighs 5x one of the rank with 10
    light, heavy = gradient_weights("per-rank", [2, 10])
    assert light / heavy == pytest.approx(5.0)


def test_at_one_rank_the_two_agree_and_a_rank_without_targets_adds_nothing():
    [losses] = split_losses([7])
    assert step_loss("per-rank", [losses]) == pytest.approx(step_loss("global-tokens", [losses]), rel=1e-12)
    assert normalization("per-rank").gradient_scale(10, 0, 2) == 0.0 and list(loss_parts(0.0, 0)) == [0.0, 0.0]
    assert set(NORMALIZATIONS) == {"global-tokens", "per-rank"}


def test_a_ranks_count_is_the_sum_of_its_micro_batches_masks():
    mask = np.array([[1, 1, 0], [1, 0, 0]], dtype=np.float32)
    batches = [(None, None, mask), (None, None, mask[:1])]
    assert local_tokens(batches) == 5.0


def test_the_n_vs_1_pair_of_a_per_rank_run_differs_by_the_normalization_and_a_global_one_fails(tmp_path):
    """The verdict's side (compare/report/parity.py): per-rank N=2 against N=1 (either normalization: at one rank
    they agree) is "differs", with the normalization named and the difference shown, and does not fail the
    comparison; the same curve under global-tokens is a real failure."""
    from compare.report.verdict_table import failure_lines
    from unit.fake_runs import judged, make_run, reference_losses

    apart = [x + 1e-4 for x in reference_losses()]
    one = make_run(tmp_path, "mlx", 1)
    per_rank = make_run(tmp_path, "mlx", 2, apart, config={"loss_normalization": "per-rank"})
    verdicts = judged(one, per_rank)
    [pair] = verdicts["dp_invariance"]
    assert (pair["verdict"], pair["explained_by"], verdicts["overall"]) == ("differs", "per-rank", "pass")
    [line] = [line for line in failure_lines(verdicts) if "mlx x2" in line]
    assert "differs from mlx x1 by 1.00e-04" in line and "--loss-normalization per-rank" in line
    global_tokens = make_run(tmp_path, "mlx", 2, apart, name="global")
    assert judged(one, global_tokens)["dp_invariance"][0]["verdict"] == "fail"
