"""zero1 and zero2 (common/parallel/zero.py, mlx_impl/zero.py, torch_impl/zero.py) without a training process: the
ZeRO ladder's state bytes per rank against the formula, from the layout and from each framework's own strategy
object built as rank r of N (the ranks simulated one after another: no collective runs); the rows every rank keeps
tile each tensor once; refusals before any rank starts; the cost model's memory and traffic through the layout.
The training runs (N=2 against N=1, MLX against torch) are tests/integration/test_zero.py's."""
import math
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from common.checkpoint.tensorsource import DictSource
from common.config import RunConfig
from common.costmodel.calibrate import calibrate
from common.costmodel.links import loopback_link
from common.costmodel.memory import memory_bytes
from common.costmodel.predict import predict
from common.costmodel.workload import Workload
from common.errors import UserError
from common.model.spec import ModelSpec, preset
from common.model.weights import init_weights, parameter_shapes
from common.parallel import layout
from common.parallel.zero import pad_elements, paper_bytes, state_elements_of

# tiny with an odd vocabulary and widths 3 does not divide: every tensor's last shard is padded at N=3
SPEC = replace(preset("tiny"), vocab_size=511)
STAGES = {"ddp": 0, "zero1": 1, "zero2": 2}


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("name", ["tiny", "small"])
def test_the_ladder_state_bytes_are_the_formula_padding_aside(name, n):
    """fp32 Adam, no master copy apart from the fp32 weights: ddp 16Ψ, zero1 4Ψ + 4Ψ + 8Ψ/N, zero2 4Ψ + 12Ψ/N,
    fsdp 16Ψ/N (the paper's Table 1 with K = 8), each plus the padding of its shards, shown on its own."""
    spec = replace(preset(name), vocab_size=511)
    shapes = parameter_shapes(spec)
    psi = sum(math.prod(s) for s in shapes.values())
    pad = pad_elements(shapes, n)
    assert 0 <= pad < n * len(shapes) * max(math.prod(s[1:]) for s in shapes.values())
    for strategy, stage in STAGES.items():
        held = layout(strategy, n).state_elements(spec)
        state = 4 * sum(held.values())
        sharded = {0: 0, 1: 8, 2: 12}[stage]  # the bytes per element of the sharded parts
        assert state == pytest.approx(paper_bytes(psi, n, stage, mixed=False) + sharded * pad / n, rel=1e-12)
    assert paper_bytes(psi, n, 0, False) == 16 * psi
    fsdp = 4 * sum(layout("fsdp", n).state_elements(spec).values())
    assert fsdp == pytest.approx(paper_bytes(psi, n, 3, False), rel=0.01)  # fsdp pads the vocabulary only
    # the paper's mixed-precision form (bf16 parameters and gradients beside an fp32 master): 2Ψ + 2Ψ + 12Ψ/N at ZeRO-1
    assert paper_bytes(psi, n, 1, True) == pytest.approx(psi * (4 + 12 / n))


class _Group:
    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


def _cfg(strategy: str, n: int) -> RunConfig:
    return RunConfig(strategy=strategy, nproc=n, preset="tiny", global_batch_size=12, framework="torch")


def _moments(shapes: dict) -> tuple[dict, dict]:
    rng = np.random.default_rng(0)
    return ({k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()},
            {k: rng.random(s).astype(np.float32) for k, s in shapes.items()})


