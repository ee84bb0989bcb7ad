"""The report's greedy continuations, read from each finished run's sample.json.

`dpcompare compare` writes those files once its runs have trained (compare/launch/sample.py); the
report starts nothing. A run without one, or with one sampled from an older checkpoint than the run's
latest (the run was resumed since), is left out of the section.
"""
from __future__ import annotations

from pathlib import Path

from common.checkpoint.store import latest_checkpoint
from common.metrics import read_json

from .parity import RunData

SAMPLE_FILE = "sample.json"  # compare/launch/sample.py writes it into the run directory


def read_sample(run_dir: Path) -> dict | None:
    """The run's sample.json, or None when there is none or it predates the run's latest checkpoint."""
    sample = read_json(Path(run_dir) / SAMPLE_FILE, None)
    if not isinstance(sample, dict):
        return None
    latest = latest_checkpoint(run_dir)
    if Path(sample.get("checkpoint") or "").name != (latest.name if latest else ""):
        return None
    return sample


def samples_summary(runs: list[RunData]) -> dict:
    """{"prompt", "by_run": {label: sample}, "fp32_identical"}: whether the float32 runs' texts agree
    (None with fewer than two)."""
    texts = {r.label: sample for r in runs if r.ok and (sample := read_sample(r.run_dir)) is not None}
    fp32 = {label: s["text"] for label, s in texts.items() if "text" in s and " bf16 " not in f" {label} "}
    prompt = next((s["prompt"] for s in texts.values() if s.get("prompt")), None)
    return {"prompt": prompt, "by_run": texts,
            "fp32_identical": len(set(fp32.values())) <= 1 if len(fp32) > 1 else None}
