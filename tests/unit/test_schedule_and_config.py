"""LR schedule, model spec and run config: the values both backends share, and their validation."""
import math

import pytest

from common.config import RunConfig
from common.errors import UserError
from common.model.hfconfig import from_hf_config, to_hf_config
from common.train.lr_schedule import lr_at
from common.model.spec import PRESETS, preset
from common.model.weights import init_weights, num_parameters, parameter_shapes


def test_lr_warms_up_linearly_then_decays_by_cosine_to_the_floor():
    kw = dict(lr=1e-3, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    warm = [lr_at(s, **kw) for s in range(10)]
    assert warm == sorted(warm) and warm[0] == pytest.approx(1e-3 / 11)
    assert lr_at(10, **kw) == pytest.approx(1e-3)
    assert lr_at(60, **kw) == pytest.approx(1e-4 + 0.5 * 0.9e-3)  # half way down the cosine
    assert lr_at(110, **kw) == pytest.approx(1e-4) and lr_at(500, **kw) == pytest.approx(1e-4)


def test_presets_match_the_source_articles():
    small, base = preset("small"), preset("base")
    assert (small.n_layers, small.dim, small.ffn_dim, small.n_heads, small.vocab_size) == (4, 256, 512, 4, 50257)
    assert (base.n_layers, base.dim, base.n_heads, base.n_kv_heads, base.vocab_size, base.max_seq_len) == \
        (12, 768, 12, 3, 50000, 2048)


@pytest.mark.parametrize("changes, field", [
    ({"dim": 30, "n_heads": 4}, "model.dim"),
    ({"n_heads": 4, "n_kv_heads": 3}, "model.n_heads"),
    ({"n_layers": 0}, "model.n_layers"),
    ({"vocab_size": -5}, "model.vocab_size"),
    ({"norm_eps": 0.0}, "model.norm_eps"),
])
def test_invalid_specs_name_the_field(changes, field):
    with pytest.raises(UserError, match=field):
        PRESETS["tiny"].with_(**changes)


def test_hf_config_round_trips():
    spec = PRESETS["base"]
    assert from_hf_config(to_hf_config(spec)) == spec


def test_seed_weights_are_deterministic_and_follow_the_documented_scheme():
    spec = PRESETS["tiny"]
    a, b, c = init_weights(spec, 0), init_weights(spec, 0), init_weights(spec, 1)
    assert all((a[k] == b[k]).all() for k in a)
    assert any((a[k] != c[k]).any() for k in a)
    assert list(a) == list(parameter_shapes(spec))
    assert sum(v.size for v in a.values()) == num_parameters(spec)
    assert (a["model.norm.weight"] == 1).all()
    assert a["model.embed_tokens.weight"].std() == pytest.approx(0.02, rel=0.05)
    assert a["model.layers.0.mlp.down_proj.weight"].std() == pytest.approx(0.02 / math.sqrt(4), rel=0.1)


def test_config_layers_defaults_toml_and_overrides(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('preset = "tiny"\nsteps = 7\nlr = 1e-3\n[model]\nn_layers = 3\n')
    cfg = RunConfig.from_sources(str(toml), {"steps": 9, "model": {"dim": 128}})
    assert (cfg.steps, cfg.lr) == (9, 1e-3)
    spec = cfg.model_spec(vocab_size=1000)
    assert (spec.n_layers, spec.dim, spec.vocab_size) == (3, 128, 1000)


@pytest.mark.parametrize("values, message", [
    ({"preset": "huge"}, "unknown preset 'huge'; allowed: tiny, small, base"),
    ({"framework": "jax"}, "unknown framework 'jax'; allowed: mlx, torch"),
    ({"framework": "torch", "backend": "ring"}, "unknown backend 'ring' for framework torch"),
    ({"sequence": "chunks"}, "unknown sequence 'chunks'"),
    ({"bogus": 1}, "unknown config field 'bogus'"),
    ({"steps": 0}, "steps must be positive"),
    ({"lr": -1.0}, "lr must be positive"),
    ({"global_batch_size": 6, "nproc": 4}, "not divisible by world size 4"),
    ({"seq_len": 100000}, "exceeds the model's max_seq_len"),
    ({"steps": "many"}, "steps must be int"),
    ({"model": {"dimm": 3}}, "unknown model field 'dimm'"),
])
def test_bad_config_values_are_user_errors_that_name_the_problem(values, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        RunConfig.from_dict(values)


def test_a_tokenizer_larger_than_an_explicit_model_vocab_is_refused():
    cfg = RunConfig.from_dict({"model": {"vocab_size": 100}})
    with pytest.raises(UserError, match="more than the model's vocab_size 100"):
        cfg.model_spec(vocab_size=5000)


def test_malformed_toml_is_a_user_error(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("steps = = 3\n")
    with pytest.raises(UserError, match="not valid TOML"):
        RunConfig.from_sources(str(bad))


def test_launch_settings_are_the_same_for_both_frameworks(tmp_path):
    from compare.launch.launchers import build_command

    envs = {}
    for framework in ("mlx", "torch"):
        for tuned in (False, True):
            # The fused-kernel compiler choice is MLX's own (PATH/TMPDIR for its JIT), checked in
            # test_mlx_cpu_jit.py; everything that sets threads and the allocator must match.
            cfg = RunConfig.from_dict({"framework": framework, "threads_per_rank": 3, "tune_malloc": tuned,
                                       "mlx_blas": "bundled", "mlx_cpu_jit": "baseline"})
            _, env, _ = build_command(cfg, tmp_path)
            envs[framework, tuned] = env
    assert envs["mlx", False] == envs["torch", False]
    assert envs["mlx", True] == envs["torch", True]
    assert envs["mlx", False]["OMP_NUM_THREADS"] == "3" and "MALLOC_MMAP_THRESHOLD_" not in envs["mlx", False]
    assert "MALLOC_MMAP_THRESHOLD_" in envs["torch", True]
