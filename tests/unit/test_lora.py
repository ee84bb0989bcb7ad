"""LoRA (common/model/lora.py, mlx_impl/lora.py, torch_impl/lora.py): one adapter spec in common, applied by each
framework; in-process Trainers at one rank (no training process: the N=2 and resume properties are
tests/integration/test_training.py's)."""
import math

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from common.config import RunConfig
from common.errors import UserError
from common.model.lora import TARGET_PATHS, Adapters, FullModel
from common.model.spec import preset
from common.model.weights import init_weights, parameter_shapes
from common.train.protocols import World
from mlx_impl.step import Trainer as MlxTrainer
from torch_impl.step import Trainer as TorchTrainer

SPEC = preset("tiny")


def test_the_adapters_sit_on_the_named_modules_of_the_last_blocks_with_pefts_shapes_and_scale():
    adapters = Adapters(rank=4, alpha=16.0, targets=("q_proj", "down_proj"), layers=1)
    shapes = adapters.state_shapes(SPEC)
    last = SPEC.n_layers - 1
    assert list(shapes) == [f"model.layers.{last}.self_attn.q_proj.lora_A", f"model.layers.{last}.self_attn.q_proj.lora_B",
                            f"model.layers.{last}.mlp.down_proj.lora_A", f"model.layers.{last}.mlp.down_proj.lora_B"]
    assert shapes[f"model.layers.{last}.mlp.down_proj.lora_A"] == (4, SPEC.ffn_dim)
    assert shapes[f"model.layers.{last}.mlp.down_proj.lora_B"] == (SPEC.dim, 4)
    assert adapters.scale == 4.0 and adapters.trained_parameters(SPEC) == sum(math.prod(s) for s in shapes.values())
    assert FullModel().state_shapes(SPEC) == parameter_shapes(SPEC)


def test_initial_values_are_seeded_b_is_zero_and_a_is_within_its_bound():
    adapters = Adapters(rank=8, alpha=8.0, targets=("q_proj", "v_proj", "gate_proj"))
    first, again, other = (adapters.initial_values(SPEC, seed) for seed in (0, 0, 1))
    for name, value in first.items():
        np.testing.assert_array_equal(value, again[name])
        if name.endswith("lora_B"):
            assert not value.any()
        else:
            bound = 1 / math.sqrt(value.shape[1])
            assert np.abs(value).max() <= bound and np.abs(value).max() > 0.8 * bound
            assert not np.array_equal(value, other[name])


@pytest.mark.parametrize("fields, message", [
    ({"lora_rank": 4, "lora_targets": "q_proj,qkv"}, "unknown module 'qkv'"),
    ({"lora_rank": 33}, "larger than model.layers.0.self_attn.v_proj's smaller dimension (32)"),
    ({"lora_rank": -1}, "lora_rank must be >= 0"),
    ({"lora_rank": 0, "lora_targets": "q_proj"}, "--lora-targets sets up LoRA adapters, but the rank is 0"),
    ({"lora_rank": 4, "strategy": "tp", "nproc": 2}, "--lora-rank trains under ddp, zero1 and zero2 only"),
    ({"lora_rank": 4, "checkpoint_format": "sharded"}, "does not hold LoRA adapters"),
])
def test_bad_lora_flags_are_refused_in_one_line(fields, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        RunConfig(preset="tiny", **fields).validate()


@pytest.fixture(autouse=True)
def uncompiled_mlx():
    """MLX's compiled kernels are built by the system compiler on first use, 20 s of this module with a cold cache
    (a fresh TMPDIR); what is checked here is which parameters train, not the kernels."""
    mx.disable_compile()
    yield
    mx.enable_compile()


def trainer_losses(trainer_cls, framework, steps=3):
    cfg = RunConfig(framework=framework, preset="tiny", lr=1e-2, lora_rank=4, lora_targets="q_proj,v_proj,down_proj",
                    grad_clip=0.0)
    cfg.validate()
    trained = cfg.trained
    weights = {**init_weights(SPEC, 0), **trained.initial_values(SPEC, 0)}
    trainer = trainer_cls(cfg, SPEC, weights, World())
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, SPEC.vocab_size, size=(4, 17)).astype(np.int32)
    batch = (tokens[:, :-1], tokens[:, 1:], np.ones((4, 16), dtype=np.float32))
    losses = [trainer.train_step([batch], 1e-2, 64)[0] for _ in range(steps)]
    return trainer, losses, weights


