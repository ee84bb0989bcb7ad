"""Issue 58's speed check: MLX / torch tokens/s on the demo at N=1 and N=2, on `small` at N=1, and on the demo in
bfloat16 at N=1, the frameworks alternating within each round (mlx, torch, mlx, torch, ...).

    python benchmarks/bench_speed_check.py [--rounds 2] [--cases demo1,demo2,small1,bf16] [--out FILE.json]

demo: configs/demo.toml (tiny, builtin stories, seq 128, global batch 8), 60 steps; small: TinyStories + GPT-2,
seq 256, global batch 8, 8 steps; 1 thread per rank, --mlx-exp auto, --mlx-bf16-matmul auto, no profile steps.
Prints each run's tokens/s with the 1-minute load average at its start, then per case the median ratio and each
round's; and the MLX runs' BLAS line, which names the exp and bf16 matmul chosen and both timings behind each.
Other work on the machine moves single runs: read the load beside them.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import benchlib

CONFIG = str(benchlib.REPO / "configs" / "demo.toml")
CASES = {
    "demo1": (["--config", CONFIG, "--steps", "60"], 1),
    "demo2": (["--config", CONFIG, "--steps", "60"], 2),
    "small1": (["--preset", "small", "--seq-len", "256", "--global-batch-size", "8", "--steps", "8",
                *benchlib.TINYSTORIES], 1),
    "bf16": (["--config", CONFIG, "--steps", "60", "--dtype", "bfloat16"], 1),
}


def run(out: Path, framework: str, args: list[str], nproc: int) -> dict:
    import json
    import subprocess

    argv = benchlib.DPCOMPARE + ["run", "--framework", framework, "--nproc", str(nproc), *args,
                                 "--threads-per-rank", "1", "--eval-every", "0", "--profile-steps", "0",
                                 "--no-op-profile", "--out", str(out), "--quiet", "--overwrite"]
    proc = subprocess.run(argv, cwd=benchlib.REPO, capture_output=True, text=True)
    summary_path = out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    if proc.returncode != 0 or summary.get("status") != "ok":
        raise RuntimeError(f"dpcompare run failed ({proc.returncode}): {summary.get('error') or proc.stderr[-2000:]}")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--out", type=Path, default=Path("runs/bench/speed_check.json"))
    a = parser.parse_args()
    cases = a.cases.split(",")
    results: dict[str, list[dict]] = {case: [] for case in cases}
    blas = set()
    print(f"{benchlib.env.cpu_model()}, {benchlib.env.cpu_count()} CPUs", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench_speed_") as work:
        for r in range(a.rounds):
            for case in cases:
                args, nproc = CASES[case]
                row = {}
                order = ("mlx", "torch") if r % 2 == 0 else ("torch", "mlx")  # who goes first swaps every round
                for fw in order:
                    load = benchlib.load_average()
                    s = run(Path(work) / f"{case}-{fw}", fw, args, nproc)
                    row[fw] = s["tokens_per_s"]
                    row[f"{fw}_load"] = load
                    if fw == "mlx":
                        blas.add(s["blas"])
                    print(f"round {r + 1} {case} {fw}: {s['tokens_per_s']:,.0f} tokens/s, final loss "
                          f"{s['final_loss']:.7f} (load {load:.1f})", flush=True)
                row["ratio"] = row["mlx"] / row["torch"]
                results[case].append(row)
    print()
    for case, rows in results.items():
        ratios = [row["ratio"] for row in rows]
        print(f"{case}: MLX / torch median {benchlib.median(ratios):.2f} (rounds: "
              f"{', '.join(f'{x:.2f}' for x in ratios)}); MLX {benchlib.median(r['mlx'] for r in rows):,.0f}, torch "
              f"{benchlib.median(r['torch'] for r in rows):,.0f} tokens/s")
    for line in sorted(blas):
        print("MLX BLAS line:", line)
    benchlib.write_result(a.out, "speed_check", {"rounds": a.rounds, "cases": cases},
                          [{"case": c, "rounds": rows} for c, rows in results.items()], blas=sorted(blas))


if __name__ == "__main__":
    main()
