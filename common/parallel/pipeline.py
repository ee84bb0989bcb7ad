"""Pipeline parallelism (--strategy pp), framework-neutral: which blocks each stage holds, the order in which a
stage runs its micro-batches and talks to its neighbours, and the analytic bubble.

One stage per rank. Blocks are split contiguously and as evenly as possible (the first stages take one more
block when N does not divide the layer count); the embedding is on the first stage, the final norm and the
head on the last. A step's batch (each of its --grad-accum micro-steps) is cut into --pp-microbatches M
pieces that flow through the stages:

    gpipe  every forward, then every backward (fill, drain), on every stage as in torch's ScheduleGPipe: each
           stage keeps M micro-batches' activations. (An earlier version ran the last stage's backwards right
           after their forwards; under blocking sends its gradients then had to wait for the last activation,
           which serialized the two stages: a simulated idle fraction of 0.385 at p=2, M=8 against 0.111,
           measured 0.31-0.32 in MLX. tests/unit/test_pp.py now times every schedule.)
    1f1b   after p - s - 1 warm-up forwards, stage s alternates one forward and one backward, so it keeps
           at most p - s micro-batches' activations; the same bubble as gpipe

Both leave each stage idle for a fraction (p - 1) / (M + p - 1) of the step when a forward and a backward
take the same time on every stage ("the bubble"). mlx_impl/pp.py runs `stage_ops` literally with blocking
send/recv; torch_impl/pp.py runs torch.distributed.pipelining's ScheduleGPipe / Schedule1F1B, which post
their sends and receives as batched non-blocking operations.

The operations of `stage_ops` are deadlock-free even if every send waited for its receive (a rendezvous),
which a blocking send over a socket does once the message outgrows the socket buffers: in 1f1b's steady
state a stage would otherwise send an activation downstream while its neighbour sends a gradient upstream,
each waiting for the other's receive. `stage_ops` lets the activation go first (the stage below receives it
before it sends its gradient); tests/unit/test_pp.py simulates every schedule up to 8 stages and 16
micro-batches under rendezvous semantics.
"""
from __future__ import annotations

from common.parallel.embedding_group import EmbeddingGroup

SCHEDULES = ("gpipe", "1f1b")
# Frameworks whose pipeline posts a send and the next receive as one batch of non-blocking operations
# (torch.distributed.pipelining's schedules, torch_impl/pp.py); MLX's runs stage_ops one blocking op at a time.
BATCHED_P2P = frozenset({"torch"})
# The largest message a sender leaves in the link's buffers before going on; a larger one holds its sender until the
# receiver has posted its receive (pipeline_timing.py's `rendezvous`). Open MPI's eager limit over TCP
# (btl_tcp_eager_limit, 64 KiB; its shared-memory transport's is 4 KiB); a TCP socket's send buffer as Linux
# autotunes it, up to net.ipv4.tcp_wmem's maximum of 4 MiB, for MLX's ring and gloo. `base`'s pieces (2 rows of
# 128 x 768 in float32, 786 KB) are past MPI's and within the sockets'.
BUFFERED_BYTES = {"mpi": 64 * 2**10, "ring": 4 * 2**20, "gloo": 4 * 2**20}


def sender_waits(backend: str, nbytes: float) -> bool:
    """Whether a send of `nbytes` on `backend` holds its sender until the receiver posts (BUFFERED_BYTES)."""
    return nbytes > BUFFERED_BYTES.get(backend, float("inf"))


DEFAULT_PIECES = 4  # --pp-microbatches when not given: at most this many pieces per micro-step


def default_pieces(rows: int, stages: int, at_least_stages: bool) -> int:
    """--pp-microbatches when not given: the largest count up to DEFAULT_PIECES that divides a micro-step's `rows`;
    where the schedules need a piece per stage at least (torch's), the smallest divisor of `rows` from `stages` up
    when no smaller one will do. DEFAULT_PIECES where nothing divides (the batch check then says why)."""
    divisors = [m for m in range(1, rows + 1) if rows % m == 0]
    fits = [m for m in divisors if m <= DEFAULT_PIECES and (m >= stages or not at_least_stages)]
    if fits:
        return max(fits)
    above = [m for m in divisors if m >= stages] if at_least_stages else []
    return min(above) if above else DEFAULT_PIECES


