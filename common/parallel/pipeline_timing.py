"""How long a pipeline's micro-step takes, played op by op: each stage runs its schedule's computations and
point-to-point operations in the order its framework posts them (pipeline.py `stage_ops`: mlx_impl/pp.py's
blocking sends and receives one at a time; `batched`, torch's Schedule1F1B, which posts a send and the next
receive together as non-blocking operations), a receive waits for its message, and a send is buffered: the sender
goes on at once (the pieces are socket-buffer and eager-protocol sized), while the message crosses its boundary.
Each boundary is a link per direction (a full-duplex hop, as compare/launch/topology.py shapes each end), carrying
one message at a time. `rendezvous` makes every send wait until its receive is posted, as Open MPI holds a message
past its eager limit; the sender then goes on while the message crosses (its rest fits the socket's buffer). Held
until the message had crossed too, as first written, MLX's pp=2,tp=2 over two levels (131 KB pieces, MPI) played
0.256 s against 0.232 measured, and as buffered 0.225 (docs/scaling.md). tests/unit/test_pp.py plays every schedule
with rendezvous sends, to show stage_ops cannot deadlock.

pp's exposure rule (pp.py) is the difference between this makespan with the sends' times and without them. The
closed form it replaces charged every slot two sends where they outlasted the slot, as if a piece's activation
and its gradient crossed one after another and each held its sender: on the kept sittings of stops 53-54
(docs/scaling.md, "Sitting 16") pp=2,dp=2 over two levels went from +24.2 to -2.7 % (torch, Zen 4, 7 sittings)
and from +39.8 to +18.0 % (MLX, a core per rank, 5 sittings).
"""
from __future__ import annotations

from common.parallel.pipeline import stage_ops


def micro_step_s(schedule: str, n_stages: int, n_micro: int, forward_s: float, backward_s: float,
                 send_s: list[float], batched: bool = False, rendezvous: bool = False) -> float:
    """Seconds from the first piece's forward to the last stage's last backward: `forward_s` and `backward_s` a
    piece's compute on each stage, `send_s[b]` one message across boundary b (between stages b and b + 1);
    `batched`: the stages post their operations as torch's schedules do (stage_ops); `rendezvous`: a send waits
    until its receive is posted (a message past Open MPI's eager limit: stage_ops must not deadlock then,
    tests/unit/test_pp.py). Raises RuntimeError on a deadlock."""
    ops = [stage_ops(schedule, s, n_stages, n_micro, batched) for s in range(n_stages)]
    done, clock = [0] * n_stages, [0.0] * n_stages
    arrives: dict[tuple, float] = {}     # (what, piece, receiving stage) -> when it has crossed
    link_free: dict[tuple, float] = {}   # (boundary, direction) -> when its last message has crossed
    moved = True
    while moved:
        moved = False
        for s in range(n_stages):
            while done[s] < len(ops[s]):
                kind, piece, *peer = ops[s][done[s]]
                if kind in ("F", "B"):
                    clock[s] += forward_s if kind == "F" else backward_s
                elif kind.startswith("send"):
                    dst, boundary, direction = peer[0], min(s, peer[0]), peer[0] > s
                    start = max(clock[s], link_free.get((boundary, direction), 0.0))
                    if rendezvous:  # only once the receiver is at this message's receive; then it crosses
                        if done[dst] == len(ops[dst]) or ops[dst][done[dst]] != ("recv" + kind[4:], piece, s):
                            break
                        start = clock[s] = max(start, clock[dst])
                    link_free[(boundary, direction)] = arrives[(kind[5:], piece, dst)] = start + send_s[boundary]
                elif (kind[5:], piece, s) in arrives:
                    clock[s] = max(clock[s], arrives[(kind[5:], piece, s)])
                else:
                    break  # its message is not sent yet: another stage moves first
                done[s] += 1
                moved = True
    if any(d < len(o) for d, o in zip(done, ops)):
        raise RuntimeError(f"the {schedule} schedule of {n_stages} stages deadlocked in the timing")
    return max(clock)
