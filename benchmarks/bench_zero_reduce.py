"""What zero2's reduce-scatter costs in MLX on the ring, against the all_sum ddp and zero1 run (docs/strategies.md
"The ZeRO ladder"): MLX 0.32.4's ring has no sum_scatter, so mlx_impl/zero.py all-sums the (N, shard) gradient
matrix and keeps its row. Timed at two local ranks on `small`'s gradient size (3,161,856 float32), median of
ROUNDS:

    all_sum        the whole flat gradient all-reduced (ddp, zero1)
    all_sum_slice  the (N, shard) matrix all-reduced, the rank's row kept (zero2 on ring and MPI)
    send_recv      a reduce-scatter written with send/recv (N = 2): each rank sends the other's half and adds the
                   half it receives; half the bytes, but the two transfers run one after the other

    python benchmarks/bench_zero_reduce.py          # starts the two ranks (compare/launch/spawn.py)
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ELEMENTS = 3_161_856  # `small` (dim 256, 8 layers, vocabulary 4096 here): its gradient
ROUNDS = 15


def rank_main() -> None:
    import mlx.core as mx

    group = mx.distributed.init(backend="ring")
    rank, n = group.rank(), group.size()
    shard = -(-ELEMENTS // n)
    flat = mx.random.normal((ELEMENTS,), key=mx.random.key(rank))
    matrix = mx.pad(flat, (0, shard * n - ELEMENTS)).reshape(n, shard)
    mx.eval(flat, matrix)

    def all_sum():
        mx.eval(mx.distributed.all_sum(flat, group=group) / n)

    def all_sum_slice():
        mx.eval(mx.distributed.all_sum(matrix, group=group)[rank] / n)

    def send_recv():
        peer = 1 - rank
        if rank == 0:
            mx.eval(mx.distributed.send(matrix[peer], peer, group=group))
            got = mx.distributed.recv((shard,), mx.float32, peer, group=group)
        else:
            got = mx.distributed.recv((shard,), mx.float32, peer, group=group)
            mx.eval(got)
            mx.eval(mx.distributed.send(matrix[peer], peer, group=group))
        mx.eval((matrix[rank] + got) / n)

    times = {}
    for name, fn in (("all_sum", all_sum), ("all_sum_slice", all_sum_slice), ("send_recv", send_recv)):
        fn()  # warm
        runs = []
        for _ in range(ROUNDS):
            mx.eval(mx.distributed.all_sum(mx.zeros(1), group=group))  # start together
            t = time.perf_counter()
            fn()
            runs.append(time.perf_counter() - t)
        times[name] = statistics.median(runs) * 1e3
    if rank == 0:
        print(json.dumps({"elements": ELEMENTS, "ms_median": times}))


def main() -> int:
    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        hostfile = Path(tmp) / "hosts.json"
        cmd = [sys.executable, "-m", "compare.launch.spawn", "--ranks", "2", "--ring-hostfile", str(hostfile), "--",
               sys.executable, str(Path(__file__).resolve()), "--rank"]
        env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
        return subprocess.run(cmd, cwd=root, env=env).returncode


if __name__ == "__main__":
    if "--rank" in sys.argv:
        rank_main()
    else:
        sys.exit(main())
