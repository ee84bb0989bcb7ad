"""Tokenize a dataset once, then let every rank memory-map the result.

A cache folder `<cache_dir>/tokens/<fingerprint[:16]>/` holds, per split ("train", "valid"):
    <split>.bin     all token ids, each document followed by one EOS, and preceded by one BOS where the
                    tokenizer adds one (uint16, or uint32 for vocabularies above 65,536)
    <split>.idx     .npy int64 document offsets into <split>.bin, num_documents + 1 entries
    <split>.mask    instruction records only (common/data/instructions.py): one uint8 per token, 1 where it is
                    its record's prompt (what --mask-prompt leaves out of the loss); meta.json names it
plus tokenizer.json (a copy of the tokenizer, for ranks and `compare` to decode with) and meta.json.
The fingerprint covers the format version, the source's identity, the tokenizer's fingerprint, the
validation fraction, the split and the text field, and for JSON data the tokenizer folder's chat template:
change any and a new cache is built.

A cache is built in a temporary folder beside its final place and renamed into place when complete,
so a folder under its final name is always whole; of two concurrent builds the first rename wins and
the other discards its copy.

Ranks never load a split into memory: `TokenSplit.tokens` is a read-only memmap, and `TokenSplit.read`
copies just the asked range with a positioned read, so the file's pages stay in the kernel's page
cache and out of the rank's resident set, however big the dataset.
"""
from __future__ import annotations

import datetime
import functools
import hashlib
import json
import os
import secrets
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from common.data.corpus import DEFAULT_CORPUS_BYTES
from common.errors import UserError
from common.data.tokenwriter import (SPLITS, training_sample, validation_every,
                                    write_json_synced, write_splits)
from common.fsutil import fsync_dir

