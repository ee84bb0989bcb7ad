"""Python's cyclic garbage collector held off while a framework process imports, then its imports frozen.

Importing torch and torch._dynamo makes about a million objects that live as long as the process, and almost no
garbage; CPython 3.11 still runs a collection every 700 allocations, and each full one walks all of them. On the AMD
EPYC Zen 3, `import torch, torch._dynamo` took 2.76-3.33 CPU-s with the collector and 2.26-2.95 without it, quiet,
three rounds alternated (docs/notes/2026-12-zen3-ci-profile.md). Paid by every rank launch, probe and sample process.

After the imports, `gc.freeze()` moves what they made out of the collector's sight (Python's documentation of
gc.freeze gives this use): the later collections of the training loop no longer walk it, and in forked ranks
(forkranks.py, which freezes before it forks) they never copy the pages the ranks share. Collections then resume
as usual, so a long run's cyclic garbage is still reclaimed.
"""
from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def imports_uncollected() -> Iterator[None]:
    """No cyclic collection inside; on leaving, what exists is frozen and collection resumes as it was."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()
