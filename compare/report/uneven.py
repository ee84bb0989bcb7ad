"""Ranks of unequal speed (docs/uneven.md): each rank's compute time (its step without the gradient sync) and its wait
at the all-reduce (the rest of a synced step), read from every rank's time breakdown, for runs of uneven shares or
ranks; how much of the step the slowest rank costs; and, where the ranks' compute per step differs by more than IMBALANCE, a finding that names the
slow rank and the --rank-shares that would balance them (each rank's sequences in proportion to its speed per
sequence, common/data/shares.py)."""
from __future__ import annotations

from common.data.shares import rank_sizes

IMBALANCE = 0.20  # the ranks' compute times differ by more than this share of the fastest: a finding


def balancing_sizes(compute_s: list[float], sizes: list[int]) -> tuple[int, ...]:
    """Whole sequences per rank that would make the ranks' compute equal: each rank's speed in sequences/s."""
    speeds = tuple(n / t for n, t in zip(sizes, compute_s))
    return rank_sizes(sum(sizes), len(sizes), speeds)


def rank_lines(rows: list[dict]) -> list[str]:
    lines = []
    for row in rows:
        compute, wait = row.get("rank_compute_s") or [], row.get("rank_wait_s") or []
        sizes = row.get("rank_batch_sizes") or []
        if len(compute) < 2 or None in compute or None in wait or len(sizes) != len(compute):
            continue
        slow = max(range(len(compute)), key=lambda r: compute[r])
        fast = min(range(len(compute)), key=lambda r: compute[r])
        uneven = compute[slow] > (1 + IMBALANCE) * compute[fast]
        if not uneven and len(set(sizes)) == 1:
            continue  # even shares on ranks of one speed: nothing to say
        step = max(c + w for c, w in zip(compute, wait))
        lines.append(f"Ranks, {row['label']}: compute " + " / ".join(f"{1e3 * c:.1f}" for c in compute)
                     + " ms, wait at the all-reduce " + " / ".join(f"{1e3 * w:.1f}" for w in wait)
                     + f" ms per step (sequences {'/'.join(map(str, sizes))}); the slowest rank ({slow}) costs "
                     f"{100 * (compute[slow] - compute[fast]) / step:.0f}% of the step beyond the fastest")
        if uneven and row.get("strategy", "ddp") == "ddp":
            balanced = balancing_sizes(compute, sizes)
            lines.append(f"Uneven ranks, {row['label']}: rank {slow} computes {compute[slow] / compute[fast]:.2f}x "
                         f"as long as rank {fast}; --rank-shares {','.join(map(str, balanced))} would balance them "
                         "(or --rank-shares auto; docs/uneven.md)")
    return lines
