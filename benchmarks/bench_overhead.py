"""Harness overhead: tokens/s of `dpcompare run` against a bare training loop of the same model.

    python benchmarks/bench_overhead.py [--quick] [--out runs/bench/overhead.json]

For each framework and world size, alternately (suite, bare, suite, bare, ...): `dpcompare run` on
TinyStories, then bare_mlx.py / bare_torch.py (random tokens of the same shape) started the way the
runner starts ranks, with the same threads and BLAS. Both report the median step time after the same
warmup steps. Target: suite >= 0.97x bare.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import benchlib

TARGET = 0.97
WARMUP = 3  # dpcompare's timing_warmup_steps default; the bare loops drop as many


def bare_tokens_per_s(framework: str, nproc: int, vocab: int, a, work: Path, extra: list[str] = ()) -> float:
    out = work / f"bare_{framework}_{nproc}.json"
    args = ["--preset", a.preset, "--vocab", str(vocab), "--seq-len", str(a.seq_len), "--batch", str(a.batch),
            "--steps", str(a.steps), "--out", str(out), *extra]
    if framework == "mlx" and nproc > 1:
        args += ["--backend", "ring"]
    benchlib.launch_script(benchlib.REPO / "benchmarks" / f"bare_{framework}.py", args, framework, nproc,
                           threads=a.threads)
    result = json.loads(out.read_text())
    return result["tokens_per_step"] / benchlib.steady_median(result["step_time_s"], WARMUP)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench/overhead.json"))
    parser.add_argument("--quick", action="store_true", help="one A/B pair per row instead of three")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--frameworks", default="mlx,torch")
    parser.add_argument("--nproc", default="1,2")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    a = parser.parse_args()
    repeats = a.repeats or (1 if a.quick else 3)

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_overhead_") as work:
        work = Path(work)
        for framework in a.frameworks.split(","):
            for nproc in map(int, a.nproc.split(",")):
                suite, bare = [], []
                for _ in range(repeats):
                    benchlib.wait_for_quiet()
                    summary = benchlib.dpcompare_run(work / "suite", framework, nproc, a.preset, a.steps,
                                                     a.seq_len, a.batch, a.threads)
                    vocab = json.loads((work / "suite" / "run_config.json").read_text())["spec"]["vocab_size"]
                    suite.append(summary["tokens_per_s"])
                    bare.append(bare_tokens_per_s(framework, nproc, vocab, a, work))
                row = {"framework": framework, "nproc": nproc, "suite_tokens_per_s": benchlib.median(suite),
                       "bare_tokens_per_s": benchlib.median(bare),
                       "suite": suite, "bare": bare,
                       "pair_ratios": [s / b for s, b in zip(suite, bare)]}
                row["ratio"] = row["suite_tokens_per_s"] / row["bare_tokens_per_s"]
                row["met"] = row["ratio"] >= TARGET
                rows.append(row)
                print(f"{framework} x{nproc}: suite {suite}, bare {bare}", flush=True)

    benchlib.print_table(rows, [("framework", "framework", ""), ("nproc", "N", "d"),
                                ("suite_tokens_per_s", "suite tok/s", ".0f"), ("bare_tokens_per_s", "bare tok/s", ".0f"),
                                ("ratio", "suite/bare", ".3f"), ("met", f">={TARGET}", "")],
                         title=f"harness overhead: {a.preset}, seq {a.seq_len}, global batch {a.batch}, {a.steps} steps "
                               f"(median after {WARMUP}), {a.threads} thread(s)/rank, {repeats} alternating pairs")
    benchlib.write_result(a.out, "overhead", {**vars(a), "out": str(a.out), "repeats": repeats, "target": TARGET},
                          rows)


if __name__ == "__main__":
    main()
