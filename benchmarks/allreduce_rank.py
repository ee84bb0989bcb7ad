"""One rank of the all-reduce sweep in bench_collectives.py: `allreduce_rank.py mlx|torch BACKEND OUT SIZES...`.

The rank is dpcompare's own (`python -m {mlx,torch}_impl.probe`, timing in common/costmodel/probe.py), the one
`dpcompare doctor --fabric` runs: a float32 buffer of each size (bytes) summed over all ranks, two warmup
calls, then timed calls, each waited for, after a barrier so the ranks start together. Here with no time
budget and the benchmark's call counts, max(3, min(50, 512 MB / size)) per size. Rank 0 writes the
result to OUT (its "results": per size, the per-call times).
"""
import importlib
import sys

framework, backend, out, sizes = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
BUDGET_BYTES = 512 * 2**20  # per size: enough calls to move this much, so big sizes repeat less

fabric = importlib.import_module(f"{framework}_impl.probe")
sys.exit(fabric.main(["--backend", backend, "--out", out, "--sizes", ",".join(sizes), "--max-calls", "50",
                      "--budget-bytes", str(BUDGET_BYTES), "--device", "auto"]))
