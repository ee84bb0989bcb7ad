"""Whether the kernel's out-of-memory killer ended a process, read back from the kernel's log (Linux, where `dmesg`
may be read: root, or kernel.dmesg_restrict=0). A rank killed for memory dies without a word of its own; the
kernel's line is the only place that says why, and how large it had grown."""
from __future__ import annotations

import re
import subprocess
import time

# "[46082.504517] Out of memory: Killed process 23006 (python) total-vm:14925624kB, anon-rss:12241548kB, ..."
KILLED = re.compile(r"^\[\s*([\d.]+)\] Out of memory: Killed process (\d+) \([^)]*\).*?anon-rss:(\d+)kB", re.M)
DMESG_TIMEOUT_S = 2.0
# Only a kill this recent counts: pids are reused (pid_max is 32768 here), and an old line about another process of
# the same pid must not turn a rank that a signal ended into one the kernel ended. The watchdog looks every 0.2 s.
RECENT_S = 120.0


def killed_rss(log: str, pid: int, now_s: float, recent_s: float = RECENT_S) -> int | None:
    """The resident bytes the kernel's log says `pid` had when the out-of-memory killer ended it, within `recent_s`
    before `now_s` (seconds since boot, the log's clock); None where the log has no such line."""
    for m in reversed(list(KILLED.finditer(log))):
        if int(m.group(2)) == pid and now_s - recent_s <= float(m.group(1)) <= now_s + 1.0:
            return int(m.group(3)) * 1024
    return None


def oom_killed(pid: int | None) -> int | None:
    """killed_rss from this machine's kernel log; None where the log does not say so or cannot be read."""
    if not pid:
        return None
    try:
        log = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=DMESG_TIMEOUT_S).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    # the log's clock and CLOCK_MONOTONIC both count from boot without suspend (Linux)
    return killed_rss(log, int(pid), time.monotonic())
