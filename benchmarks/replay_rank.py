"""One rank of bench_tp.py's communication replay: `replay_rank.py mlx|torch BACKEND OUT SIZE:COUNT...`.

Replays a step's all-reduces: COUNT float32 all-reduces of SIZE bytes back to back, each waited for before the
next starts (as in a step, where each needs the compute before it), after one barrier. Five timed sequences per
pair after one warmup; rank 0 writes the seconds per sequence to OUT. No barrier between the calls: on a busy
machine a rank that sleeps before every call waits a scheduler tick to run again (allreduce_rank.py's per-call
times), which would count that tick once per call.
"""
import json
import os
import sys
import time

framework, backend, out = sys.argv[1:4]
pairs = [tuple(int(v) for v in arg.split(":")) for arg in sys.argv[4:]]
REPEATS = 5

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
for size, count in pairs:
    x = make(size)
    times = []
    for repeat in range(REPEATS + 1):
        barrier()
        start = time.perf_counter()
        for _ in range(count):
            all_reduce(x)
        if repeat:  # the first sequence warms up
            times.append(time.perf_counter() - start)
    results.append({"size_bytes": size, "count": count, "times_s": times})
    del x

if rank == 0:
    with open(out, "w") as f:
        json.dump(results, f)
if framework == "torch":
    dist.destroy_process_group()
