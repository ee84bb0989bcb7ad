"""The report: every file is written, the HTML stands alone and renders, the verdict comes first, MFU
uses the stated formula."""
from __future__ import annotations

import json
import re

import pytest

from common.errors import UserError
from common.model.flops import flops_per_token, known_peak_flops, matmul_parameters, mfu
from common.model.spec import ModelSpec
from compare.report.parity import Tolerances
from compare.report.writer import terminal_table, write_report
from unit.fake_runs import make_run, reference_losses

PEAKS = {"mlx": {"flops": 100e9, "device": "cpu", "threads": 1, "blas": "openblas"},
         "torch": {"flops": 80e9, "device": "cpu", "threads": 1, "blas": "mkl"}}
CONTEXT = {"command": "dpcompare compare --nproc 1,2 --out runs/x", "peaks": PEAKS, "accelerator": None}
PLOTS = ("loss", "eval_loss", "throughput", "scaling", "memory")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """Both frameworks at 1 and 2 ranks, torch x2 failed part-way: a report with every section."""
    root = tmp_path_factory.mktemp("runs")
    evals = {20: 3.1, 40: 2.9}
    dirs = [make_run(root, "mlx", 1, evals=evals, tokens_per_s=9_000),
            make_run(root, "torch", 1, [x + 2e-6 for x in reference_losses()], evals=evals, tokens_per_s=11_000),
            make_run(root, "mlx", 2, evals=evals, tokens_per_s=16_000),
            make_run(root, "torch", 2, reference_losses()[:7], status="failed", tokens_per_s=12_000)]
    out = root / "report"
    summary = write_report(dirs, out, Tolerances(), CONTEXT)
    return out, summary


def test_every_file_is_written(report):
    out, summary = report
    for name in ("summary.json", "report.md", "report.html"):
        assert (out / name).stat().st_size > 0
    assert sorted(summary["plots"]) == sorted(PLOTS)
    for path in summary["plots"].values():
        assert (out / path).read_bytes().startswith(b"\x89PNG")
    assert json.loads((out / "summary.json").read_text()) == json.loads(json.dumps(summary))


def test_summary_holds_verdicts_tables_and_settings(report):
    _, summary = report
    assert {"verdicts", "runs", "parity", "speed", "scaling", "mfu", "tolerances", "fairness", "environment",
            "commands", "plots"} <= set(summary)
    assert summary["verdicts"]["all_pass"] is True and summary["verdicts"]["parity"] == "pass"
    (speed,) = summary["speed"]  # torch x2 failed, so only N=1 compares speed
    assert speed["faster"] == "torch" and speed["speedup"] == pytest.approx(11_000 / 9_000, rel=0.05)
    (one, two) = summary["scaling"]["mlx"]
    assert two["efficiency"] == pytest.approx(16_000 / (2 * 9_000), rel=0.05)
    assert summary["commands"]["compare"] == CONTEXT["command"]


def test_html_is_self_contained_with_every_plot_embedded(report):
    out, summary = report
    page = (out / "report.html").read_text()
    sources = re.findall(r'<img[^>]*src="([^"]+)"', page)
    assert len(sources) == len(summary["plots"]) and all(s.startswith("data:image/png;base64,") for s in sources)
    assert not re.search(r'(src|href)="(https?:)?//', page), "no external resources"
    assert "<link" not in page


def test_markdown_opens_with_the_verdict(report):
    out, _ = report
    text = (out / "report.md").read_text()
    verdict = text.index("## Verdict")
    assert verdict < text.index("## Runs")
    head = text[verdict:text.index("## Runs")]
    assert "| pass | MLX vs torch | mlx x1 vs torch x1 | 2.00e-06 ≤ 0.0001 |" in head
    assert "| MLX vs torch | mlx x1 vs torch x1 | torch | 1.2" in head  # the speed table
    assert "| scaling | against | x2 speedup (efficiency) |" in head  # a table, one row per run group
    assert re.search(r"\| mlx \| mlx x1 \| 1\.\d\dx \(89%\) \|", head)
    assert "rank 1 died at step 7" in head  # the failed run and its error
    assert "dpcompare compare --nproc 1,2" in text and "python -m torch_impl.launch" in text


