"""Tokenize a dataset once, then let every rank memory-map the result.

A cache folder `<cache_dir>/tokens/<fingerprint[:16]>/` holds, per split ("train", "valid"):
    <split>.bin     all token ids, each document followed by one EOS, and preceded by one BOS where the
                    tokenizer adds one (uint16, or uint32 for vocabularies above 65,536)
    <split>.idx     .npy int64 document offsets into <split>.bin, num_documents + 1 entries
plus tokenizer.json (a copy of the tokenizer, for ranks and `compare` to decode with) and meta.json.
The fingerprint covers the format version, the source's identity, the tokenizer's fingerprint, the
validation fraction, the split and the text field: change any and a new cache is built.

A cache is built in a temporary folder beside its final place and renamed into place when complete,
so a folder under its final name is always whole; of two concurrent builds the first rename wins and
the other discards its copy.

Ranks never load a split into memory: `TokenSplit.tokens` is a read-only memmap, and `TokenSplit.read`
copies just the asked range with a positioned read, so the file's pages stay in the kernel's page
cache and out of the rank's resident set, however big the dataset.
"""
from __future__ import annotations

import datetime
import hashlib
import itertools
import json
import os
import secrets
import shutil
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from common.data.corpus import DEFAULT_CORPUS_BYTES
from common.errors import UserError
from common.fsutil import fsync_dir

FORMAT_VERSION = 1
SPLITS = ("train", "valid")
CHUNK_DOCS = 2000  # documents per encode_batch call: big enough to keep every core busy
PROGRESS_MIN_DOCS = 2000  # shorter jobs finish before a progress bar would tell anything
READ_CHUNK = 1 << 16  # offsets entries per read when checking a cache


# ---- reading a cache ---------------------------------------------------------------------------