def test_both_frameworks_train_only_the_adapters_from_the_same_values_to_the_same_losses():
    mlx_trainer, mlx_losses, weights = trainer_losses(MlxTrainer, "mlx")
    torch_trainer, torch_losses, _ = trainer_losses(TorchTrainer, "torch")
    np.testing.assert_allclose(mlx_losses, torch_losses, rtol=0, atol=1e-5)
    assert mlx_losses[-1] < mlx_losses[0]  # the adapters learn
    names = set(Adapters(4, 8.0, ("q_proj", "v_proj", "down_proj")).state_shapes(SPEC))
    # The base is frozen: unchanged, no gradient, no optimizer state; the adapters moved (B from zero)
    assert set(dict(tree_flatten(mlx_trainer.model.trainable_parameters()))) == names
    for name, value in tree_flatten(mlx_trainer.model.parameters()):
        if name not in names:
            np.testing.assert_array_equal(np.array(value), weights[name])
    assert {torch_trainer.names[p] for p in torch_trainer.optimizer.state} == names
    for name, param in torch_trainer.model.named_parameters():
        assert param.requires_grad == (name in names)
        if name not in names:
            np.testing.assert_array_equal(param.detach().numpy(), weights[name])
    b = "model.layers.1.mlp.down_proj.lora_B"
    assert np.abs(np.array(dict(tree_flatten(mlx_trainer.model.parameters()))[b])).max() > 0
    adapter_bytes = 4 * Adapters(4, 8.0, ("q_proj", "v_proj", "down_proj")).trained_parameters(SPEC)
    for trainer in (mlx_trainer, torch_trainer):
        sizes = trainer.state_bytes()
        assert sizes["params"] == sizes["grads"] == adapter_bytes and sizes["optimizer"] >= 2 * adapter_bytes
        assert {name for name, _ in trainer.export_state()[0]} == names  # a checkpoint holds the adapters


def test_an_adapted_linear_adds_scale_times_b_a_to_the_base():
    cfg = RunConfig(framework="mlx", preset="tiny", lora_rank=2, lora_alpha=6.0, lora_targets="o_proj")
    trained = cfg.trained
    weights = {**init_weights(SPEC, 0), **trained.initial_values(SPEC, 0)}
    weights["model.layers.0.self_attn.o_proj.lora_B"] = np.random.default_rng(1).normal(
        size=weights["model.layers.0.self_attn.o_proj.lora_B"].shape).astype(np.float32)
    trainer = MlxTrainer(cfg, SPEC, weights, World())
    linear = trainer.model.model.layers[0].self_attn.o_proj
    x = np.random.default_rng(2).normal(size=(3, SPEC.dim)).astype(np.float32)
    a, b = weights["model.layers.0.self_attn.o_proj.lora_A"], weights["model.layers.0.self_attn.o_proj.lora_B"]
    expected = x @ weights["model.layers.0.self_attn.o_proj.weight"].T + 3.0 * (x @ a.T) @ b.T
    np.testing.assert_allclose(np.array(linear(mx.array(x))), expected, rtol=1e-5, atol=1e-5)


def test_the_initial_adapters_are_written_once_beside_the_seed_for_both_frameworks_and_other_tools(tmp_path):
    from safetensors.numpy import load_file

    from common.model.lora import initial_adapters_file

    adapters = Adapters(rank=4, alpha=8.0, targets=("q_proj", "v_proj"))
    path = initial_adapters_file(adapters, SPEC, 7, tmp_path)
    written = load_file(str(path))
    expected = adapters.initial_values(SPEC, 7)
    assert written.keys() == expected.keys() and all(np.array_equal(written[k], expected[k]) for k in expected)
    mtime = path.stat().st_mtime_ns
    assert initial_adapters_file(adapters, SPEC, 7, tmp_path) == path and path.stat().st_mtime_ns == mtime
    assert initial_adapters_file(adapters, SPEC, 8, tmp_path) != path  # another seed, another file
    assert initial_adapters_file(FullModel(), SPEC, 7, tmp_path) is None  # the seed checkpoint holds every value


