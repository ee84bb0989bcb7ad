"""The token cache: tokenized once, exactly, reused when nothing changed, rejected when damaged."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from common.errors import UserError
from common.data.tokencache import TokenCache, describe, prepare_tokens
from common.data.tokenwriter import token_dtype
from common.data.tokenizer import load_tokenizer

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
STORIES, GPT2 = DATA / "tinystories" / "train.txt", DATA / "gpt2"
STORIES_TOKENS, STORIES_DOCS = 500_462, 2_317  # shared/data/README.md, before EOS
REPO = Path(__file__).resolve().parents[2]
SMALL = {"builtin_bytes": 60_000, "builtin_vocab_size": 400, "progress": False}


def needs_real_data():
    if not (STORIES.is_file() and GPT2.is_dir()):
        pytest.skip(f"real data not found under {DATA}")


@pytest.fixture(scope="module")
def stories_cache(tmp_path_factory):
    needs_real_data()
    return prepare_tokens(str(STORIES), str(GPT2), cache_dir=tmp_path_factory.mktemp("cache"), val_fraction=0,
                          progress=False)


@pytest.fixture(scope="module")
def gpt2_docs():
    from common.data.sources import load_documents

    needs_real_data()
    return load_documents(str(STORIES)).documents


# ---- the real thing: TinyStories with GPT-2 ------------------------------------------------------


def test_tinystories_with_gpt2_gives_the_known_token_count(stories_cache):
    meta = stories_cache.meta
    assert meta["num_documents"] == STORIES_DOCS
    assert meta["num_tokens"] == STORIES_TOKENS + STORIES_DOCS
    assert (meta["vocab_size"], meta["eos_id"], meta["pad_id"], meta["dtype"]) == (50257, 50256, 50256, "uint16")
    train = stories_cache.split("train")
    assert (train.num_documents, train.num_tokens) == (STORIES_DOCS, STORIES_TOKENS + STORIES_DOCS)
    assert isinstance(train.tokens, np.memmap) and train.tokens.dtype == np.uint16
    assert stories_cache.split("valid").num_documents == 0


def test_cached_tokens_equal_autotokenizer_per_document(stories_cache, gpt2_docs):
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(GPT2))
    train = stories_cache.split("train")
    for doc in (0, 1, 17, 1000, 2315, 2316):
        start, stop = int(train.offsets[doc]), int(train.offsets[doc + 1])
        assert train.tokens[start:stop].tolist() == reference(gpt2_docs[doc])["input_ids"] + [50256]
    assert np.count_nonzero(np.asarray(train.tokens) == 50256) == STORIES_DOCS  # no EOS inside stories


def test_default_validation_split_holds_out_every_100th_story(stories_cache, tmp_path):
    cache = prepare_tokens(str(STORIES), str(GPT2), cache_dir=tmp_path, progress=False)
    train, valid = cache.split("train"), cache.split("valid")
    assert train.num_documents + valid.num_documents == STORIES_DOCS
    assert valid.num_documents == 24  # stories 1, 101, ..., 2301
    assert train.num_tokens + valid.num_tokens == STORIES_TOKENS + STORIES_DOCS
    all_docs = stories_cache.split("train")
    assert valid.read(0, int(valid.offsets[1])).tolist() == all_docs.read(
        int(all_docs.offsets[1]), int(all_docs.offsets[2])).tolist()
    assert cache.meta["splits"]["valid"]["num_documents"] == 24
    assert cache.path != stories_cache.path


def test_meta_records_what_ranks_and_compare_need(stories_cache):
    meta = stories_cache.meta
    for key in ("num_documents", "num_tokens", "vocab_size", "dtype", "eos_id", "pad_id", "splits", "tokenizer",
                "source", "tokens_per_s", "created", "fingerprint"):
        assert key in meta, key
    assert meta["source"]["sha256"] == "5352b299dcb1a32898b2d779b145b5a05f3e1265953fd21c264c9f9f9c9ae33d"
    assert meta["tokens_per_s"] > 0
    reloaded = load_tokenizer(str(stories_cache.tokenizer_path), cache_dir=stories_cache.path)
    assert reloaded.fingerprint == meta["tokenizer"]["fingerprint"]
    assert reloaded.encode_batch(["Once upon a time"]) == [[7454, 2402, 257, 640]]
    report = describe(stories_cache)
    assert str(stories_cache.path) in report and "2,317 documents" in report and "502,779 tokens" in report


# ---- reuse and invalidation ----------------------------------------------------------------------


def test_second_prepare_reuses_the_cache_without_training_or_reading(tmp_path, monkeypatch):
    import common.data.sources
    import common.data.tokenizer

    first = prepare_tokens("builtin", "builtin", cache_dir=tmp_path, **SMALL)
    mtime = (first.path / "train.bin").stat().st_mtime_ns

    def forbidden(*args, **kwargs):
        raise AssertionError("a cache hit must not load documents or train a tokenizer")

    monkeypatch.setattr(common.data.tokenizer, "_train_bpe", forbidden)
    monkeypatch.setattr(common.data.sources, "load_documents", forbidden)
    second = prepare_tokens("builtin", "builtin", cache_dir=tmp_path, **SMALL)
    assert second.path == first.path and second.meta == first.meta
    assert (second.path / "train.bin").stat().st_mtime_ns == mtime
    assert [p.name for p in (tmp_path / "tokens").iterdir()] == [first.path.name]  # no leftovers


def test_changed_data_or_tokenizer_or_options_give_a_new_cache(tmp_path):
    needs_real_data()
    data = tmp_path / "stories.txt"
    data.write_text("Tom had a red ball.\n\nLily saw a big dog.\n\nThe end.")
    paths = {prepare_tokens(str(data), str(GPT2), cache_dir=tmp_path, progress=False).path}
    paths.add(prepare_tokens(str(data), str(GPT2), cache_dir=tmp_path, progress=False, val_fraction=0).path)
    builtin = load_tokenizer("builtin", corpus_docs=["Tom had a red ball."] * 10, vocab_size=300, cache_dir=tmp_path)
    paths.add(prepare_tokens(str(data), builtin, cache_dir=tmp_path, progress=False).path)
    data.write_text("Tom had a red ball.\n\nLily saw a big cat.\n\nThe end.")
    changed = prepare_tokens(str(data), str(GPT2), cache_dir=tmp_path, progress=False)
    paths.add(changed.path)
    assert len(paths) == 4
    assert changed.meta["num_documents"] == 3


def test_builtin_seed_and_size_choose_the_cache(tmp_path):
    base = prepare_tokens("builtin", "builtin", cache_dir=tmp_path, **SMALL)
    reseeded = prepare_tokens("builtin", "builtin", cache_dir=tmp_path, seed=1, **SMALL)
    assert reseeded.path != base.path
    assert not np.array_equal(np.asarray(base.split("train").tokens[:50]),
                              np.asarray(reseeded.split("train").tokens[:50]))
    assert base.meta["vocab_size"] <= 400 and base.meta["eos_id"] == 0


def test_truncated_tokens_are_rejected_on_open_and_rebuilt_by_prepare(tmp_path):
    cache = prepare_tokens("builtin", "builtin", cache_dir=tmp_path, **SMALL)
    tokens = cache.path / "train.bin"
    with open(tokens, "r+b") as f:
        f.truncate(tokens.stat().st_size - 2)
    with pytest.raises(UserError, match="corrupt or truncated.*delete it or rerun prepare"):
        TokenCache.open(cache.path)
    rebuilt = prepare_tokens("builtin", "builtin", cache_dir=tmp_path, **SMALL)
    assert rebuilt.path == cache.path
    assert rebuilt.split("train").num_tokens == cache.meta["splits"]["train"]["num_tokens"]


def test_wrong_offsets_or_meta_are_rejected(tmp_path):
    cache = prepare_tokens("builtin", "builtin", cache_dir=tmp_path, **SMALL)
    offsets = np.load(cache.path / "train.idx")
    offsets[3], offsets[4] = offsets[4], offsets[3]
    with open(cache.path / "train.idx", "wb") as f:
        np.save(f, offsets)
    with pytest.raises(UserError, match="corrupt or truncated"):
        TokenCache.open(cache.path)
    (cache.path / "meta.json").write_text("{ torn")
    with pytest.raises(UserError, match="corrupt or truncated"):
        TokenCache.open(cache.path)
    with pytest.raises(UserError, match="no token cache"):
        TokenCache.open(tmp_path / "elsewhere")


def test_concurrent_prepares_publish_one_whole_cache(tmp_path):
    script = ("import sys; sys.path.insert(0, sys.argv[1]); from common.data.tokencache import prepare_tokens; "
              "print(prepare_tokens('builtin', 'builtin', cache_dir=sys.argv[2], builtin_bytes=300_000, "
              "progress=False).path)")
    env = dict(os.environ, RAYON_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", script, str(REPO), str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    outputs = [proc.communicate(timeout=120) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    assert outputs[0][0] == outputs[1][0]
    assert [p.name for p in (tmp_path / "tokens").iterdir()] == [Path(outputs[0][0].strip()).name]
    TokenCache.open(Path(outputs[0][0].strip()))


def test_a_build_that_loses_the_race_keeps_the_winner_and_discards_its_copy(tmp_path, monkeypatch):
    import common.data.tokencache

    winner = prepare_tokens("builtin", "builtin", cache_dir=tmp_path, **SMALL)
    created = winner.meta["created"]
    mtime = (winner.path / "train.bin").stat().st_mtime_ns
    real_reusable = common.data.tokencache._reusable
    calls = []

    def miss_once(path, fingerprint):  # as if the winner renamed its folder in while we were building
        calls.append(path)
        return None if len(calls) == 1 else real_reusable(path, fingerprint)

    monkeypatch.setattr(common.data.tokencache, "_reusable", miss_once)
    loser = prepare_tokens("builtin", "builtin", cache_dir=tmp_path, **SMALL)
    assert len(calls) == 2
    assert loser.path == winner.path and loser.meta["created"] == created
    assert (winner.path / "train.bin").stat().st_mtime_ns == mtime
    assert [p.name for p in (tmp_path / "tokens").iterdir()] == [winner.path.name]


# ---- the split API ---------------------------------------------------------------------------------


def test_splits_are_read_only_memory_maps(tmp_path):
    cache = prepare_tokens("builtin", "builtin", cache_dir=tmp_path, **SMALL)
    train = cache.split("train")
    assert isinstance(train.tokens, np.memmap) and train.offsets.dtype == np.int64
    with pytest.raises(ValueError):
        train.tokens[0] = 1
    assert train.read(5, 9).tolist() == train.tokens[5:9].tolist()
    starts, stops = train.document_spans(np.array([0, train.num_documents - 1]))
    assert starts.tolist() == [0, int(train.offsets[-2])] and stops[-1] == train.num_tokens
    assert all(train.tokens[stop - 1] == train.eos_id for stop in stops)
    with pytest.raises(UserError, match="unknown split"):
        cache.split("test")


def test_token_dtype_widens_only_past_65536_tokens():
    assert token_dtype(50257) == np.uint16 and token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32


# ---- user mistakes ------------------------------------------------------------------------------------


def test_empty_dataset_and_bad_fraction_are_user_errors(tmp_path):
    (tmp_path / "blank.txt").write_text("\n\n  \n")
    with pytest.raises(UserError, match="no documents"):
        prepare_tokens(str(tmp_path / "blank.txt"), "builtin", cache_dir=tmp_path, progress=False)
    with pytest.raises(UserError, match="validation fraction"):
        prepare_tokens("builtin", "builtin", cache_dir=tmp_path, val_fraction=0.9, **SMALL)
    with pytest.raises(UserError, match="does not exist"):
        prepare_tokens("./missing.jsonl", "builtin", cache_dir=tmp_path, progress=False)


def test_two_documents_give_both_splits(tmp_path):
    (tmp_path / "two.txt").write_text("first story here\n\nsecond story here")
    cache = prepare_tokens(str(tmp_path / "two.txt"), "builtin", cache_dir=tmp_path, builtin_vocab_size=300,
                           progress=False)
    assert (cache.split("train").num_documents, cache.split("valid").num_documents) == (1, 1)
    assert json.loads((cache.path / "meta.json").read_text())["num_documents"] == 2