@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
def test_each_frameworks_ranks_hold_the_formulas_bytes_and_their_rows_tile_every_tensor(strategy):
    """Rank r of 3 in each framework: its state bytes (moments read whole at resume, cut to its rows) are the
    layout's, padding included, and the rows of the three ranks, laid out as the all-gather lays them, give back
    the whole moments."""
    import mlx.core as mx
    import torch
    from mlx.utils import tree_flatten, tree_map, tree_unflatten

    from mlx_impl.comm import CommCounter as MlxComm
    from mlx_impl.model import Llama as MlxLlama
    from mlx_impl.optimizer import make_optimizer as mlx_optimizer
    from mlx_impl.zero import Zero1 as MlxZero1, Zero2 as MlxZero2
    from torch_impl.adamw import AdamW
    from torch_impl.comm import CommCounter as TorchComm
    from torch_impl.model import Llama as TorchLlama
    from torch_impl.zero import Zero1 as TorchZero1, Zero2 as TorchZero2

    n, stage = 3, STAGES[strategy]
    source = DictSource(init_weights(SPEC, 0))
    shapes = {k: tuple(s) for k, s in parameter_shapes(SPEC).items()}
    want = {k: 4 * v for k, v in state_elements_of(shapes, n, stage).items()}
    m, v = _moments(shapes)
    cfg = _cfg(strategy, n)
    mlx_rows, torch_rows = [], []
    for rank in range(n):
        world = SimpleNamespace(group=_Group(rank, n), rank=rank, size=n, device="cpu")
        # MLX: the optimizer's state holds the rank's rows; whole moments set at resume are cut at its first update
        z = {"zero1": MlxZero1, "zero2": MlxZero2}[strategy](cfg, world, MlxComm())
        model = z.wrap(MlxLlama(SPEC), source)
        opt = z.optimizer(mlx_optimizer(cfg))
        opt.init(model.trainable_parameters())
        held = z.state_bytes(model, opt)
        scalars = held["optimizer"] - want["optimizer"]  # the step count and the learning rate
        assert (held["params"], held["grads"]) == (want["params"], want["grads"]) and 0 < scalars <= 16
        state = opt.state
        for key, moment in (("m", m), ("v", v)):
            for path, value in tree_flatten(tree_unflatten([(p, mx.array(moment[p])) for p in shapes])):
                node = state
                *parents, leaf = path.split(".")
                for part in parents:
                    node = node[int(part)] if isinstance(node, list) else node[part]
                node[leaf][key] = value
        tree_map(opt._cut, z.own_rows(model.trainable_parameters()), opt.state)
        mlx_rows.append(dict(tree_flatten(opt.state)))
        # torch: the same rows, cut as the Trainer sets whole moments by the whole parameters
        t = {"zero1": TorchZero1, "zero2": TorchZero2}[strategy](cfg, world, TorchComm())
        with torch.device("meta"):
            tmodel = TorchLlama(SPEC)
        if stage == 1:  # zero1 wraps the model in DDP, which needs a process group; its rows are the same without
            from torch_impl.load import load_local
            load_local(tmodel, torch.device("cpu"), source, t.local_index)
            named = [(k, p) for k, p in tmodel.named_parameters() if p.requires_grad]
            t.shapes = {k: tuple(p.shape) for k, p in named}
            t.params = [p for _, p in named]
            t.shards = [t._rows_of(k, p) for k, p in named]
        else:
            t.wrap(tmodel, source)
        base = AdamW([{"params": t.params}], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
        topt = t.optimizer(base)
        for name, p in tmodel.named_parameters():
            topt.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.from_numpy(m[name]),
                             "exp_avg_sq": torch.from_numpy(v[name])}
        theld = t.state_bytes(tmodel, topt)
        assert (theld["params"], theld["grads"]) == (want["params"], want["grads"])
        assert theld["optimizer"] - want["optimizer"] == 4 * len(shapes)  # each tensor's step count
        torch_rows.append({name: topt.state.get(p) for name, p in tmodel.named_parameters()})
    for name, shape in shapes.items():
        for key, tkey, whole in (("m", "exp_avg", m), ("v", "exp_avg_sq", v)):
            gathered = np.concatenate([np.array(r[f"{name}.{key}"]) for r in mlx_rows])[:shape[0]]
            np.testing.assert_array_equal(gathered, whole[name])
            tgathered = np.concatenate([r[name][tkey].numpy() for r in torch_rows])[:shape[0]]
            np.testing.assert_array_equal(tgathered, whole[name])
            pad = np.concatenate([np.array(r[f"{name}.{key}"]) for r in mlx_rows])[shape[0]:]
            assert not pad.any()  # the last ranks' padding rows are zero


