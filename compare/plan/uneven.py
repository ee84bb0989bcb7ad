"""`plan --rank-speed R:F,...` (docs/uneven.md): ddp over ranks of unequal speed. Rank r computes its share in
compute_s x (its sequences / an even share) / F_r, so a synchronous step takes the slowest rank's compute plus the
exposed communication and host work of an even step (`compare/plan/table.py`'s ddp row). Predicted: the step with
even shares, with the best shares (sequences in proportion to speed, common/data/shares.py), and without the
slowest rank (N - 1 ranks, its own ddp row, best shares among them): whether the slow host is worth keeping."""
from __future__ import annotations

from common.data.shares import rank_sizes


def step_s(row: dict, sizes: tuple[int, ...], factors: list[float]) -> float:
    """A ddp row's step when rank r takes sizes[r] sequences at speed factors[r]."""
    even = sum(sizes) / len(sizes)
    rest = row["step_s"] - row["compute_s"]  # exposed communication and host work, as in an even step
    return max(row["compute_s"] * n / even / f for n, f in zip(sizes, factors)) + rest


def uneven_plan(rows: list[dict], speeds: dict[int, float], world: int, global_batch: int) -> dict:
    """`rows`: ddp rows at `world` and `world - 1` ranks (make_plan)."""
    by_n = {r["world_size"]: r for r in rows if r["strategy"] == "ddp" and "impossible" not in r}
    factors = [speeds.get(r, 1.0) for r in range(world)]
    row = by_n[world]
    even, best = rank_sizes(global_batch, world), rank_sizes(global_batch, world, tuple(factors))
    out = {"world_size": world, "speeds": factors, "even_sizes": list(even), "best_sizes": list(best),
           "even_step_s": step_s(row, even, factors), "best_step_s": step_s(row, best, factors)}
    slowest = min(range(world), key=lambda r: (factors[r], -r))
    if world - 1 in by_n:
        kept = [f for r, f in enumerate(factors) if r != slowest]
        sizes = rank_sizes(global_batch, world - 1, tuple(kept))
        out.update(dropped_rank=slowest, without_sizes=list(sizes),
                   without_step_s=step_s(by_n[world - 1], sizes, kept))
        out["keep_slowest"] = out["best_step_s"] < out["without_step_s"]
    return out


def uneven_lines(plan: dict) -> list[str]:
    speeds = ", ".join(f"rank {r} x{f:g}" for r, f in enumerate(plan["speeds"]))
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
