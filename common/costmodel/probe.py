"""Timing all-reduces on every rank, framework-neutral: the rank side of `dpcompare doctor --fabric` and
of benchmarks/bench_collectives.py.

`python -m {mlx,torch}_impl.probe --backend B --sizes 4096,33554432 ...` is started on every rank by the
launchers that start training (compare/launch/launchers.py). The framework's fabric.py supplies `Collectives`;
`measure` sums a float32 buffer of each size over all ranks: two warmup calls, then timed calls, each
waited for and each after a barrier, so the ranks start together. Every decision that changes the number
of collectives (how many calls a size gets, whether a size is skipped to stay in the time budget) is
rank 0's, sent to the others inside a collective, so the ranks never disagree and hang. Rank 0 prints
one line `RESULT_PREFIX{json}` on stdout (mlx.launch, mpirun and torchrun relay it from any host) and
writes it to --out when given.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

RESULT_PREFIX = "dpcompare-fabric-result "
WARMUP_CALLS = 2
PREDICT_FROM_BYTES = 256 * 1024
STARTED = time.monotonic()  # imported before the framework: the rank's own clock for its time budget


@dataclass
class Collectives:
    """What a framework supplies: its rank and size, where buffers live, and three blocking operations."""
    rank: int
    size: int
    device: str
    buffer: Callable[[int], object]         # a float32 buffer of n bytes, ready (evaluated)
    all_reduce: Callable[[object], None]    # sum over ranks, returns when done
    from_rank0: Callable[[float], float]    # rank 0's value, on every rank (a small all-reduce)
    finish: Callable[[], None] = lambda: None
    all_gather: Callable[[object], None] | None = None  # gathers every rank's buffer, returns when done
    # An all-reduce over this rank's group of `group_size` consecutive ranks (every group at once), for the inner
    # level of a two-level link, or with across=True over the ranks at this rank's place in every group (one rank
    # per machine: the groups that cross the slow link at once, as an outer mesh axis's do); None where the backend
    # cannot split its group (MLX's ring). Every rank calls it.
    group_all_reduce: Callable[[int, bool], Callable[[object], None] | None] | None = None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m {mlx,torch}_impl.probe")
    parser.add_argument("--backend", required=True)
    parser.add_argument("--sizes", required=True, help="comma list of message sizes in bytes, ascending")
    parser.add_argument("--out", help="also write the result JSON here (rank 0)")
    parser.add_argument("--max-calls", type=int, default=50, help="timed calls per size at most")
    parser.add_argument("--budget-bytes", type=int, default=512 * 2**20,
                        help="timed calls per size move at most about this much (3 calls at least)")
    parser.add_argument("--time-budget-s", type=float, default=math.inf,
                        help="stop measuring (skip the remaining sizes) after this long, counted from start")
    parser.add_argument("--device", default="cpu", help="cpu, gpu (MLX) or cuda (torch nccl)")
    parser.add_argument("--communication-stream", default="auto", help="MLX: auto, cpu or default")
    parser.add_argument("--timeout-s", type=float, default=60.0, help="torch: collective timeout")
    args = parser.parse_args(argv)
    args.sizes = [int(s) for s in args.sizes.split(",") if s]
    return args


def planned_calls(size: int, max_calls: int, budget_bytes: int) -> int:
    return max(3, min(max_calls, budget_bytes // max(size, 1)))


def measure(c: Collectives, sizes: list[int], max_calls: int = 50, budget_bytes: int = 512 * 2**20,
            time_budget_s: float = math.inf, started: float = STARTED, op: str = "all_reduce") -> list[dict]:
    """[{"size_bytes", "times_s"}] per size measured; sizes that would not fit the time budget, counted from
    `started` (time.monotonic(); default: when this module was imported), are left out.

    op="all_gather" times `c.all_gather` instead; its size is the gathered (whole) size, as the cost model
    counts an all-gather, so every rank contributes size / N bytes."""
    deadline = started + time_budget_s
    collective = getattr(c, op)
    per_rank = c.size if op == "all_gather" else 1
    results, last = [], None  # last: (size, seconds per call) of the previous size, to predict the next
    for i, size in enumerate(sizes):
        left = deadline - time.monotonic()
        # Time grows with the bytes only past the latency-bound sizes: predict from 256 KB up.
        predicted = last[1] * size / last[0] if last and last[0] >= PREDICT_FROM_BYTES else 0.0
        go = c.from_rank0(1.0 if left > (WARMUP_CALLS + 1) * predicted else 0.0)
        if go < 0.5:
            break
        x = c.buffer(max(4, size // per_rank))
        for _ in range(WARMUP_CALLS):
            start = time.perf_counter()
            collective(x)
        warm_s = time.perf_counter() - start
        calls = planned_calls(size, max_calls, budget_bytes)
        if math.isfinite(time_budget_s):  # this size's share of the time left, over the sizes left
            share = (deadline - time.monotonic()) / (len(sizes) - i)
            calls = min(calls, max(1, int(share / max(warm_s, 1e-6))))
        calls = int(c.from_rank0(float(calls)))
        times = []
        for _ in range(calls):
            c.from_rank0(0.0)  # the barrier: everyone enters the timed call together
            start = time.perf_counter()
            collective(x)
            times.append(time.perf_counter() - start)
        results.append({"size_bytes": size, "times_s": times})
        last = (size, sorted(times)[len(times) // 2])
        del x
    return results


# What every multi-rank run measures of its own all-reduce before training (summary.json `link.allreduce`,
# read by the cost model): a latency-bound size (10 timed calls) and bandwidth-bound ones (3), in a few seconds
# at most (4 MiB at 200 Mbit/s takes ~0.2 s a call).
# 32 MiB (a gradient bucket: MLX's ring reached 0.3 GB/s at 4 MiB and 1.3 at 32 MiB over loopback) only where
# it fits the budget: over 200mbit it would take 1.3 s a call, and 4 MiB is then bandwidth-bound anyway.
# 1 MiB for the slowest links: over 20mbit 4 MiB takes 1.75 s a call, so after its two warm-up calls only one
# was timed, and that one call put the link at 2.05-2.41 MB/s in eight runs; 1 MiB gets 3 (2.35-2.50 in eight).
PROBE_SIZES = (4096, 2**20, 4 * 2**20, 32 * 2**20)
PROBE_BUDGET_S = 5.0


def fit(results: list[dict]) -> dict:
    """{"latency_s", "bandwidth_Bps", "large_bytes"} from measure()'s results: latency is the median time of
    the smallest message, bandwidth the largest over its median time less that latency (None where the
    sweep has one size only)."""
    medians = {r["size_bytes"]: statistics.median(r["times_s"]) for r in results if r["times_s"]}
    if not medians:
        return {"latency_s": None, "bandwidth_Bps": None, "large_bytes": 0}
    small, large = min(medians), max(medians)
    latency = medians[small]
    if large == small:
        return {"latency_s": latency, "bandwidth_Bps": None, "large_bytes": large}
    # Subtracting the latency isolates the time that grows with the bytes; fall back when noise inverts it.
    moving_s = medians[large] - latency
    bandwidth = large / (moving_s if moving_s > 0.05 * medians[large] else medians[large])
    return {"latency_s": latency, "bandwidth_Bps": bandwidth, "large_bytes": large}


def fastest_fit(records: list[dict]) -> dict | None:
    """fit() over each size's fastest call in any of `records` (probe_allreduce's, with their `times_s`): what the
    path gives when no rank waits on the scheduler. On two shared cores a waiting rank's call of 4 KB took 0.1-0.3
    ms or a 4 ms tick, so a run's median latency read 0.3 ms or 3.7 ms from one run to the next (docs/plan-model.md);
    load and ticks only ever slow a call. None where no record holds two sizes' calls."""
    fastest: dict[int, float] = {}
    for record in records:
        for size, calls in ((record or {}).get("times_s") or {}).items():
            if calls:
                fastest[int(size)] = min(fastest.get(int(size), math.inf), min(calls))
    if len(fastest) < 2:
        return None
    return fit([{"size_bytes": size, "times_s": [t]} for size, t in fastest.items()])


