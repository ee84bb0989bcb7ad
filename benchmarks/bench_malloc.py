"""Page faults from freed-and-refetched memory: `dpcompare run` with and without `--tune-malloc`.

    python benchmarks/bench_malloc.py [--quick] [--out runs/bench/malloc.json]

Both frameworks allocate their large activations (the `small` logits are 1024 x 50257 floats) afresh
every step. glibc serves blocks above its mmap threshold (at most 32 MB) with mmap and unmaps them on
free, so every step faults the same memory in again, page by page (MLX's CPU buffer cache holds only
32 MB by default). `--tune-malloc` sets MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ for the ranks
(compare/machine/environment.py malloc_env), which keeps freed memory in the heap. Runs alternate plain / tuned;
Linux (glibc) only.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import benchlib

from compare.machine.environment import malloc_env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench/malloc.json"))
    parser.add_argument("--quick", action="store_true", help="one pair per row instead of three")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--nproc", default="1,2")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    a = parser.parse_args()
    repeats = 1 if a.quick else 3

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_malloc_") as work:
        for framework in ("mlx", "torch"):
            for nproc in map(int, a.nproc.split(",")):
                runs = {"plain": [], "tuned": []}
                rss = {"plain": [], "tuned": []}
                for _ in range(repeats):
                    for mode in runs:
                        benchlib.wait_for_quiet()
                        s = benchlib.dpcompare_run(Path(work) / mode, framework, nproc, a.preset, a.steps, a.seq_len,
                                                   a.batch, extra=["--tune-malloc"] if mode == "tuned" else [])
                        runs[mode].append(s["tokens_per_s"])
                        rss[mode].append(max(s["peak_rss_bytes"]))
                plain, tuned = benchlib.median(runs["plain"]), benchlib.median(runs["tuned"])
                rows.append({"framework": framework, "nproc": nproc, "plain_tokens_per_s": plain,
                             "tuned_tokens_per_s": tuned, "speedup": tuned / plain,
                             "plain_peak_rss_MiB": benchlib.median(rss["plain"]) / 2**20,
                             "tuned_peak_rss_MiB": benchlib.median(rss["tuned"]) / 2**20, "runs": runs})
    benchlib.print_table(rows, [("framework", "framework", ""), ("nproc", "N", "d"),
                                ("plain_tokens_per_s", "plain tok/s", ".0f"), ("tuned_tokens_per_s", "tuned tok/s", ".0f"),
                                ("speedup", "speedup", ".2f"), ("plain_peak_rss_MiB", "plain RSS MiB", ".0f"),
                                ("tuned_peak_rss_MiB", "tuned RSS MiB", ".0f")],
                         title=f"--tune-malloc ({' '.join(f'{k}={v}' for k, v in malloc_env().items())}), "
                               f"{a.preset}, seq {a.seq_len}, global batch {a.batch}, {repeats} pair(s)")
    benchlib.write_result(a.out, "malloc", {**vars(a), "out": str(a.out), "repeats": repeats, "tuned_env": malloc_env()}, rows)


if __name__ == "__main__":
    main()
