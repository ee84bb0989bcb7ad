"""Pretrained checkpoints: folders transformers writes with the real configs of SmolLM2-135M, TinyLlama-1.1B
and Llama-3.2-1B (reduced in size, every field that changes the numbers at its real value) load in both
frameworks and give transformers' logits; every config field is honoured or refused by name."""
from __future__ import annotations

import importlib.util
import json

import mlx.core as mx
import numpy as np
import pytest
import torch
import transformers

import mlx_impl.model as mlx_model
import torch_impl.model as torch_model
from common.errors import UserError
from common.model.hfconfig import from_hf_config, to_hf_config
from common.model.weights import load_pretrained, save_pretrained
from helpers import ROOT, dpcompare_here

spec_of = importlib.util.spec_from_file_location("pretrained_folder", ROOT / "benchmarks" / "pretrained_folder.py")
pretrained_folder = importlib.util.module_from_spec(spec_of)
spec_of.loader.exec_module(pretrained_folder)
reduced, write_folder = pretrained_folder.reduced, pretrained_folder.write_folder

# Measured max |Δ logits| against LlamaForCausalLM (float32, eager attention), T = 64, over the configs below:
# torch 5e-7 to 6.5e-6, MLX 9e-7 to 3.7e-5 (TinyLlama's, the widest); at T = 8200 on Llama-3.2's (4 heads):
# torch 1.8e-6, MLX 1.3e-5. 1e-4 is the bound.
ATOL = 1e-4
CONFIGS = {
    "smollm2-135m": reduced("smollm2-135m"),
    "tinyllama-1.1b": reduced("tinyllama-1.1b"),
    "llama-3.2-1b": reduced("llama-3.2-1b"),
    # Fields none of the three sets, each on a real base: a head size other than hidden / heads, biases,
    # linear and dynamic scaling (dynamic with a short max_position_embeddings, so T passes it).
    "head-dim-and-biases": reduced("llama-3.2-1b", hidden_size=192, attention_bias=True, mlp_bias=True),
    "linear": reduced("smollm2-135m", rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "dynamic": reduced("smollm2-135m", max_position_embeddings=48, rope_scaling={"rope_type": "dynamic",
                                                                                  "factor": 2.0}),
}
BACKENDS = {"mlx": mlx_model, "torch": torch_model}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("pretrained")
    return {name: write_folder(root / name, "smollm2-135m", config, qk_gain=8.0, tokenizer=False)
            for name, config in CONFIGS.items()}


def hf_logits(directory, tokens: np.ndarray) -> np.ndarray:
    model = transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                          attn_implementation="eager").eval()
    with torch.no_grad():
        return model(torch.from_numpy(tokens)).logits.numpy()


def our_logits(backend, directory, tokens: np.ndarray) -> np.ndarray:
    model = backend.from_pretrained(directory)
    if backend is mlx_model:
        return np.array(model(mx.array(tokens)))
    with torch.no_grad():
        return model(torch.from_numpy(tokens)).numpy()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_both_frameworks_give_transformers_logits_on_real_configs(folders, name):
    T = 64  # past the dynamic variant's max_position_embeddings (48): its theta grows
    tokens = np.random.default_rng(1).integers(0, CONFIGS[name]["vocab_size"], size=(2, T))
    expected = hf_logits(folders[name], tokens)
    for framework, backend in BACKENDS.items():
        got = our_logits(backend, folders[name], tokens)
        assert np.abs(got - expected).max() <= ATOL, (framework, float(np.abs(got - expected).max()))


@pytest.mark.parametrize("name", ["llama-3.2-1b", "head-dim-and-biases", "dynamic"])
def test_config_round_trips_through_export(folders, name, tmp_path):
    """The config.json a run's checkpoint (and `export`) writes reads back as the same spec and logits."""
    spec, weights = load_pretrained(folders[name])
    save_pretrained(tmp_path, spec, weights)
    again, _ = load_pretrained(tmp_path)
    assert again == spec and from_hf_config(to_hf_config(spec)) == spec
    tokens = np.random.default_rng(3).integers(0, spec.vocab_size, size=(1, 16))
    for backend in BACKENDS.values():
        np.testing.assert_array_equal(our_logits(backend, tmp_path, tokens), our_logits(backend, folders[name], tokens))


