"""`--trace` in torch (common/train/trace.py): torch.profiler's Chrome trace, with dpcompare's phases in it.

trace/rank{R}.json is torch.profiler's own export: every operator on its thread, and on a CUDA GPU the
kernels and memory copies on their streams (ProfilerActivity.CUDA). Each step and its phases are
record_function scopes (user annotations), each phase ended by a device sync (Trainer.train_step with wait=True).
DDP and FSDP reduce gradients from autograd hooks during the backward, so there is no communication
phase of its own: the collectives are the gloo:/nccl: events (and NCCL kernels) inside `backward`.
On MPS the profiler sees only the CPU side (torch.mps.profiler writes Instruments signposts instead,
not a Chrome trace). The file names processes by OS pid; its distributedInfo holds the rank (N > 1).
"""
from __future__ import annotations

from pathlib import Path

from torch.profiler import ProfilerActivity, profile, record_function


class Tracer:
    def __init__(self, trace_dir: Path, rank: int, device: str, steps: int):
        self.trace_dir, self.rank, self.device, self.steps = Path(trace_dir), rank, device, steps
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
        self.profiler = profile(activities=activities)
        self.files: list[Path] = []

    def __enter__(self):
        self.profiler.__enter__()
        return self

    def __exit__(self, kind, value, tb):
        self.profiler.__exit__(kind, value, tb)
        if kind is None:
            path = self.trace_dir / f"rank{self.rank}.json"
            self.profiler.export_chrome_trace(str(path))
            self.files.insert(0, path)
        return False

    def span(self, name: str):
        return record_function(name)

    def step(self, number: int):
        return record_function(f"step {number}")
