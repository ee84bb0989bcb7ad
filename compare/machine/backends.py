"""Which distributed backends and devices this machine's framework builds have, asked of a fresh
interpreter (this process imports neither framework, and a broken install cannot crash it): the whole
picture for `dpcompare doctor` (probe), and a yes or no before a run starts (check_available), so a run
that cannot start exits 2 before anything starts."""
from __future__ import annotations

import functools
import json
import subprocess
import sys

from common.config import RunConfig
from common.errors import UserError

from ..launch.hosts import effective_backend
from . import environment as env

MLX_PROBE = r"""
import json, mlx.core as mx
print(json.dumps({
    "default_device": str(mx.default_device()),
    "gpu": bool(mx.is_available(mx.gpu)),
    "backends": {b: bool(mx.distributed.is_available(b)) for b in ("ring", "mpi", "nccl", "jaccl")},
}))
"""
TORCH_PROBE = r"""
import json, torch, torch.distributed as dist
print(json.dumps({
    "cuda": torch.cuda.is_available(),
    "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    "mps": bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()),
    "backends": {"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available(), "mpi": dist.is_mpi_available()},
    "threads": torch.get_num_threads(),
}))
"""


def probe(code: str, timeout: float = 120) -> dict:
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": "probe timed out"}
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or ["import failed"])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


# Backends that only some builds have, and what it takes to get them; ring, gloo and (with mpirun) mpi
# are in every build dpcompare installs.
OPTIONAL_BACKENDS = {
    ("mlx", "jaccl"): "RDMA over Thunderbolt 5: macOS 26.2 or later, RDMA enabled in recoveryOS",
    ("mlx", "jaccl-ring"): "RDMA over Thunderbolt 5: macOS 26.2 or later, RDMA enabled in recoveryOS",
    ("mlx", "nccl"): "NVIDIA GPUs with mlx[cuda] installed",
    ("torch", "nccl"): "NVIDIA GPUs with torch's CUDA build",
}
# One expression per framework, backend or device to check, printed as 0 or 1 by a fresh interpreter.
PROBES = {
    ("mlx", "backend"): "mx.distributed.is_available({name!r})",
    ("mlx", "device"): "mx.is_available(mx.gpu)",
    ("torch", "nccl"): "dist.is_available() and dist.is_nccl_available() and torch.cuda.is_available()",
    ("torch", "cuda"): "torch.cuda.is_available()",
    ("torch", "mps"): "torch.backends.mps.is_available()",
}
PROBE_IMPORTS = {"mlx": "import mlx.core as mx", "torch": "import torch, torch.distributed as dist"}


def check_available(cfg: RunConfig) -> None:
    """Exit 2 before anything starts when this machine's framework build lacks the backend or the device."""
    backend, checks = effective_backend(cfg), []
    need = OPTIONAL_BACKENDS.get((cfg.framework, backend))
    if need is not None and cfg.world_size > 1:
        name = {"jaccl-ring": "jaccl"}.get(backend, backend)
        expr = PROBES[(cfg.framework, "backend" if cfg.framework == "mlx" else backend)].format(name=name)
        checks.append((expr, f"has no {backend} backend; it needs {need}"))
    if cfg.device in ("cuda", "mps", "gpu"):
        key = ("mlx", "device") if cfg.framework == "mlx" else ("torch", "mps" if cfg.device == "mps" else "cuda")
        checks.append((PROBES[key], f"sees no {cfg.device} device"))
    if not checks:
        return
    code = PROBE_IMPORTS[cfg.framework] + "; " + "; ".join(f"print(int(bool({expr})))" for expr, _ in checks)
    answers = probe_flags(code, len(checks))
    for (_, problem), ok in zip(checks, answers):
        if ok is False:
            version = env.version(cfg.framework) or "not installed"
            flag = f"--backend {backend}" if "backend" in problem else f"--device {cfg.device}"
            raise UserError(f"{flag}: {cfg.framework} {version} on this machine ({sys.platform}) {problem}")


@functools.lru_cache(maxsize=None)  # `run` checks before preparing the data and again before launching
def probe_flags(code: str, count: int, timeout_s: float = 60) -> list[bool | None]:
    """Run `code`, which prints `count` lines of 0 or 1, in a fresh interpreter; None where it cannot tell."""
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return [None] * count
    lines = out.stdout.strip().splitlines()[-count:]
    if out.returncode != 0 or len(lines) != count or any(line not in ("0", "1") for line in lines):
        return [False if "ModuleNotFoundError" in out.stderr else None] * count
    return [line == "1" for line in lines]