def test_both_config_layouts_give_the_same_spec(folders):
    """transformers 5 nests rope settings under rope_parameters; older files have rope_theta and
    rope_scaling (with `type` in the oldest) beside the other fields."""
    new = json.loads((folders["llama-3.2-1b"] / "config.json").read_text())
    assert "rope_parameters" in new  # what the installed transformers wrote
    old = {k: v for k, v in new.items() if k != "rope_parameters"}
    scaling = {k: v for k, v in new["rope_parameters"].items() if k != "rope_theta"}
    old.update(rope_theta=new["rope_parameters"]["rope_theta"], rope_scaling=scaling)
    oldest = {**old, "rope_scaling": {("type" if k == "rope_type" else k): v for k, v in scaling.items()}}
    spec = from_hf_config(new)
    assert spec == from_hf_config(old) == from_hf_config(oldest)
    assert spec.rope_theta == 500000.0 and dict(spec.rope_scaling)["rope_type"] == "llama3"
    assert spec.head_dim == 64 and spec.tie_embeddings and spec.norm_eps == 1e-5 and spec.max_seq_len == 131072


@pytest.mark.parametrize("field, value, named", [
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}, "'yarn'"),
    ("rope_scaling", {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}, "'longrope'"),
    ("hidden_act", "gelu", "hidden_act = 'gelu'"),
    ("attention_dropout", 0.1, "attention_dropout = 0.1"),
    ("partial_rotary_factor", 0.5, "partial_rotary_factor = 0.5"),
    ("model_type", "mistral", "model_type = 'mistral'"),
])
def test_a_field_the_project_does_not_implement_is_refused_by_name(field, value, named):
    cfg = {**to_hf_config(from_hf_config(reduced("tinyllama-1.1b"))), field: value}
    with pytest.raises(UserError, match=named.replace("[", r"\[")):
        from_hf_config(cfg)


def test_run_refuses_a_yarn_checkpoint_with_exit_2_naming_the_field(folders, tmp_path, cache_dir):
    folder = tmp_path / "yarn"
    folder.mkdir()
    cfg = json.loads((folders["llama-3.2-1b"] / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0,
                              "original_max_position_embeddings": 8192}
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "model.safetensors").write_bytes((folders["llama-3.2-1b"] / "model.safetensors").read_bytes())
    proc = dpcompare_here("run", "--framework", "mlx", "--init-from", folder, "--steps", "1",
                          "--out", tmp_path / "out", cache_dir=cache_dir)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "rope_type 'yarn'" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


def test_a_preset_or_model_field_that_contradicts_the_folder_exits_2_naming_the_field(folders, tmp_path,
                                                                                       cache_dir):
    folder = folders["smollm2-135m"]
    for args, needle in ((["--preset", "tiny"], "model.dim is 64 in the preset, 192 in the folder"),
                         (["--set", "model.n_layers=4"], "model.n_layers=4 contradicts"),
                         (["--set", "model.rope_theta=10000"], "model.rope_theta=10000 contradicts")):
        proc = dpcompare_here("run", "--framework", "torch", "--init-from", folder, *args,
                              "--out", tmp_path / "out", cache_dir=cache_dir)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert needle in proc.stderr, proc.stderr
    # restating the folder's own value is no contradiction
    from common.config import RunConfig

    cfg = RunConfig.from_dict({"init_from": str(folder), "model": {"n_layers": 2}, "seq_len": 32})
    assert cfg.model_spec().dim == 192 and cfg.model_spec().rope_theta == 100000.0


