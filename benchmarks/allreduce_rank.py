"""One rank of the all-reduce sweep in bench_collectives.py: `allreduce_rank.py mlx|torch BACKEND OUT SIZES...`.

Sums a float32 buffer of each size (bytes) over all ranks: a few warmup calls, then `iterations(size)`
timed calls, each waited for (mx.eval / a blocking dist.all_reduce), after a barrier so the ranks start
together. Rank 0 writes the per-call times to OUT.
"""
import json
import os
import sys
import time

framework, backend, out, sizes = sys.argv[1], sys.argv[2], sys.argv[3], [int(s) for s in sys.argv[4:]]
BUDGET_BYTES = 512 * 2**20  # per size: enough calls to move this much, so big sizes repeat less


def iterations(size: int) -> int:
    return max(3, min(50, BUDGET_BYTES // size))


if framework == "mlx":
    import mlx.core as mx

    group = mx.distributed.init(backend=backend, strict=True)
    rank = group.rank()

    def barrier():
        mx.eval(mx.distributed.all_sum(mx.zeros(1), group=group))

    def make(size):
        x = mx.ones(size // 4, dtype=mx.float32)
        mx.eval(x)
        return x

    def all_reduce(x):
        mx.eval(mx.distributed.all_sum(x, group=group))
else:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 1)))
    dist.init_process_group(backend)
    rank = dist.get_rank()
    barrier = dist.barrier

    def make(size):
        return torch.ones(size // 4, dtype=torch.float32)

    def all_reduce(x):
        dist.all_reduce(x)

results = []
for size in sizes:
    x = make(size)
    for _ in range(2):
        all_reduce(x)
    times = []
    for _ in range(iterations(size)):
        barrier()
        start = time.perf_counter()
        all_reduce(x)
        times.append(time.perf_counter() - start)
    results.append({"size_bytes": size, "times_s": times})
    del x

if rank == 0:
    with open(out, "w") as f:
        json.dump(results, f)
if framework == "torch":
    dist.destroy_process_group()
