"""The four-axis mesh measured: `--mesh pp=2,dp=2,cp=2,tp=2` (16 ranks, every axis at its smallest) against ddp x1 of
the same model, in both frameworks: max |Δloss| per step, the median step time and peak RSS per rank.

    python benchmarks/four_axis_mesh.py OUT                  # tiny, ring attention, 8 x 32 tokens, 4 steps
    python benchmarks/four_axis_mesh.py OUT --table-only     # the table of runs already in OUT
    python benchmarks/four_axis_mesh.py OUT -- --cp-attention ulysses --set model.n_kv_heads=4   # flags for the runs

Runs `dpcompare run` four times (MLX and torch, ddp x1 and the mesh); not `compare`, which would add ddp at 16
ranks. MLX's mesh runs on MPI (its ring backend cannot split a group). The docs' table (docs/benchmarks.md, "Four
axes") came from it.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MESH = "pp=2,dp=2,cp=2,tp=2"
DEFAULT = ["--preset", "tiny", "--seq-len", "32", "--global-batch-size", "8", "--steps", "4", "--warmup-steps", "1",
           "--lr", "1e-3", "--eval-every", "0", "--no-op-profile", "--profile-steps", "0",
           "--no-link-probe", "--pp-microbatches", "2", "--cp-attention", "ring", "--collective-timeout-s", "600"]
RUNS = {"ddp x1": ["--nproc", "1"], f"{MESH} x16": ["--nproc", "16", "--mesh", MESH]}


def losses(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["loss"] for r in rows if "loss" in r and "step" in r]


def step_times(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["step_time_s"] for r in rows if "step_time_s" in r][1:]  # the first step compiles


def table(out: Path) -> list[str]:
    rows = ["| framework | run | status | max \\|Δloss\\| vs ddp x1 (steps) | step time s (median) | "
            "peak RSS MB per rank (min-max) |", "|---|---|---|---|---|---|"]
    for framework in ("mlx", "torch"):
        base = out / f"{framework}-ddp-n1"
        for label in RUNS:
            run = out / (f"{framework}-ddp-n1" if label == "ddp x1" else f"{framework}-mesh-n16")
            if not (run / "summary.json").exists():
                rows.append(f"| {framework} | {label} | no summary.json (see {run.name}/log.txt) | | | |")
                continue
            s = json.loads((run / "summary.json").read_text())
            mine, ref = losses(run), losses(base) if (base / "metrics.jsonl").exists() else []
            delta = max((abs(a - b) for a, b in zip(mine, ref)), default=float("nan"))
            rss = [r / 1e6 for r in s["peak_rss_bytes"] if r]
            times = step_times(run)
            rows.append(f"| {framework} | {label} | {s['status']} | {delta:.2e} ({min(len(mine), len(ref))}) | "
                        f"{statistics.median(times) if times else float('nan'):.3f} | "
                        f"{min(rss):,.0f}-{max(rss):,.0f} |")
    return rows


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    if "--table-only" not in argv:
        for framework in ("mlx", "torch"):
            for label, flags in RUNS.items():
                run = out / f"{framework}-{'ddp-n1' if label == 'ddp x1' else 'mesh-n16'}"
                subprocess.run([sys.executable, "-m", "compare.cli", "run", "--framework", framework, *DEFAULT,
                                *flags, *extra, "--out", str(run), "--overwrite"], cwd=ROOT, check=False)
    print("\n".join(table(out)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