def differentiated_shapes(framework, monkeypatch) -> list:
    """The shapes of what each op-class workload asks its framework to differentiate, recorded as they run."""
    seen: list = []
    if framework == "mlx":
        vjp = mx.vjp

        def recording(fun, primals, cotangents):
            seen.append([tuple(p.shape) for p in primals])
            return vjp(fun, primals, cotangents)
        monkeypatch.setattr(mx, "vjp", recording)
    else:
        import torch

        grad = torch.autograd.grad

        def recording_grad(outputs, inputs, *args, **kwargs):
            seen.append([tuple(t.shape) for t in inputs])
            return grad(outputs, inputs, *args, **kwargs)
        monkeypatch.setattr(torch.autograd, "grad", recording_grad)
    return seen


@pytest.mark.parametrize("framework", ["mlx", "torch"])
@pytest.mark.parametrize("bits", [0, 4])
def test_the_op_classes_of_a_lora_step_differentiate_the_adapters_never_the_frozen_base(framework, bits, monkeypatch):
    """The op-class profile (mlx_impl/opclasses.py, torch_impl/opclasses.py) times what a LoRA step runs: the
    adapted projections differentiated for their inputs and adapters (the frozen base, float32 or 4-bit, gets no
    weight gradient), the blocks below the adapted ones forward alone, and the update of the adapters only."""
    from common.model.quantize import quantize_tensors

    spec = SPEC.__class__(**{**SPEC.to_dict(), "vocab_size": 512, "ffn_dim": 192})
    cfg = RunConfig(framework=framework, preset="tiny", lora_rank=4, lora_targets="q_proj,v_proj,down_proj",
                    lora_layers=1, quantize_base=bits, model={"vocab_size": 512, "ffn_dim": 192})
    cfg.validate()
    base = init_weights(spec, 0)
    weights = {**(quantize_tensors(cfg.base_storage, spec, base) if bits else base), **cfg.trained.initial_values(spec, 0)}
    trainer = {"mlx": MlxTrainer, "torch": TorchTrainer}[framework](cfg, spec, weights, World())
    tokens = np.random.default_rng(0).integers(0, 512, size=(2, 17)).astype(np.int32)
    workloads = trainer.op_workloads((tokens[:, :-1], tokens[:, 1:], np.ones((2, 16), dtype=np.float32)), 3)
    # one block of two adapted: its layer workloads 3 times a step (a micro-batch each), the block below's forward
    for name in ("matmul", "attention", "norms/activations/RoPE"):
        assert [times for _, times in workloads[name]][:2] == [3, 3], name
    seen = differentiated_shapes(framework, monkeypatch)
    for parts in workloads.values():
        for run, _ in parts:
            run()
    # every tensor differentiated is an activation (3-D or more) or an adapter: once per workload with a backward
    assert len(seen) == 6  # the layer's matmuls, the head, attention, the loss, the layer's and the final norms
    parameters = sorted(shape for shapes in seen for shape in shapes if len(shape) <= 2)
    adapters = {k: v for k, v in cfg.trained.state_shapes(spec).items() if k.startswith("model.layers.1.")}
    assert parameters == sorted(adapters.values())
    if framework == "torch":  # the update gave only the adapters gradients
        assert all(p.grad is None for p in trainer.model.parameters() if not p.requires_grad)


@pytest.mark.parametrize("framework", ["mlx", "torch"])
def test_under_full_training_the_op_classes_differentiate_every_weight_they_use(framework, monkeypatch):
    cfg = RunConfig(framework=framework, preset="tiny")
    cfg.validate()
    trainer = {"mlx": MlxTrainer, "torch": TorchTrainer}[framework](cfg, SPEC, init_weights(SPEC, 0), World())
    tokens = np.random.default_rng(0).integers(0, SPEC.vocab_size, size=(2, 17)).astype(np.int32)
    workloads = trainer.op_workloads((tokens[:, :-1], tokens[:, 1:], np.ones((2, 16), dtype=np.float32)), 1)
    assert {name: [times for _, times in parts] for name, parts in workloads.items()} == {
        "matmul": [2, 1], "attention": [2], "softmax/cross-entropy": [1], "norms/activations/RoPE": [2, 1],
        "optimizer": [1]}
    seen = differentiated_shapes(framework, monkeypatch)
    for parts in workloads.values():
        for run, _ in parts:
            run()
    shapes = parameter_shapes(SPEC)
    block = [shapes[f"model.layers.0.{m}.weight"] for m in TARGET_PATHS.values()]
    norms = [shapes["model.layers.0.input_layernorm.weight"]] * 2 + [shapes["model.norm.weight"]]
    assert sorted(s for shapes_ in seen for s in shapes_ if len(s) <= 2) == \
        sorted(block + [shapes["lm_head.weight"]] + norms)
