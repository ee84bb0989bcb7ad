"""Run directories as compare/launch/runner.py leaves them (run_config.json, metrics.jsonl, summary.json, the
real schema), written from a given loss curve: what the parity judge, the report, the baseline and the trackers
read in the unit lane, without training."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from common.config import RunConfig
from common.metrics import write_json
from common.model.spec import preset
from compare.report.parity import Tolerances, judge, load_run

STEPS = 40


def reference_losses(steps: int = STEPS) -> list[float]:
    """A decaying loss curve with a little noise, the same at every call (seed 0)."""
    rng = np.random.default_rng(0)
    return [float(2.5 + 5.1 * math.exp(-s / 12) + 0.05 * rng.standard_normal()) for s in range(1, steps + 1)]


def make_run(root: Path, framework: str, nproc: int, losses: list[float] | None = None, *,
             evals: dict[int, float] | None = None, status: str = "ok", config: dict | None = None,
             tokens_per_s: float = 10_000.0, name: str | None = None, write_summary: bool = True,
             op_profile: dict | None = None, summary_extra: dict | None = None) -> Path:
    """A run directory as compare/launch/runner.py leaves it, with the given loss curve (and `op_profile`, a
    record as `op_profile_of` makes one; `summary_extra`, fields that replace or join summary.json's)."""
    losses = reference_losses() if losses is None else losses
    cfg = RunConfig().to_dict()
    cfg.update(framework=framework, nproc=nproc, steps=len(losses), eval_every=20,
               backend="auto" if nproc == 1 else ("ring" if framework == "mlx" else "gloo"))
    cfg.update(config or {})
    run_dir = root / (name or f"{framework}-n{nproc}")
    run_dir.mkdir(parents=True)
    spec = preset(cfg["preset"]).to_dict()
    tokens = cfg["global_batch_size"] * cfg["seq_len"]
    write_json(run_dir / "run_config.json", {
        "config": cfg, "spec": spec, "token_cache": "/cache/tokens", "seed_checkpoint": "/cache/seeds/x",
        "world_size": nproc, "backend": "none" if nproc == 1 else cfg["backend"],
        "data": {"num_documents": 100, "num_tokens": 50_000, "vocab_size": 2048, "tokenizer": "builtin"}})
    rng = np.random.default_rng(nproc)
    lines = []
    for step, loss in enumerate(losses, start=1):
        rate = tokens_per_s * (1 + 0.03 * rng.standard_normal())
        lines.append({"step": step, "loss": loss, "lr": 3e-4, "grad_norm": 1.0, "tokens": tokens,
                      "step_time_s": tokens / rate, "tokens_per_s": rate, "epoch": 0})
        if evals and step in evals:
            lines.append({"step": step, "eval_loss": evals[step]})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    if write_summary:
        rates = [line["tokens_per_s"] for line in lines if "tokens_per_s" in line]
        tps = np.array(rates[3:] or rates)  # after 3 warmup steps, as the runner does
        summary = {
            "framework": framework, "world_size": nproc, "backend": "none" if nproc == 1 else cfg["backend"],
            "device": "cpu", "status": status, "steps": len(losses),
            "tokens_per_s": float(np.median(tps)), "tokens_per_s_p10": float(np.percentile(tps, 10)),
            "tokens_per_s_p90": float(np.percentile(tps, 90)), "step_time_s": tokens / float(np.median(tps)),
            "timed_steps": len(tps), "warmup_steps": 3, "compile_s": 0.4, "time_to_first_step_s": 2.5,
            "wall_s": 12.0, "peak_mem_bytes": [150e6 + 1e6 * r for r in range(nproc)],
            "peak_rss_bytes": [400e6 + 2e6 * r for r in range(nproc)],
            "blas": "openblas (preloaded)" if framework == "mlx" else "framework default",
            "threads_per_rank": cfg["threads_per_rank"],
            "versions": {"python": "3.12.0", "numpy": "2.0", "mlx": "0.32.4", "torch": "2.13.0"},
            "machine": {"host": "testhost", "platform": "Linux-test", "machine": "x86_64",
                        "processor": "Test CPU", "cpus": 2},
            "final_loss": losses[-1], "final_eval_loss": evals[max(evals)] if evals else None,
            "tokens_per_step": tokens, "command": f"python -m {framework}_impl.launch {run_dir}", "config": cfg,
        }
        if op_profile is not None:
            summary["op_profile"] = op_profile
        summary.update(summary_extra or {})
        if status != "ok":
            summary.update(error="rank 1 died at step 7 without reporting an error", failed_rank=1)
        write_json(run_dir / "summary.json", summary)
    return run_dir


def judged(*run_dirs: Path, tol: Tolerances | None = None) -> dict:
    """The parity judgement of these run directories, as `dpcompare report` makes it."""
    return judge([load_run(d) for d in run_dirs], tol or Tolerances())


def op_profile_of(class_ms: dict[str, float], step_ms: float, preset_name: str = "tiny", micro_batch: int = 8,
                  seq_len: int = 32, dtype: str = "float32", bandwidth_Bps: float = 10e9) -> dict:
    """summary.json's op_profile (common/train/opprofile.py's schema) for classes that took `class_ms` per step,
    three reps alike, beside steps of `step_ms`."""
    from common.train.opclasses import class_work
    from common.train.opprofile import summarize

    reps = [{**{name: v / 1e3 for name, v in class_ms.items()}, "reference_step_s": step_ms / 1e3}] * 3
    work = class_work(preset(preset_name), micro_batch, seq_len, 1, dtype)
    return {**summarize(reps, work), "memory_bandwidth_Bps": bandwidth_Bps,
            "shapes": {"micro_batch": micro_batch, "seq_len": seq_len, "grad_accum": 1, "dtype": dtype},
            "build_s": 0.05, "warmup_s": 0.05, "wall_s": 0.4}