def probe_allreduce(c: Collectives, backend: str, op: str = "all_reduce") -> dict:
    """This job's own float32 all-reduce (or op="all_gather": its all-gather, S the gathered size):
    time(S) ~= latency_s + S / bandwidth_Bps at this world size."""
    results = measure(c, list(PROBE_SIZES), max_calls=10, budget_bytes=12 * 2**20,
                      time_budget_s=PROBE_BUDGET_S, started=time.monotonic(), op=op)
    # Each timed call's seconds as this rank saw it, per size: the calls are the same on every rank (rank 0
    # decides their number), so the launcher can take each call's slowest rank (last_rank_fit).
    return {"backend": backend, "world_size": c.size, **fit(results),
            "times_s": {str(r["size_bytes"]): [round(t, 6) for t in r["times_s"]] for r in results}}


def last_rank_fit(records: list[dict]) -> dict | None:
    """fit() over each call's slowest rank, from every rank's probe record (their `times_s`, call by call): the
    time until the last rank of every group has its result, which is what a step that syncs all those groups at
    once waits for. Measured (docs/scaling.md, "Sitting 15"): MLX's dp=2,tp=2 over two levels reached its sync
    within ~10 ms on every rank, its first rank was done after 0.18-0.19 s and its last after 0.27-0.29 s (medians
    of four runs), where rank 0's own figure said 0.20-0.245 s. None where a rank recorded no calls or the ranks'
    calls differ in number."""
    per_rank: list[dict[str, list[float]]] = [r.get("times_s") or {} for r in records]
    if not per_rank or any(not t for t in per_rank):
        return None
    sizes = set(per_rank[0])
    if any(set(t) != sizes or any(len(t[s]) != len(per_rank[0][s]) for s in sizes) for t in per_rank):
        return None
    results = [{"size_bytes": int(s), "times_s": [max(call) for call in zip(*(t[s] for t in per_rank))]}
               for s in sorted(sizes, key=int)]
    return fit(results) if all(r["times_s"] for r in results) else None


