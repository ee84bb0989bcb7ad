"""MLX against torch on `small`, phase by phase: the figures behind issue 13's targets.

    python benchmarks/bench_gap.py [--quick] [--out runs/bench/gap.json] [--flags=--tune-malloc]
                                   [--mlx-flags="--mlx-cpu-jit baseline"] [--torch-flags=...]

TinyStories + GPT-2 (vocab 50257), seq 256, global batch 8, 1 thread per rank, N=1 and N=2; the four runs
alternate (mlx x1, torch x1, mlx x2, torch x2, then again) so both frameworks see the same machine.
Each run adds --profile-steps rounds of profile steps after its timed ones (common/train/breakdown.py), so every
row also says where the step goes. Printed per framework and N: tokens/s, the phases in ms, exposed
gradient communication as a share of the step; then MLX / torch tokens/s at each N, the first target
(>= 0.8) and the communication target (<= 5 % at N=2).
"""
from __future__ import annotations

import argparse
import shlex
import tempfile
from pathlib import Path

import benchlib

PHASES = ("data", "forward", "backward", "communication", "optimizer", "other")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench/gap.json"))
    parser.add_argument("--quick", action="store_true", help="one round instead of --repeats")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--nproc", default="1,2")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--profile-steps", type=int, default=5)
    parser.add_argument("--flags", default="", help="extra `dpcompare run` flags for both frameworks")
    parser.add_argument("--mlx-flags", default="", help="extra flags for the MLX runs only")
    parser.add_argument("--torch-flags", default="", help="extra flags for the torch runs only")
    a = parser.parse_args()
    repeats = 1 if a.quick else a.repeats
    nprocs = [int(n) for n in a.nproc.split(",")]
    extra = {"mlx": shlex.split(a.flags) + shlex.split(a.mlx_flags),
             "torch": shlex.split(a.flags) + shlex.split(a.torch_flags)}

    runs: dict[tuple[str, int], list[dict]] = {(fw, n): [] for n in nprocs for fw in ("mlx", "torch")}
    with tempfile.TemporaryDirectory(prefix="bench_gap_") as work:
        for r in range(repeats):
            for (fw, n) in runs:
                load = benchlib.wait_for_quiet()
                s = benchlib.dpcompare_run(Path(work) / f"{fw}{n}", fw, n, a.preset, a.steps, a.seq_len, a.batch,
                                           extra=["--profile-steps", str(a.profile_steps), *extra[fw]])
                b = s["breakdown"]
                run = {"tokens_per_s": s["tokens_per_s"], "step_s": s["step_time_s"],
                       "reference_step_s": b["reference_step_s"], "final_loss": s["final_loss"],
                       "load": load, **{p: b[p] for p in PHASES}}
                runs[fw, n].append(run)
                print(f"round {r + 1}/{repeats} {fw} x{n}: {run['tokens_per_s']:.0f} tokens/s, "
                      f"communication {1e3 * run['communication']:.0f} ms of {1e3 * run['reference_step_s']:.0f} ms"
                      f" (load {load:.1f})", flush=True)

    rows = []
    for (fw, n), rs in runs.items():
        row = {"run": f"{fw} x{n}", "framework": fw, "nproc": n,
               **{k: benchlib.median(r[k] for r in rs) for k in ("tokens_per_s", "step_s", "reference_step_s",
                                                                   "final_loss", *PHASES)}}
        row["communication_share"] = row["communication"] / row["reference_step_s"]
        row.update({f"{p}_ms": 1e3 * row[p] for p in PHASES})
        row["runs"] = rs
        rows.append(row)
    benchlib.print_table(rows, [("run", "run", ""), ("tokens_per_s", "tokens/s", ".0f"),
                                *[(f"{p}_ms", p, ",.0f") for p in PHASES],
                                ("communication_share", "comm share", ".1%"), ("final_loss", "final loss", ".7f")],
                         title=f"{a.preset}, seq {a.seq_len}, global batch {a.batch}, 1 thread/rank, medians of "
                               f"{repeats} round(s), phases in ms per step")
    ratios = {}
    for n in nprocs:
        by_fw = {r["framework"]: r for r in rows if r["nproc"] == n}
        ratios[n] = by_fw["mlx"]["tokens_per_s"] / by_fw["torch"]["tokens_per_s"]
        print(f"N={n}: MLX / torch tokens/s = {ratios[n]:.3f} (target >= 0.8: {'met' if ratios[n] >= 0.8 else 'not met'})")
    for r in rows:
        if r["nproc"] > 1:
            print(f"{r['run']}: exposed communication {r['communication_share']:.1%} of the step "
                  f"(target <= 5 %: {'met' if r['communication_share'] <= 0.05 else 'not met'})")
    benchlib.write_result(a.out, "gap", {**vars(a), "out": str(a.out), "repeats": repeats}, rows,
                          mlx_over_torch={str(n): v for n, v in ratios.items()})


if __name__ == "__main__":
    main()
