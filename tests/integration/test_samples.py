"""What a user does with trained weights: a greedy continuation in the report (the same text from both
frameworks at fp32 parity), and an exported folder that transformers' pipeline opens with its tokenizer."""
import json

import pytest

from helpers import dpcompare
from compare.launch.sample import PROMPT, continuation


def test_both_frameworks_continue_the_prompt_with_the_same_tokens(matrix):
    mlx, torch = (continuation(matrix.run(fw, 1), max_new_tokens=12) for fw in ("mlx", "torch"))
    assert mlx["prompt"] == PROMPT and mlx["framework"] == "mlx" and torch["framework"] == "torch"
    assert len(mlx["tokens"]) == 12 and mlx["text"]
    assert mlx["tokens"] == torch["tokens"] and mlx["text"] == torch["text"]


def test_the_exported_folder_generates_with_transformers_pipeline_and_its_tokenizer(matrix, cache_dir, tmp_path):
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "hf"
    dpcompare("export", matrix.run("torch", 1), "--out", out, cache_dir=cache_dir)
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= {p.name for p in out.iterdir()}
    assert json.loads((out / "generation_config.json").read_text())["do_sample"] is False
    ours = continuation(matrix.run("torch", 1), max_new_tokens=8)
    generator = transformers.pipeline("text-generation", model=str(out), device="cpu")
    eos = generator.tokenizer.eos_token_id
    expected = ours["tokens"][:ours["tokens"].index(eos) + 1] if eos in ours["tokens"] else ours["tokens"]
    text = generator(PROMPT, max_new_tokens=8, do_sample=False, return_full_text=False)[0]["generated_text"]
    assert text == generator.tokenizer.decode(expected)
    assert generator.tokenizer.encode(PROMPT) == generator.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
