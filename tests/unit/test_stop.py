"""No orphaned ranks: a signal to the dpcompare process alone (kill, timeout, CI, systemd, a closed ssh
session, the OOM killer) ends the whole job within 10 s: launcher and ranks, with the run marked
interrupted and the last complete checkpoint kept, from which --resume continues exactly."""
import subprocess
import time
from pathlib import Path

import pytest

from common.train import supervisor
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="Linux /proc")
def test_a_supervisor_counts_as_gone_once_exited_even_unreaped_or_its_pid_recycled():
    child = subprocess.Popen(["sleep", "60"])
    start = supervisor._start_time(child.pid)
    here = f"{supervisor._here()}:{child.pid}"
    assert not supervisor.supervisor_gone(f"{here}:{start}")
    assert supervisor.supervisor_gone(f"{here}:{int(start) + 1}")  # another process under the same pid
    assert not supervisor.supervisor_gone(f"elsewhere:{child.pid}:{int(start) + 1}")  # not ours to watch
    child.kill()  # a zombie now: exited, not yet reaped
    deadline = time.time() + 5
    while not supervisor.supervisor_gone(f"{here}:{start}") and time.time() < deadline:
        time.sleep(0.05)
    assert supervisor.supervisor_gone(f"{here}:{start}")
    assert Path(f"/proc/{child.pid}").exists()
    child.wait()
    assert supervisor.supervisor_gone(f"{here}:{start}")
