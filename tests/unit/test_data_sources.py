"""Where documents and tokenizers come from: local files and folders, the builtin corpus, the hub."""
import json
import time
from pathlib import Path

import pytest

from common.data.corpus import generate_stories
from common.errors import UserError
from common.data.sources import load_documents, source_identity
from common.data.tokenizer import load_tokenizer

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
STORIES, VALID, GPT2 = DATA / "tinystories" / "train.txt", DATA / "tinystories" / "valid.txt", DATA / "gpt2"
# From shared/data/README.md.
STORIES_SHA256 = "5352b299dcb1a32898b2d779b145b5a05f3e1265953fd21c264c9f9f9c9ae33d"


def needs(path: Path) -> None:
    if not path.exists():
        pytest.skip(f"real data not found: {path}")


# ---- plain text ---------------------------------------------------------------------------------


def test_tinystories_splits_on_endoftext_lines_into_2317_stories():
    needs(STORIES)
    docs = load_documents(str(STORIES))
    assert len(docs.documents) == 2317
    assert docs.documents[0].startswith("One day, a little girl named Lily")
    assert all(doc == doc.strip() and "<|endoftext|>" not in doc for doc in docs.documents)
    assert docs.identity == {"kind": "text", "sha256": STORIES_SHA256}


def test_blank_line_separated_text_gives_one_document_per_paragraph():
    needs(VALID)
    docs = load_documents(str(VALID)).documents
    assert len(docs) > 100
    assert all(doc and "\n\n" not in doc for doc in docs)


def test_text_without_endoftext_lines_splits_on_blank_lines(tmp_path):
    path = tmp_path / "doc.txt"
    path.write_text("  first story\nsecond line \n\n\n second story\n \t\nthird <|endoftext|> inline\n\n")
    assert load_documents(str(path)).documents == ["first story\nsecond line", "second story",
                                                   "third <|endoftext|> inline"]


def test_endoftext_lines_win_over_blank_lines(tmp_path):
    path = tmp_path / "doc.txt"
    path.write_text("a\n\nstill a\n<|endoftext|>\nb\r\n<|endoftext|>  \n\n<|endoftext|>\n")
    assert load_documents(str(path)).documents == ["a\n\nstill a", "b"]


# ---- structured files and folders --------------------------------------------------------------


ROWS = [{"text": " one ", "story": "uno", "n": 1}, {"text": "two", "story": "dos", "n": 2},
        {"text": "", "story": "tres", "n": 3}, {"text": None, "story": "cuatro", "n": 4}]


def test_jsonl_reads_the_text_field_and_drops_empty_rows(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in ROWS))
    assert load_documents(str(path)).documents == ["one", "two"]
    assert load_documents(str(path), text_field="story").documents == ["uno", "dos", "tres", "cuatro"]


def test_json_list_of_records_is_read_too(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(ROWS))
    assert load_documents(str(path), text_field="story").documents == ["uno", "dos", "tres", "cuatro"]


def test_json_lines_arrow_cannot_type_still_load_and_broken_json_is_a_user_error(tmp_path):
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text('{"text": "a", "id": 1}\n{"text": "b", "id": "two"}\n')
    assert load_documents(str(mixed)).documents == ["a", "b"]
    columns = tmp_path / "columns.json"
    columns.write_text('{"text": ["c", "d"]}')
    assert load_documents(str(columns)).documents == ["c", "d"]
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "a"\n')
    with pytest.raises(UserError, match="neither JSON Lines nor JSON"):
        load_documents(str(broken))
    (tmp_path / "scalars.json").write_text("[1, 2]")
    with pytest.raises(UserError, match="JSON records"):
        load_documents(str(tmp_path / "scalars.json"))
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(UserError, match="cannot read parquet"):
        load_documents(str(tmp_path / "junk.parquet"))


