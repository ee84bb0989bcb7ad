"""`plan --rank-speed R:F,...` (docs/uneven.md): ddp over ranks of unequal speed. Rank r computes its share in
compute_s x (its sequences / an even share) / F_r, so a synchronous step takes the slowest rank's compute plus the
exposed communication and host work of an even step (`compare/plan/table.py`'s ddp row). Predicted: the step with
even shares, with the best shares (sequences in proportion to speed, common/data/shares.py), and without the
slowest rank (N - 1 ranks, its own ddp row, best shares among them): whether the slow host is worth keeping.

Ranks that share one machine (`Machines`: `plan --ranks-per-machine`, as `--rank-speed` emulates them on one host)
also share its cores: a rank done with its share waits at the all-reduce, and where its backend polls while it
waits (common/costmodel/links.py polling_threads: MLX's ring, two socket threads) those threads take cores from
the ranks on its machine that still compute. Each such rank then runs at cores / (threads that want a core) of its
speed until it is done. On ranks of their own machines (the default, a cluster) the term is nothing. Measured
(docs/notes/2026-12-uneven-polling.md): MLX even shares at rank 1 x0.5 on 2 cores, 764 ms a step, against 568 ms
with both ranks at x0.5, where no rank waits; torch's gloo, whose waits block, 890 and 918 ms."""
from __future__ import annotations

from dataclasses import dataclass

from common.data.shares import rank_sizes


@dataclass(frozen=True)
class Machines:
    """Where the ranks run: `ranks_per_machine` consecutive ranks share a machine of `cores` cores, each computing
    with `threads` threads, and a rank waiting at the all-reduce keeps `polling` threads busy (0: its waits block)."""
    ranks_per_machine: int = 1
    cores: int = 1
    threads: int = 1
    polling: int = 0


def finish_s(work: list[float], machines: Machines) -> float:
    """When the last rank is done, rank r needing work[r] seconds alone: ranks run together, and on each machine
    the computing ranks' threads and the waiting ranks' polling threads share its cores (fair shares)."""
    left, now = list(work), 0.0
    while any(w > 0 for w in left):
        rates = [1.0] * len(left)
        for r in range(len(left) if machines.ranks_per_machine > 1 else 0):
            mates = [m for m in range(len(left)) if m // machines.ranks_per_machine == r // machines.ranks_per_machine]
            want = sum(machines.threads if left[m] > 0 else machines.polling for m in mates)
            rates[r] = min(1.0, machines.cores / want) if left[r] > 0 else 0.0
        dt = min(w / rate for w, rate in zip(left, rates) if w > 0)  # until the next rank is done
        left = [0.0 if w - dt * rate < 1e-12 else w - dt * rate for w, rate in zip(left, rates)]
        now += dt
    return now


def step_s(row: dict, sizes: tuple[int, ...], factors: list[float], machines: Machines = Machines()) -> float:
    """A ddp row's step when rank r takes sizes[r] sequences at speed factors[r]."""
    even = sum(sizes) / len(sizes)
    rest = row["step_s"] - row["compute_s"]  # exposed communication and host work, as in an even step
    return finish_s([row["compute_s"] * n / even / f for n, f in zip(sizes, factors)], machines) + rest


def uneven_plan(rows: list[dict], speeds: dict[int, float], world: int, global_batch: int,
                machines: Machines = Machines()) -> dict:
    """`rows`: ddp rows at `world` and `world - 1` ranks (make_plan)."""
    by_n = {r["world_size"]: r for r in rows if r["strategy"] == "ddp" and "impossible" not in r}
    factors = [speeds.get(r, 1.0) for r in range(world)]
    row = by_n[world]
    even, best = rank_sizes(global_batch, world), rank_sizes(global_batch, world, tuple(factors))
    out = {"world_size": world, "speeds": factors, "even_sizes": list(even), "best_sizes": list(best),
           "even_step_s": step_s(row, even, factors, machines), "best_step_s": step_s(row, best, factors, machines)}
    if machines.ranks_per_machine > 1:
        out["machines"] = vars(machines)
    slowest = min(range(world), key=lambda r: (factors[r], -r))
    if world - 1 in by_n:
        kept = [f for r, f in enumerate(factors) if r != slowest]
        sizes = rank_sizes(global_batch, world - 1, tuple(kept))
        out.update(dropped_rank=slowest, without_sizes=list(sizes),
                   without_step_s=step_s(by_n[world - 1], sizes, kept, machines))
        out["keep_slowest"] = out["best_step_s"] < out["without_step_s"]
    return out


def uneven_lines(plan: dict) -> list[str]:
    speeds = ", ".join(f"rank {r} x{f:g}" for r, f in enumerate(plan["speeds"]))
    if "machines" in plan:
        m = plan["machines"]
        speeds += (f"; {m['ranks_per_machine']} ranks share each machine's {m['cores']} cores, "
                   + (f"a waiting rank polling with {m['polling']} threads" if m["polling"] else "waits that block"))
    lines = [f"ddp x{plan['world_size']} at {speeds}: even shares {'/'.join(map(str, plan['even_sizes']))} "
             f"{plan['even_step_s']:.4g} s a step; best shares {'/'.join(map(str, plan['best_sizes']))} "
             f"{plan['best_step_s']:.4g} s ({plan['even_step_s'] / plan['best_step_s']:.2f}x faster; "
             f"--rank-shares {','.join(map(str, plan['best_sizes']))})"]
    if "without_step_s" in plan:
        verdict = "keep it" if plan["keep_slowest"] else "leave it out"
        lines.append(f"without rank {plan['dropped_rank']} (x{plan['world_size'] - 1}, shares "
                     f"{'/'.join(map(str, plan['without_sizes']))}): {plan['without_step_s']:.4g} s a step against "
                     f"{plan['best_step_s']:.4g} s with it at best shares: {verdict}")
    return lines
