"""Paths a user types, resolved once into absolute ones: against the directory dpcompare was started in for
flags, and against the config file's own directory for paths inside a TOML config.

Every process dpcompare starts (ranks, samplers, diagnosis workers) runs in the project's directory, not
the user's, so nothing relative may reach one. A path that cannot serve (missing, unreadable, a file where
a directory is needed) is one UserError naming it as typed and as resolved.

`--dataset` and `--tokenizer` also take names that are not paths (common/data/sources.py, common/data/tokenizer.py):
"builtin" stays as it is; a string naming something that exists relative to the base directory, or one
that looks like a path (starts with ".", "/" or "~", ends in a data suffix, or is no valid hub id), is
resolved, and must exist; anything else is a hub name and is left alone.
"""
from __future__ import annotations

import os
from pathlib import Path

from common.errors import UserError
from common.data.sources import DATA_SUFFIXES, looks_like_path

# What each kind of path must be. Inputs must exist; outputs may be created, but not over a thing of the
# wrong type or under one that cannot be written.
KINDS = ("file", "dir", "out_dir", "out_file", "dataset", "tokenizer")

# RunConfig fields that hold a path, and their kind (TOML keys, `--set KEY=VALUE` and the flags alike).
CONFIG_PATHS = {"dataset": "dataset", "tokenizer": "tokenizer", "init_from": "dir", "hostfile": "file",
                "cache_dir": "out_dir", "out": "out_dir"}

BUILTIN = "builtin"


def resolve(typed: str, base: Path, kind: str, name: str) -> str:
    """`typed` as an absolute path against `base` (hub and builtin names unchanged), checked for `kind`.
    `name` says where it came from in messages: "--out", "dataset in /x/run.toml"."""
    if kind not in KINDS:
        raise ValueError(f"unknown path kind {kind!r}")
    if typed in ("", None):
        return typed
    typed = str(typed)
    path = Path(base, Path(typed).expanduser())
    resolved = Path(os.path.normpath(path))  # no symlinks followed: the user's spelling, made absolute
    if kind in ("dataset", "tokenizer"):
        if typed == BUILTIN:
            return typed
        suffixes = DATA_SUFFIXES if kind == "dataset" else (".json",)
        if not _exists(resolved) and not looks_like_path(typed, suffixes):
            return typed  # a hub name such as roneneldan/TinyStories or gpt2
        kind = "input"
    check(typed, resolved, kind, name)
    return str(resolved)


def check(typed: str, resolved: Path, kind: str, name: str) -> None:
    def refuse(problem: str):
        shown = str(resolved) if typed == str(resolved) else f"{typed} (resolved: {resolved})"
        raise UserError(f"{name} {shown} {problem}")

    if kind in ("file", "dir", "input"):
        if not _exists(resolved):
            # A directory on the way that this user may not enter hides what is behind it.
            blocked = next((p for p in reversed(resolved.parents) if _exists(p) and not os.access(p, os.X_OK)),
                           None)
            missing = "does not exist" + ("; nothing is downloaded: pass a local model folder (huggingface-cli "
                                          f"download {typed} --local-dir DIR, then --init-from DIR)"
                                          if name == "--init-from" else "")
            refuse(f"cannot be read: {blocked} is not accessible" if blocked else missing)
        if kind == "file" and resolved.is_dir():
            refuse("is a directory, not a file")
        if kind == "dir" and not resolved.is_dir():
            refuse("is a file, not a directory")
        readable = os.R_OK | (os.X_OK if resolved.is_dir() else 0)
        if not os.access(resolved, readable):
            refuse("cannot be read (permission denied)")
        return
    if kind == "out_dir" and _exists(resolved) and not resolved.is_dir():
        refuse("is a file, not a directory")
    if kind == "out_file" and _exists(resolved) and resolved.is_dir():
        refuse("is a directory, not a file")
    parent = next(p for p in [resolved, *resolved.parents] if _exists(p))
    if not parent.is_dir():
        refuse(f"cannot be created: {parent} is a file")
    if not os.access(parent, os.W_OK | os.X_OK):
        refuse(f"cannot be written: {parent} is not writable")


def _exists(path: Path) -> bool:
    """Path.exists() that says False where a directory on the way cannot be entered (it raises there)."""
    try:
        path.stat()
    except OSError:
        return False
    return True


def resolve_config_paths(values: dict, base: Path, where: str) -> dict:
    """The path fields of a config dict (TOML or --set values) resolved against `base`; others unchanged."""
    out = dict(values)
    for key, kind in CONFIG_PATHS.items():
        if isinstance(out.get(key), str):
            out[key] = resolve(out[key], base, kind, f"{key}{where}")
    return out
