"""`--trace` in MLX (common/train/trace.py): the phases by dpcompare's own clock, and on a Metal GPU a capture.

MLX has no operator profiler and no Chrome trace of its own, on the CPU or on a GPU. So trace/rank{R}.json
holds the spans of common/train/trace.py's Timeline: each step and its phases, each phase ended by mx.eval
(Trainer.train_step with wait=True), with pid = the rank.

On a Metal GPU (macOS) MLX can record every GPU command buffer into an Xcode capture
(mx.metal.start_capture / stop_capture): the last traced step goes to trace/rank{R}.gputrace, opened
with Xcode, besides the JSON. Metal allows a capture only when MTL_CAPTURE_ENABLED=1 was in the environment
when the process started, so the launcher sets it for traced MLX runs (compare/launch/launchers.py). A capture
can be large (every buffer a step touches), hence one step. A capture that cannot start is named in the
JSON's otherData and on stderr and never fails the run. Not tested here: Linux, no GPU. MLX's CUDA backend
has no capture; an external profiler (nsys) sees its kernels.
"""
from __future__ import annotations

import shutil
import sys
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx

from common.train.trace import Timeline


class Tracer:
    def __init__(self, trace_dir: Path, rank: int, device: str, steps: int):
        self.trace_dir, self.rank, self.device, self.steps = Path(trace_dir), rank, device, steps
        self.timeline = Timeline(rank, f"mlx {device}")
        self.metal = device == "gpu" and sys.platform == "darwin" and mx.metal.is_available()
        self.capture_note = "none: Metal only" if not self.metal else ""
        self.files: list[Path] = []

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        if kind is None:
            path = self.trace_dir / f"rank{self.rank}.json"
            self.files.insert(0, self.timeline.write(
                path, framework="mlx", device=self.device, mlx=mx.__version__, metal_capture=self.capture_note,
                clock="dpcompare's, each phase ended by mx.eval"))
        return False

    def span(self, name: str):
        return self.timeline.span(name)

    @contextmanager
    def step(self, number: int):
        capturing = self.metal and number == self.steps and self._start_capture()
        try:
            with self.timeline.span(f"step {number}"):
                yield
        finally:
            if capturing:
                self._stop_capture()

    def _capture_path(self) -> Path:
        return self.trace_dir / f"rank{self.rank}.gputrace"

    def _start_capture(self) -> bool:
        path = self._capture_path()
        if path.is_dir():  # a bundle; Metal will not write over one
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        try:
            mx.metal.start_capture(str(path))
        except Exception as err:  # noqa: BLE001 - a trace must never fail the run it traces
            self.capture_note = (f"failed: {type(err).__name__}: {err} (Metal captures need "
                                 "MTL_CAPTURE_ENABLED=1 when the process starts)")
            print(f"rank {self.rank}: --trace: Metal capture {self.capture_note}", file=sys.stderr, flush=True)
            return False
        return True

    def _stop_capture(self) -> None:
        try:
            mx.metal.stop_capture()
        except Exception as err:  # noqa: BLE001
            self.capture_note = f"failed to stop: {type(err).__name__}: {err}"
            return
        path = self._capture_path()
        if path.exists():
            self.capture_note = path.name
            self.files.append(path)
        else:
            self.capture_note = "stopped, but Metal wrote no file"
