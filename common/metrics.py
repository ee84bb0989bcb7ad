"""The metrics schema both backends write and `compare` reads.

Run directory (one per framework x world size):
    run_config.json          the resolved RunConfig this run was started with
    metrics.jsonl            rank 0, one JSON object per line (see TRAIN_FIELDS / EVAL_FIELDS)
    ranks/rank{r}.json       per-rank status (starting, running, ok, failed, interrupted), heartbeat and
                             peak memory (written by every rank)
    ranks/stop.json          written by dpcompare before it stops the job on a signal (common/train/supervisor.py)
    summary.json             written by the launcher once all ranks ended (see SUMMARY_FIELDS)
    checkpoints/step_XXXXXX/ model.safetensors + config.json + optimizer.safetensors + state.json
    log.txt                  everything the ranks printed
"""
from __future__ import annotations

import json
import os
import resource
import sys
import time
from typing import Any, Callable
from pathlib import Path

import numpy as np

# One line per optimizer step. `step` counts completed optimizer steps (1-based); `tokens` is the global
# number of real target tokens in the step; `loss` is the global token mean.
TRAIN_FIELDS = ("step", "loss", "lr", "grad_norm", "tokens", "step_time_s", "tokens_per_s")
EVAL_FIELDS = ("step", "eval_loss")
SUMMARY_FIELDS = (
    "framework", "world_size", "backend", "device", "status", "steps", "tokens_per_s", "warmup_steps",
    "compile_s", "wall_s", "peak_mem_bytes", "peak_rss_bytes", "fixed_rss_bytes", "blas", "threads_per_rank", "versions",
    "config",
)


class MetricsWriter:
    """Appends JSON lines; a no-op on ranks other than 0. Flushed per line so a crash loses nothing."""

    def __init__(self, path: Path, enabled: bool):
        self.path = Path(path)
        self._file = open(path, "a", buffering=1) if enabled else None

    def write(self, record: dict) -> None:
        if self._file:
            try:
                self._file.write(json.dumps(record) + "\n")
            except OSError as err:  # a full disk: the error names the file (the launcher prints it)
                raise OSError(err.errno, err.strerror, str(self.path)) from None

    def close(self) -> None:
        if self._file:
            try:
                self._file.close()
            except OSError:  # what could not be flushed was reported by `write`
                pass


def read_jsonl(path: Path) -> list:
    """The rows of a JSON Lines file written as a process ran (none where it does not exist); a line torn by
    the process's end (a killed run, a stopped probe) is left out."""
    rows: list = []
    if not Path(path).exists():
        return rows
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def read_metrics(path: Path) -> tuple[list[dict], list[dict]]:
    """(train rows, eval rows) of a metrics.jsonl; a torn last line from a killed run is ignored."""
    train: list[dict] = []
    evals: list[dict] = []
    for row in read_jsonl(path):
        (evals if "eval_loss" in row else train).append(row)
    return train, evals


def truncate_metrics(path: Path, after_step: int) -> None:
    """Drop lines past `after_step`, so a resumed run does not log steps twice."""
    path = Path(path)
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= after_step:
                kept.append(line)
        except (json.JSONDecodeError, KeyError):
            continue
    path.write_text("".join(k + "\n" for k in kept))


def throughput_stats(train_rows: list[dict], warmup_steps: int) -> dict:
    """Median and spread of tokens/s and step time, excluding the first `warmup_steps` steps."""
    timed = [r for r in train_rows if r["step"] > warmup_steps and r.get("step_time_s")]
    if not timed:
        timed = [r for r in train_rows if r.get("step_time_s")]
    if not timed:
        return {}
    tps = np.array([r["tokens_per_s"] for r in timed])
    st = np.array([r["step_time_s"] for r in timed])
    return {
        "tokens_per_s": float(np.median(tps)),
        "tokens_per_s_p10": float(np.percentile(tps, 10)),
        "tokens_per_s_p90": float(np.percentile(tps, 90)),
        "step_time_s": float(np.median(st)),
        "timed_steps": len(timed),
    }


def peak_rss_bytes() -> int:
    """This process's peak resident set size.

    On Linux VmHWM from /proc: ru_maxrss survives fork+exec, so a rank started by a big launcher
    process would report the launcher's peak instead of its own.
    """
    try:
        return _status_bytes("VmHWM:")
    except (OSError, ValueError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # Linux reports KiB


def held_at_peak_rss(fn: Callable[[], object]) -> float | None:
    """Bytes one call of `fn` holds resident at its peak beyond what was resident before it (Linux: VmHWM, reset to
    the current RSS just before by clear_refs 5); None where the system cannot say (not Linux, no glibc). glibc is
    first told to map every allocation of 64 KiB or more apart (M_MMAP_THRESHOLD, which also stops the threshold
    growing) and to give back what its heap holds (malloc_trim), so the peak is what the call allocated and
    touched, not pages a heap reused. The resident pages, not an allocator's count: MLX's allocator counted 4.5-6.6
    logits-sized buffers at the peak of `small`'s head and cross-entropy where the resident pages rose by 3.0
    (issue 56). It changes how malloc maps for the rest of the process: call it last."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
        libc.malloc_trim(0)
        before = _status_bytes("VmRSS:")
        Path("/proc/self/clear_refs").write_text("5")
        fn()
        return float(max(0, _status_bytes("VmHWM:") - before))
    except (OSError, AttributeError, ValueError):
        return None


def _status_bytes(key: str) -> int:
    """A size line of /proc/self/status (VmRSS:, VmHWM:, ...) in bytes; OSError without /proc (macOS)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    raise ValueError(f"/proc/self/status has no {key}")


def rss_bytes() -> int:
    """This process's resident set size now (VmRSS); where /proc is missing (macOS) the peak so far, which at
    a rank's start, where it is read (common/train/loop.py: the fixed footprint), is about the same."""
    try:
        return _status_bytes("VmRSS:")
    except (OSError, ValueError):
        pass
    return peak_rss_bytes()


def read_json(path: Path, default=None):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return default


def write_json(path: Path, data: dict) -> None:
    from common.fsutil import atomic_write_text

    atomic_write_text(Path(path), json.dumps(data, indent=2, default=_jsonable) + "\n")


def _jsonable(value):
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


class RankStatus:
    """ranks/rank{r}.json: the launcher's watchdog reads it to tell a dead or hung rank from a slow one."""

    def __init__(self, run_dir: Path, rank: int):
        self.path = Path(run_dir) / "ranks" / f"rank{rank}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.data: dict[str, Any] = {"rank": rank, "pid": os.getpid(), "host": os.uname().nodename, "status": "starting",
                     "step": 0, "heartbeat": time.time()}
        self._last_write = 0.0
        self.flush()

    @classmethod
    def existing(cls, run_dir: Path, rank: int) -> "RankStatus":
        """The status file as this rank last wrote it (or a fresh one), to record a failure in."""
        status = cls.__new__(cls)
        status.path = Path(run_dir) / "ranks" / f"rank{rank}.json"
        status.path.parent.mkdir(parents=True, exist_ok=True)
        status.data = read_json(status.path, None) or {"rank": rank, "pid": os.getpid(),
                                                       "host": os.uname().nodename, "step": 0}
        status._last_write = 0.0
        return status

    def update(self, force: bool = False, **fields) -> None:
        self.data.update(fields)
        self.data["heartbeat"] = time.time()
        # A heartbeat at most every half second: cheap next to any real step.
        if force or self.data["heartbeat"] - self._last_write > 0.5:
            self.flush()

    def flush(self) -> None:
        write_json(self.path, self.data)
        self._last_write = time.time()
