"""A job's local ranks forked from one process that has imported the framework, instead of each importing it.

Every torch rank imports torch and torch._dynamo (DDP's constructor reads its config): 2.1 CPU-seconds
before its first step on an AMD EPYC Zen 4, against 0.3 s for the rest of its start. When ranks share a
machine's cores, N ranks pay that N times. With `compare.launch.spawn --fork`, spawn starts the rank command
once, with ENV naming a file of every rank's environment. The backend's launch (torch_impl/launch.py) calls
`fork_ranks` first:
- it imports what every rank imports (`preload`);
- it forks one child per rank, each taking its rank's environment, as a process spawn would have started;
- it writes their pids to the file's `pids` path and exits.

spawn is a child subreaper (Linux prctl), so the ranks become its children when the forking process exits.
It waits for them, signals them and reports them exactly as the ranks it starts itself. Nothing else
changes: a forked rank runs the same `main` with the same argv, environment, working directory and
inherited output, and the supervisor watch, rescue thread and signal handlers start after the fork.

Forking is safe here because nothing that cannot cross a fork has started yet: no collective, no device
(spawn asks for it on gloo runs only, and the preload imports but initialises no device), and numpy's OpenBLAS pool handles forks itself (pthread_atfork).
It applies only where spawn starts the ranks directly: not inside network namespaces (`ip netns exec`
per rank), nor under torchrun, mpirun or Slurm.
"""
from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path
from typing import Callable

ENV = "DPCOMPARE_FORK_RANKS"


def fork_ranks(preload: Callable[[], None]) -> None:
    """Return at once in a rank spawn started itself. In the forking process, import (`preload`), fork the
    ranks, and return in each of them; the forking process itself ends here."""
    spec_path = os.environ.pop(ENV, None)
    if spec_path is None:
        return
    spec = json.loads(Path(spec_path).read_text())
    preload()
    # What the imports made lives as long as the ranks: out of the collector's sight, a rank's collections never
    # touch (and so copy) the pages it shares with its siblings (Python's gc.freeze documentation gives this use).
    gc.freeze()
    pids = []
    for env in spec["envs"]:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # this process is now one rank, with the environment spawn would have given it
            os.environ.clear()
            os.environ.update(env)
            return
        pids.append(pid)
    tmp = Path(spec["pids"] + ".tmp")
    tmp.write_text(json.dumps(pids))
    tmp.replace(spec["pids"])
    os._exit(0)  # no atexit handlers or buffers of the ranks' to run twice
