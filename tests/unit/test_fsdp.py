"""FSDP (--strategy fsdp) computes what DDP computes, in both frameworks, while each rank holds 1/N of
the state: losses and gradients equal DDP's step by step, MLX and torch agree, and checkpoints stay full
so a run switches strategy (and framework) at a checkpoint. The runs are in tests/integration/test_fsdp.py."""
import math

import pytest

from common.errors import UserError
from common.model.spec import preset
from common.parallel import check_strategy


def test_the_shape_check_names_the_parameter_and_passes_shardable_models():
    check_strategy("fsdp", preset("base"), 2)  # 50000-token vocabulary, every block dimension even
    check_strategy("fsdp", preset("small"), 4)  # 50257 tokens do not divide: padded, not refused
    check_strategy("ddp", preset("tiny"), 1)
    with pytest.raises(UserError, match=r"model.layers.0.input_layernorm.weight of shape \(768,\) over 5 ranks"):
        check_strategy("fsdp", preset("base"), 5)
    with pytest.raises(UserError, match="needs 2 or more"):
        check_strategy("fsdp", preset("tiny"), 1)


class _TwoRanks:
    """A group of 2 for code that asks only its size and rank; the collectives are faked below."""

    def size(self):
        return 2

    def rank(self):
        return 0


@pytest.mark.parametrize("backend", ["ring", "nccl"])
def test_mlx_fsdp_runs_every_collective_on_the_communication_stream(backend, monkeypatch):
    """The all-gathers of the forward, the reduce-scatters of the backward and the norm's all-sum all get
    the Trainer's stream (here mx.cpu, what a Metal GPU run uses): upstream's gather passed none."""
    import mlx.core as mx
    import mlx.nn as nn
    from types import SimpleNamespace

    from common.checkpoint.tensorsource import DictSource
    from common.model.weights import init_weights
    from mlx_impl.comm import CommCounter
    from mlx_impl.fsdp import Sharding
    from mlx_impl.model import Llama

    streams = []

    def fake(name, fn):
        def collective(x, *, group=None, stream=None):
            streams.append((name, stream))
            return fn(x)
        monkeypatch.setattr(mx.distributed, name, collective)

    fake("all_gather", lambda x: mx.concatenate([x, x]))
    fake("all_sum", lambda x: 2 * x)
    fake("sum_scatter", lambda x: 2 * x[:x.shape[0] // 2])
    cfg = SimpleNamespace(resolved_backend=backend, all_reduce_size_mb=25)
    sharding = Sharding(cfg, SimpleNamespace(group=_TwoRanks()), CommCounter(stream=mx.cpu))
    model = sharding.wrap(Llama(preset("tiny")), DictSource(init_weights(preset("tiny"), 0)))
    tokens = mx.zeros((1, 8), dtype=mx.int32)
    _, grads = nn.value_and_grad(model, lambda m, x: m(x).sum())(model, tokens)
    mx.eval(sharding.global_norm(grads))
    names = {name for name, _ in streams}
    assert {"all_gather", "all_sum" if backend == "ring" else "sum_scatter"} <= names, names
    assert all(stream == mx.cpu for _, stream in streams), streams


class _SyntheticSource:
    """A TensorSource of any size that stores nothing: each read makes just the slice asked for (ones)."""

    def __init__(self, shapes: dict):
        self.shapes, self.bytes_read = shapes, 0

    def names(self):
        return list(self.shapes)

    def shape(self, name):
        return self.shapes[name]

    def read(self, name, index=()):
        import numpy as np

        out = np.ascontiguousarray(np.broadcast_to(np.float32(1), self.shapes[name])[index])
        self.bytes_read += out.nbytes
        return out


@pytest.mark.parametrize("strategy", ["fsdp", "tp"])
@pytest.mark.parametrize("rank", [0, 1])
def test_an_mlx_sharded_rank_evaluates_only_what_it_keeps(strategy, rank):
    """A vocabulary of 2**18 + 1 tokens (67 MB per matrix, padded to 2**18 + 2 rows under fsdp) and an FFN
    of 2**15: had the rank evaluated one whole sharded tensor (the model's lazy init, or the source's), MLX's
    peak would exceed what the rank keeps by 16-67 MB. It reads what it keeps, less fsdp's pad rows."""
    import mlx.core as mx
    from types import SimpleNamespace

    from mlx.utils import tree_flatten

    from common.model.spec import ModelSpec
    from common.parallel.tp import tp_split_axis
    from common.model.weights import num_parameters, parameter_shapes
    from mlx_impl.comm import CommCounter
    from mlx_impl.fsdp import Sharding
    from mlx_impl.model import Llama
    from mlx_impl.tp import TensorParallel

    class Group(_TwoRanks):
        def rank(self):
            return rank

    spec = ModelSpec(vocab_size=2**18 + 1, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=2**15, max_seq_len=32)
    source = _SyntheticSource(parameter_shapes(spec))
    cfg = SimpleNamespace(resolved_backend="ring", all_reduce_size_mb=25)
    world = SimpleNamespace(group=Group())
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    strategy_cls = {"fsdp": Sharding, "tp": TensorParallel}[strategy]
    model = strategy_cls(cfg, world, CommCounter()).wrap(Llama(spec), source)
    held = sum(p.nbytes for _, p in tree_flatten(model.parameters()))
    pad = 64 * 4 * 2 if strategy == "fsdp" and rank == 1 else 0  # one zero row each in the embedding and head
    assert source.bytes_read == held - pad
    split = sum(math.prod(s) for n, s in source.shapes.items() if tp_split_axis(n) is not None)
    keeps = {"fsdp": 4 * (num_parameters(spec) + 2 * 64) // 2 + 4 * 64 // 2,  # the final norm stays whole
             "tp": 4 * (num_parameters(spec) - split // 2)}[strategy]
    assert held == keeps
    assert mx.get_peak_memory() - before <= held + 4 * 2**20, (mx.get_peak_memory() - before, held)


def test_torch_fsdp_gathers_a_block_twice_and_every_other_unit_once_per_micro_step(tmp_path, monkeypatch):
    """FSDP2 frees a block after its forward and gathers it again for its backward; the head stays gathered
    to its backward, the embedding's backward needs no weights, the root stays (torch_impl/fsdp.py). The
    cost model counts the same gathers, and an evaluation frees what stayed gathered. The freed heap is
    returned as the backward starts and again before the embedding's gradient (the rank's peak). One process: at
    N=1 FSDP2 only pretends to gather, which is what is counted."""
    from collections import Counter
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as fsdp_group
    from torch.distributed.tensor import DTensor

    from common.costmodel.workload import Workload
    from common.parallel import collectives
    from torch_impl.fsdp import Sharding, shard_model
    from torch_impl.model import Llama, token_loss_sum

    import torch_impl.fsdp

    gathered, backward = [], []  # backward: each unit's post-backward, and the heap releases, in order
    unshard = fsdp_group.FSDPParamGroup.unshard
    post_backward = fsdp_group.FSDPParamGroup.post_backward

    def recording(self, *args, **kwargs):
        backward.append(names[self.modules[0]])
        return post_backward(self, *args, **kwargs)

    monkeypatch.setattr(fsdp_group.FSDPParamGroup, "post_backward", recording)
    monkeypatch.setattr(torch_impl.fsdp, "release_freed_heap", lambda: backward.append("release"))

    def counting(self, *args, **kwargs):
        pending = self._all_gather_result is None and self.is_sharded
        unshard(self, *args, **kwargs)
        if pending and self._all_gather_result is not None:  # a gather started
            gathered.append(names[self.modules[0]])

    monkeypatch.setattr(fsdp_group.FSDPParamGroup, "unshard", counting)
    spec = preset("tiny")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = Llama(spec)
        shard_model(model, torch.device("cpu"), "gloo", release_heap=True)
        names = {module: name or "root" for name, module in model.named_modules()}
        tokens = torch.randint(0, spec.vocab_size, (1, 9))
        batch = (tokens[:, :-1], tokens[:, 1:], torch.ones(1, 8))
        for _ in range(2):  # the second step as the first
            gathered.clear()
            backward.clear()
            token_loss_sum(model, *batch).backward()
            assert Counter(gathered) == {"root": 1, "model.embed_tokens": 1, "lm_head": 1,
                                         **{f"model.layers.{i}": 2 for i in range(spec.n_layers)}}
            # The freed heap goes back twice: before any unit's backward, then after every block's and before
            # the embedding's.
            assert backward.count("release") == 2 and backward[0] == "release"
            second = backward.index("release", 1)
            assert all(backward.index(f"model.layers.{i}") < second for i in range(spec.n_layers))
            assert second < backward.index("model.embed_tokens")
        modelled = next(c for c in collectives("fsdp", Workload(spec, 8, 1, framework="torch"), 2) if c.kind == "all_gather")
        assert modelled.calls == len(gathered)

        strategy = Sharding.__new__(Sharding)
        strategy.model, strategy.device = model, torch.device("cpu")
        backward.clear()
        with torch.no_grad():
            strategy.eval_losses(SimpleNamespace(model=model), [tuple(t.numpy() for t in batch)])
        assert all(isinstance(p, DTensor) for p in model.parameters()), "a unit stayed gathered after an evaluation"
        assert "release" not in backward  # an evaluation has no backward to release before
    finally:
        dist.destroy_process_group()