def stage_layers(n_layers: int, n_stages: int, stage: int) -> range:
    """The transformer blocks of `stage`: contiguous, the first n_layers % n_stages stages one block more."""
    base, extra = divmod(n_layers, n_stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


def stage_of(name: str, n_layers: int, n_stages: int) -> int:
    """The stage that holds an HF-named parameter."""
    if name.startswith("model.embed_tokens."):
        return 0
    if name.startswith("model.layers."):
        layer = int(name.split(".")[2])
        return next(s for s in range(n_stages) if layer in stage_layers(n_layers, n_stages, s))
    return n_stages - 1  # model.norm, lm_head


def stage_holds(name: str, n_layers: int, stage: int, embedding: EmbeddingGroup) -> bool:
    """Whether `stage` holds the HF-named parameter: its own (stage_of), or its copy of a tied matrix (the last
    stage's, common/parallel/embedding_group.py)."""
    return stage_of(name, n_layers, embedding.n_stages) == stage or embedding.holds(name, stage)


def compute_order(schedule: str, stage: int, n_stages: int, n_micro: int) -> list[tuple[str, int]]:
    """("F", i) and ("B", i) in the order `stage` runs them."""
    if schedule == "gpipe":
        return [("F", i) for i in range(n_micro)] + [("B", i) for i in range(n_micro)]
    if schedule != "1f1b":
        raise ValueError(f"unknown pipeline schedule {schedule!r}; allowed: {', '.join(SCHEDULES)}")
    warm = min(n_stages - stage - 1, n_micro)
    order = [("F", i) for i in range(warm)]
    for i in range(n_micro - warm):
        order += [("F", warm + i), ("B", i)]
    return order + [("B", i) for i in range(n_micro - warm, n_micro)]


def stage_ops(schedule: str, stage: int, n_stages: int, n_micro: int, batched: bool = False) -> list[tuple]:
    """The stage's computations and point-to-point operations, in order:

        ("recv_act", i, src)  ("F", i)  ("send_act", i, dst)  ("recv_grad", i, src)  ("B", i)  ("send_grad", i, dst)

    A gradient sent upstream right before an activation is received from upstream is sent after it instead
    (see the module docstring: otherwise 1f1b deadlocks under blocking sends); `batched`: as torch's schedules
    post them, a send and the next receive as one batch of non-blocking operations, which needs no such swap."""
    first, last = stage == 0, stage == n_stages - 1
    ops: list[tuple] = []
    for kind, i in compute_order(schedule, stage, n_stages, n_micro):
        if kind == "F":
            ops += ([] if first else [("recv_act", i, stage - 1)]) + [("F", i)]
            ops += [] if last else [("send_act", i, stage + 1)]
        else:
            ops += ([] if last else [("recv_grad", i, stage + 1)]) + [("B", i)]
            ops += [] if first else [("send_grad", i, stage - 1)]
    ordered, k = [], 0
    while k < len(ops):
        if not batched and k + 1 < len(ops) and ops[k][0] == "send_grad" and ops[k + 1][0] == "recv_act":
            ordered += [ops[k + 1], ops[k]]
            k += 2
        else:
            ordered.append(ops[k])
            k += 1
    return ordered


def bubble_fraction(n_stages: int, n_micro: int) -> float:
    """The analytic idle fraction of a stage, (p - 1) / (M + p - 1), for gpipe and 1f1b alike."""
    return (n_stages - 1) / (n_micro + n_stages - 1)


def split_idle(idle: list[float | None]) -> dict | None:
    """Each stage's measured idle fraction -> the bubble and the imbalance.

    The stages share one window per step (barriers), so the stage that idles least is the busiest: it sets the
    pace, and its idle time is the schedule's bubble, the figure (p - 1) / (M + p - 1) describes (it assumes
    equal stages). Another stage idles that much and also waits for the busiest whenever its own busy time is
    smaller (the last stage also runs the head and the loss; the stages' sends and receives differ): its
    imbalance, the busy time it lacks against the busiest stage, as a fraction of the window. Measured in MLX
    at p = 2, M = 8 with gpipe (docs/strategies.md): stage 1 idled 12 % (11 % analytic), stage 0 25 %."""
    known = [(s, x) for s, x in enumerate(idle) if x is not None]
    if not known:
        return None
    busiest, bubble = min(known, key=lambda sx: sx[1])
    return {"busiest_stage": busiest, "bubble": bubble,
            "imbalance": [None if x is None else x - bubble for x in idle]}


def comm_bytes_per_step(global_batch: int, seq_len: int, dim: int, dtype_bytes: int = 4) -> int:
    """Bytes one stage boundary carries each way per optimizer step: the activations (B, T, dim) of the whole
    global batch go down, their gradients come back up. An end stage sends this once, a middle stage twice."""
    return global_batch * seq_len * dim * dtype_bytes
