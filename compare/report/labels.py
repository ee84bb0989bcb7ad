"""Names of runs: "mlx x2", "mlx fsdp x2", "torch tp bf16 x2" in reports; mlx-n2, mlx-fsdp-n2 on disk.

The default strategy (ddp) and dtype (float32) are left out, so fp32 DDP runs keep the names they always had.
"""
from __future__ import annotations

SHORT_DTYPES = {"float32": None, "bfloat16": "bf16"}


def strategy_name(strategy: str, mesh: str = "") -> str:
    """A run's strategy as labels show it: a mesh by its axes ("dp=2,tp=2" -> "dp2xtp2"), else its name."""
    return mesh.replace("=", "").replace(",", "x") if mesh else strategy


def run_parts(framework: str, strategy: str = "ddp", dtype: str = "float32") -> list[str]:
    parts = [framework]
    if strategy and strategy != "ddp":
        parts.append(strategy)
    short = SHORT_DTYPES.get(dtype, dtype)
    if short:
        parts.append(short)
    return parts


def run_label(framework: str, world_size: int, strategy: str = "ddp", dtype: str = "float32") -> str:
    return " ".join(run_parts(framework, strategy, dtype) + [f"x{world_size}"])


def run_dirname(framework: str, world_size: int, strategy: str = "ddp", dtype: str = "float32") -> str:
    return "-".join(run_parts(framework, strategy, dtype) + [f"n{world_size}"])
