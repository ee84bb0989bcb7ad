"""The report in a real browser: the HTML stands alone and every figure renders."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed: the HTML report was not rendered")
def test_report_html_renders_every_figure_in_headless_chromium(matrix, tmp_path):
    out, summary = matrix.out, matrix.summary  # a real compare's report, every plot it has
    argv = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=5000", "--dump-dom",
            (out / "report.html").as_uri()]
    dom = subprocess.run(argv, capture_output=True, text=True, timeout=60).stdout
    loaded = re.search(r'data-images-loaded="(\d+)/(\d+)"', dom)
    assert loaded, "the page's load script did not run"
    assert loaded.group(1) == loaded.group(2) == str(len(summary["plots"]))
