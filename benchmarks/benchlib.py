"""What every benchmark shares: `dpcompare run` as a subprocess, launching a script the way the runner
launches ranks, the machine's description, a table printer and the JSON writer.

Not named `common.py`: `python benchmarks/x.py` puts benchmarks/ first on sys.path, and a
benchmarks/common.py would hide the project's `common` package.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common.config import RunConfig  # noqa: E402
from compare.machine import environment as env  # noqa: E402
from compare.launch.launchers import build_command  # noqa: E402

DPCOMPARE = [sys.executable, "-m", "compare.cli"]
SHARED_DATA = REPO.parent / "shared" / "data"
# The MLX blog's setup: TinyStories with the GPT-2 tokenizer (vocab 50257), for the `small` preset.
TINYSTORIES = ["--dataset", str(SHARED_DATA / "tinystories" / "train.txt"), "--tokenizer", str(SHARED_DATA / "gpt2")]
# `tiny` keeps a small vocabulary (the builtin tokenizer's, about 1,000) only with the builtin data; with GPT-2's 50257
# tokens its output projection would be most of the work.
BUILTIN: list[str] = ["--dataset", "builtin", "--tokenizer", "builtin"]


def data_args(preset: str) -> list[str]:
    if preset == "small" and (SHARED_DATA / "gpt2").is_dir():
        return TINYSTORIES
    return BUILTIN


def dpcompare_run(out: Path, framework: str, nproc: int, preset: str, steps: int, seq_len: int,
                  batch: int, threads: int = 1, extra: list[str] = ()) -> dict:
    """One `dpcompare run`; returns its summary.json (raises when the run failed)."""
    argv = DPCOMPARE + ["run", "--framework", framework, "--nproc", str(nproc), "--preset", preset,
                        "--steps", str(steps), "--seq-len", str(seq_len), "--global-batch-size", str(batch),
                        "--threads-per-rank", str(threads), "--eval-every", "0", *data_args(preset),
                        *extra, "--out", str(out), "--quiet", "--overwrite"]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True)
    summary_path = Path(out) / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    if proc.returncode != 0 or summary.get("status") != "ok":
        raise RuntimeError(f"dpcompare run failed ({proc.returncode}): {summary.get('error') or proc.stderr[-2000:]}")
    return summary


def launch_script(script: Path, args: list[str], framework: str, nproc: int, threads: int = 1,
                  backend: str = "auto", mlx_blas: str = "auto", timeout_s: float = 1800) -> None:
    """Run `script args` as every rank, started exactly as the runner starts `{framework}_impl.launch`
    (plain python at N=1; compare.launch.spawn for an MLX ring, mpirun, torchrun at N>1) with the same thread and
    BLAS environment."""
    cfg = RunConfig(framework=framework, nproc=nproc, threads_per_rank=threads, backend=backend, mlx_blas=mlx_blas)
    cfg.validate()
    run_dir = Path(tempfile.mkdtemp(prefix="bench_launch_"))  # where a ring hostfile goes
    argv, extra, _ = build_command(cfg, run_dir)
    i = next(i for i in range(len(argv)) if argv[i:i + 3] == ["-m", f"{framework}_impl.launch", str(run_dir)])
    argv[i:i + 3] = [str(script), *args]
    child_env = {**os.environ, **extra, "PYTHONUNBUFFERED": "1",
                 "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    try:
        proc = subprocess.run(argv, cwd=REPO, env=child_env, capture_output=True, text=True, timeout=timeout_s)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")


def load_average() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0


def wait_for_quiet(max_load: float | None = None, max_wait_s: float = 60) -> float:
    """Wait (a while) until the 1-minute load drops below the core count: other people's jobs skew timings."""
    limit = max_load if max_load is not None else env.cpu_count()
    deadline = time.time() + max_wait_s
    while load_average() > limit and time.time() < deadline:
        time.sleep(5)
    return load_average()


def median(values) -> float:
    values = [v for v in values if v is not None]
    return float(statistics.median(values)) if values else float("nan")


def steady_median(step_times: list[float], warmup: int) -> float:
    return median(step_times[warmup:] or step_times)


def machine() -> dict:
    return {**env.machine(), "versions": env.versions(), "mlx_blas": env.mlx_blas("auto")[0],
            "load_average_at_start": load_average()}


def print_table(rows: list[dict], columns: list[tuple[str, str, str]], title: str = "") -> None:
    """columns: (key, header, format spec) per column; a missing value prints as '-'."""
    if title:
        print(f"\n{title}")
    cells = [[("-" if r.get(k) is None else format(r[k], fmt)) for k, _, fmt in columns] for r in rows]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, (_, h, _) in enumerate(columns)]
    print("  ".join(h.rjust(w) for (_, h, _), w in zip(columns, widths)))
    for c in cells:
        print("  ".join(v.rjust(w) for v, w in zip(c, widths)))


def drop_checkpoints(kept: Path) -> int:
    """Remove the `checkpoints/` folder of every run kept under `kept` (a folder with its summary.json beside
    it), and return the bytes freed. A kept sitting is read again from its summaries (`--recompute`, `--again`);
    its final checkpoints are the run's own whole model, and filled this machine's disk once: 14 GB of one
    bench_plan_model sitting with `base` and the 1B shape. `--keep-checkpoints` keeps them."""
    freed = 0
    for folder in sorted(Path(kept).rglob("checkpoints")):
        if folder.is_dir() and (folder.parent / "summary.json").is_file():
            freed += sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
            shutil.rmtree(folder)
    return freed


def write_result(path: Path, name: str, params: dict, rows: list[dict], **extra) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"benchmark": name, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": machine(),
            "params": params, "rows": rows, **extra}
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    print(f"\nwrote {path}")
