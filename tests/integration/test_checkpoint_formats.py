"""--checkpoint-format sharded end to end: MLX fsdp ranks each write their own shards, torch tp resumes from them
on the uninterrupted curve and writes its own, and `dpcompare export` reassembles whole HF files that
transformers opens. The pieces themselves: tests/unit/test_checkpoint_formats.py."""
import json

import numpy as np
import pytest

from helpers import dpcompare
from integration.runs import switched_at_a_checkpoint

SHARDED = ("--checkpoint-format", "sharded")
STRATEGY = {"fsdp": ("--strategy", "fsdp", "--nproc", 2, *SHARDED), "tp": ("--strategy", "tp", "--nproc", 2, *SHARDED)}


def test_a_sharded_checkpoint_resumes_in_the_other_framework_under_another_strategy_and_exports(
        uninterrupted, cache_dir, tmp_path):
    transformers = pytest.importorskip("transformers")
    import torch
    from safetensors.numpy import load_file

    from common.checkpoint.sharded import ShardedSource
    from torch_impl.model import from_pretrained

    resumed, straight = switched_at_a_checkpoint("mlx fsdp", "torch tp", STRATEGY, uninterrupted, cache_dir, tmp_path)
    # the cross-framework tolerance of the hf-format switch tests (test_fsdp.py, test_tp.py); measured 2.3e-7
    np.testing.assert_allclose(resumed, straight, rtol=0, atol=1e-4)

    ckpts = tmp_path / "switched" / "checkpoints"
    for step, files in ((10, 2), (20, 2)):  # MLX fsdp's ranks wrote step 10, torch tp's step 20: no whole file
        index = json.loads((ckpts / f"step_{step:06d}" / "shards" / "index.json").read_text())
        assert len(index["files"]) == files and not (ckpts / f"step_{step:06d}" / "model.safetensors").exists()
        split = index["tensors"]["model.layers.0.mlp.gate_proj.weight"]["pieces"]
        assert [p["file"] for p in split] == ["rank_00000.safetensors", "rank_00001.safetensors"]
    assert [p["file"] for p in index["tensors"]["model.norm.weight"]["pieces"]] == ["rank_00000.safetensors"]

    dpcompare("export", tmp_path / "switched", "--out", tmp_path / "hf", cache_dir=cache_dir)
    exported, source = load_file(str(tmp_path / "hf" / "model.safetensors")), ShardedSource(ckpts / "step_000020")
    assert exported.keys() == set(source.names())
    assert all(np.array_equal(exported[name], source.read(name)) for name in exported)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    ours = from_pretrained(ckpts / "step_000020")  # our model reads the sharded checkpoint itself
    tokens = torch.randint(0, ours.spec.vocab_size, (1, 12))
    with torch.no_grad():
        np.testing.assert_allclose(hf(tokens).logits.numpy(), ours(tokens).numpy(), atol=1e-4)
