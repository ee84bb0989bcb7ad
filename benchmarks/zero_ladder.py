"""The ZeRO ladder measured: each rank's bytes of parameters, gradients and optimizer state under ddp, zero1, zero2 and
fsdp, beside the formula (common/parallel/zero.py: 16Ψ, 8Ψ + 8Ψ/N, 4Ψ + 12Ψ/N, 16Ψ/N; fp32 Adam, whose fp32
parameters are the master copy), the padding of the shards, and the peak RSS with the phase the prediction puts it in.

    python benchmarks/zero_ladder.py OUT      # runs `dpcompare compare --strategies ddp,zero1,zero2,fsdp --nproc 2`
    python benchmarks/zero_ladder.py OUT --table-only      # the table of an existing compare directory

The docs' excerpt (docs/strategies.md "The ZeRO ladder") came from it. Extra flags after `--` go to compare
(default: `--preset small --seq-len 128 --global-batch-size 8 --steps 4`).
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common.model.spec import ModelSpec  # noqa: E402
from common.model.weights import parameter_shapes  # noqa: E402
from common.parallel.zero import pad_elements, paper_bytes  # noqa: E402

STAGE = {"ddp": 0, "zero1": 1, "zero2": 2, "fsdp": 3}
TERMS = {0: "16Ψ", 1: "8Ψ + 8Ψ/N", 2: "4Ψ + 12Ψ/N", 3: "16Ψ/N"}
DEFAULT = ["--preset", "small", "--seq-len", "128", "--global-batch-size", "8", "--steps", "4", "--warmup-steps", "1",
           "--eval-every", "0", "--no-op-profile", "--no-samples"]


def table(out: Path) -> list[str]:
    rows = ["| run | formula | Ψ | formula MB (padding aside) | padding MB | params / grads / optimizer MB per rank | "
            "state MB per rank | peak RSS MB per rank (phase) |", "|---|---|---|---|---|---|---|---|"]
    runs = [(p, json.loads((p / "summary.json").read_text())) for p in out.iterdir() if (p / "summary.json").exists()]
    runs = [(p, s) for p, s in runs if s.get("strategy", "ddp") in STAGE and s["world_size"] > 1]
    for run, s in sorted(runs, key=lambda r: (r[1]["framework"], STAGE[r[1].get("strategy", "ddp")])):
        strategy, n = s.get("strategy", "ddp"), s["world_size"]
        shapes = parameter_shapes(ModelSpec.from_dict(json.loads((run / "run_config.json").read_text())["spec"]))
        held = s["state_bytes"]
        psi = sum(math.prod(x) for x in shapes.values())
        formula = paper_bytes(psi, n, STAGE[strategy], mixed=False)
        pad = {1: 8, 2: 12}.get(STAGE[strategy], 0) * pad_elements(shapes, n) / n
        pred = s.get("memory_prediction") or {}
        parts = [" / ".join(f"{held[k][r] / 1e6:,.2f}" for k in ("params", "grads", "optimizer")) for r in range(n)]
        state = [f"{sum(held[k][r] for k in ('params', 'grads', 'optimizer')) / 1e6:,.2f}" for r in range(n)]
        peaks = [f"{b / 1e6:,.0f} ({phase})" for b, phase in zip(s.get("peak_rss_bytes") or [],
                                                                      pred.get("peak_at") or ["?"] * n)]
        label = f"{s['framework']} {strategy} x{n}"
        rows.append(f"| {label} | {TERMS[STAGE[strategy]]} | {psi:,} | "
                    f"{formula / 1e6:,.2f} | {pad / 1e6:,.3f} | "
                    f"{'; '.join(parts)} | {'; '.join(state)} | {'; '.join(peaks)} |")
    return rows


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    extra = argv[argv.index("--") + 1:] if "--" in argv else DEFAULT
    if "--table-only" not in argv:
        subprocess.run([sys.executable, "-m", "compare.cli", "compare", "--frameworks", "mlx,torch", "--strategies",
                        "ddp,zero1,zero2,fsdp", "--nproc", "2", *extra, "--out", str(out)], cwd=ROOT, check=True)
    print("\n".join(table(out)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
