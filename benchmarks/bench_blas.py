"""MLX on Linux: the wheel's bundled reference BLAS against a preloaded system OpenBLAS (`--mlx-blas`).

    python benchmarks/bench_blas.py [--quick] [--out runs/bench/blas.json]

`dpcompare run --framework mlx --nproc 1 --mlx-blas bundled|system` on `tiny` (builtin corpus, vocab 2048)
and `small` (TinyStories, GPT-2 vocab 50257), alternately. The bundled BLAS needs seconds per `small`
step, so runs are short (--steps, 2 warmup steps). Target: system >= 5x bundled on `small`. On macOS both
choices mean Accelerate, and the ratio is 1.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import benchlib

TARGET = 5.0
WARMUP = 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench/blas.json"))
    parser.add_argument("--quick", action="store_true", help="one run per BLAS instead of two")
    parser.add_argument("--presets", default="tiny,small")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    a = parser.parse_args()
    repeats = 1 if a.quick else 2

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_blas_") as work:
        for name in a.presets.split(","):
            runs = {"bundled": [], "system": []}
            for _ in range(repeats):
                for blas in runs:
                    benchlib.wait_for_quiet()
                    s = benchlib.dpcompare_run(Path(work) / blas, "mlx", 1, name, a.steps, a.seq_len, a.batch,
                                               extra=["--mlx-blas", blas, "--set", f"timing_warmup_steps={WARMUP}"])
                    runs[blas].append(s["tokens_per_s"])
                    label = s["blas"]
            bundled, system = benchlib.median(runs["bundled"]), benchlib.median(runs["system"])
            rows.append({"preset": name, "bundled_tokens_per_s": bundled, "system_tokens_per_s": system,
                         "speedup": system / bundled, "runs": runs, "system_blas": label,
                         "met": system / bundled >= TARGET if name == "small" else None})
    benchlib.print_table(rows, [("preset", "preset", ""), ("bundled_tokens_per_s", "bundled tok/s", ".0f"),
                                ("system_tokens_per_s", "OpenBLAS tok/s", ".0f"), ("speedup", "speedup", ".1f"),
                                ("met", f">={TARGET:g}x", "")],
                         title=f"MLX, 1 rank, 1 thread, seq {a.seq_len}, global batch {a.batch}, "
                               f"{a.steps} steps (median after {WARMUP}), {repeats} run(s) per BLAS")
    benchlib.write_result(a.out, "blas", {**vars(a), "out": str(a.out), "repeats": repeats, "target": TARGET}, rows)


if __name__ == "__main__":
    main()
