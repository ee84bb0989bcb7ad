"""The DP sampler: the global batch of every step is fixed by (seed, step), whatever the world size."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.errors import UserError
from common.data.sampler import GlobalSampler, check_divisible, micro_batches, rank_slice

layouts = st.sampled_from([(1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (4, 2)])


@settings(max_examples=60, deadline=None)
@given(num_samples=st.integers(16, 300), per_part=st.integers(1, 4), layout=layouts, layout2=layouts,
       seed=st.integers(0, 2**31), step=st.integers(0, 200))
def test_global_batch_is_identical_for_every_world_size(num_samples, per_part, layout, layout2, seed, step):
    (n1, a1), (n2, a2) = layout, layout2
    global_batch = per_part * n1 * a1 * n2 * a2
    if global_batch > num_samples:
        return
    seen = []
    for world, accum in (layout, layout2):
        sampler = GlobalSampler(num_samples, global_batch, seed)
        indices = sampler.global_batch_indices(step)
        parts = [m for r in range(world) for m in micro_batches(rank_slice(indices, r, world), accum)]
        seen.append(np.concatenate(parts))
    np.testing.assert_array_equal(seen[0], seen[1])


@settings(max_examples=40, deadline=None)
@given(num_samples=st.integers(8, 200), world=st.sampled_from([1, 2, 4]), seed=st.integers(0, 1000))
def test_rank_slices_are_disjoint_and_make_the_global_batch(num_samples, world, seed):
    global_batch = 2 * world
    if global_batch > num_samples:
        return
    sampler = GlobalSampler(num_samples, global_batch, seed)
    step = 3
    indices = sampler.global_batch_indices(step)
    slices = [rank_slice(indices, r, world) for r in range(world)]
    np.testing.assert_array_equal(np.concatenate(slices), indices)
    # Within an epoch no sample repeats; a step that straddles two epochs may meet a sample again.
    if sampler.epoch_of(step) == ((step + 1) * global_batch - 1) // num_samples:
        assert len(set(indices.tolist())) == global_batch


@settings(max_examples=30, deadline=None)
@given(num_samples=st.integers(4, 120), global_batch=st.integers(1, 8), seed=st.integers(0, 1000))
def test_each_epoch_visits_every_sample_once_and_epochs_reshuffle(num_samples, global_batch, seed):
    if global_batch > num_samples:
        return
    sampler = GlobalSampler(num_samples, global_batch, seed)
    steps = (2 * num_samples) // global_batch + 1
    stream = np.concatenate([sampler.global_batch_indices(k) for k in range(steps)])
    np.testing.assert_array_equal(np.sort(stream[:num_samples]), np.arange(num_samples))
    np.testing.assert_array_equal(np.sort(stream[num_samples:2 * num_samples]), np.arange(num_samples))
    if num_samples >= 8:
        assert not np.array_equal(sampler.permutation(0), sampler.permutation(1))


def test_a_resumed_sampler_sees_the_same_batches_as_an_uninterrupted_one():
    first = GlobalSampler(100, 8, seed=7)
    straight = [first.global_batch_indices(k) for k in range(30)]
    resumed = GlobalSampler(100, 8, seed=7)  # a new process, starting at step 17
    for k in range(17, 30):
        np.testing.assert_array_equal(resumed.global_batch_indices(k), straight[k])


def test_different_seeds_give_different_orders():
    a = GlobalSampler(1000, 8, seed=1).global_batch_indices(0)
    b = GlobalSampler(1000, 8, seed=2).global_batch_indices(0)
    assert not np.array_equal(a, b)


def test_global_batch_not_divisible_by_world_times_accum_is_a_user_error_naming_the_numbers():
    with pytest.raises(UserError, match=r"10 is not divisible by world size 2 x grad accum 3 = 6"):
        check_divisible(10, 2, 3)
    assert check_divisible(12, 2, 3) == 2


def test_a_dataset_smaller_than_one_global_batch_is_a_user_error():
    with pytest.raises(UserError, match="fewer than one global batch"):
        GlobalSampler(5, 8, seed=0)
