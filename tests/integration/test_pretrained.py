"""Fine-tuning a pretrained checkpoint: `compare --init-from DIR` from a folder transformers wrote with
Llama-3.2-1B's config (llama3 rope scaling, tied embeddings, a tokenizer that adds BOS), at the smallest
shapes, passes its parity verdicts; the summary names the checkpoint; the export reads back unchanged."""
import hashlib
import importlib.util
import json

import numpy as np
import pytest

from helpers import ROOT, dpcompare

spec_of = importlib.util.spec_from_file_location("pretrained_folder", ROOT / "benchmarks" / "pretrained_folder.py")
pretrained_folder = importlib.util.module_from_spec(spec_of)
spec_of.loader.exec_module(pretrained_folder)

# 4 steps of 8 x 32 tokens on a 2-layer, 128-wide model: each run is mostly process start-up.
FINETUNE = ["--steps", 4, "--seq-len", 32, "--global-batch-size", 8, "--warmup-steps", 1, "--eval-every", 0,
            "--profile-steps", 0, "--quiet", "--set", "builtin_corpus_bytes=200000"]


def test_finetuning_from_a_llama32_folder_passes_parity_and_exports_what_it_loaded(cache_dir, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    folder = pretrained_folder.write_folder(
        tmp_path / "llama32", "llama-3.2-1b",
        pretrained_folder.reduced("llama-3.2-1b", heads_per_kv=2, vocab_size=384))
    out = tmp_path / "cmp"
    proc = dpcompare("compare", "--init-from", folder, *FINETUNE, "--frameworks", "mlx,torch", "--nproc", "1,2",
                     "--no-samples", "--out", out, cache_dir=cache_dir)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["verdicts"]["all_pass"] is True and "parity PASS" in proc.stdout
    digest = hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()
    assert summary["init_from"] == [{"path": str(folder.resolve()), "weights_sha256": digest}]
    assert f"Started from the checkpoint {folder.resolve()}" in (out / "report.md").read_text()
    # --no-samples: no continuation was generated, and the report has no section for them (test_bf16 reads them)
    assert not list(out.glob("*/sample.json")) and "Greedy continuations" not in (out / "report.md").read_text()
    plan = json.loads((out / "mlx-n1" / "run_config.json").read_text())
    assert plan["spec"]["rope_scaling"]["rope_type"] == "llama3" and plan["spec"]["tie_embeddings"] is True
    assert plan["data"]["tokenizer"]["name"] == str(folder)  # the folder's tokenizer, not the builtin one

    # export -> --init-from again: the same spec; transformers and torch_impl give the same logits from it
    from common.config import folder_spec
    from torch_impl.model import from_pretrained

    dpcompare("export", out / "mlx-n1", "--out", tmp_path / "hf", cache_dir=cache_dir)
    assert folder_spec(tmp_path / "hf") == folder_spec(folder)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    tokens = torch.randint(0, 384, (1, 24))
    with torch.no_grad():
        np.testing.assert_allclose(hf(tokens).logits.numpy(), from_pretrained(tmp_path / "hf")(tokens).numpy(),
                                   atol=1e-4)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    bos = tok.convert_tokens_to_ids("<|begin_of_text|>")
    assert tok("Once upon a time").input_ids.count(bos) == 1 and tok("Once upon a time").input_ids[0] == bos
