"""Test-only fault injection: DPCOMPARE_INJECT_FAULT makes one rank fail at a chosen step, deterministically.

    DPCOMPARE_INJECT_FAULT="framework=torch,rank=1,step=13,signal=KILL"

- framework, rank: whom it hits (default: every framework, every rank);
- step: the optimizer step it hits, before that step's work (1-based); with during=eval, in the eval after that
  step instead (a survivor then keeps the step, and the restart must compute the eval again);
- signal: KILL or STOP sends that signal to the rank itself (a death, a hang); none raises a RuntimeError;
- by default it hits once per run: the first start that reaches that step (a start that failed earlier for
  another reason, a slow first step on a loaded machine, does not use it up). RUN_DIR/.injected_fault records
  that it fired, for the dpcompare process that started the run (DPCOMPARE_SUPERVISOR);
- attempt=K: only start K (0: the first; compare/launch/restarts.py numbers restarts 1, 2, ... in
  DPCOMPARE_ATTEMPT); world=N: every start at N ranks, at its first step >= step, so a restart from a later
  checkpoint is hit again (a rank that dies at every start).

Nothing reads it but the loop (common/train/loop.py); tests and benchmarks/bench_restart.py set it.
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from common.train import supervisor

ENV = "DPCOMPARE_INJECT_FAULT"
FIRED_FILE = ".injected_fault"
ATTEMPT_ENV = "DPCOMPARE_ATTEMPT"


@dataclass(frozen=True)
class Fault:
    step: int
    rank: int | None = None
    signal: str = ""          # "", "KILL" or "STOP"
    attempt: int | None = None  # None: once per run (see the module's docstring)
    world: int | None = None
    during: str = "step"      # "step" (before its work) or "eval" (the eval after it)

    def due(self, rank: int, world_size: int, step: int, start_step: int, run_dir: Path) -> bool:
        """Whether it hits `rank` before optimizer step `step` (1-based) of an attempt that started after
        `start_step`."""
        if self.rank is not None and self.rank != rank:
            return False
        if self.world is not None:
            return world_size == self.world and step == max(self.step, start_step + 1)
        if self.attempt is not None:
            return self.attempt == int(os.environ.get(ATTEMPT_ENV, "0")) and step == self.step
        return step == self.step and not fired(run_dir)

    def strike(self, step: int, status, run_dir: Path) -> None:
        """Fail now: `status` (the rank's RankStatus) records when, for the restart's figures."""
        status.update(force=True, fault_at=time.time())
        (run_dir / FIRED_FILE).write_text(os.environ.get(supervisor.ENV, ""))
        if self.signal:
            os.kill(os.getpid(), getattr(signal, f"SIG{self.signal}"))
            time.sleep(0.5)  # SIGKILL and SIGSTOP act at once; SIGCONT resumes here, and the step goes on
            return
        raise RuntimeError(f"injected fault at step {step} ({ENV})")


def fired(run_dir: Path) -> bool:
    """Whether a once-per-run fault already hit a start of this run (by this dpcompare process)."""
    try:
        return (run_dir / FIRED_FILE).read_text() == os.environ.get(supervisor.ENV, "")
    except OSError:
        return False


def injected_fault(framework: str) -> Fault | None:
    """The fault DPCOMPARE_INJECT_FAULT names for this framework, or None."""
    spec = os.environ.get(ENV)
    if not spec:
        return None
    fields = dict(item.split("=", 1) for item in spec.split(",") if "=" in item)
    if fields.get("framework", framework) != framework or "step" not in fields:
        return None
    world = int(fields["world"]) if "world" in fields else None
    return Fault(step=int(fields["step"]), rank=int(fields["rank"]) if "rank" in fields else None,
                 signal=fields.get("signal", "").upper().removeprefix("SIG"),
                 attempt=int(fields["attempt"]) if "attempt" in fields else None, world=world,
                 during=fields.get("during", "step"))
