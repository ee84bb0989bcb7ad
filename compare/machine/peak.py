"""Measured matmul peaks (the CPU MFU denominator) and the name of this machine's accelerator.

Each framework measures itself in a subprocess (`python -m {mlx,torch}_impl.peak`), started with the
environment a run gets: the same threads per rank and, for MLX, the same preloaded BLAS. Results are
cached per machine, versions, threads, BLAS and device, since a measurement takes seconds.
"""
from __future__ import annotations

import hashlib
import json
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from common.config import FRAMEWORKS, default_cache_dir
from common.metrics import read_json, write_json

from . import environment as env

PROJECT_ROOT = Path(__file__).resolve().parents[2]
PROBE_TIMEOUT_S = 300


def cache_path() -> Path:
    return default_cache_dir() / "peak.json"


def measured_peaks(refresh: bool = False, threads: int = 1, device: str = "cpu") -> dict:
    """{"mlx": {...}, "torch": {...}}, each with flops (FLOP/s), device, threads, blas.

    A framework that cannot be measured gets flops 0.0 and an "error"; failures are not cached.
    """
    blas, blas_env = env.mlx_blas("auto")
    key = cache_key(threads, blas, device)
    cache = read_json(cache_path(), {}) or {}
    if not refresh and key in cache:
        return cache[key]["peaks"]
    peaks = {framework: measure(framework, threads, device, blas, blas_env) for framework in FRAMEWORKS}
    if not any("error" in peak for peak in peaks.values()):
        cache[key] = {"measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "peaks": peaks}
        try:
            cache_path().parent.mkdir(parents=True, exist_ok=True)
            write_json(cache_path(), cache)
        except OSError:
            pass  # a read-only cache costs a re-measurement next time, nothing more
    return peaks


def cache_key(threads: int, blas: str, device: str) -> str:
    identity = [env.machine(), env.versions(), threads, blas, device]
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def measure(framework: str, threads: int, device: str, blas: str, blas_env: dict) -> dict:
    failed = {"flops": 0.0, "device": device, "threads": threads, "blas": blas if framework == "mlx" else ""}
    if env.version(framework) is None:
        return {**failed, "error": f"{framework} is not installed"}
    extra = env.thread_env(threads)
    if framework == "mlx":
        extra.update(blas_env)
    child_env = env.child_env(extra)
    device_arg = {"mlx": {"cuda": "gpu", "mps": "gpu"}, "torch": {"gpu": "cuda"}}[framework].get(device, device)
    argv = [sys.executable, "-m", f"{framework}_impl.peak", "--threads", str(threads), "--device", device_arg]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, env=child_env, cwd=PROJECT_ROOT,
                             timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {**failed, "error": f"timed out after {PROBE_TIMEOUT_S} s"}
    if out.returncode != 0:
        return {**failed, "error": (out.stderr.strip().splitlines() or ["no output"])[-1]}
    try:
        result = json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {**failed, "error": f"unreadable output: {out.stdout[-200:]!r}"}
    if framework == "mlx":
        result["blas"] = blas  # the library the launcher preloads, so the one runs use
    return result


def accelerator_name() -> str | None:
    """This machine's GPU as the known-peak table names it: "NVIDIA H100 80GB HBM3" from nvidia-smi,
    "Apple M2 Max (38-core GPU)" on a Mac; None when there is none or it cannot be told."""
    if sys.platform == "darwin":
        return _apple_gpu()
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    names = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    return names[0] if out.returncode == 0 and names else None


def _apple_gpu() -> str | None:
    try:
        chip = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
        displays = subprocess.run(["system_profiler", "SPDisplaysDataType"], capture_output=True, text=True,
                                  timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    cores = re.search(r"Total Number of Cores:\s*(\d+)", displays)
    if not chip.startswith("Apple"):
        return None
    return f"{chip} ({cores.group(1)}-core GPU)" if cores else chip


def this_host() -> str:
    return platform.node()