def test_parquet_reads_the_text_field(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    assert load_documents(str(path)).documents == ["one", "two"]
    assert load_documents(str(path), text_field="story").documents[-1] == "cuatro"


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_missing_text_field_names_the_available_fields(tmp_path, suffix):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / f"rows{suffix}"
    if suffix == ".jsonl":
        path.write_text("\n".join(json.dumps(row) for row in ROWS))
    else:
        pq.write_table(pa.Table.from_pylist(ROWS), path)
    with pytest.raises(UserError, match=r"no field 'body'.*n, story, text|no field 'body'.*text, story, n"):
        load_documents(str(path), text_field="body")


def test_a_non_text_field_is_a_user_error(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in ROWS))
    with pytest.raises(UserError, match="holds int values, not text"):
        load_documents(str(path), text_field="n")


def test_save_to_disk_folders_load_with_their_split(tmp_path):
    import datasets

    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "single"))
    assert load_documents(str(tmp_path / "single"), text_field="story").documents[0] == "uno"
    pair = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"body": ["t1", "t2"]}),
                                 "validation": datasets.Dataset.from_dict({"body": ["v1"]})})
    pair.save_to_disk(str(tmp_path / "pair"))
    assert load_documents(str(tmp_path / "pair"), text_field="body").documents == ["t1", "t2"]
    assert load_documents(str(tmp_path / "pair"), split="validation", text_field="body").documents == ["v1"]
    with pytest.raises(UserError, match="no split 'test'.*train, validation"):
        load_documents(str(tmp_path / "pair"), split="test", text_field="body")


def test_a_folder_of_data_files_reads_those_of_the_split(tmp_path):
    (tmp_path / "data-train.txt").write_text("a\n\nb")
    (tmp_path / "data-valid.txt").write_text("c")
    (tmp_path / "notes.md").write_text("ignored")
    assert load_documents(str(tmp_path)).documents == ["a", "b"]
    assert load_documents(str(tmp_path), split="valid").documents == ["c"]


def test_identity_follows_the_content_not_the_name(tmp_path):
    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_text("same")
    second.write_text("same")
    assert source_identity(str(first)) == source_identity(str(second))
    second.write_text("changed")
    assert source_identity(str(first)) != source_identity(str(second))


# ---- user mistakes -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["./missing", "missing.txt", "data/nothing/here.jsonl", "/no/such/dir",
                                  "a/b/c"])
def test_a_missing_path_is_reported_as_missing(name):
    with pytest.raises(UserError, match="does not exist"):
        load_documents(name)