def test_failed_runs_appear_with_their_error(report):
    _, summary = report
    failed = next(r for r in summary["runs"] if r["label"] == "torch x2")
    assert failed["status"] == "failed" and "rank 1 died" in failed["problem"]
    assert failed["parity"] == "skipped"


def test_mfu_uses_the_faster_measured_peak_times_the_ranks(report):
    _, summary = report
    row = next(r for r in summary["runs"] if r["label"] == "mlx x2")
    assert row["peak_flops"] == pytest.approx(2 * 100e9)
    assert row["mfu"] == pytest.approx(row["tokens_per_s"] * row["flops_per_token"] / 200e9)
    assert "6·N + 12·L·T·d" in summary["mfu"]["formula"]


def test_terminal_table_has_a_row_per_run_then_the_verdict(report):
    _, summary = report
    text = terminal_table(summary)
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["run", "N", "status"]
    assert [line.split()[0] + " " + line.split()[1] for line in lines[2:6]] == \
           ["mlx x1", "torch x1", "mlx x2", "torch x2"]
    assert "verdict: parity PASS" in text and "89%" in text


def test_a_failed_parity_check_shows_in_every_output(tmp_path):
    dirs = [make_run(tmp_path, "mlx", 1), make_run(tmp_path, "torch", 1, [x + 1e-3 for x in reference_losses()])]
    summary = write_report(dirs, tmp_path / "out", Tolerances(), CONTEXT)
    assert summary["verdicts"]["all_pass"] is False and summary["verdicts"]["parity"] == "fail"
    assert "does NOT match" in (tmp_path / "out" / "report.md").read_text()
    assert "FAIL" in terminal_table(summary)


def test_plots_without_data_are_skipped(tmp_path):
    failed = make_run(tmp_path, "mlx", 1, reference_losses()[:3], status="failed")
    empty = tmp_path / "empty"
    empty.mkdir()
    summary = write_report([failed, empty], tmp_path / "out", Tolerances(), CONTEXT)
    assert "scaling" not in summary["plots"] and "eval_loss" not in summary["plots"]
    assert summary["verdicts"]["parity"] == "no data"
    assert (tmp_path / "out" / "report.html").exists()


def test_without_matplotlib_the_report_is_written_and_says_its_figures_are_skipped(tmp_path, monkeypatch):
    """matplotlib is declared, but a minimal environment (the lent GPU machines) lacks it: the report, the verdict
    and compare's predictions must not hang on the figures."""
    from compare.report import plots
    monkeypatch.setattr(plots, "plt", None)
    run = make_run(tmp_path, "mlx", 1)
    summary = write_report([run], tmp_path / "out", Tolerances(), CONTEXT)
    assert summary["plots"] == {} and not (tmp_path / "out" / "plots").exists()
    assert "figures skipped: matplotlib is not installed" in (tmp_path / "out" / "report.md").read_text()


def test_the_report_never_overwrites_a_run_directory(tmp_path):
    run = make_run(tmp_path, "mlx", 1)
    with pytest.raises(UserError, match="run directory"):
        write_report([run], run, Tolerances(), CONTEXT)


# ---- FLOPs -------------------------------------------------------------------------------------

def test_flops_per_token_matches_a_hand_count():
    spec = ModelSpec(vocab_size=100, dim=8, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=16, max_seq_len=32)
    # Per layer: q 8x8=64, k and v 4x8=32 each, o 64, gate/up/down 8x16=128 each -> 576; lm_head 100x8=800.
    assert matmul_parameters(spec) == 2 * 576 + 800
    seq_len = 16
    assert flops_per_token(spec, seq_len) == 6 * (2 * 576 + 800) + 12 * 2 * 16 * 8


def test_tied_embeddings_count_once_as_the_output_projection():
    spec = ModelSpec(vocab_size=100, dim=8, n_layers=1, n_heads=2, n_kv_heads=2, ffn_dim=16, tie_embeddings=True)
    assert matmul_parameters(spec) == (64 + 2 * 64 + 64 + 3 * 128) + 800


