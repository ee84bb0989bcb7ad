"""Tokenizers, reduced to what training needs: fast batch encoding, the vocabulary size, BOS, EOS and pad
ids, and a fingerprint that changes whenever the tokenizer does.

BOS: a pretrained tokenizer that adds one (its tokenizer_config.json says add_bos_token, or else its
post-processor puts a token before the text, as Llama 2's and Llama 3's do) gets it at the start of every
document (common/data/tokencache.py), as the checkpoint saw in pretraining; GPT-2's, SmolLM2's and the builtin
one add none.

`--tokenizer` takes one string:
  "builtin"                 a byte-level BPE trained on the run's documents, cached under cache_dir;
  a tokenizer.json file     loaded with `tokenizers`;
  a folder                  anything `transformers.AutoTokenizer.from_pretrained` loads (e.g. a GPT-2 dir);
  anything else             a hub name such as `gpt2`, from the local HF cache when the hub is unreachable.
Every kind ends up as a Rust `tokenizers.Tokenizer`, whose batch encoder runs on all cores.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from common.data.corpus import DEFAULT_CORPUS_BYTES, generate_stories
from common.errors import UserError
from common.fsutil import atomic_write_text
from common.data.hub import hub_offline_if_unreachable
from common.data.sources import looks_like_path

if TYPE_CHECKING:
    from tokenizers import Tokenizer

EOS_TOKEN = "<|endoftext|>"
# End-of-sequence spellings of common tokenizers, tried when a tokenizer.json does not say which it uses.
EOS_CANDIDATES = (EOS_TOKEN, "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "<|im_end|>")
# 256 byte symbols + EOS is the least a byte-level BPE can have.
MIN_BUILTIN_VOCAB = 257
# BPE statistics settle long before this; training on all of a multi-GB dataset would only cost time.
BUILTIN_TRAINING_BYTES = 32_000_000
BUILTIN_TRAINER_VERSION = 1


@dataclass(frozen=True)
class TokenizerInfo:
    name: str
    vocab_size: int  # including added special tokens: the model's embedding needs at least this many rows
    eos_id: int
    pad_id: int
    fingerprint: str  # sha256 of the serialized tokenizer
    backend: Tokenizer = field(repr=False, compare=False)
    bos_id: int | None = None  # put before every document; None: the tokenizer adds no BOS

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, no special tokens added; parallel in Rust across the batch."""
        encode = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)  # _fast skips offsets
        return [encoding.ids for encoding in encode(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=False)

    def save(self, path: Path) -> None:
        """Write a tokenizer.json that `load_tokenizer(str(path), ...)` reloads as the same tokenizer."""
        atomic_write_text(Path(path), self.backend.to_str())


def load_tokenizer(name: str, *, corpus_docs: Sequence[str] | None = None, vocab_size: int = 2048,
                   cache_dir: Path) -> TokenizerInfo:
    """`corpus_docs` and `vocab_size` matter only for "builtin" (the default corpus when no docs are given)."""
    if name == "builtin":
        return _builtin(corpus_docs, vocab_size, Path(cache_dir))
    path = Path(name).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".json":
            raise UserError(f"tokenizer file {name!r} is not a tokenizer.json; pass a tokenizer.json file or "
                            "a tokenizer folder")
        return _from_json_file(name, path)
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            return _from_folder(name, path)
        return _from_pretrained(name, str(path), hub=False)
    if looks_like_path(name, (".json",)):
        raise UserError(f"tokenizer path {name!r} does not exist")
    return _from_pretrained(name, name, hub=True)


def _from_json_file(name: str, path: Path) -> TokenizerInfo:
    from tokenizers import Tokenizer

    try:
        backend = Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust side raises bare Exception for malformed files
        raise UserError(f"cannot load tokenizer file {name!r}: {_first_line(e)}") from None
    return _info(name, backend, eos_token=None, pad_token=None)


def _from_folder(name: str, path: Path) -> TokenizerInfo:
    """A saved HF tokenizer folder, read with `tokenizers` alone: transformers would import torch into
    the launcher, which must stay framework-free (and it costs seconds)."""
    import json

    from tokenizers import Tokenizer

    try:
        backend = Tokenizer.from_file(str(path / "tokenizer.json"))
    except Exception as e:  # the Rust side raises bare Exception for malformed files
        raise UserError(f"cannot load tokenizer {name!r}: {_first_line(e)}") from None
    config = {}
    if (path / "tokenizer_config.json").is_file():
        try:
            config = json.loads((path / "tokenizer_config.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise UserError(f"cannot read {path / 'tokenizer_config.json'}: {e}") from None

    def token(key: str) -> str | None:
        value = config.get(key)
        return value.get("content") if isinstance(value, dict) else value

    add_bos = config.get("add_bos_token")  # stated: it decides; absent: the post-processor does
    bos_id = backend.token_to_id(token("bos_token") or "") if add_bos else None
    return _info(name, backend, eos_token=token("eos_token"), pad_token=token("pad_token"),
                 bos=None if add_bos is None else bos_id if bos_id is not None else False)


def _from_pretrained(name: str, location: str, *, hub: bool) -> TokenizerInfo:
    from transformers import AutoTokenizer

    with hub_offline_if_unreachable() as reachable:
        try:
            pretrained = AutoTokenizer.from_pretrained(location)
        except Exception as e:  # transformers raises OSError, ValueError, KeyError... for unloadable dirs
            if hub and not reachable:
                raise UserError(
                    f"tokenizer {name!r} is not a local path, the Hugging Face hub is unreachable and it is not "
                    "in the local cache, so it cannot be downloaded; pass a local tokenizer folder or a "
                    "tokenizer.json file") from None
            raise UserError(f"cannot load tokenizer {name!r}: {_first_line(e)}") from None
    backend = getattr(pretrained, "backend_tokenizer", None)
    if backend is None:
        raise UserError(f"tokenizer {name!r} has no fast (Rust) tokenizer; pass one with a tokenizer.json")
    from tokenizers import Tokenizer

    # A private copy: padding or truncation configured for inference must not cut training documents.
    backend = Tokenizer.from_str(backend.to_str())
    add_bos = getattr(pretrained, "add_bos_token", None)
    return _info(name, backend, eos_token=pretrained.eos_token, pad_token=pretrained.pad_token,
                 vocab_size=len(pretrained),
                 bos=None if add_bos is None else pretrained.bos_token_id if add_bos else False)


def _info(name: str, backend, *, eos_token: str | None, pad_token: str | None,
          vocab_size: int = 0, bos: int | None | bool = None) -> TokenizerInfo:
    """`bos`: the BOS id a tokenizer config names (or False: it adds none); None: ask the post-processor."""
    backend.no_padding()
    backend.no_truncation()
    bos_id = _added_bos(backend) if bos is None else bos if bos is not False else None
    eos_id = backend.token_to_id(eos_token) if eos_token else None
    if eos_id is None:
        eos_id = next((i for i in map(backend.token_to_id, EOS_CANDIDATES) if i is not None), None)
    if eos_id is None:
        raise UserError(f"tokenizer {name!r} has no end-of-sequence token (looked for "
                        f"{', '.join(EOS_CANDIDATES)}); documents need one to be separated")
    pad_id = backend.token_to_id(pad_token) if pad_token else None
    serialized = backend.to_str()
    return TokenizerInfo(
        name=name,
        vocab_size=max(vocab_size, backend.get_vocab_size(with_added_tokens=True)),
        eos_id=eos_id,
        pad_id=eos_id if pad_id is None else pad_id,
        fingerprint=hashlib.sha256(serialized.encode()).hexdigest(),
        bos_id=bos_id,
        backend=backend,
    )


def _added_bos(backend) -> int | None:
    """The token the post-processor puts before a text, if it puts exactly one there."""
    plain = backend.encode("a", add_special_tokens=False).ids
    special = backend.encode("a", add_special_tokens=True).ids
    if len(special) > len(plain) and special[1:1 + len(plain)] == plain:
        return special[0]
    return None


def _builtin(corpus_docs: Sequence[str] | None, vocab_size: int, cache_dir: Path) -> TokenizerInfo:
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < MIN_BUILTIN_VOCAB:
        raise UserError(f"builtin tokenizer vocab size must be an integer >= {MIN_BUILTIN_VOCAB}, "
                        f"got {vocab_size!r}")
    docs = generate_stories(DEFAULT_CORPUS_BYTES, seed=0) if corpus_docs is None else corpus_docs
    sample = training_sample(docs)
    if not sample:
        raise UserError("the builtin tokenizer needs documents to train on, and there are none")
    digest = hashlib.sha256(f"builtin-bpe-{BUILTIN_TRAINER_VERSION}:{vocab_size}".encode())
    for doc in sample:
        digest.update(b"\0" + doc.encode())
    path = cache_dir / "tokenizers" / f"builtin-{digest.hexdigest()[:16]}.json"
    if path.is_file():
        from tokenizers import Tokenizer

        try:
            return _info("builtin", Tokenizer.from_file(str(path)), eos_token=EOS_TOKEN, pad_token=None)
        except Exception:  # a damaged cache file is retrained below
            pass
    backend = _train_bpe(sample, vocab_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, backend.to_str())
    return _info("builtin", backend, eos_token=EOS_TOKEN, pad_token=None)


def training_sample(docs: Sequence[str], max_bytes: int = BUILTIN_TRAINING_BYTES) -> list[str]:
    """The leading documents, up to about `max_bytes` of text, that the builtin BPE learns from."""
    sample, total = [], 0
    for doc in docs:
        if total >= max_bytes:
            break
        sample.append(doc)
        total += len(doc)
    return sample


def _train_bpe(docs: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    # Byte level: every string round-trips, whatever its characters.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(docs, trainer, length=len(docs))
    return backend


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
