"""Fine-tuning as it is done on Macs, end to end: LoRA adapters on a frozen base, trained on chat records rendered by
the tokenizer folder's chat template with the prompt masked out of the loss, in both frameworks at 1 and 2 ranks;
the loss normalization judged (per-rank, mlx-lm's, against global-tokens); the adapters exported for peft and
mlx-lm and the fused folder for transformers, each opened by that library. One compare of four runs and two
per-rank runs, tiny with a 512-token vocabulary. (LoRA's mechanism in-process: tests/unit/test_lora.py; the
normalizations' arithmetic: tests/unit/test_normalization.py.)"""
import json

import numpy as np
import pytest

from helpers import FAST, SHARED_DATA, dpcompare, losses, summary

pytestmark = pytest.mark.slow

# A chat template of the usual shape: each turn tagged with its role, the assistant's turn opened by the generation
# prompt (so the prompt a record's completion is cut from is everything up to it).
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
LORA = ("--lora-rank", 4, "--lora-targets", "q_proj,v_proj,o_proj", "--lora-alpha", 8)
STEPS = 12


def chat_data(tmp_path):
    """A tokenizer folder with TEMPLATE (a byte-level BPE of 512 tokens trained here on the stories: GPT-2's 50257
    would make the model's head most of each step), and chat records cut from TinyStories: the user gives a story's
    first sentence, the assistant tells the rest. Stories differ in length, so ranks hold unequal counts of targets."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    train = SHARED_DATA / "tinystories" / "train.txt"
    if not train.is_file():
        pytest.skip(f"TinyStories is absent ({train})")
    stories = [s.strip() for s in train.read_text()[:120_000].split("<|endoftext|>") if s.strip()]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    bpe.train_from_iterator(stories, trainers.BpeTrainer(vocab_size=512, special_tokens=["<|endoftext|>"],
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    bpe.save(str(tokenizer / "tokenizer.json"))
    (tokenizer / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>", "chat_template": TEMPLATE}))
    records = []
    for story in stories:
        first, _, rest = story.partition(". ")
        if first and rest:
            records.append({"messages": [{"role": "user", "content": f"Go on: {first}."},
                                         {"role": "assistant", "content": rest[:60 + 7 * (len(records) % 23)]}]})
    data = tmp_path / "chat.jsonl"
    # 99 records: the validation split (every 100th) holds one, fewer than the 2 ranks (its eval was NaN at N=2)
    data.write_text("".join(json.dumps(r) + "\n" for r in records[:99]))
    return data, tokenizer


def test_lora_on_masked_chat_records_agrees_across_frameworks_and_ranks_and_exports_what_it_trained(cache_dir,
                                                                                                   tmp_path):
    data, tokenizer = chat_data(tmp_path)
    flags = (*FAST, "--dataset", data, "--tokenizer", tokenizer, "--mask-prompt", *LORA, "--steps", STEPS,
             "--seq-len", 64, "--lr", "1e-2", "--profile-steps", 0, "--no-op-profile", "--eval-every", STEPS)
    out = tmp_path / "cmp"
    # with what a new user's compare writes: the breakdown (the predictions), the op classes and the samples
    dpcompare("compare", *flags, "--profile-steps", 2, "--op-profile", "--frameworks", "mlx,torch", "--nproc", "1,2",
              "--out", out, cache_dir=cache_dir, timeout=600)
    check_the_report_is_whole(out)
    pairs = {tuple(p["pair"].split(" vs ")): p for p in summary(out)["verdicts"]["pairs"]}
    for n in (1, 2):  # the bound: 1e-4 per step
        assert pairs[(f"mlx x{n}", f"torch x{n}")]["verdict"] == "pass", pairs
        np.testing.assert_allclose(losses(out / f"mlx-n{n}"), losses(out / f"torch-n{n}"), rtol=0, atol=1e-4)
    for framework in ("mlx", "torch"):
        one, two = losses(out / f"{framework}-n1"), losses(out / f"{framework}-n2")
        np.testing.assert_allclose(two, one, rtol=0, atol=1e-5)  # global tokens: N=2 computes what N=1 does
        evals = [summary(out / f"{framework}-n{n}")["final_eval_loss"] for n in (1, 2)]
        assert np.isfinite(evals).all() and abs(evals[0] - evals[1]) <= 1e-5, evals  # one record, split over 2
        s = summary(out / f"{framework}-n2")
        assert s["adapters"]["rank"] == 4 and s["loss_normalization"] == "global-tokens"
        # only the adapters cross the wire, as many bytes as the estimate; each rank holds only their state
        assert s["comm_bytes_per_step"] == s["comm_bytes_per_step_estimate"] == s["state_bytes"]["params"][0] > 0
        # the predicted peak counts the adapters' state beside the frozen base, not the whole model's state
        parts = s["memory_prediction"]["parts"]
        assert parts["gradients"] == s["state_bytes"]["grads"][0] and parts["optimizer"] == 2 * parts["gradients"]
    check_the_prompts_are_masked(out / "mlx-n2")

    # per-rank (mlx-lm's): N=2 differs from N=1, labelled as the normalization's; the frameworks still agree
    for framework in ("mlx", "torch"):
        dpcompare("run", *flags, "--framework", framework, "--nproc", 2, "--loss-normalization", "per-rank",
                  "--out", tmp_path / f"per-rank-{framework}", cache_dir=cache_dir)
    report = tmp_path / "report"
    proc = dpcompare("report", out / "mlx-n1", out / "torch-n1", tmp_path / "per-rank-mlx", tmp_path / "per-rank-torch",
                     "--out", report, cache_dir=cache_dir)
    judged = {tuple(p["pair"].split(" vs ")): p for p in summary(report)["verdicts"]["pairs"]}
    assert judged[("mlx x2", "torch x2")]["verdict"] == "pass"
    for framework in ("mlx", "torch"):
        assert judged[(f"{framework} x2", f"{framework} x1")]["verdict"] == "differs", judged
        apart = np.abs(np.array(losses(tmp_path / f"per-rank-{framework}")) - losses(out / f"{framework}-n1"))
        assert apart.max() > 1e-6
    assert "--loss-normalization per-rank makes it (not a bug)" in proc.stdout

    check_exports(out / "mlx-n2", tmp_path, cache_dir)


def check_the_report_is_whole(out):
    """A LoRA compare's report as a new user opens it: nothing in it failed, both frameworks' op-class columns, a
    continuation from every run (its adapters over the frozen base: check_exports holds its tokens to the fused
    folder's), and each N=2 run's predicted step."""
    html, md = (out / "report.html").read_text(), (out / "report.md").read_text()
    assert "failed" not in html and "failed" not in md
    assert "| op class | lower bound ms | mlx x1 ms | torch x1 ms |" in md
    for framework in ("mlx", "torch"):
        assert summary(out / f"{framework}-n1")["op_profile"]["classes"]["matmul"]["s"] > 0
        assert summary(out / f"{framework}-n2")["prediction"]["step_s"] > 0
    samples = summary(out)["samples"]["by_run"]
    assert sorted(samples) == ["mlx x1", "mlx x2", "torch x1", "torch x2"] and "## Greedy continuations" in md
    assert all(s.get("text") and s["tokens"] == samples["mlx x1"]["tokens"] for s in samples.values()), samples


def check_the_prompts_are_masked(run_dir):
    """Each step's count of targets is the completions' alone, the two ranks hold different counts (so only the
    global count makes N=2 equal N=1), and the records cut to --seq-len are counted."""
    from common.data.sampler import GlobalSampler
    from common.data.sequences import SequenceView
    from common.data.tokencache import TokenCache

    split = TokenCache.open(json.loads((run_dir / "run_config.json").read_text())["token_cache"]).split("train")
    view, unmasked = SequenceView(split, 64, mask_prompt=True), SequenceView(split, 64)
    steps = [GlobalSampler(view.num_samples, 8, 0).global_batch_indices(step) for step in range(STEPS)]
    counts = [json.loads(line)["tokens"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
              if "tokens" in json.loads(line)]
    assert counts == [view.real_target_count(indices) for indices in steps]
    assert all(view.real_target_count(i) < unmasked.real_target_count(i) for i in steps)
    assert any(len({view.real_target_count(half) for half in np.split(indices, 2)}) == 2 for indices in steps)
    assert summary(run_dir)["truncated_records"] == view.truncated_records > 0
    # `dpcompare batches` hands the same global batches to another tool: its masks count the steps' targets
    out = run_dir.parent.parent / "batches.npz"
    dpcompare("batches", run_dir, "--steps", "2:5", "--out", out, cache_dir=run_dir.parent.parent)
    written = np.load(out)
    assert list(written["steps"]) == [2, 3, 4] and list(written["tokens"]) == counts[2:5]
    assert [int(m.sum()) for m in written["mask"]] == counts[2:5] and written["inputs"].shape == (3, 8, 64)


def check_exports(run_dir, tmp_path, cache_dir):
    """The fused folder through transformers, the adapters through peft and through mlx_lm: the logits of the run's
    own model (torch_impl's Llama with the adapters attached, from the seed and the checkpoint) to 1e-5."""
    import glob

    import mlx.core as mx
    import peft
    import torch
    import transformers
    from mlx_lm.utils import load as mlx_lm_load
    from safetensors.numpy import load_file

    from common.runplan import RunPlan
    from torch_impl.lora import attach
    from torch_impl.model import Llama
    from torch_impl.quantized import quantize_base

    for kind in ("fused", "peft", "mlx-lm"):
        dpcompare("export", run_dir, "--out", tmp_path / kind, *(("--adapters", kind) if kind != "fused" else ()),
                  cache_dir=cache_dir)
    plan = RunPlan.read(run_dir)
    checkpoint = sorted(glob.glob(str(run_dir / "checkpoints" / "step_*")))[-1]
    state = {**load_file(str(plan.seed_checkpoint / "model.safetensors")), **load_file(checkpoint + "/model.safetensors")}
    own = Llama(plan.spec)
    quantize_base(own, plan.config.base_storage, plan.spec)  # a QLoRA run's base: its packed words (as int32)
    attach(own, plan.config.trained, plan.spec)
    own.load_state_dict({k: torch.from_numpy(v.view(np.int32) if v.dtype == np.uint32 else v)
                         for k, v in state.items()}, strict=False)
    tokens = np.random.default_rng(0).integers(0, plan.spec.vocab_size, size=(2, 24))
    with torch.no_grad():
        expected = own(torch.from_numpy(tokens)).numpy()
        fused = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fused", dtype=torch.float32).eval()
        base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "peft" / "base", dtype=torch.float32)
        with_peft = peft.PeftModel.from_pretrained(base, tmp_path / "peft").eval()
        got = {"fused": fused(torch.from_numpy(tokens)).logits.numpy(),
               "peft": with_peft(torch.from_numpy(tokens)).logits.numpy()}
    model, _ = mlx_lm_load(str(tmp_path / "mlx-lm" / "base"), adapter_path=str(tmp_path / "mlx-lm"))
    got["mlx-lm"] = np.array(model(mx.array(tokens)).astype(mx.float32))
    trained = max(np.abs(v).max() for k, v in state.items() if k.endswith("lora_B"))
    assert trained > 0  # the adapters moved from their zero start, so the checks below see them
    for kind, logits in got.items():
        assert np.abs(logits - expected).max() <= 1e-5, (kind, float(np.abs(logits - expected).max()))
    check_the_sample_is_the_trained_models(run_dir, plan, fused)


def check_the_sample_is_the_trained_models(run_dir, plan, fused):
    """The run's greedy continuation (sample.json) is the fused folder's: the adapters over the base they trained on."""
    import torch
    from tokenizers import Tokenizer

    from common.train.generate import generate

    sample = json.loads((run_dir / "sample.json").read_text())
    assert "tokens" in sample, sample  # not {"error": ...}
    tokenizer_file, meta = plan.tokenizer_file()
    prompt = Tokenizer.from_file(str(tokenizer_file)).encode(sample["prompt"], add_special_tokens=False).ids
    prompt = ([int(meta["bos_id"])] if meta.get("bos_id") is not None else []) + prompt
    with torch.no_grad():
        greedy = generate(fused, lambda model, window: int(model(torch.tensor([window])).logits[0, -1].argmax()),
                          prompt, len(sample["tokens"]), plan.spec.max_seq_len)
    assert greedy == sample["tokens"], (greedy, sample)


def test_qlora_on_a_folder_mlx_lm_quantized_agrees_across_frameworks_and_exports_to_both_libraries(cache_dir,
                                                                                                   tmp_path):
    """A float32 Llama folder quantized by mlx_lm.convert -q (4 bits, groups of 64) is the frozen base of a LoRA run
    in both frameworks: the project's quantizer writes the same bytes; MLX and torch agree to 1e-4 a step; each rank
    holds under a fifth of the float32 base; the adapters export for mlx-lm (over the quantized base) and peft (over
    it dequantized); and a folder whose scales do not fit its weights is refused in one line before any rank."""
    import shutil
    import subprocess
    import sys

    from safetensors.numpy import load_file, save_file

    from common.model.quantize import FullPrecision, Quantization, quantize_tensors
    from common.model.spec import ModelSpec
    from common.model.weights import init_weights, load_pretrained, save_pretrained

    data, tokenizer = chat_data(tmp_path)
    # every matrix's input side a multiple of 64 (as in a real Llama), so every Linear and the embedding quantize
    spec = ModelSpec(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=192, max_seq_len=512)
    fp32, quantized = tmp_path / "fp32", tmp_path / "q4"
    save_pretrained(fp32, spec, init_weights(spec, 3))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(tokenizer / name, fp32 / name)
    subprocess.run([sys.executable, "-m", "mlx_lm", "convert", "--hf-path", str(fp32), "--mlx-path", str(quantized),
                    "-q", "--q-bits", "4", "--q-group-size", "64"], check=True, capture_output=True, timeout=120)
    theirs = load_file(str(quantized / "model.safetensors"))
    ours = quantize_tensors(Quantization(4, 64), spec, load_pretrained(fp32)[1])
    assert ours.keys() == theirs.keys() and all(np.array_equal(ours[k], theirs[k]) for k in ours)

    flags = ("--init-from", quantized, "--dataset", data, "--tokenizer", tokenizer, "--mask-prompt", *LORA,
             "--seq-len", 64, "--global-batch-size", 8, "--warmup-steps", 2, "--lr", "1e-2", "--quiet",
             "--profile-steps", 0, "--no-op-profile", "--no-link-probe", "--eval-every", 0)
    out = tmp_path / "qlora"
    dpcompare("compare", *flags, "--steps", 8, "--frameworks", "mlx,torch", "--nproc", 1,
              "--out", out, cache_dir=cache_dir, timeout=600)
    np.testing.assert_allclose(losses(out / "mlx-n1"), losses(out / "torch-n1"), rtol=0, atol=1e-4)
    fp32_bytes = FullPrecision().base_bytes(spec)
    for framework in ("mlx", "torch"):
        s = summary(out / f"{framework}-n1")
        assert s["base_quantization"] == {"bits": 4, "group_size": 64, "mode": "affine"}
        base_bytes = s["weights_bytes_read"][0] - s["state_bytes"]["params"][0]
        assert base_bytes == Quantization(4, 64).base_bytes(spec) <= 0.2 * fp32_bytes, (base_bytes, fp32_bytes)
    assert "4-bit base, groups of 64" in (out / "report.md").read_text()
    check_exports(out / "mlx-n1", tmp_path, cache_dir)

    bad = tmp_path / "bad"
    shutil.copytree(quantized, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    tensors["model.layers.1.mlp.up_proj.scales"] = tensors["model.layers.1.mlp.up_proj.scales"][:, :-1].copy()
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "mlx"})
    proc = dpcompare("run", *flags[2:], "--init-from", bad, "--steps", 2, "--framework", "mlx", "--out",
                     tmp_path / "refused", cache_dir=cache_dir, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "model.layers.1.mlp.up_proj.scales has shape (192, 0), the spec needs (192, 1)" in proc.stderr.strip()
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "refused" / "ranks").exists()