def test_mfu_and_known_peaks():
    assert mfu(1000.0, 1e9, 1e13) == pytest.approx(0.1)
    with pytest.raises(ValueError):
        mfu(1000.0, 1e9, 0.0)
    assert known_peak_flops("NVIDIA H100 80GB HBM3")[0] == "NVIDIA H100 SXM"
    assert known_peak_flops("NVIDIA H100 PCIe", "bfloat16") == ("NVIDIA H100 PCIe", 756e12)
    assert known_peak_flops("NVIDIA L40S")[0] == "NVIDIA L40S" and known_peak_flops("NVIDIA L4")[0] == "NVIDIA L4"
    assert known_peak_flops("Apple M2 Max (38-core GPU)") == ("Apple M2 Max (38-core GPU)", 13.6e12)
    assert known_peak_flops("Tesla T4", "bfloat16") is None  # no bf16 on T4
    assert known_peak_flops("Some Unknown GPU") is None


def test_the_memory_table_puts_the_predicted_peak_beside_the_measured_one(tmp_path):
    from compare.plan import add_memory_predictions

    run = make_run(tmp_path, "torch", 2, tokens_per_s=12_000)
    summary = json.loads((run / "summary.json").read_text())
    summary.update(fixed_rss_bytes=[360e6, 362e6], state_bytes={"params": [1e6] * 2, "grads": [1e6] * 2,
                                                                "optimizer": [2e6] * 2})
    (run / "summary.json").write_text(json.dumps(summary))
    add_memory_predictions([run])
    predicted = json.loads((run / "summary.json").read_text())["memory_prediction"]
    write_report([run], tmp_path / "report", Tolerances(), CONTEXT)
    md = (tmp_path / "report" / "report.md").read_text()
    assert "| run | rank | params MB | grads MB | optimizer MB | state MB | formula MB | activations MB (est.) | fixed MB | " \
           "predicted peak MB | framework peak MB | peak RSS MB | predicted vs peak |" in md
    for rank, (fixed, peak) in enumerate(zip((360, 362), (400, 402))):  # make_run: 400 MB + 2 MB per rank
        error = f"{100 * (predicted['peak_bytes'][rank] / (peak * 1e6) - 1):+.0f}%"
        assert f"| {fixed} | {predicted['peak_bytes'][rank] / 1e6:,.0f} | {150 + rank} | {peak} | {error} |" in md


def test_a_compare_with_lora_runs_tables_what_trains_beside_the_full_runs(tmp_path):
    """compare/report/adapters.py: trained parameters, the bytes a step all-reduces (and the estimate), the frozen
    base each rank holds, for LoRA and full runs side by side; a compare without LoRA has no such table."""
    from common.metrics import read_json, write_json

    adapters = {"rank": 8, "alpha": 16.0, "scale": 2.0, "targets": ["q_proj", "v_proj"], "layers": 0}
    dirs = []
    for name, trained, extra in (("full", 1_000_000, None), ("lora", 8_192, adapters)):
        run = make_run(tmp_path, "mlx", 2, name=name)
        summary = read_json(run / "summary.json")
        summary.update(adapters=extra, loss_normalization="global-tokens", comm_bytes_per_step=4 * trained,
                       comm_bytes_per_step_estimate=4 * trained, weights_bytes_read=[4_000_000 + 4 * trained] * 2,
                       state_bytes={"params": [4 * trained] * 2, "grads": [4 * trained] * 2,
                                    "optimizer": [8 * trained] * 2})
        write_json(run / "summary.json", summary)
        dirs.append(run)
    write_report(dirs, tmp_path / "out", Tolerances(), CONTEXT)
    md = (tmp_path / "out" / "report.md").read_text()
    table = md[md.index("## What trains"):].split("\n## ")[0]
    assert "| every parameter | global-tokens | 1,000,000 | 4,000,000 B (4,000,000) | – |" in table
    assert "| LoRA r=8 alpha=16 on q_proj,v_proj | global-tokens | 8,192 | 32,768 B (32,768) | 4.0 |" in table
    write_report(dirs[:1], tmp_path / "full-only", Tolerances(), CONTEXT)
    assert "## What trains" not in (tmp_path / "full-only" / "report.md").read_text()
