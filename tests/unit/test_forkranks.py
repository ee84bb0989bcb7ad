"""compare.launch.spawn --fork (common/train/forkranks.py): one process imports, forks the ranks and exits;
spawn, a child subreaper, waits for them, reports a failed one and stops the others, as with ranks it starts.
The ranks here are a small script, not training (spawn runs in a `python -c` child: it makes itself a
subreaper, which the test process must not become)."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="spawn --fork needs Linux's child subreaper")

RANK = """
import json, os, sys, time
from pathlib import Path
sys.path.insert(0, {root!r})
from common.train.forkranks import fork_ranks

preloaded = []
fork_ranks(lambda: preloaded.append(os.getpid()))
rank = os.environ["RANK"]
Path(sys.argv[1], f"rank{{rank}}.json").write_text(json.dumps(
    {{"pid": os.getpid(), "preloaded_in": preloaded, "fork_env_left": "DPCOMPARE_FORK_RANKS" in os.environ,
      "world": os.environ["WORLD_SIZE"]}}))
if os.environ.get("FAIL_RANK") == rank:
    time.sleep(0.5)
    sys.exit(7)
if os.environ.get("FAIL_RANK"):
    time.sleep(60)
"""


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def spawn(tmp_path: Path, ranks: int, env: dict | None = None) -> subprocess.CompletedProcess:
    script = tmp_path / "rank.py"
    script.write_text(RANK.format(root=str(ROOT)))
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from compare.launch.spawn import main; "
            f"sys.exit(main(['--ranks', '{ranks}', '--torch', '--fork', '--', sys.executable, {str(script)!r}, "
            f"{str(tmp_path)!r}]))")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


def test_the_ranks_are_forked_from_one_process_each_with_its_own_environment(tmp_path):
    proc = spawn(tmp_path, 3)
    assert proc.returncode == 0, proc.stderr
    infos = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    forker = {i["preloaded_in"][0] for i in infos}
    assert len(forker) == 1 and all(len(i["preloaded_in"]) == 1 for i in infos)  # imported once, before the fork
    assert len({i["pid"] for i in infos} | forker) == 4  # three ranks, none of them the forking process
    assert not any(i["fork_env_left"] for i in infos) and {i["world"] for i in infos} == {"3"}


def test_a_failed_forked_rank_is_reported_and_the_others_are_stopped(tmp_path):
    started = time.monotonic()
    proc = spawn(tmp_path, 2, env={"FAIL_RANK": "1"})
    assert proc.returncode == 7, proc.stderr
    assert "rank 1 exited with code 7" in proc.stderr
    assert time.monotonic() - started < 30  # rank 0 would sleep 60 s: spawn stopped it
    assert not alive(json.loads((tmp_path / "rank0.json").read_text())["pid"])
