"""Writing a token cache's split files: the documents tokenized in chunks, each split's ids and offsets
appended as they come (and, for instruction records, which tokens are the prompt), and which documents are held
out for validation. common/data/tokencache.py decides when to build, publishes the result and reads it back."""
from __future__ import annotations

import itertools
import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np

from common.errors import UserError

SPLITS = ("train", "valid")
CHUNK_DOCS = 2000  # documents per encode_batch call: big enough to keep every core busy


def validation_every(val_fraction: float) -> int:
    """Document i is held out for validation when i % k == 1, k = round(1 / val_fraction); 0: none.
    Counting from 1 rather than 0 keeps document 0 in train, so any two documents give both splits."""
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) \
            or not 0 <= val_fraction <= 0.5:
        raise UserError(f"validation fraction must be between 0 and 0.5, got {val_fraction!r}")
    return round(1 / val_fraction) if val_fraction else 0


def is_validation(index: int, every: int) -> bool:
    return every > 0 and index % every == 1


def training_sample(documents, every: int) -> tuple[Iterable[str], list[str]]:
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
    """Appends documents' tokens (EOS included) to <split>.bin and remembers their lengths; with `masked`, also
    one byte per token to <split>.mask, 1 where the token is its record's prompt."""

    def __init__(self, directory: Path, name: str, dtype: np.dtype, masked: bool = False):
        self.directory, self.name, self.dtype = directory, name, dtype
        self.file = open(directory / f"{name}.bin", "wb")
        self.mask_file = open(directory / f"{name}.mask", "wb") if masked else None
        self.lengths: list[np.ndarray] = []

    def append(self, token_lists: list[list[int]], prompt_lengths: list[int] | None = None) -> int:
        lengths = np.fromiter(map(len, token_lists), dtype=np.int64, count=len(token_lists))
        flat = np.fromiter(itertools.chain.from_iterable(token_lists), dtype=self.dtype, count=int(lengths.sum()))
        self.file.write(flat.tobytes())
        if self.mask_file is not None:
            assert prompt_lengths is not None
            starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
            limits = np.repeat(np.asarray(prompt_lengths, dtype=np.int64), lengths)
            self.mask_file.write((np.arange(len(flat)) - starts < limits).astype(np.uint8).tobytes())
        self.lengths.append(lengths)
        return len(flat)

    def close(self) -> dict:
        for file in filter(None, (self.file, self.mask_file)):
            file.flush()
            os.fsync(file.fileno())
            file.close()
        lengths = np.concatenate([np.zeros(1, np.int64), *self.lengths])
        offsets = np.cumsum(lengths)
        with open(self.directory / f"{self.name}.idx", "wb") as f:  # a file object: np.save would add .npy
            np.save(f, offsets)
            f.flush()
            os.fsync(f.fileno())
        files = {"tokens_file": f"{self.name}.bin", "offsets_file": f"{self.name}.idx"}
        if self.mask_file is not None:
            files["prompt_mask_file"] = f"{self.name}.mask"
        return {"num_documents": len(offsets) - 1, "num_tokens": int(offsets[-1]), **files}


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def document_tokens(info) -> Callable[[list], tuple[list[list[int]], None]]:
    """Plain documents' tokens: BOS where the tokenizer adds one, the text's ids, EOS."""
    def encode(chunk: list[str]) -> tuple[list[list[int]], None]:
        token_lists = info.encode_batch(chunk)
        if info.bos_id is not None:
            token_lists = [[info.bos_id, *ids] for ids in token_lists]
        for ids in token_lists:
            ids.append(info.eos_id)
        return token_lists, None
    return encode


def write_splits(directory: Path, documents: Iterable, info, every: int, total_documents: int | None,
                  *, show_progress: bool, encode: Callable | None = None) -> dict:
    """`encode(chunk) -> (token lists, prompt lengths)` tokenizes the items of `documents`: plain documents'
    (`document_tokens`, no prompt: no mask files) unless given (instruction records, common/data/instructions.py)."""
    from tqdm import tqdm

    dtype = token_dtype(info.vocab_size)
    masked = encode is not None
    encode = encode or document_tokens(info)
    writers = {name: _SplitWriter(directory, name, dtype, masked) for name in SPLITS}
    # disable=None: no bar when stderr is not a terminal (CI logs, pipes), as for the training bar.
    bar = tqdm(total=total_documents, unit="doc", desc="tokenizing", file=sys.stderr,
               disable=None if show_progress else True, leave=False)
    started, first = time.perf_counter(), 0
    for chunk in _chunks(documents, CHUNK_DOCS):
        token_lists, prompt_lengths = encode(chunk)
        if every:
            held_out = [is_validation(first + i, every) for i in range(len(chunk))]
            for name, keep in (("valid", True), ("train", False)):
                writers[name].append([ids for ids, out in zip(token_lists, held_out) if out == keep],
                                     None if prompt_lengths is None else
                                     [n for n, out in zip(prompt_lengths, held_out) if out == keep])
        else:
            writers["train"].append(token_lists, prompt_lengths)
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


def write_json_synced(path: Path, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
