"""Time to first step and compile time, for each framework (from `dpcompare run`'s summary.json).

    python benchmarks/bench_startup.py [--quick] [--out runs/bench/startup.json]

time_to_first_step_s: from the launcher starting the ranks to the end of rank 0's first step (imports,
distributed init, weights, the first step's compilation). compile_s: what the warmup steps cost beyond
steady-state steps (MLX's mx.compile tracing, torch's first-call allocations). wall_s: the whole command.
import_s: `import mlx.core, mlx.nn` or `import torch` alone, in a fresh interpreter.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import benchlib

IMPORTS = {"mlx": "import mlx.core, mlx.nn, mlx.optimizers", "torch": "import torch, torch.distributed"}


def import_s(framework: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", IMPORTS[framework]], check=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench/startup.json"))
    parser.add_argument("--quick", action="store_true", help="one run per row instead of three")
    parser.add_argument("--presets", default="tiny,small")
    parser.add_argument("--nproc", default="1,2")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    a = parser.parse_args()
    repeats = 1 if a.quick else 3

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_startup_") as work:
        for name in a.presets.split(","):
            for nproc in map(int, a.nproc.split(",")):
                runs = {"mlx": [], "torch": []}
                for _ in range(repeats):
                    for framework in runs:  # alternate, so both see the same load
                        benchlib.wait_for_quiet()
                        s = benchlib.dpcompare_run(Path(work) / framework, framework, nproc, name, a.steps,
                                                   a.seq_len, a.batch)
                        runs[framework].append({k: s[k] for k in ("time_to_first_step_s", "compile_s", "wall_s",
                                                                  "step_time_s")})
                for framework, got in runs.items():
                    rows.append({"framework": framework, "preset": name, "nproc": nproc, "runs": got,
                                 **{k: benchlib.median(g[k] for g in got) for k in got[0]}})
        imports = {fw: benchlib.median(import_s(fw) for _ in range(repeats)) for fw in IMPORTS}
    for row in rows:
        row["import_s"] = imports[row["framework"]]
    benchlib.print_table(rows, [("framework", "framework", ""), ("preset", "preset", ""), ("nproc", "N", "d"),
                                ("import_s", "import (s)", ".2f"), ("time_to_first_step_s", "first step (s)", ".2f"),
                                ("compile_s", "compile (s)", ".2f"), ("step_time_s", "step (s)", ".3f"),
                                ("wall_s", "wall (s)", ".1f")],
                         title=f"startup, seq {a.seq_len}, global batch {a.batch}, {a.steps} steps, "
                               f"median of {repeats} run(s)")
    benchlib.write_result(a.out, "startup", {**vars(a), "out": str(a.out), "repeats": repeats}, rows)


if __name__ == "__main__":
    main()
