"""MLX on Linux: the wheel's bundled reference BLAS against the OpenBLAS wheel and a system OpenBLAS (`--mlx-blas`).

    python benchmarks/bench_blas.py [--quick] [--blas bundled,wheel,system] [--out runs/bench/blas.json]

`dpcompare run --framework mlx --nproc 1 --mlx-blas bundled|wheel|system` on `tiny` (builtin corpus, vocab 2048)
and `small` (TinyStories, GPT-2 vocab 50257), alternately; a library not installed here is left out. The bundled
BLAS needs seconds per `small` step, so runs are short (--steps, 2 warmup steps). Target: the best OpenBLAS >= 5x
bundled on `small`. On macOS every choice means Accelerate, and the ratio is 1.
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
    parser.add_argument("--blas", default="bundled,wheel,system")
    a = parser.parse_args()
    from compare.machine import blas as choices

    here = {"wheel": choices.wheel_candidate(choices.default_cache_dir()), "system": choices.system_candidate()}
    libraries = [b for b in a.blas.split(",") if b == "bundled" or here.get(b) is not None]
    repeats = 1 if a.quick else 2

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_blas_") as work:
        for name in a.presets.split(","):
            runs: dict[str, list] = {b: [] for b in libraries}
            labels = {}
            for _ in range(repeats):
                for blas in runs:
                    benchlib.wait_for_quiet()
                    s = benchlib.dpcompare_run(Path(work) / blas, "mlx", 1, name, a.steps, a.seq_len, a.batch,
                                               extra=["--mlx-blas", blas, "--set", f"timing_warmup_steps={WARMUP}"])
                    runs[blas].append(s["tokens_per_s"])
                    labels[blas] = s["blas"].split(";")[0]
            medians = {b: benchlib.median(v) for b, v in runs.items()}
            best = max((b for b in medians if b != "bundled"), key=medians.get, default="bundled")
            rows.append({"preset": name, **{f"{b}_tokens_per_s": m for b, m in medians.items()},
                         "speedup": medians[best] / medians.get("bundled", medians[best]), "best": best,
                         "runs": runs, "blas": labels,
                         "met": medians[best] / medians["bundled"] >= TARGET if name == "small" and "bundled" in
                         medians else None})
    benchlib.print_table(rows, [("preset", "preset", ""), *[(f"{b}_tokens_per_s", f"{b} tok/s", ".0f")
                                                            for b in libraries],
                                ("best", "best", ""), ("speedup", "best/bundled", ".1f"), ("met", f">={TARGET:g}x", "")],
                         title=f"MLX, 1 rank, 1 thread, seq {a.seq_len}, global batch {a.batch}, "
                               f"{a.steps} steps (median after {WARMUP}), {repeats} run(s) per BLAS")
    benchlib.write_result(a.out, "blas", {**vars(a), "out": str(a.out), "repeats": repeats, "target": TARGET}, rows)


if __name__ == "__main__":
    main()
