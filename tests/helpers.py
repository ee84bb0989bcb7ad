"""Running the real CLI in tests: each call is a subprocess, as a user would run it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"

# Small and fast: a few hundred KB of builtin stories, tiny model, short sequences, and 2 rounds of profile
# steps instead of the default 8 (the breakdown is still written; the shared matrix, whose breakdown is judged,
# asks for 8): 18 fewer steps in every run of the suite. No op-class profile either (0.3-0.5 s of every 1-rank
# run at these shapes); the matrix, whose op profile is judged, asks for it. No probe of the job's all-reduce
# before training (0.2-0.9 s of every multi-rank job, over a hundred of them): the runs whose link or prediction
# is judged ask for it (--link-probe, after FAST: the last flag wins).
FAST = ["--preset", "tiny", "--seq-len", "32", "--global-batch-size", "8", "--warmup-steps", "2",
        "--eval-every", "0", "--quiet", "--set", "builtin_corpus_bytes=400000", "--set", "builtin_vocab_size=512",
        "--profile-steps", "2", "--no-op-profile", "--no-link-probe"]


def dpcompare(*args, cache_dir: Path, timeout: float = 300, env: dict | None = None, check: bool = True,
              cwd: Path = ROOT):
    """`dpcompare ARGS` started in `cwd` (the checkout unless a test says otherwise)."""
    cmd = [sys.executable, "-m", "compare.cli", *map(str, args)]
    full_env = {**os.environ, "DPCOMPARE_CACHE": str(cache_dir), **(env or {})}
    if cwd != ROOT:  # `python -m` looks in cwd first; the project must still be found, from anywhere
        full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), full_env.get("PYTHONPATH")]))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=full_env)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
                             + _log_tail(args, cwd))
    return proc


def _log_tail(args, cwd: Path = ROOT) -> str:
    args = list(map(str, args))
    if "--out" in args:
        log = Path(cwd, args[args.index("--out") + 1]) / "log.txt"
        if log.exists():
            return "\nlog.txt:\n" + log.read_text()[-3000:]
    return ""


def losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def summary(run_dir: Path) -> dict:
    return json.loads((Path(run_dir) / "summary.json").read_text())


def dpcompare_here(*args, cache_dir: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """`dpcompare ARGS` in this process, for inputs refused before any rank starts (the unit lane's guard
    fails a test whose call gets further): exit code, stdout and stderr as the subprocess would give them."""
    import contextlib
    import io
    import traceback
    from unittest import mock

    from compare.cli import main

    out, err = io.StringIO(), io.StringIO()
    with mock.patch.dict(os.environ, {"DPCOMPARE_CACHE": str(cache_dir), **(env or {})}), \
            contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(map(str, args)))
        except SystemExit as exc:  # argparse's errors
            code = exc.code
        except Exception:  # noqa: BLE001 - the traceback is what a test reports
            code = None
            traceback.print_exc()
    return subprocess.CompletedProcess(["dpcompare", *map(str, args)], code, out.getvalue(), err.getvalue())


def namespaces() -> list[str]:
    """`ip netns list`, names only: what an emulated link must leave as it found."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return sorted(line.split()[0] for line in out.splitlines() if line.strip())


def can_emulate_links() -> bool:
    import shutil

    return sys.platform.startswith("linux") and os.geteuid() == 0 and shutil.which("ip") and shutil.which("tc")


def skip_unless_links() -> None:
    import pytest

    if not can_emulate_links():
        pytest.skip("emulated links need Linux, root, ip and tc (iproute2)")