@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
def test_a_world_of_one_and_the_sharded_format_exit_before_any_rank_starts(strategy):
    """RunConfig.from_dict validates as every run's config is made (common/config_checks.py), before anything is
    prepared: the CLI prints the UserError as one line and exits 2."""
    with pytest.raises(UserError, match=f"strategy {strategy} shards the optimizer state over the ranks and needs 2"):
        RunConfig.from_dict({"strategy": strategy, "nproc": 1})
    with pytest.raises(UserError, match="--checkpoint-format sharded: --strategy"):
        RunConfig.from_dict({"strategy": strategy, "nproc": 2, "checkpoint_format": "sharded"})
    with pytest.raises(UserError, match="a mesh names its own strategies"):
        RunConfig.from_dict({"strategy": strategy, "nproc": 2, "mesh": "dp=2"})
    RunConfig.from_dict({"strategy": strategy, "nproc": 2, "lora_rank": 4})  # LoRA trains under zero1 and zero2


@pytest.mark.parametrize("args", [("--nproc", 1), ("--nproc", 2, "--checkpoint-format", "sharded"),
                                  ("--nproc", 4, "--mesh", "zero1=2,tp=2")])
def test_the_cli_exits_2_with_one_line(args, cache_dir, tmp_path):
    from helpers import dpcompare_here

    proc = dpcompare_here("run", "--framework", "torch", "--strategy", "zero2", *args, "--out", tmp_path / "r",
                          cache_dir=cache_dir)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, (proc.returncode, proc.stderr)


def test_the_cost_model_reads_the_ladder_from_the_layouts():
    """memory_bytes' state parts are each layout's state_elements (no branch on a name); the traffic is ddp's
    all-reduce plus the gather (zero1), or a reduce-scatter of the padded shards plus the gather (zero2)."""
    spec = ModelSpec.from_dict({**preset("small").__dict__, "vocab_size": 511})
    w = Workload(spec, seq_len=64, global_batch_size=8, framework="mlx")
    psi = sum(math.prod(s) for s in parameter_shapes(spec).values())
    ddp, z1, z2 = (memory_bytes(layout(s, 2), w) for s in ("ddp", "zero1", "zero2"))
    assert ddp["params"] == z1["params"] == z2["params"] == 4 * psi
    assert z1["grads"] == 4 * psi and z2["grads"] == pytest.approx(2 * psi, rel=1e-3)
    assert z1["optimizer"] == z2["optimizer"] == pytest.approx(4 * psi, rel=1e-3)
    kinds = {s: [c.kind for c in layout(s, 2).collectives(w, "native")] for s in ("zero1", "zero2")}
    assert kinds == {"zero1": ["all_reduce", "all_gather"], "zero2": ["reduce_scatter", "all_gather"]}
    assert [c.kind for c in layout("zero2", 2).collectives(w, "all_sum_slice")] == ["all_reduce", "all_gather"]
    assert layout("zero1", 2).comm_bytes_per_step_estimate(spec, 4, 64, 1) > 4 * psi


@pytest.mark.parametrize("framework, backend", [("mlx", "ring"), ("torch", "gloo")])
def test_plan_predicts_zero1_and_zero2_from_a_one_rank_run(framework, backend):
    """`dpcompare plan --strategies ddp,zero1,zero2,fsdp`: each rung's step and memory from a calibration, through its
    layout. The rungs between ddp and fsdp hold less state than ddp, and zero2 less than zero1."""
    from costmodel_fixtures import SPEC as FIXTURE_SPEC, summary

    cal = calibrate(summary(framework, 1), ModelSpec.from_dict(FIXTURE_SPEC))
    p = {s: predict(cal, s, 2, loopback_link(backend)) for s in ("ddp", "zero1", "zero2", "fsdp")}
    state = {s: sum(p[s].memory_bytes[k] for k in ("params", "grads", "optimizer")) for s in p}
    assert state["ddp"] > state["zero1"] > state["zero2"] > state["fsdp"]
    assert all(x.step_s > 0 and x.wire_bytes_per_rank > 0 for x in p.values())
    # MLX's ring has no reduce-scatter: an all-reduce's bytes (common/parallel/fsdp.py reduce_scatter_kind)
    rs = {"mlx": "all_reduce", "torch": "reduce_scatter"}[framework]
    assert [c.kind for c in p["zero2"].collectives] == [rs, "all_gather"]
