"""cp, the sequence axis (common/parallel/cp.py, mlx_impl/cp.py, torch_impl/cp.py) without a training process: the
slices each rank keeps, ring attention's block math (zig-zag, online softmax, skipped future halves) against whole
causal attention in each framework with the ranks simulated one after another (the ring's pass handing each rank the
blocks its predecessors hold: no collective runs), Ulysses's reshapes, refusals before any rank starts, and the cost
model's memory and traffic through the layout. The training runs are tests/integration/test_cp.py's."""
import numpy as np
import pytest

from common.config import RunConfig
from common.costmodel.memory import memory_bytes
from common.costmodel.workload import Workload
from common.errors import UserError
from common.model.spec import preset
from common.parallel import layout
from common.parallel.cp import causal_work, cp_positions, ring_blocks, zigzag_positions


@pytest.mark.parametrize("n", [2, 3, 4])
def test_each_split_tiles_the_sequence_once(n):
    for positions in (cp_positions, zigzag_positions):
        held = np.concatenate([positions(48, r, n) for r in range(n)])
        assert sorted(held) == list(range(48))


@pytest.mark.parametrize("n", [2, 4])
def test_zigzag_balances_the_causal_work_and_contiguous_does_not(n):
    zig = {causal_work(zigzag_positions(64, r, n)) for r in range(n)}
    flat = [causal_work(cp_positions(64, r, n)) for r in range(n)]
    assert len(zig) == 1
    assert flat[-1] > 2 * flat[0]


def test_ring_blocks_skip_exactly_the_keys_wholly_in_the_future():
    """For every rank and source block: the part ring_blocks computes is exactly the part with a visible key."""
    n, T = 4, 32
    c = T // (2 * n)
    for rank in range(n):
        q = zigzag_positions(T, rank, n)
        for source in range(n):
            k = zigzag_positions(T, source, n)
            visible = q[:, None] >= k[None]
            kind = ring_blocks(rank, source)
            if kind == "first":  # every query against the first chunk, all of it visible; nothing of the second
                assert visible[:, :c].all() and not visible[:, c:].any()
            elif kind == "second":  # the second chunk's queries see all; the first chunk's see nothing
                assert visible[c:].all() and not visible[:c].any()
            else:
                assert source == rank