# ---- the checkpoint's tokenizer -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer_folders(tmp_path_factory):
    """The three checkpoints' special-token conventions on one small BPE: Llama 3.2 and TinyLlama put a BOS
    before a text, SmolLM2 does not; and Llama 3.2's with add_bos_token stated false."""
    root = tmp_path_factory.mktemp("tokenizers")
    folders = {}
    for name in ("llama-3.2-1b", "smollm2-135m", "tinyllama-1.1b"):
        folders[name] = root / name
        folders[name].mkdir()
        pretrained_folder.write_tokenizer(folders[name], name, vocab_size=300)
    folders["no-bos"] = root / "no-bos"
    folders["no-bos"].mkdir()
    pretrained_folder.write_tokenizer(folders["no-bos"], "llama-3.2-1b", vocab_size=300)
    config = json.loads((folders["no-bos"] / "tokenizer_config.json").read_text())
    (folders["no-bos"] / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": False}))
    return folders


def test_each_document_starts_with_bos_where_the_checkpoints_tokenizer_adds_one(tokenizer_folders, tmp_path):
    from tokenizers import Tokenizer

    from common.data.sequences import SequenceView
    from common.data.tokencache import prepare_tokens

    data = tmp_path / "docs.txt"
    data.write_text("Tom saw a cat.\n\nThe cat ran away.\n\nTom was sad, then happy.\n")
    caches = {name: prepare_tokens(str(data), str(folder), cache_dir=tmp_path / "cache", val_fraction=0,
                                   progress=False) for name, folder in tokenizer_folders.items()}
    for name, cache in caches.items():
        split = cache.split("train")
        bos_token = pretrained_folder.SPECIAL_TOKENS[name][0] if name != "no-bos" else None
        adds_bos = name in ("llama-3.2-1b", "tinyllama-1.1b")
        expected_bos = cache.meta["bos_id"] if adds_bos else None
        assert (expected_bos is not None) == adds_bos, name
        if adds_bos:
            assert expected_bos == Tokenizer.from_file(str(cache.tokenizer_path)).token_to_id(bos_token)
        for doc in range(split.num_documents):
            start, stop = (int(x[0]) for x in split.document_spans(np.array([doc])))
            tokens = split.read(start, stop).tolist()
            assert tokens[-1] == cache.meta["eos_id"], name  # EOS between documents
            assert (tokens[0] == expected_bos) if expected_bos is not None else (tokens[0] != cache.meta["eos_id"])
            assert tokens.count(expected_bos) == (1 if expected_bos is not None else 0)
        # padding: one sample per document, from its BOS, the targets past its EOS masked
        inputs, _, mask = SequenceView(split, 16, "padding").batch([0])
        starts, stops = split.document_spans(np.array([0]))
        assert mask.sum() == min(int(stops[0] - starts[0]) - 1, 16) and mask[0, -1] == 0
        assert expected_bos is None or inputs[0, 0] == expected_bos
    # The same tokenizer.json with and without BOS handling: two caches, not one.
    same = caches["llama-3.2-1b"].meta["tokenizer"]["fingerprint"] == caches["no-bos"].meta["tokenizer"]["fingerprint"]
    assert same and caches["llama-3.2-1b"].path != caches["no-bos"].path


def test_init_from_takes_the_tokenizer_from_the_folder_unless_one_is_named(tokenizer_folders, folders, tmp_path):
    from common.config import RunConfig

    folder = tmp_path / "ckpt"
    folder.mkdir()
    for file in ("config.json", "model.safetensors"):
        (folder / file).write_bytes((folders["llama-3.2-1b"] / file).read_bytes())
    assert RunConfig.from_dict({"init_from": str(folder)}).resolved_tokenizer == "builtin"  # none in the folder
    for file in ("tokenizer.json", "tokenizer_config.json"):
        (folder / file).write_bytes((tokenizer_folders["llama-3.2-1b"] / file).read_bytes())
    assert RunConfig.from_dict({"init_from": str(folder)}).resolved_tokenizer == str(folder)
    named = str(tokenizer_folders["smollm2-135m"])
    assert RunConfig.from_dict({"init_from": str(folder), "tokenizer": named}).resolved_tokenizer == named


@pytest.mark.parametrize("strategy", ["fsdp", "tp", "pp"])
def test_sharded_strategies_refuse_a_checkpoint_with_biases(folders, strategy):
    from common.config import RunConfig

    with pytest.raises(UserError, match=f"--strategy {strategy} does not support biases .model.attention_bias"):
        RunConfig.from_dict({"init_from": str(folders["head-dim-and-biases"]), "strategy": strategy, "nproc": 2,
                             "seq_len": 32})
    RunConfig.from_dict({"init_from": str(folders["head-dim-and-biases"]), "nproc": 2, "seq_len": 32})  # ddp runs


def test_flops_count_an_explicit_head_dim(folders):
    from common.model.flops import matmul_parameters

    spec, weights = load_pretrained(folders["head-dim-and-biases"])
    assert spec.n_heads * spec.head_dim != spec.dim
    matmuls = sum(w.size for name, w in weights.items() if name.endswith("proj.weight")) + spec.vocab_size * spec.dim
    assert matmul_parameters(spec) == matmuls
