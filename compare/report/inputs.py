"""What a run read, named by its content rather than by its path, so that the same data at two paths pairs.

Runs made on two machines (a Mac and a Linux box, gathered by `dpcompare report A B`) name the same files by
different absolute paths. Each input a run names by a path already carries a content hash in the run directory:

    dataset    run_config.json "token_cache": the cache folder's name is the first 16 hex digits of the cache's
               fingerprint (common/data/tokencache.py: <cache_dir>/tokens/<fingerprint[:16]>/), which covers the
               data's bytes (sha256 of a local file or folder), the tokenizer, split, text field and
               validation fraction
    tokenizer  run_config.json "data" "tokenizer" "fingerprint": sha256 of the serialized tokenizer
    init_from  summary.json "init_from" "weights_sha256": sha256 of the folder's model.safetensors

Where both runs carry an input's hash, the hashes decide and the paths are ignored; where either lacks it (a run
of an older version, a token cache outside the cache layout), the paths are compared as before.
"""
from __future__ import annotations

import re
from pathlib import PurePath

CACHE_NAME = re.compile(r"[0-9a-f]{16}")


def content_hashes(run_config: dict, summary: dict) -> dict[str, str]:
    """{config key (dataset, tokenizer, init_from): content hash} for the inputs whose hash this run's files
    carry; an input without one is left out."""
    hashes = {}
    cache = PurePath(str(run_config.get("token_cache") or ""))
    if cache.parent.name == "tokens" and CACHE_NAME.fullmatch(cache.name):
        hashes["dataset"] = cache.name
    if fingerprint := tokenizer_fingerprint(run_config.get("data") or {}):
        hashes["tokenizer"] = fingerprint
    if weights := (summary.get("init_from") or {}).get("weights_sha256"):
        hashes["init_from"] = str(weights)
    return hashes


def tokenizer_fingerprint(data: dict) -> str | None:
    """The tokenizer's sha256 from run_config.json's "data" section (the token cache's meta), if recorded."""
    tokenizer = data.get("tokenizer")
    return str(tokenizer["fingerprint"]) if isinstance(tokenizer, dict) and tokenizer.get("fingerprint") else None


def named(path, digest: str) -> str:
    """A path with its content hash, as a difference shows it: "/data/train.txt (sha 3f2a9c01b7e4)"."""
    return f"{path or '(none)'} (sha {digest[:12]})"