def test_an_empty_file_is_a_user_error(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(UserError, match="is empty"):
        load_documents(str(tmp_path / "empty.txt"))
    (tmp_path / "blank.txt").write_text("\n  \n\n<|endoftext|>\n")
    with pytest.raises(UserError, match="holds no documents"):
        load_documents(str(tmp_path / "blank.txt"))


def test_unsupported_file_types_and_binary_text_are_user_errors(tmp_path):
    (tmp_path / "data.csv").write_text("text\nhello")
    with pytest.raises(UserError, match="unsupported type '.csv'"):
        load_documents(str(tmp_path / "data.csv"))
    (tmp_path / "data.txt").write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(UserError, match="not UTF-8"):
        load_documents(str(tmp_path / "data.txt"))


def test_an_unknown_hub_dataset_fails_fast_with_advice():
    started = time.monotonic()
    with pytest.raises(UserError, match="dpcompare-tests/no-such-dataset"):
        load_documents("dpcompare-tests/no-such-dataset")
    assert time.monotonic() - started < 30


# ---- the builtin corpus ------------------------------------------------------------------------


def test_builtin_corpus_is_deterministic_per_seed_and_about_the_size_asked():
    stories = generate_stories(100_000, seed=3)
    assert stories == generate_stories(100_000, seed=3)
    assert stories != generate_stories(100_000, seed=4)
    total = sum(map(len, stories))
    assert 100_000 <= total < 100_000 + max(map(len, stories))
    assert all(story.isascii() for story in stories)


def test_builtin_stories_keep_the_hero_s_pronouns():
    import re

    from common.data.corpus import GIRLS

    for story in generate_stories(50_000, seed=0):
        hero = re.search(r"(?:named|called) (\w+)", story).group(1)
        wrong = r"\b(he|him|his|himself)\b" if hero in GIRLS else r"\b(she|her|herself)\b"
        assert not re.search(wrong, story, re.IGNORECASE), story


def test_default_builtin_corpus_generates_quickly():
    started = time.perf_counter()
    stories = generate_stories(3_000_000, seed=0)
    assert time.perf_counter() - started < 2
    assert len(set(stories)) > 0.9 * len(stories)  # varied, not one story repeated


def test_builtin_dataset_identity_names_size_and_seed():
    assert source_identity("builtin", builtin_bytes=1000, seed=1) != source_identity("builtin", builtin_bytes=1000,
                                                                                    seed=2)
    assert len(load_documents("builtin", builtin_bytes=20_000, seed=1).documents) > 10
    with pytest.raises(UserError, match="positive"):
        load_documents("builtin", builtin_bytes=0)


# ---- tokenizers --------------------------------------------------------------------------------


def test_builtin_tokenizer_round_trips_and_is_trained_once(tmp_path):
    docs = generate_stories(200_000, seed=0)
    tokenizer = load_tokenizer("builtin", corpus_docs=docs, vocab_size=600, cache_dir=tmp_path)
    assert tokenizer.vocab_size <= 600
    assert tokenizer.decode(tokenizer.encode_batch(["<|endoftext|>"])[0]) == "<|endoftext|>"
    assert tokenizer.encode_batch(["<|endoftext|>"])[0] == [tokenizer.eos_id] == [tokenizer.pad_id]
    for text in (docs[0], docs[-1], 'Tom said, "Héllo 世界!"\n\tThe end.'):
        ids = tokenizer.encode_batch([text])[0]
        assert len(ids) < len(text.encode())
        assert tokenizer.decode(ids) == text
    [cached] = (tmp_path / "tokenizers").iterdir()
    again = load_tokenizer("builtin", corpus_docs=docs, vocab_size=600, cache_dir=tmp_path)
    assert again.fingerprint == tokenizer.fingerprint
    assert list((tmp_path / "tokenizers").iterdir()) == [cached]
    other = load_tokenizer("builtin", corpus_docs=docs, vocab_size=500, cache_dir=tmp_path)
    assert other.fingerprint != tokenizer.fingerprint


def test_builtin_tokenizer_rejects_a_tiny_vocab(tmp_path):
    with pytest.raises(UserError, match="vocab size"):
        load_tokenizer("builtin", corpus_docs=["a b c"], vocab_size=100, cache_dir=tmp_path)


def test_gpt2_from_a_folder_and_from_its_tokenizer_json_agree(tmp_path):
    needs(GPT2)
    folder = load_tokenizer(str(GPT2), cache_dir=tmp_path)
    file = load_tokenizer(str(GPT2 / "tokenizer.json"), cache_dir=tmp_path)
    for tokenizer in (folder, file):
        assert (tokenizer.vocab_size, tokenizer.eos_id, tokenizer.pad_id) == (50257, 50256, 50256)
        assert tokenizer.encode_batch(["Once upon a time"]) == [[7454, 2402, 257, 640]]
    assert folder.fingerprint == file.fingerprint


def test_unknown_hub_tokenizer_fails_fast(tmp_path):
    started = time.monotonic()
    with pytest.raises(UserError, match="dpcompare-tests/no-such-tokenizer"):
        load_tokenizer("dpcompare-tests/no-such-tokenizer", cache_dir=tmp_path)
    assert time.monotonic() - started < 30


def test_tokenizer_paths_that_do_not_load_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_tokenizer("./no/tokenizer.json", cache_dir=tmp_path)
    (tmp_path / "bad.json").write_text('{"not": "a tokenizer"}')
    with pytest.raises(UserError, match="cannot load tokenizer file"):
        load_tokenizer(str(tmp_path / "bad.json"), cache_dir=tmp_path)
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(UserError, match="cannot load tokenizer"):
        load_tokenizer(str(tmp_path / "empty_dir"), cache_dir=tmp_path)
