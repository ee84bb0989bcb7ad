"""The CLI a user meets: doctor, prepare, compare with a failing run, report rebuild, export."""
import json

import numpy as np
import pytest

from helpers import FAST, SHARED_DATA, dpcompare, losses


def test_doctor_reports_frameworks_backends_and_blas(cache_dir):
    out = dpcompare("doctor", cache_dir=cache_dir).stdout
    for needle in ("mlx", "torch", "ring", "gloo", "BLAS", "CPUs"):
        assert needle in out


def test_prepare_on_tinystories_with_gpt2_reports_the_known_counts(cache_dir):
    data, tok = SHARED_DATA / "tinystories" / "train.txt", SHARED_DATA / "gpt2"
    if not (data.exists() and tok.exists()):
        pytest.skip(f"real data not found under {SHARED_DATA}")
    out = dpcompare("prepare", "--dataset", data, "--tokenizer", tok, cache_dir=cache_dir).stdout
    assert "2,317" in out or "2317" in out
    assert "502,779" in out or "502779" in out  # 500,462 GPT-2 tokens + one EOS per story


def test_compare_reports_a_failed_run_runs_the_rest_and_exits_nonzero(cache_dir, tmp_path):
    # torch x2, the first run of the matrix, fails at step 3; mlx x2 still runs after it.
    out = tmp_path / "cmp"
    proc = dpcompare("compare", *FAST, "--frameworks", "torch,mlx", "--nproc", "2", "--steps", 6, "--no-samples", "--out", out,
                     cache_dir=cache_dir, check=False, env={"DPCOMPARE_INJECT_FAULT": "framework=torch,rank=1,step=3"})
    assert proc.returncode == 1
    assert "torch x2 failed" in proc.stderr and "rank 1" in proc.stderr
    assert proc.stderr.index("== torch x2") < proc.stderr.index("   failed: ") < proc.stderr.index("== mlx x2")
    summary = json.loads((out / "summary.json").read_text())
    status = {(r["framework"], r["world_size"]): r["status"] for r in summary["runs"]}
    assert status == {("mlx", 2): "ok", ("torch", 2): "failed"}
    assert (out / "report.html").exists() and "failed" in (out / "report.md").read_text()


def test_report_rebuilds_from_separate_runs(matrix, cache_dir, tmp_path):
    dpcompare("report", matrix.run("mlx", 1), matrix.run("torch", 1), "--out", tmp_path / "rep", cache_dir=cache_dir)
    summary = json.loads((tmp_path / "rep" / "summary.json").read_text())
    assert summary["verdicts"]["all_pass"] is True
    assert (tmp_path / "rep" / "report.html").exists()


def test_export_gives_a_directory_transformers_loads_with_the_same_logits(matrix, cache_dir, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    dpcompare("export", matrix.run("mlx", 1), "--out", tmp_path / "hf", cache_dir=cache_dir)
    from torch_impl.model import from_pretrained

    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    ours = from_pretrained(tmp_path / "hf")
    tokens = torch.randint(0, ours.spec.vocab_size, (1, 12))
    with torch.no_grad():
        np.testing.assert_allclose(hf(tokens).logits.numpy(), ours(tokens).numpy(), atol=1e-4)
    proc = dpcompare("export", matrix.run("mlx", 1), "--out", tmp_path / "hf", cache_dir=cache_dir, check=False)
    assert proc.returncode == 2 and "not empty" in proc.stderr


def test_a_toml_config_and_flags_drive_a_run(cache_dir, tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('framework = "torch"\nsteps = 4\n[model]\nn_layers = 1\n')
    dpcompare("run", *FAST, "--config", toml, "--steps", 3, "--out", tmp_path / "r", cache_dir=cache_dir)
    plan = json.loads((tmp_path / "r" / "run_config.json").read_text())
    assert plan["spec"]["n_layers"] == 1 and plan["config"]["framework"] == "torch"
    assert len(losses(tmp_path / "r")) == 3
