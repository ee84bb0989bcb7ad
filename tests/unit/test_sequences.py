"""Samples cut from a token split: packed windows and padded documents, with masks that count exactly."""
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.errors import UserError
from common.data.sampler import GlobalSampler
from common.data.sequences import SequenceView
from common.data.tokencache import prepare_tokens


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    """Documents from a few words to a few hundred tokens, so short, exact and truncated samples all occur."""
    rng = random.Random(0)
    words = "the cat sat on a mat and then a dog ran to the park with a red ball".split()
    docs = [" ".join(rng.choice(words) for _ in range(rng.choice((1, 3, 8, 20, 60, 150)))) for _ in range(120)]
    folder = tmp_path_factory.mktemp("sequences")
    (folder / "docs.txt").write_text("\n\n".join(docs))
    cache = prepare_tokens(str(folder / "docs.txt"), "builtin", cache_dir=folder, val_fraction=0,
                           builtin_vocab_size=300, progress=False)
    return cache.split("train")


def document(split, i) -> np.ndarray:
    return np.asarray(split.tokens[split.offsets[i]:split.offsets[i + 1]])


def test_packed_windows_are_contiguous_and_cover_the_stream(split):
    view = SequenceView(split, 16, "packing")
    assert view.num_samples == (split.num_tokens - 1) // 16
    inputs, targets, mask = view.batch(np.arange(view.num_samples))
    stream = np.asarray(split.tokens)
    covered = view.num_samples * 16
    assert inputs.reshape(-1).tolist() == stream[:covered].tolist()
    assert targets.reshape(-1).tolist() == stream[1:covered + 1].tolist()
    assert np.array_equal(targets[:-1, -1], inputs[1:, 0])  # neighbours share one boundary token
    assert mask.dtype == np.float32 and mask.all()
    assert split.num_tokens - 1 - covered < 16  # less than one window left over


def test_batches_have_the_training_dtypes_and_shapes(split):
    for mode in ("packing", "padding"):
        inputs, targets, mask = SequenceView(split, 32, mode).batch([3, 0, 3])
        assert (inputs.dtype, targets.dtype, mask.dtype) == (np.int32, np.int32, np.float32)
        assert inputs.shape == targets.shape == mask.shape == (3, 32)
        assert inputs.flags.c_contiguous and targets.flags.c_contiguous
        assert np.array_equal(inputs[0], inputs[2])


def test_padded_samples_are_documents_with_masked_padding(split):
    seq_len = 24
    view = SequenceView(split, seq_len, "padding")
    assert view.num_samples == split.num_documents
    inputs, targets, mask = view.batch(np.arange(view.num_samples))
    saw_short = saw_truncated = False
    for i in range(view.num_samples):
        doc = document(split, i)
        kept = doc[:seq_len + 1]  # truncated to seq_len + 1 tokens
        real = len(kept) - 1
        assert inputs[i, :real].tolist() == kept[:-1].tolist()
        assert targets[i, :real].tolist() == kept[1:].tolist()
        assert mask[i].tolist() == [1.0] * real + [0.0] * (seq_len - real)
        assert (targets[i, real:] == split.pad_id).all() and (inputs[i, real + 1:] == split.pad_id).all()
        saw_short |= len(doc) < seq_len + 1
        saw_truncated |= len(doc) > seq_len + 1
        if len(doc) <= seq_len + 1:
            assert targets[i, real - 1] == split.eos_id  # a whole document ends on its EOS
    assert saw_short and saw_truncated


@settings(max_examples=60, deadline=None)
@given(seq_len=st.integers(1, 200), mode=st.sampled_from(["packing", "padding"]), data=st.data())
def test_real_target_count_equals_the_mask_sum(split, seq_len, mode, data):
    view = SequenceView(split, seq_len, mode)
    indices = data.draw(st.lists(st.integers(0, view.num_samples - 1), min_size=0, max_size=12))
    _, _, mask = view.batch(np.array(indices, dtype=np.int64))
    assert view.real_target_count(indices) == int(mask.sum())


def test_padding_counts_the_global_batch_across_ranks(split):
    """Each rank's share of the loss denominator adds up to the single-process count."""
    view = SequenceView(split, 32, "padding")
    step = GlobalSampler(view.num_samples, global_batch=8, seed=0).global_batch_indices(3)
    per_rank = [view.real_target_count(part) for part in np.split(step, 4)]
    assert sum(per_rank) == view.real_target_count(step) == int(view.batch(step)[2].sum())


def test_bad_settings_are_user_errors_and_bad_indices_index_errors(split):
    for seq_len in (0, -4, 2.5, True):
        with pytest.raises(UserError, match="sequence length"):
            SequenceView(split, seq_len)
    with pytest.raises(UserError, match="unknown sequence mode 'sliding'"):
        SequenceView(split, 8, "sliding")
    view = SequenceView(split, 8)
    with pytest.raises(IndexError):
        view.batch([view.num_samples])
    with pytest.raises(IndexError):
        view.real_target_count([-1])


def test_a_sequence_longer_than_the_split_has_no_samples(split):
    assert SequenceView(split, split.num_tokens, "packing").num_samples == 0
    assert SequenceView(split, split.num_tokens - 1, "packing").num_samples == 1
