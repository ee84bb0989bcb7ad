"""Long context under cp: each rank's peak activation memory at cp=2 against one rank's (ddp x1), on `small` at a
sequence length where the activations dominate a rank's memory. The activation share is the peak less the state
(params + grads + optimizer, summary.json's state_bytes): MLX's allocator peak (peak_mem_bytes), and for both the
peak RSS (peak_rss_bytes) less the RSS the rank held before its model existed (fixed_rss_bytes: the interpreter and
the framework).

    python benchmarks/cp_memory.py OUT                       # small, seq 1024, two sequences a step, 3 steps
    python benchmarks/cp_memory.py OUT --table-only          # the table of an existing compare directory
    python benchmarks/cp_memory.py OUT -- --seq-len 512 ...  # other flags for compare

The issue's bar: cp=2's activations per rank at most 0.6 of one rank's (docs/strategies.md "The sequence axis").
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ["--preset", "small", "--seq-len", "1024", "--global-batch-size", "2", "--steps", "3", "--warmup-steps",
           "1", "--eval-every", "0", "--no-op-profile", "--no-samples", "--profile-steps", "0", "--no-link-probe"]


def activations(s: dict) -> tuple[float | None, float]:
    """(allocator peak less state, peak RSS less the fixed footprint and state), the larger rank's, in bytes; the
    allocator's is None for torch on a CPU (its peak_mem_bytes is the RSS)."""
    held = s["state_bytes"]
    state = max(sum(held[k][r] for k in ("params", "grads", "optimizer")) for r in range(s["world_size"]))
    alloc = s.get("peak_mem_bytes")
    alloc_peak = max(alloc) if isinstance(alloc, list) else alloc
    rss = max(p - (f or 0) for p, f in zip(s["peak_rss_bytes"], s.get("fixed_rss_bytes") or [0] * s["world_size"]))
    return (alloc_peak - state if alloc_peak and s["framework"] == "mlx" else None), rss - state


def table(out: Path) -> list[str]:
    runs = {}
    for p in sorted(out.iterdir()):
        if (p / "summary.json").exists():
            s = json.loads((p / "summary.json").read_text())
            runs[(s["framework"], s.get("strategy", "ddp"), s["world_size"])] = s
    rows = ["| framework | run | allocator peak - state MB | peak RSS - fixed - state MB | ratio to x1 (allocator; RSS) |",
            "|---|---|---|---|---|"]
    for (fw, strategy, n), s in sorted(runs.items()):
        alloc, rss = activations(s)
        base = runs.get((fw, "ddp", 1))
        ratio = ""
        if base is not None:
            b_alloc, b_rss = activations(base)
            ratio = "; ".join(f"{a / b:.2f}" for a, b in ((alloc, b_alloc), (rss, b_rss)) if a and b)
        rows.append(f"| {fw} | {strategy} x{n} | {'–' if alloc is None else f'{alloc / 1e6:,.0f}'} | "
                    f"{rss / 1e6:,.0f} | {ratio} |")
    return rows


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    if "--table-only" not in argv:
        subprocess.run([sys.executable, "-m", "compare.cli", "compare", "--frameworks", "mlx,torch", "--strategies",
                        "cp", "--nproc", "1,2", *DEFAULT, *extra, "--out", str(out), "--overwrite"], cwd=ROOT,
                       check=True)
    print("\n".join(table(out)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
