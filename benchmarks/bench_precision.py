"""bfloat16 against float32 (`--dtype`), both frameworks: tokens/s and peak memory on `small`, and which op
makes a difference (`precision_ops.py`).

    python benchmarks/bench_precision.py [--quick] [--out runs/bench/precision.json]

Part `steps`: `dpcompare run --nproc 1 --preset small` (TinyStories, GPT-2 vocab) in float32 and bfloat16,
alternating, median step after 2 warmup steps. MLX bf16 matmuls on a CPU do not use the BLAS (MLX's own
kernel; OpenBLAS is preloaded for float32 only), so its runs are slow and short (--steps).
Part `ops`: the ops of a `small` step alone, in each dtype, each framework started as a rank is.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import benchlib

WARMUP = 2
DTYPES = ("float32", "bfloat16")
# How often each op of precision_ops.py runs in one `small` step, forward and backward (4 layers; a
# matmul's backward is two matmuls of its size; q/k/v/o are 4 per layer, gate/up 2).
PER_STEP = {"matmul q/k/v/o (1024x256 @ 256x256)": 4 * 4 * 3, "matmul gate/up (1024x256 @ 256x512)": 4 * 2 * 3,
            "matmul down (1024x512 @ 512x256)": 4 * 3, "matmul lm_head (1024x256 @ 256x50257)": 3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench/precision.json"))
    parser.add_argument("--quick", action="store_true", help="one run per dtype instead of two")
    parser.add_argument("--parts", default="steps,ops")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    a = parser.parse_args()
    repeats = 1 if a.quick else 2
    parts = a.parts.split(",")

    rows, ops = [], {}
    with tempfile.TemporaryDirectory(prefix="bench_precision_") as work:
        if "steps" in parts:
            for framework in ("mlx", "torch"):
                runs = {dt: [] for dt in DTYPES}
                for _ in range(repeats):
                    for dtype in DTYPES:
                        benchlib.wait_for_quiet()
                        s = benchlib.dpcompare_run(Path(work) / dtype, framework, 1, a.preset, a.steps, a.seq_len,
                                                   a.batch, extra=["--dtype", dtype,
                                                                   "--set", f"timing_warmup_steps={WARMUP}",
                                                                   # MLX bf16 steps can exceed a minute here
                                                                   "--collective-timeout-s", "900"])
                        runs[dtype].append({"tokens_per_s": s["tokens_per_s"], "peak_mem_bytes": s["peak_mem_bytes"][0],
                                            "peak_rss_bytes": s["peak_rss_bytes"][0], "final_loss": s["final_loss"]})
                for dtype in DTYPES:
                    med = {k: benchlib.median([r[k] for r in runs[dtype]]) for k in runs[dtype][0]}
                    rows.append({"framework": framework, "dtype": dtype, "tokens_per_s": med["tokens_per_s"],
                                 "step_s": a.seq_len * a.batch / med["tokens_per_s"],
                                 "peak_mem_MiB": med["peak_mem_bytes"] / 2**20, "peak_rss_MiB": med["peak_rss_bytes"] / 2**20,
                                 "runs": runs[dtype]})
                fp32, bf16 = rows[-2], rows[-1]
                bf16["speed_vs_fp32"] = bf16["tokens_per_s"] / fp32["tokens_per_s"]
                bf16["mem_vs_fp32"] = bf16["peak_mem_MiB"] / fp32["peak_mem_MiB"]
            benchlib.print_table(rows, [("framework", "framework", ""), ("dtype", "dtype", ""),
                                        ("tokens_per_s", "tokens/s", ".0f"), ("step_s", "step s", ".2f"),
                                        ("speed_vs_fp32", "vs fp32", ".2f"), ("peak_mem_MiB", "peak mem MiB", ".0f"),
                                        ("mem_vs_fp32", "vs fp32", ".2f"), ("peak_rss_MiB", "peak RSS MiB", ".0f")],
                                 title=f"{a.preset}, 1 rank, 1 thread, seq {a.seq_len}, batch {a.batch}, {a.steps} steps "
                                       f"(median after {WARMUP}), {repeats} run(s) per dtype")
        if "ops" in parts:
            for framework in ("mlx", "torch"):
                path = Path(work) / f"ops_{framework}.json"
                benchlib.wait_for_quiet()
                benchlib.launch_script(benchlib.REPO / "benchmarks" / "precision_ops.py",
                                       [framework, str(path), "3" if a.quick else "7"], framework, 1)
                ops[framework] = json.loads(path.read_text())
            op_rows = []
            for name in ops["mlx"]:
                row = {"op": name}
                for framework in ("mlx", "torch"):
                    for dtype in DTYPES:
                        row[f"{framework}_{dtype}_ms"] = ops[framework][name].get(dtype, 0.0) * 1e3 or None
                    fp32, bf16 = row[f"{framework}_float32_ms"], row[f"{framework}_bfloat16_ms"]
                    row[f"{framework}_ratio"] = bf16 / fp32 if fp32 and bf16 else None
                    if name in PER_STEP:
                        row[f"{framework}_bfloat16_per_step_s"] = bf16 * PER_STEP[name] / 1e3
                op_rows.append(row)
            benchlib.print_table(op_rows, [("op", "op", ""), ("mlx_float32_ms", "MLX fp32 ms", ".2f"),
                                           ("mlx_bfloat16_ms", "MLX bf16 ms", ".2f"), ("mlx_ratio", "ratio", ".1f"),
                                           ("mlx_bfloat16_per_step_s", "MLX bf16 s/step", ".2f"),
                                           ("torch_float32_ms", "torch fp32 ms", ".2f"),
                                           ("torch_bfloat16_ms", "torch bf16 ms", ".2f"), ("torch_ratio", "ratio", ".1f")],
                                 title="one op, forward, best of repeats (s/step: x its count in a small step, fwd+bwd)")
            ops = {"per_framework": ops, "rows": op_rows}
    benchlib.write_result(a.out, "precision", {**vars(a), "out": str(a.out), "repeats": repeats, "warmup": WARMUP},
                          rows, ops=ops)


if __name__ == "__main__":
    main()
