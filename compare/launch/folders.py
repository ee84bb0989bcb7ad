"""`--init-from DIR` read by the peers' loaders before any rank starts: mlx-lm's and transformers' logits on a few
tokens against dpcompare's own, in a child (peers/folder_check.py; compare/ imports no framework). A folder one of
them reads differently is one warning naming the library and the cause (transformers 5's `rope_parameters`, which
mlx-lm 0.32 ignores); a folder dpcompare exports reads alike and warns nothing. The check warns, never refuses.
Its answer is remembered in the cache by the folder's config.json and weights (a few seconds of imports a check)."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

from common.fsutil import atomic_write_text

TIMEOUT_S = 120


def folder_warnings(init_from: str, cache_dir: Path) -> list[str]:
    if not init_from:
        return []
    from common.model.weights import weights_digest

    folder = Path(init_from).resolve()
    try:
        key = hashlib.sha256(((folder / "config.json").read_bytes() + str(folder).encode() +
                              weights_digest(folder, cache_dir).encode())).hexdigest()[:24]
    except OSError:
        return []
    remembered = Path(cache_dir) / "folder-checks" / f"{key}.json"
    if remembered.is_file():
        return json.loads(remembered.read_text())
    try:
        proc = subprocess.run([sys.executable, "-m", "peers.folder_check", str(folder)], capture_output=True,
                              text=True, timeout=TIMEOUT_S, cwd=Path(__file__).parents[2])
        lines = proc.stdout.strip().splitlines()
        found = json.loads(lines[-1]) if proc.returncode == 0 and lines else None
    except (OSError, subprocess.TimeoutExpired, ValueError):  # a check that cannot run says nothing
        found = None
    if found is None:
        return []
    remembered.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(remembered, json.dumps(found))
    return found
