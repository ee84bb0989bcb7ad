"""`--trace`: a timeline of a few extra training steps per rank, for chrome://tracing and ui.perfetto.dev.

After the run's timed steps and the profile steps of common/train/breakdown.py, each rank takes TRACE_STEPS more
synced steps inside its framework's tracer and writes RUN_DIR/trace/rank{R}.json (Chrome Trace Event
Format). Each step is a span `step N` holding the phases of common/train/breakdown.py it can separate:
`forward` and `backward` per micro-batch, `communication` (the gradient sync, where it runs apart from
the backward) and `optimizer`; what the step spends outside them (host overhead, the loss all-reduce) is
the breakdown's `other`. The phases wait for the device, as the breakdown's instrumented steps do.

    torch  torch.profiler: every operator (and CUDA kernel on a GPU), the phases as record_function
           scopes, DDP's all-reduce as the gloo/nccl events inside backward (torch_impl/trace.py)
    mlx    MLX has no operator profiler: the phases measured by this module's clock (Timeline below),
           and on a Metal GPU also an Xcode capture, trace/rank{R}.gputrace (mlx_impl/trace.py)

The first traced step may compile a variant the run had not used, so at least two are taken. Like the
profile steps they run after the last checkpoint and the final eval: no reported figure includes them.

Framework tracer interface (mlx_impl/trace.py and torch_impl/trace.py, both `Tracer`):
    Tracer(trace_dir, rank, device, steps)    a context manager; on exit it writes its files
    .step(number)                             context manager around one step (`step N`)
    .span(name)                               context manager around one phase
    .files                                    the paths written, after exit
and the Trainer's one step (common/train/protocols.py): train_step(..., phase=tracer.span, wait=True)
"""
from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from common.fsutil import atomic_write_text

TRACE_DIR = "trace"
TRACE_STEPS = 2


def trace(trainer, tracer_cls, batches_for, run_dir: Path, rank: int, world_size: int,
          progress=lambda k: None) -> list[str]:
    """Take TRACE_STEPS traced steps; the files written, relative to `run_dir`. `batches_for(k)` ->
    (batches, lr, global_tokens) of the k-th traced step; `progress(k)` after each (the watchdog's
    heartbeat)."""
    trace_dir = Path(run_dir) / TRACE_DIR
    trace_dir.mkdir(parents=True, exist_ok=True)
    with tracer_cls(trace_dir, rank, str(trainer.device), TRACE_STEPS) as tracer:
        for k in range(TRACE_STEPS):
            if world_size > 1:  # start together, so a rank's step does not include waiting for a late peer
                trainer.all_sum(np.zeros(1), over="world")
            with tracer.step(k + 1):
                trainer.train_step(*batches_for(k), phase=tracer.span, wait=True)
            progress(k)
    return [str(Path(path).relative_to(run_dir)) for path in tracer.files]


class Timeline:
    """Spans measured by this process's clock, written as Chrome trace "X" (complete) events.

    Timestamps are microseconds of the wall clock (time.time at the first span, advanced by
    perf_counter), so the files of ranks on one host share a time axis and can be concatenated."""

    def __init__(self, rank: int, label: str):
        self.rank, self.label = rank, label
        self.events: list[dict] = []
        self._wall0, self._perf0 = time.time(), time.perf_counter()

    def _now_us(self) -> float:
        return (self._wall0 + time.perf_counter() - self._perf0) * 1e6

    @contextmanager
    def span(self, name: str, **args):
        start = self._now_us()
        try:
            yield
        finally:
            self.events.append({"name": name, "cat": "dpcompare", "ph": "X", "ts": round(start, 3),
                                "dur": round(self._now_us() - start, 3), "pid": self.rank, "tid": 0,
                                **({"args": args} if args else {})})

    def write(self, path: Path, **other) -> Path:
        """The Chrome trace JSON, with the process named after the rank; `other` goes to otherData."""
        names = [{"name": "process_name", "ph": "M", "pid": self.rank, "tid": 0,
                  "args": {"name": f"rank {self.rank} ({self.label})"}},
                 {"name": "process_sort_index", "ph": "M", "pid": self.rank, "tid": 0,
                  "args": {"sort_index": self.rank}},
                 {"name": "thread_name", "ph": "M", "pid": self.rank, "tid": 0, "args": {"name": "steps"}}]
        write_chrome_trace(path, names + sorted(self.events, key=lambda e: e["ts"]), other)
        return path


def write_chrome_trace(path: Path, events: list[dict], other: dict | None = None) -> None:
    """{"traceEvents": [...]} as chrome://tracing and Perfetto read it; written whole or not at all."""
    atomic_write_text(Path(path), json.dumps({"traceEvents": events, "displayTimeUnit": "ms",
                                              "otherData": {"generator": "dpcompare --trace", **(other or {})}}))
