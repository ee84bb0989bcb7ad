"""MFU for each framework and preset against the measured device peak.

    python benchmarks/bench_mfu.py [--quick] [--out runs/bench/mfu.json]

MFU = tokens/s x FLOPs per token (common/model/flops.py: 6 N + 12 L T d) / peak FLOP/s of the hardware the run
used. The peak is compare/machine/peak.py's measured fp32 matmul rate per rank (1024^3 matmuls, same threads and
BLAS as a run) times the ranks; like the report, the MFU column uses the faster framework's peak, and
`own-peak MFU` the run's own framework's. Runs: `dpcompare run` at N=1 and N=2, both frameworks alternately.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import benchlib

from common.model.flops import flops_per_token
from common.model.spec import ModelSpec
from compare.machine.peak import measured_peaks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench/mfu.json"))
    parser.add_argument("--quick", action="store_true", help="one run per row instead of two")
    parser.add_argument("--presets", default="tiny,small")
    parser.add_argument("--nproc", default="1,2")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    a = parser.parse_args()
    repeats = 1 if a.quick else 2
    peaks = measured_peaks(threads=a.threads)
    best = max(p["flops"] for p in peaks.values())
    cpus = benchlib.env.cpu_count()

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_mfu_") as work:
        for name in a.presets.split(","):
            for nproc in map(int, a.nproc.split(",")):
                tps = {"mlx": [], "torch": []}
                for _ in range(repeats):
                    for framework in tps:
                        benchlib.wait_for_quiet()
                        run = Path(work) / framework
                        s = benchlib.dpcompare_run(run, framework, nproc, name, a.steps, a.seq_len, a.batch, a.threads)
                        tps[framework].append(s["tokens_per_s"])
                        spec = ModelSpec.from_dict(json.loads((run / "run_config.json").read_text())["spec"])
                per_token = flops_per_token(spec, a.seq_len)
                share = min(1.0, cpus / (nproc * a.threads))  # oversubscribed ranks cannot exceed the cores
                for framework, got in tps.items():
                    t = benchlib.median(got)
                    rows.append({"framework": framework, "preset": name, "nproc": nproc, "vocab": spec.vocab_size,
                                 "tokens_per_s": t, "flops_per_token": per_token, "mflops_per_token": per_token / 1e6, "achieved_GFLOPs": t * per_token / 1e9,
                                 "mfu": t * per_token / (best * nproc * share),
                                 "own_peak_mfu": t * per_token / (peaks[framework]["flops"] * nproc * share),
                                 "runs": got})
    benchlib.print_table(rows, [("framework", "framework", ""), ("preset", "preset", ""), ("nproc", "N", "d"),
                                ("vocab", "vocab", "d"), ("tokens_per_s", "tok/s", ".0f"),
                                ("mflops_per_token", "MFLOP/token", ".1f"), ("achieved_GFLOPs", "GFLOP/s", ".1f"),
                                ("mfu", "MFU", ".1%"), ("own_peak_mfu", "own-peak MFU", ".1%")],
                         title=f"MFU, seq {a.seq_len}, global batch {a.batch}, {a.threads} thread(s)/rank; peaks per rank: "
                               + ", ".join(f"{fw} {p['flops'] / 1e9:.0f} GFLOP/s ({p.get('blas', '')})"
                                           for fw, p in peaks.items()))
    benchlib.write_result(a.out, "mfu", {**vars(a), "out": str(a.out), "repeats": repeats}, rows, peaks=peaks)


if __name__ == "__main__":
    main()
