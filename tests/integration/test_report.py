"""The report: every file is written, the HTML stands alone and renders, the verdict comes first, MFU
uses the stated formula."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from compare.report.parity import Tolerances
from compare.report.writer import write_report
from unit.test_parity import make_run, reference_losses

PEAKS = {"mlx": {"flops": 100e9, "device": "cpu", "threads": 1, "blas": "openblas"},
         "torch": {"flops": 80e9, "device": "cpu", "threads": 1, "blas": "mkl"}}
CONTEXT = {"command": "dpcompare compare --nproc 1,2 --out runs/x", "peaks": PEAKS, "accelerator": None}
CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)


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


# ---- the page in a real browser ----------------------------------------------------------------

@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed: the HTML report was not rendered")
def test_report_html_renders_every_figure_in_headless_chromium(report, tmp_path):
    out, summary = report
    argv = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=5000", "--dump-dom",
            (out / "report.html").as_uri()]
    dom = subprocess.run(argv, capture_output=True, text=True, timeout=60).stdout
    loaded = re.search(r'data-images-loaded="(\d+)/(\d+)"', dom)
    assert loaded, "the page's load script did not run"
    assert loaded.group(1) == loaded.group(2) == str(len(summary["plots"]))