@dataclass
class TokenSplit:
    name: str
    tokens: np.ndarray  # read-only np.memmap (a plain empty array for an empty split)
    offsets: np.ndarray  # int64 document offsets, num_documents + 1 entries, memory-mapped
    eos_id: int
    pad_id: int
    vocab_size: int
    _tokens_file: object = field(repr=False, default=None)
    _offsets_file: object = field(repr=False, default=None)

    @property
    def num_documents(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def read(self, start: int, stop: int) -> np.ndarray:
        """A copy of tokens[start:stop]."""
        return _pread(self._tokens_file, self.tokens, start, stop)

    def document_spans(self, documents: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(start, stop) token offsets of each document index, read without mapping the offsets file."""
        documents = np.asarray(documents, dtype=np.int64)
        spans = np.empty((len(documents), 2), dtype=np.int64)
        for row, doc in enumerate(documents.tolist()):
            spans[row] = _pread(self._offsets_file, self.offsets, doc, doc + 2)
        return spans[:, 0], spans[:, 1]


@dataclass
class TokenCache:
    path: Path
    meta: dict

    @classmethod
    def open(cls, path: Path) -> "TokenCache":
        path = Path(path)
        meta_path = path / "meta.json"
        if not meta_path.is_file():
            raise UserError(f"no token cache at {str(path)!r} (meta.json missing); run prepare first")
        try:
            meta = json.loads(meta_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise _corrupt(path, "meta.json is not valid JSON") from None
        if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
            raise _corrupt(path, f"format version {meta.get('format_version') if isinstance(meta, dict) else None}"
                                 f" is not {FORMAT_VERSION}")
        cache = cls(path, meta)
        for name in SPLITS:
            cache._check_split(name)
        return cache

    @property
    def fingerprint(self) -> str:
        return self.meta["fingerprint"]

    @property
    def tokenizer_path(self) -> Path:
        return self.path / self.meta["tokenizer"]["path"]

    def split(self, name: str) -> TokenSplit:
        if name not in SPLITS:
            raise UserError(f"unknown split {name!r}; a token cache has {', '.join(SPLITS)}")
        info = self.meta["splits"][name]
        dtype = np.dtype(self.meta["dtype"])
        tokens_path, offsets_path = self.path / info["tokens_file"], self.path / info["offsets_file"]
        tokens = (np.memmap(tokens_path, dtype=dtype, mode="r") if info["num_tokens"]
                  else np.zeros(0, dtype=dtype))  # mmap refuses empty files
        return TokenSplit(
            name=name, tokens=tokens, offsets=np.load(offsets_path, mmap_mode="r"),
            eos_id=self.meta["eos_id"], pad_id=self.meta["pad_id"], vocab_size=self.meta["vocab_size"],
            _tokens_file=open(tokens_path, "rb", buffering=0), _offsets_file=open(offsets_path, "rb", buffering=0))

    def _check_split(self, name: str) -> None:
        try:
            info = self.meta["splits"][name]
            num_documents, num_tokens = int(info["num_documents"]), int(info["num_tokens"])
            itemsize = np.dtype(self.meta["dtype"]).itemsize
            tokens_path = self.path / info["tokens_file"]
            offsets = np.load(self.path / info["offsets_file"], mmap_mode="r")
        except (KeyError, TypeError, ValueError, OSError) as e:
            raise _corrupt(self.path, f"{name} split unreadable: {e}") from None
        size = tokens_path.stat().st_size if tokens_path.is_file() else None
        if size != num_tokens * itemsize:
            raise _corrupt(self.path, f"{tokens_path.name} holds {size} bytes, meta.json says "
                                      f"{num_tokens} tokens of {itemsize} bytes")
        if offsets.dtype != np.int64 or offsets.shape != (num_documents + 1,):
            raise _corrupt(self.path, f"{info['offsets_file']} does not hold {num_documents + 1} int64 offsets")
        if not _offsets_valid(self.path / info["offsets_file"], offsets, num_tokens):
            raise _corrupt(self.path, f"{info['offsets_file']} offsets do not rise from 0 to {num_tokens}")


def describe(cache: TokenCache) -> str:
    """A few lines for `dpcompare prepare` to print."""
    meta = cache.meta
    source = meta["source"]
    source_text = ", ".join(f"{k} {str(v)[:12] if k == 'sha256' else v}" for k, v in source.items())
    lines = [
        f"token cache  {cache.path}",
        f"  dataset    {meta['dataset']} ({source_text})",
        f"  tokenizer  {meta['tokenizer']['name']}: vocab {meta['vocab_size']:,}, eos {meta['eos_id']}, "
        f"pad {meta['pad_id']}, stored as {meta['dtype']}",
    ]
    for name in SPLITS:
        info = meta["splits"][name]
        lines.append(f"  {name:<10} {info['num_documents']:,} documents, {info['num_tokens']:,} tokens")
    lines.append(f"  total      {meta['num_documents']:,} documents, {meta['num_tokens']:,} tokens "
                 "(each document's tokens + one EOS)")
    lines.append(f"  tokenized  {meta['num_tokens']:,} tokens in {meta['tokenize_s']:.2f} s "
                 f"({meta['tokens_per_s'] / 1e6:.2f} M tokens/s)")
    return "\n".join(lines)


def _corrupt(path: Path, why: str) -> UserError:
    return UserError(f"token cache {str(path)!r} is corrupt or truncated ({why}); delete it or rerun prepare")


def _pread(file, array: np.ndarray, start: int, stop: int) -> np.ndarray:
    if not 0 <= start <= stop <= len(array):
        raise IndexError(f"range [{start}, {stop}) outside 0..{len(array)}")
    if not hasattr(os, "pread"):  # Windows: no positioned reads, go through the mapping
        return np.array(array[start:stop])
    itemsize = array.dtype.itemsize
    data = os.pread(file.fileno(), (stop - start) * itemsize, getattr(array, "offset", 0) + start * itemsize)
    if len(data) != (stop - start) * itemsize:
        raise UserError(f"token file {file.name!r} was truncated while in use; rerun prepare")
    return np.frombuffer(data, dtype=array.dtype)


def _offsets_valid(path: Path, offsets: np.ndarray, num_tokens: int) -> bool:
    """Offsets start at 0, end at num_tokens and rise strictly (every document has at least its EOS).
    Read in small chunks rather than through the mapping, so opening a cache does not grow the RSS."""
    with open(path, "rb", buffering=0) as file:
        previous = -1
        for start in range(0, len(offsets), READ_CHUNK):
            chunk = _pread(file, offsets, start, min(start + READ_CHUNK, len(offsets)))
            if chunk[0] <= previous or np.any(np.diff(chunk) <= 0):
                return False
            previous = int(chunk[-1])
    return int(offsets[0]) == 0 and int(offsets[-1]) == num_tokens


# ---- building a cache --------------------------------------------------------------------------


def prepare_tokens(dataset: str, tokenizer, *, cache_dir: Path, split: str = "train", text_field: str = "text",
                   streaming: bool = False, val_fraction: float = 0.01, builtin_vocab_size: int = 2048,
                   builtin_bytes: int = DEFAULT_CORPUS_BYTES, seed: int = 0, progress: bool = True,
                   num_threads: int | None = None) -> TokenCache:
    """The token cache of `dataset` under `tokenizer` (a name for `load_tokenizer`, or a TokenizerInfo),
    built on first use. `seed` and `builtin_bytes` choose the builtin corpus; `builtin_vocab_size` the
    builtin tokenizer's size. `num_threads` caps the encoder's threads, if set before its first use."""
    from common.data.sources import load_documents, source_identity
    from common.data.tokenizer import TokenizerInfo, load_tokenizer

    every = validation_every(val_fraction)
    cache_dir = Path(cache_dir)
    identity = source_identity(dataset, split=split, text_field=text_field, builtin_bytes=builtin_bytes, seed=seed)
    tokenizer_key: str | dict[str, object]
    if isinstance(tokenizer, TokenizerInfo):
        info, tokenizer_key = tokenizer, tokenizer.fingerprint
    elif tokenizer == "builtin":
        # Trained on this very source, so the source identity and the size name it without training.
        info, tokenizer_key = None, {"builtin_vocab_size": builtin_vocab_size}
    else:
        info = load_tokenizer(tokenizer, cache_dir=cache_dir)
        tokenizer_key = info.fingerprint
    if info is not None and info.bos_id is not None:  # BOS before each document: other tokens, another cache
        tokenizer_key = {"fingerprint": info.fingerprint, "bos_id": info.bos_id}
    fingerprint = _fingerprint(identity, tokenizer_key, val_fraction, split, text_field)
    final = cache_dir / "tokens" / fingerprint[:16]
    if cached := _reusable(final, fingerprint):
        return cached

    documents: Iterable[str] = load_documents(dataset, split=split, text_field=text_field, streaming=streaming,
                                              builtin_bytes=builtin_bytes, seed=seed).documents
    total_documents = len(documents) if isinstance(documents, list) else None
    if info is None:
        documents, sample = _training_sample(documents, every)
        info = load_tokenizer("builtin", corpus_docs=sample, vocab_size=builtin_vocab_size, cache_dir=cache_dir)
    if num_threads:
        os.environ.setdefault("RAYON_NUM_THREADS", str(num_threads))

    final.parent.mkdir(parents=True, exist_ok=True)
    building = final.parent / f".tmp-{final.name}-{os.getpid()}-{secrets.token_hex(4)}"
    building.mkdir()
    try:
        long_job = total_documents is None or total_documents > PROGRESS_MIN_DOCS
        meta = _write_splits(building, documents, info, every, total_documents, show_progress=progress and long_job)
        if meta["num_documents"] == 0:
            raise UserError(f"dataset {dataset!r} is empty: it holds no documents")
        meta.update(format_version=FORMAT_VERSION, fingerprint=fingerprint,
                    created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    dataset=dataset, source=identity, split=split, text_field=text_field,
                    val_fraction=val_fraction)
        info.save(building / "tokenizer.json")
        _write_json_synced(building / "meta.json", meta)
        fsync_dir(building)
        _publish(building, final, fingerprint)
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return TokenCache.open(final)


def validation_every(val_fraction: float) -> int:
    """Document i is held out for validation when i % k == 1, k = round(1 / val_fraction); 0: none.
    Counting from 1 rather than 0 keeps document 0 in train, so any two documents give both splits."""
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) \
            or not 0 <= val_fraction <= 0.5:
        raise UserError(f"validation fraction must be between 0 and 0.5, got {val_fraction!r}")
    return round(1 / val_fraction) if val_fraction else 0


def is_validation(index: int, every: int) -> bool:
    return every > 0 and index % every == 1


def _fingerprint(identity: dict, tokenizer_key, val_fraction: float, split: str, text_field: str) -> str:
    key = {"format_version": FORMAT_VERSION, "source": identity, "tokenizer": tokenizer_key,
           "val_fraction": val_fraction, "split": split, "text_field": text_field}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def _reusable(path: Path, fingerprint: str) -> TokenCache | None:
    if not (path / "meta.json").is_file():
        return None
    try:
        cache = TokenCache.open(path)
    except UserError:  # damaged: rebuilt and swapped in by the caller
        return None
    return cache if cache.meta.get("fingerprint") == fingerprint else None


def _training_sample(documents, every: int) -> tuple[Iterable[str], list[str]]:
    """Leading train documents for the builtin tokenizer, and the documents to tokenize (a stream is
    buffered, then replayed)."""
    from common.data.tokenizer import BUILTIN_TRAINING_BYTES

    stream = iter(documents)
    head, head_bytes = [], 0
    for doc in stream:
        head.append(doc)
        head_bytes += len(doc)
        if head_bytes >= BUILTIN_TRAINING_BYTES:
            break
    sample = [doc for i, doc in enumerate(head) if not is_validation(i, every)]
    return (documents if isinstance(documents, list) else itertools.chain(head, stream)), sample


def _chunks(documents: Iterable[str], size: int) -> Iterator[list[str]]:
    stream = iter(documents)
    while chunk := list(itertools.islice(stream, size)):
        yield chunk


class _SplitWriter:
    """Appends documents' tokens (EOS included) to <split>.bin and remembers their lengths."""

    def __init__(self, directory: Path, name: str, dtype: np.dtype):
        self.directory, self.name, self.dtype = directory, name, dtype
        self.file = open(directory / f"{name}.bin", "wb")
        self.lengths: list[np.ndarray] = []

    def append(self, token_lists: list[list[int]]) -> int:
        lengths = np.fromiter(map(len, token_lists), dtype=np.int64, count=len(token_lists))
        flat = np.fromiter(itertools.chain.from_iterable(token_lists), dtype=self.dtype, count=int(lengths.sum()))
        self.file.write(flat.tobytes())
        self.lengths.append(lengths)
        return len(flat)

    def close(self) -> dict:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        lengths = np.concatenate([np.zeros(1, np.int64), *self.lengths])
        offsets = np.cumsum(lengths)
        with open(self.directory / f"{self.name}.idx", "wb") as f:  # a file object: np.save would add .npy
            np.save(f, offsets)
            f.flush()
            os.fsync(f.fileno())
        return {"num_documents": len(offsets) - 1, "num_tokens": int(offsets[-1]),
                "tokens_file": f"{self.name}.bin", "offsets_file": f"{self.name}.idx"}


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def _write_splits(directory: Path, documents: Iterable[str], info, every: int, total_documents: int | None,
                  *, show_progress: bool) -> dict:
    from tqdm import tqdm

    dtype = token_dtype(info.vocab_size)
    writers = {name: _SplitWriter(directory, name, dtype) for name in SPLITS}
    # disable=None: no bar when stderr is not a terminal (CI logs, pipes), as for the training bar.
    bar = tqdm(total=total_documents, unit="doc", desc="tokenizing", file=sys.stderr,
               disable=None if show_progress else True, leave=False)
    started, first = time.perf_counter(), 0
    for chunk in _chunks(documents, CHUNK_DOCS):
        token_lists = info.encode_batch(chunk)
        if info.bos_id is not None:
            token_lists = [[info.bos_id, *ids] for ids in token_lists]
        for ids in token_lists:
            ids.append(info.eos_id)
        if every:
            held_out = [is_validation(first + i, every) for i in range(len(chunk))]
            writers["valid"].append([ids for ids, out in zip(token_lists, held_out) if out])
            writers["train"].append([ids for ids, out in zip(token_lists, held_out) if not out])
        else:
            writers["train"].append(token_lists)
        first += len(chunk)
        bar.update(len(chunk))
    bar.close()
    splits = {name: writer.close() for name, writer in writers.items()}
    tokenize_s = time.perf_counter() - started
    num_tokens = sum(s["num_tokens"] for s in splits.values())
    return {
        "num_documents": sum(s["num_documents"] for s in splits.values()),
        "num_tokens": num_tokens,
        "vocab_size": info.vocab_size,
        "dtype": dtype.name,
        "eos_id": info.eos_id,
        "pad_id": info.pad_id,
        "bos_id": info.bos_id,
        "splits": splits,
        # Relative path: the cache folder can move.
        "tokenizer": {"name": info.name, "fingerprint": info.fingerprint, "path": "tokenizer.json"},
        "tokenize_s": round(tokenize_s, 4),
        "tokens_per_s": round(num_tokens / max(tokenize_s, 1e-9), 1),
    }


def _write_json_synced(path: Path, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


def _publish(building: Path, final: Path, fingerprint: str) -> None:
    """Rename the finished folder into place. If a whole cache got there first, keep it (the caller
    deletes ours); if a damaged one is there, move it aside and replace it."""
    try:
        os.rename(building, final)
    except OSError:
        if _reusable(final, fingerprint):
            return
        trash = final.parent / f".trash-{final.name}-{os.getpid()}-{secrets.token_hex(4)}"
        os.rename(final, trash)
        os.rename(building, final)
        shutil.rmtree(trash, ignore_errors=True)
    fsync_dir(final.parent)
