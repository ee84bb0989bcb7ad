"""Uneven shares of each global batch (`--rank-shares 3,1`): ranks of unequal speed take unequal numbers of whole
sequences, so a fast rank does not wait for a slow one at every all-reduce (MXNet's `work_load_list`).

Rank r of N takes `sizes[r]` of the G sequences of every global batch: G x w_r / sum(w), rounded down, the
sequences left over given one each to the ranks with the largest fractional parts (ties to the lower rank), so
every world size and framework cuts the same batch the same way. Even shares are the special case w = (1, ..., 1).
Each rank cuts its part into the same `grad_accum` micro-steps, the first ones one sequence longer where it does
not divide. Under global-tokens each rank scales its summed token losses by N / T_global, so the ranks' gradients
sum to the whole batch's whatever the sizes (common/train/normalization.py); under per-rank they do not.
"""
from __future__ import annotations

from common.errors import UserError

AUTO = "auto"  # time one step per rank first, then shares from the measured speeds (compare/launch/balance.py)


def parse_shares(text: str) -> tuple[float, ...]:
    """'3,1' -> (3.0, 1.0); '' -> () (even). A share must be a positive number."""
    if not text or text == AUTO:
        return ()
    try:
        shares = tuple(float(s) for s in text.split(","))
    except ValueError:
        raise UserError(f"--rank-shares {text!r}: give one positive weight per rank, e.g. 3,1, or auto") from None
    if any(not w > 0 for w in shares):
        raise UserError(f"--rank-shares {text}: every share must be positive (a rank with no share is a rank "
                        "to leave out: use fewer --nproc)")
    return shares


def rank_sizes(global_batch: int, world: int, shares: tuple[float, ...] = ()) -> tuple[int, ...]:
    """Sequences each of `world` ranks takes of a global batch: in proportion to `shares` (even when empty),
    whole sequences, the remainder to the largest fractional parts (ties: the lower rank)."""
    weights = shares or (1.0,) * world
    exact = [global_batch * w / sum(weights) for w in weights]
    sizes = [int(x) for x in exact]
    order = sorted(range(world), key=lambda r: (-(exact[r] - sizes[r]), r))
    for r in order[:global_batch - sum(sizes)]:
        sizes[r] += 1
    return tuple(sizes)


def micro_sizes(rank_size: int, grad_accum: int) -> tuple[int, ...]:
    """A rank's sequences cut into `grad_accum` micro-steps, the first ones one longer where it does not divide."""
    base, extra = divmod(rank_size, grad_accum)
    return tuple(base + (i < extra) for i in range(grad_accum))


def check_shares(text: str, global_batch: int, world: int, grad_accum: int, strategy: str, takes_shares: bool,
                 peer: str, max_restarts: int) -> None:
    """Every refusal of --rank-shares, one line each, before anything starts. `takes_shares`: the strategy's
    Layout.takes_uneven_shares (ddp's)."""
    if not text:
        return
    if not takes_shares or peer or max_restarts:
        what = (f"--strategy {strategy}" if not takes_shares else f"the {peer} peer" if peer
                else "--max-restarts (a restart changes the rank count)")
        raise UserError(f"--rank-shares works with ddp only (full and LoRA), not with {what}")
    if world < 2:
        return  # one rank takes the whole batch: the N=1 reference of a comparison
    shares = parse_shares(text)
    if shares and len(shares) != world:
        raise UserError(f"--rank-shares {text} gives {len(shares)} shares for {world} ranks; give one per rank")
    sizes = rank_sizes(global_batch, world, shares) if shares else (global_batch // world,) * world
    short = [r for r, n in enumerate(sizes) if n < grad_accum]
    if short:
        r = short[0]
        raise UserError(f"--rank-shares {text} leaves rank {r} {sizes[r]} of the {global_batch} sequences of a "
                        f"batch, fewer than its {grad_accum} micro-step(s): every micro-step needs a sequence (raise "
                        "--global-batch-size or its share)")


def speeds_to_shares(step_s: list[float], global_batch: int, grad_accum: int) -> tuple[int, ...]:
    """Shares from each rank's measured time for an even step: in proportion to its speed 1 / t, as whole
    sequences, each rank keeping at least one per micro-step. The sizes are the shares themselves."""
    speeds = [1.0 / t for t in step_s]
    sizes = list(rank_sizes(global_batch, len(step_s), tuple(speeds)))
    for r in range(len(sizes)):
        while sizes[r] < grad_accum:  # take from the largest
            donor = max(range(len(sizes)), key=lambda k: sizes[k])
            sizes[donor] -= 1
            sizes[r] += 1
    return tuple(sizes)


def parse_speeds(text: str, world: int) -> dict[int, float]:
    """'--rank-speed 1:0.5' -> {1: 0.5}: rank 1 computes at half speed (compare/launch/throttle.py)."""
    if not text or world < 2:
        return {}  # one rank waits for no other: the N=1 reference of a comparison runs at full speed
    speeds = {}
    for item in text.split(","):
        try:
            rank_text, factor_text = item.split(":")
            rank, factor = int(rank_text), float(factor_text)
        except ValueError:
            raise UserError(f"--rank-speed {text!r}: give RANK:FACTOR pairs, e.g. 1:0.5") from None
        if not 0 <= rank < world:
            raise UserError(f"--rank-speed {text}: rank {rank} is not one of the {world} ranks")
        if not 0.05 <= factor <= 1:
            raise UserError(f"--rank-speed {text}: a speed factor must be in [0.05, 1] (1: full speed)")
        speeds[rank] = factor
    return speeds