FORMAT_VERSION = 1
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
    prompt_mask: np.ndarray | None = None  # instruction records: uint8 per token, 1 = prompt (memmap); else None
    _tokens_file: object = field(repr=False, default=None)
    _offsets_file: object = field(repr=False, default=None)
    _mask_file: object = field(repr=False, default=None)

    @property
    def num_documents(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def read(self, start: int, stop: int) -> np.ndarray:
        """A copy of tokens[start:stop]."""
        return _pread(self._tokens_file, self.tokens, start, stop)

    def read_prompt_mask(self, start: int, stop: int) -> np.ndarray:
        """A copy of prompt_mask[start:stop] (1: a prompt token); instruction records only."""
        if self.prompt_mask is None:
            raise ValueError(f"the {self.name} split holds plain text: no prompt mask")
        return _pread(self._mask_file, self.prompt_mask, start, stop)

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
        prompt_mask, mask_file = None, None
        if info.get("prompt_mask_file"):
            mask_path = self.path / info["prompt_mask_file"]
            prompt_mask = (np.memmap(mask_path, dtype=np.uint8, mode="r") if info["num_tokens"]
                           else np.zeros(0, dtype=np.uint8))
            mask_file = open(mask_path, "rb", buffering=0)
        return TokenSplit(
            name=name, tokens=tokens, offsets=np.load(offsets_path, mmap_mode="r"),
            eos_id=self.meta["eos_id"], pad_id=self.meta["pad_id"], vocab_size=self.meta["vocab_size"],
            prompt_mask=prompt_mask, _tokens_file=open(tokens_path, "rb", buffering=0),
            _offsets_file=open(offsets_path, "rb", buffering=0), _mask_file=mask_file)

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
        if info.get("prompt_mask_file"):
            mask_path = self.path / str(info["prompt_mask_file"])
            size = mask_path.stat().st_size if mask_path.is_file() else None
            if size != num_tokens:
                raise _corrupt(self.path, f"{mask_path.name} holds {size} bytes, meta.json says {num_tokens} "
                                          "tokens of one prompt-mask byte each")
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
    instruction = meta.get("instruction")
    if instruction:
        lines.append(f"  records    {' and '.join(instruction['kinds'])}, one sample each; "
                     f"{instruction['prompt_tokens']:,} prompt tokens (left out of the loss by --mask-prompt)")
    lines.append(f"  total      {meta['num_documents']:,} documents, {meta['num_tokens']:,} tokens "
                 + ("(each record's tokens)" if instruction else "(each document's tokens + one EOS)"))
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
    from common.data import instructions
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
    # JSON data may hold chat records, rendered by the tokenizer folder's template: a new template, new tokens.
    template = instructions.template_identity(tokenizer) if identity["kind"] in ("json", "folder") else None
    fingerprint = _fingerprint(identity, tokenizer_key, val_fraction, split, text_field, template)
    final = cache_dir / "tokens" / fingerprint[:16]
    if cached := _reusable(final, fingerprint):
        return cached

    records = instructions.load_instructions(dataset, split=split, text_field=text_field) \
        if identity["kind"] in ("json", "folder") else None
    documents: Iterable = records.records if records else \
        load_documents(dataset, split=split, text_field=text_field, streaming=streaming,
                       builtin_bytes=builtin_bytes, seed=seed).documents
    total_documents = len(documents) if isinstance(documents, list) else None
    if info is None:
        if records:
            _, sample = training_sample(instructions.training_texts(records.records), every)
        else:
            documents, sample = training_sample(documents, every)
        info = load_tokenizer("builtin", corpus_docs=sample, vocab_size=builtin_vocab_size, cache_dir=cache_dir)
    encode = None
    if records:
        templated = instructions.templated_records(records.records, tokenizer)
        template_of = instructions.ChatTemplate(tokenizer, templated[0]) if templated else None
        encode = functools.partial(instructions.encode, info=info, template=template_of)
    if num_threads:
        os.environ.setdefault("RAYON_NUM_THREADS", str(num_threads))

    final.parent.mkdir(parents=True, exist_ok=True)
    building = final.parent / f".tmp-{final.name}-{os.getpid()}-{secrets.token_hex(4)}"
    building.mkdir()
    try:
        long_job = total_documents is None or total_documents > PROGRESS_MIN_DOCS
        meta = write_splits(building, documents, info, every, total_documents, show_progress=progress and long_job,
                            encode=encode)
        if meta["num_documents"] == 0:
            raise UserError(f"dataset {dataset!r} is empty: it holds no documents")
        if records:
            meta["instruction"] = {"kinds": records.kinds, "chat_template_sha256": template,
                                   "prompt_tokens": _prompt_tokens(building, meta)}
        meta.update(format_version=FORMAT_VERSION, fingerprint=fingerprint,
                    created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    dataset=dataset, source=identity, split=split, text_field=text_field,
                    val_fraction=val_fraction)
        info.save(building / "tokenizer.json")
        write_json_synced(building / "meta.json", meta)
        fsync_dir(building)
        _publish(building, final, fingerprint)
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return TokenCache.open(final)


def _fingerprint(identity: dict, tokenizer_key, val_fraction: float, split: str, text_field: str,
                 chat_template: str | None = None) -> str:
    key = {"format_version": FORMAT_VERSION, "source": identity, "tokenizer": tokenizer_key,
           "val_fraction": val_fraction, "split": split, "text_field": text_field}
    if chat_template is not None:  # absent otherwise: caches built before templates counted keep their names
        key["chat_template"] = chat_template
        key["prompt_completion"] = "chat_template"  # pairs rendered as a user/assistant turn, as mlx-lm's
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def _prompt_tokens(directory: Path, meta: dict) -> int:
    total = 0
    for info in meta["splits"].values():
        if info["num_tokens"]:
            total += int(np.count_nonzero(np.memmap(directory / info["prompt_mask_file"], dtype=np.uint8, mode="r")))
    return total


def _reusable(path: Path, fingerprint: str) -> TokenCache | None:
    if not (path / "meta.json").is_file():
        return None
    try:
        cache = TokenCache.open(path)
    except UserError:  # damaged: rebuilt and swapped in by the caller
        return None
    return cache if cache.meta.get("fingerprint") == fingerprint else None


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
