"""A rank's link to the dpcompare process that started its job (the supervisor), through any launcher.

Two things a rank must tell apart from a failure:
- dpcompare was signalled (SIGTERM, SIGHUP, SIGINT) and is stopping the job: it writes ranks/stop.json
  before it signals the ranks, so their SIGTERM handler records "interrupted", not "failed".
- dpcompare is gone without cleaning up (SIGKILL, OOM killer): nobody will stop the job, so every rank
  watches the supervisor itself and exits within POLL_S of its death.

The watch cannot use the parent: ranks are children of torchrun, mpirun or compare.launch.spawn, and a
parent-death signal (Linux prctl) fires for the parent thread only. Nor an inherited pipe: torchrun and
mpirun close the file descriptors they do not know. So dpcompare passes its identity in the environment
(DPCOMPARE_SUPERVISOR=host:pid:start) and the rank checks that this process still exists:
- Linux: /proc/PID/stat's start time must still match, so a recycled pid does not count as alive;
- macOS (no /proc): a kqueue EVFILT_PROC/NOTE_EXIT event on the pid, which the kernel raises when that
  very process exits (no pid reuse problem); kill(pid, 0) polling where kqueue is missing.
A rank on another host (mlx.launch over ssh, mpirun --hostfile) cannot see the supervisor and does not
watch it.
"""
from __future__ import annotations

import os
import select
import sys
import threading
import time
from pathlib import Path

ENV = "DPCOMPARE_SUPERVISOR"
STOP_FILE = "stop.json"  # in the run directory's ranks/, written by dpcompare before it stops the job
POLL_S = 0.5


_exited = threading.Event()  # set by the watch once it has seen the supervisor exit


def identity() -> str:
    """This process as the supervisor of the jobs it starts: the value of DPCOMPARE_SUPERVISOR."""
    return f"{_here()}:{os.getpid()}:{_start_time(os.getpid()) or ''}"


def _here() -> str:
    """Where a pid means this process: the host, and on Linux the pid namespace (containers that share
    a host name do not share pids)."""
    try:
        return f"{os.uname().nodename}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return os.uname().nodename


def _start_time(pid: int) -> str | None:
    """Linux: the process's start time in clock ticks since boot; None when it is gone or a zombie (an
    exited supervisor whose parent has not reaped it yet); "" where there is no /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return None if fields[0] in ("Z", "X") else fields[19]
    except FileNotFoundError:
        return None
    except (OSError, IndexError):
        return ""


def _parse(value: str | None) -> tuple[int, str] | None:
    """(pid, start time) of a supervisor on this host, or None when there is none to watch."""
    try:
        host, pid, start = (value or "").rsplit(":", 2)
        return (int(pid), start) if host == _here() else None
    except ValueError:
        return None


def supervisor_gone(value: str | None = None) -> bool:
    """True when the supervisor named in DPCOMPARE_SUPERVISOR (or `value`) has exited."""
    if _exited.is_set():
        return True
    parsed = _parse(value if value is not None else os.environ.get(ENV))
    if parsed is None:
        return False
    pid, start = parsed
    if start:
        return _start_time(pid) != start
    try:
        os.kill(pid, 0)  # no /proc (macOS): a pid alive now is taken for the supervisor
        return False
    except ProcessLookupError:
        return True
    except PermissionError:  # a process of another user: the pid was recycled
        return True


def watch_supervisor(on_gone) -> bool:
    """Call `on_gone()` from a daemon thread once the supervisor has exited; False when there is none."""
    parsed = _parse(os.environ.get(ENV))
    if parsed is None:
        return False
    pid, start = parsed

    def wait():
        # kqueue reports the exit itself, before the parent reaps the zombie that kill(pid, 0) still sees.
        if not (not start and hasattr(select, "kqueue") and _wait_kqueue(pid)):
            while not supervisor_gone():
                time.sleep(POLL_S)
        _exited.set()
        on_gone()

    threading.Thread(target=wait, name="supervisor-watch", daemon=True).start()
    return True


def _wait_kqueue(pid: int) -> bool:
    """macOS/BSD: block until process `pid` exits (True); False on any error, and the caller polls."""
    if sys.platform == "linux":  # no kqueue (the caller asks first); this line tells mypy too
        return False
    try:
        queue = select.kqueue()
        event = select.kevent(pid, filter=select.KQ_FILTER_PROC,
                              flags=select.KQ_EV_ADD | select.KQ_EV_ONESHOT, fflags=select.KQ_NOTE_EXIT)
        queue.control([event], 0, 0)  # ESRCH (an OSError) when it is gone already
        return bool(queue.control(None, 1, None))
    except (OSError, AttributeError, ValueError):
        return False


def request_stop(run_dir: Path, reason: str) -> None:
    """dpcompare is stopping the job on purpose: tell the ranks before they are signalled."""
    from common.metrics import write_json

    (Path(run_dir) / "ranks").mkdir(parents=True, exist_ok=True)
    write_json(Path(run_dir) / "ranks" / STOP_FILE, {"reason": reason, "pid": os.getpid(), "time": time.time()})


def stop_reason(run_dir: Path) -> str | None:
    """Why this job is being stopped from outside, when that is no failure of its own; else None."""
    from common.metrics import read_json

    marker = read_json(Path(run_dir) / "ranks" / STOP_FILE)
    if marker:
        return marker.get("reason", "stopped by dpcompare")
    if supervisor_gone():
        pid = (_parse(os.environ.get(ENV)) or ("?",))[0]
        return f"its supervisor (dpcompare, pid {pid}) is gone"
    return None
