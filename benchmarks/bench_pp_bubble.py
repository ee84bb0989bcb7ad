"""The pipeline's measured bubble against (p - 1) / (M + p - 1), per framework, schedule and M (issue 26).

    python benchmarks/bench_pp_bubble.py [--microbatches 2,4,8] [--schedules gpipe,1f1b] [--steps 8]
                                         [--out runs/bench/pp_bubble.json]

One `dpcompare run --strategy pp --nproc 2` per cell, on `tiny` widened to dim 256 with 4 layers (ffn 704, 4
heads), 16 x 128 tokens per step: micro-batches of 8, 4 and 2 sequences at M = 2, 4, 8. Each stage's idle
fraction is its median over the steps after the first (summary.json `pipeline.bubble`, mlx_impl/pp.py and
torch_impl/pp.py); the busiest stage's is the bubble the formula describes, the other's excess is waiting on
it (common/parallel/pipeline.py split_idle). Cells alternate between the frameworks so a change in the machine's load hits both.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import benchlib

from common.parallel.pipeline import bubble_fraction, split_idle

SHAPE = ["--set", "model.dim=256", "--set", "model.ffn_dim=704", "--set", "model.n_layers=4", "--set",
         "model.n_heads=4", "--set", "model.n_kv_heads=4"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", default="2,4,8")
    parser.add_argument("--schedules", default="gpipe,1f1b")
    parser.add_argument("--frameworks", default="mlx,torch")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("runs/bench/pp_bubble.json"))
    parser.add_argument("--quick", action="store_true", help="M = 8 only, the hardest case")
    a = parser.parse_args()
    if a.quick:
        a.microbatches = "8"
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_pp_") as work:
        for m in (int(x) for x in a.microbatches.split(",")):
            for schedule in a.schedules.split(","):
                for framework in a.frameworks.split(","):
                    load = benchlib.wait_for_quiet()
                    out = Path(work) / f"{framework}-{schedule}-{m}"
                    s = benchlib.dpcompare_run(out, framework, 2, "tiny", a.steps, 128, 16, extra=[
                        *SHAPE, "--strategy", "pp", "--pp-schedule", schedule, "--pp-microbatches", str(m),
                        "--profile-steps", "0"])
                    bubble = (s.get("pipeline") or {}).get("bubble") or [None, None]
                    analytic = bubble_fraction(2, m)
                    idle = split_idle(bubble) or {}
                    rows.append({"framework": framework, "schedule": schedule, "M": m, "analytic": analytic,
                                 "stage0": bubble[0], "stage1": bubble[1], "load": load,
                                 "busiest": idle.get("busiest_stage"), "bubble": idle.get("bubble"),
                                 "points_over": None if not idle else 100 * (idle["bubble"] - analytic),
                                 "step_time_s": s.get("step_time_s")})
    benchlib.print_table(rows, [("framework", "framework", ""), ("schedule", "schedule", ""), ("M", "M", "d"),
                                ("analytic", "analytic", ".1%"), ("stage0", "stage 0", ".1%"),
                                ("stage1", "stage 1", ".1%"), ("busiest", "busiest", "d"),
                                ("points_over", "its idle - analytic", "+.1f"),
                                ("step_time_s", "step s", ".4f"), ("load", "load", ".1f")],
                         "pp at N=2: measured idle fraction per stage against (p - 1) / (M + p - 1)")
    benchlib.write_result(a.out, "pp_bubble", vars(a), rows)


if __name__ == "__main__":
    main()