def across_with_last_rank(records: list[dict | None]) -> dict | None:
    """The summary's `allreduce_across`: rank 0's record, as before, with `last_rank` (last_rank_fit over every
    rank's calls) beside its figures."""
    first = records[0] if records else None
    if not first:
        return first
    last = last_rank_fit([r or {} for r in records])
    return {**first, "last_rank": last} if last and last.get("bandwidth_Bps") else dict(first)


def probe_group_allreduce(c: Collectives, backend: str, group_size: int, across: bool = False) -> dict:
    """One level of a two-level link, as its mesh axes use it, every group at once, the ranks started together
    by the whole job's barrier and timed as probe_allreduce times the whole job's:
    - inside (across=False): each group of `group_size` consecutive ranks all-reduces inside itself, as an inner
      axis does; `world_size` is the group's size;
    - across (across=True): the ranks at the same place in every group all-reduce together, `group_size` such
      groups at once, each crossing the slow link and sharing each machine's card, as an outer axis does (dp=2 x
      tp=2 on two machines of two: both dp groups). `world_size` is the number of machines, `concurrent` the groups
      that share a card. The whole job's all-reduce over N ranks, divided by the sharing, is not what those
      groups see: MPI's over two ranks moves fewer bytes per hop than over four, and the two differed by -29 to
      +45 % in docs/scaling.md's "Sitting 13".
    `note` says why nothing was measured where the backend cannot split its group."""
    ranks = c.size // group_size if across else group_size
    split = c.group_all_reduce(group_size, across) if c.group_all_reduce is not None else None
    if split is None:
        return {"backend": backend, "world_size": ranks, "latency_s": None, "bandwidth_Bps": None,
                "note": f"not measured: {backend} cannot split its group (the TCP probe's figures stand)"}
    grouped = Collectives(c.rank, c.size, c.device, c.buffer, split, c.from_rank0)
    try:
        return {**probe_allreduce(grouped, backend), "world_size": ranks,
                **({"concurrent": group_size} if across else {})}
    finally:
        del grouped, split  # MLX: a sub-group is freed before MPI finalizes, or the process aborts at exit


def rank_main(argv: list[str] | None, start: Callable[[argparse.Namespace], Collectives], framework: str) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        c = start(args)
        results = measure(c, args.sizes, args.max_calls, args.budget_bytes, args.time_budget_s)
    except Exception as err:  # noqa: BLE001 - one line for the launcher, whatever failed
        print(f"fabric rank: {framework} {args.backend}: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        return 1
    if c.rank == 0:
        result = {"framework": framework, "backend": args.backend, "world_size": c.size, "device": c.device,
                  "results": results}
        text = json.dumps(result)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text)
        print(RESULT_PREFIX + text, flush=True)
    c.finish()
    return 0
