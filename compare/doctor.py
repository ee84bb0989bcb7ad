"""`dpcompare doctor`: what this machine can run. Frameworks are probed in subprocesses so this
package stays framework-neutral (and a broken framework install cannot crash the CLI)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from common.config import RunConfig, default_cache_dir

from .machine import environment as env
from .machine.backends import MLX_PROBE, TORCH_PROBE, probe
from .machine.blas import wheel_candidate
from .machine.kernels import described


def mlx_linked_blas() -> str:
    """The BLAS library inside the mlx wheel (Linux): a reference BLAS unless a system one is preloaded."""
    try:
        import importlib.util

        spec = importlib.util.find_spec("mlx")
        lib = Path(spec.submodule_search_locations[0]) / "lib" / "libmlx.so"
        if sys.platform == "darwin":
            return "Accelerate (macOS)"
        out = subprocess.run(["ldd", str(lib)], capture_output=True, text=True, timeout=10).stdout
        blas = [line.split("=>")[0].strip() for line in out.splitlines() if "blas" in line.lower()]
        return ", ".join(blas) or "none found"
    except (OSError, AttributeError, TypeError, subprocess.TimeoutExpired):
        return "unknown"


def doctor(measure_peak: bool = False) -> str:
    versions = env.versions()
    mlx = probe(MLX_PROBE) if versions["mlx"] else {"error": "not installed"}
    torch = probe(TORCH_PROBE) if versions["torch"] else {"error": "not installed"}
    machine = env.machine()
    openblas = env.system_openblas()
    lines = [
        f"python        {versions['python']}  ({sys.executable})",
        f"machine       {machine['processor']}, {machine['cpus']} CPUs, {machine['platform']}",
        f"dpcompare     {versions['dpcompare']}   numpy {versions['numpy']}",
        "",
        f"mlx           {versions['mlx'] or 'not installed'}",
    ]
    if "error" in mlx:
        lines.append(f"  problem     {mlx['error']}")
    else:
        usable = {b: ok for b, ok in mlx["backends"].items()}
        lines += [
            f"  device      {mlx['default_device']} (gpu available: {mlx['gpu']})",
            f"  ring        {'yes' if usable['ring'] else 'no'} (localhost and hostfile ranks over TCP; a waiting rank "
            f"polls its sockets, which costs steps where the ranks fill the {machine['cpus']} CPUs)",
            f"  mpi         {'yes' if usable['mpi'] else 'no'}; mpirun: {env.mpirun() or 'not found'}; "
            f"libmpi: {env.libmpi() or 'not found'}",
            f"  nccl        {'yes' if usable['nccl'] else 'no'}",
            f"  jaccl       {'yes' if usable['jaccl'] else 'no'} (jaccl, jaccl-ring: Thunderbolt 5 RDMA between Macs)",
            f"  BLAS linked {mlx_linked_blas()}",
            f"  --mlx-blas auto uses: {env.mlx_blas('auto')[0]}",
            f"  --mlx-exp auto uses: {described(RunConfig(), 'exp')}",
            f"  --mlx-bf16-matmul auto uses: {described(RunConfig(dtype='bfloat16'), 'bf16_matmul')}",
            f"  attention core (auto, the default run's shapes): {described(RunConfig(), 'attention')}",
        ]
    lines += ["", f"torch         {versions['torch'] or 'not installed'}"]
    if "error" in torch:
        lines.append(f"  problem     {torch['error']}")
    else:
        lines += [
            f"  cuda        {torch['cuda']} {', '.join(torch['cuda_devices'])}",
            f"  mps         {torch['mps']} (DDP over MPS is not supported upstream: multi-rank uses CPU)",
            f"  gloo        {torch['backends']['gloo']}   nccl {torch['backends']['nccl']}   "
            f"mpi {torch['backends']['mpi']}",
        ]
    wheel = wheel_candidate(default_cache_dir()) if sys.platform.startswith("linux") else None
    lines += ["", f"OpenBLAS wheel   {wheel.origin + ' (' + wheel.library + ')' if wheel else 'not installed'}",
              f"system OpenBLAS  {openblas or 'not found (Debian: apt install libopenblas0-pthread)'}",
              "network          `dpcompare doctor --fabric [--hostfile FILE]` measures all-reduce latency and bandwidth"]
    if measure_peak:
        from .machine.peak import measured_peaks

        lines.append("")
        for framework, peak in measured_peaks(refresh=True).items():
            lines.append(f"peak {framework:<6} {peak['flops'] / 1e9:8.1f} GFLOP/s fp32 matmul "
                         f"({peak['device']}, {peak['threads']} thread(s), {peak.get('blas', '')})")
    return "\n".join(lines)