def _whole_causal(q, k, v, scale):
    """numpy float64 causal attention, (B, H, T, D), grouped-query."""
    k, v = (np.repeat(a, q.shape[1] // a.shape[1], axis=1) for a in (k, v))
    s = q @ k.swapaxes(-1, -2) * scale
    s = np.where(np.tri(q.shape[2], dtype=bool), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


def _inputs(n, T=24, B=2, H=4, KV=2, D=8):
    rng = np.random.default_rng(0)
    return [rng.standard_normal(shape).astype(np.float32) for shape in ((B, H, T, D), (B, KV, T, D), (B, KV, T, D))]


def _simulated_ring(ring_attention, to_array, to_numpy, n):
    """Each rank's ring_attention output, its predecessors' blocks handed in by a simulated pass, put back in order
    of position."""
    q, k, v = _inputs(n)
    out = np.zeros_like(q)
    for rank in range(n):
        mine = zigzag_positions(q.shape[2], rank, n)
        held = [to_array(np.stack([k[:, :, zigzag_positions(q.shape[2], r, n)],
                                   v[:, :, zigzag_positions(q.shape[2], r, n)]])) for r in range(n)]
        calls = iter(range(1, n))

        def from_previous(kv, rank=rank, held=held, calls=calls):
            return held[(rank - next(calls)) % n]

        got = ring_attention(to_array(q[:, :, mine]), to_array(k[:, :, mine]), to_array(v[:, :, mine]), 0.35, rank,
                             n, from_previous)
        out[:, :, mine] = to_numpy(got)
    return out, _whole_causal(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), 0.35)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_mlx_ring_attention_equals_whole_causal_attention(n):
    import mlx.core as mx

    from mlx_impl.cp import ring_attention
    got, want = _simulated_ring(ring_attention, mx.array, np.array, n)
    assert np.abs(got - want).max() < 1e-5


@pytest.mark.parametrize("n", [1, 2, 3])
def test_torch_ring_attention_equals_whole_causal_attention(n):
    import torch

    from torch_impl.cp import ring_attention
    got, want = _simulated_ring(ring_attention, torch.from_numpy, lambda t: t.numpy(), n)
    assert np.abs(got - want).max() < 1e-5


def test_mlx_ring_attention_gradient_equals_whole_attention_at_one_rank():
    """The block math's gradient (online softmax, merged logsumexps) against MLX's own attention, cp=1 (the other
    blocks' gradients travel through the pass's vjp, checked by the integration test)."""
    import mlx.core as mx

    from mlx_impl.attention import attention
    from mlx_impl.cp import ring_attention
    q, k, v = (mx.array(a) for a in _inputs(1))
    w = mx.array(np.random.default_rng(1).standard_normal(q.shape).astype(np.float32))
    ring = mx.grad(lambda q, k, v: (ring_attention(q, k, v, 0.35, 0, 1, lambda x: x) * w).sum(), argnums=(0, 1, 2))
    whole = mx.grad(lambda q, k, v: (attention(q, k, v, 0.35, "causal") * w).sum(), argnums=(0, 1, 2))
    for a, b in zip(ring(q, k, v), whole(q, k, v)):
        assert np.abs(np.array(a) - np.array(b)).max() < 1e-5


def test_torch_ring_attention_gradient_equals_whole_attention_at_one_rank():
    import torch

    from torch_impl.attention import attention
    from torch_impl.cp import ring_attention
    q, k, v = (torch.from_numpy(a).requires_grad_() for a in _inputs(1))
    w = torch.from_numpy(np.random.default_rng(1).standard_normal(q.shape).astype(np.float32))
    ring = torch.autograd.grad((ring_attention(q, k, v, 0.35, 0, 1, lambda x: x) * w).sum(), (q, k, v))
    whole = torch.autograd.grad((attention(q, k, v, 0.35, None) * w).sum(), (q, k, v))
    for a, b in zip(ring, whole):
        assert (a - b).abs().max() < 1e-5


def _cfg(**kw):
    base = dict(strategy="cp", nproc=2, preset="tiny", global_batch_size=8, seq_len=32, framework="torch")
    cfg = RunConfig(**{**base, **kw})
    cfg.validate()  # what the CLI runs on every RunConfig before anything is prepared
    return cfg


@pytest.mark.parametrize("kw, words", [
    (dict(seq_len=33), "not divisible by 2"),
    (dict(nproc=3, seq_len=36), "model.n_heads = 4"),
    (dict(nproc=4), "model.n_kv_heads = 2"),
    (dict(cp_attention="ring", seq_len=34), "2 x cp = 4 chunks"),
    (dict(nproc=1), "at least 2"),
    (dict(strategy="mesh", mesh="dp=2,cp=2"), "holds 2 x 2 = 4 ranks"),
    (dict(cp_attention="striped"), "unknown cp_attention"),
    (dict(lora_rank=4), "--lora-rank"),
])
def test_bad_input_is_one_line_before_any_rank(kw, words):
    _cfg()  # the run itself is fine
    _cfg(nproc=3, seq_len=36, cp_attention="ring")  # the ring keeps every head on every rank: 3 need not divide 4
    with pytest.raises(UserError) as err:
        _cfg(**kw)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_the_layout_splits_activations_and_names_its_all_to_alls():
    spec = preset("small")
    w = Workload(spec, seq_len=1024, global_batch_size=2, framework="torch")
    one, two, mesh = layout("ddp", 1), layout("cp", 2), layout("mesh", 4, "dp=2,cp=2")
    assert two.activation_bytes(w) == pytest.approx(one.activation_bytes(w) / 2)
    assert mesh.activation_bytes(w) == pytest.approx(one.activation_bytes(w) / 4)
    assert memory_bytes(two, w)["params"] == memory_bytes(one, w)["params"]
    colls = two.collectives(w, "native")
    per_head = 2 * 512 * spec.head_dim * 4  # B x T/cp x head_dim x fp32
    assert [c.nbytes for c in colls[:2]] == [per_head * spec.n_heads, per_head * spec.n_kv_heads]
    assert colls[0].calls == 4 * spec.n_layers
    mlx = two.collectives(Workload(spec, seq_len=1024, global_batch_size=2, framework="mlx"), "native")
    assert mlx[0].nbytes == 2 * colls[0].nbytes  # MLX all-gathers the whole tensor: cp x the all-to-all's bytes
    assert two.work_fraction(w) == 0.5 and mesh.work_fraction(w) == 0.25


def test_dp_x_cp_predicts_one_gradient_all_reduce_over_the_job():
    """Both frameworks run dp x cp as ddp over every rank: one all-reduce of the whole gradients over dp x cp ranks.
    Each axis carried one (the dp groups' and the cp groups'), twice the traffic (issue 77)."""
    spec = preset("small")
    w = Workload(spec, seq_len=1024, global_batch_size=4, framework="torch")
    mesh, cp4 = layout("mesh", 4, "dp=2,cp=2"), layout("cp", 4)
    axes = {a.axis: a for a in mesh.axis_collectives(w)}
    reduces = [(a.group_size, c) for a in axes.values() for c in a.collectives if c.kind == "all_reduce"]
    (alone,) = [c for c in cp4.collectives(w) if c.kind == "all_reduce"]
    assert [(size, c.nbytes * c.calls) for size, c in reduces] == [(4, alone.nbytes * alone.calls)]
    assert axes["dp"].group_size == 4 and axes["cp"].group_size == 2
    assert [c.what for c in axes["cp"].collectives] == ["all-to-all q/out", "all-to-all k/v"]
    wire = sum(c.wire_bytes(a.group_size) for a in axes.values() for c in a.collectives if c.kind == "all_reduce")
    assert wire == pytest.approx(alone.wire_bytes(4))
