"""A speed ratio that measures the machine names no faster framework (compare/report/environment_bound.py, issue 72):
an MLX run on its wheel's reference BLAS, or two runs given different threads, opens the speed section with why,
both frameworks' matmul GFLOP/s and the fix. Fake runs with a fake slow BLAS choice; no timing."""
from __future__ import annotations

import re

import pytest

from common.model.spec import preset
from common.train.opclasses import class_work
from compare.report.environment_bound import REFERENCE_FIX, blas_of
from compare.report.parity import Tolerances
from compare.report.verdict_table import SPEED_HEADERS
from compare.report.writer import write_report, terminal_table
from unit.fake_runs import make_run, op_profile_of

pytestmark = pytest.mark.usefixtures("no_figures")  # the speed section is what is read

CONTEXT = {"peaks": {"mlx": {"flops": 5e9, "device": "cpu", "threads": 1, "blas": "reference"},
                     "torch": {"flops": 80e9, "device": "cpu", "threads": 1, "blas": "mkl"}}, "accelerator": None}
# The machine: MLX's matmul 263 ms a step on the reference BLAS, torch's 16.1 ms on MKL.
MLX_MS = {"matmul": 263.0, "attention": 10.0, "softmax/cross-entropy": 8.0, "norms/activations/RoPE": 6.0,
          "optimizer": 3.0}
TORCH_MS = {"matmul": 16.1, "attention": 5.0, "softmax/cross-entropy": 4.0, "norms/activations/RoPE": 3.0,
            "optimizer": 2.0}
REFERENCE = {"blas_kind": "reference", "blas_chosen": "flag", "blas_fix": None,
             "blas": "bundled (mlx wheel's reference BLAS)"}
OPENBLAS = {"blas_kind": "openblas", "blas_chosen": "auto", "blas_fix": None, "blas": "openblas (preloaded)"}
MATMUL_FLOPS = class_work(preset("tiny"), 8, 128, 1, "float32")["matmul"]["flops"]


def report(tmp_path, mlx_blas: dict, torch_config: dict | None = None) -> dict:
    profile = lambda classes, step: op_profile_of(classes, step, seq_len=128)  # noqa: E731
    dirs = [make_run(tmp_path, "mlx", 1, tokens_per_s=3_225, op_profile=profile(MLX_MS, 300), summary_extra=mlx_blas),
            make_run(tmp_path, "torch", 1, tokens_per_s=25_685, op_profile=profile(TORCH_MS, 40), config=torch_config),
            make_run(tmp_path, "mlx", 2, tokens_per_s=4_600, summary_extra=mlx_blas),
            make_run(tmp_path, "torch", 2, tokens_per_s=25_700, config=torch_config)]
    return write_report(dirs, tmp_path / "report", Tolerances(), CONTEXT)


def speed_section(md: str) -> list[str]:
    """The markdown lines from the end of what precedes the speed table up to the table's header."""
    lines = md.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| speed |"))
    start = max(i for i in range(header) if lines[i].startswith("|") or lines[i].startswith("## ")) + 1
    return [line for line in lines[start:header + 1] if line]


def faster_cells(md: str) -> list[str]:
    column = SPEED_HEADERS.index("faster")
    return [line.split(" | ")[column] for line in md.splitlines() if line.startswith("| MLX vs torch |")]


def test_a_reference_blas_opens_the_speed_section_with_both_gflops_and_the_fix_and_names_no_faster_framework(tmp_path):
    summary = report(tmp_path, REFERENCE)
    mlx_rate, torch_rate = MATMUL_FLOPS / 0.263 / 1e9, MATMUL_FLOPS / 0.0161 / 1e9
    first = summary["verdicts"]["speed_environment"][0]
    assert first.startswith("Speed is environment-bound (mlx x1 vs torch x1, mlx x2 vs torch x2): MLX ran on its "
                            "reference BLAS")
    assert f"{mlx_rate:.3g} GFLOP/s" in first and f"{torch_rate:.3g} GFLOP/s for torch" in first
    assert first.endswith(f"Fix: {REFERENCE_FIX}")
    assert summary["verdicts"]["lines"][0] == first  # summary.json's verdict block says it first, too
    assert all(s["environment_bound"] for s in summary["speed"] if s["kind"] == "framework")
    md = (tmp_path / "report" / "report.md").read_text()
    section = speed_section(md)
    assert section[0] == "- **Speed is environment-bound (mlx x1 vs torch x1, mlx x2 vs torch x2):**" + first.split(":", 1)[1]
    assert faster_cells(md) == ["environment-bound", "environment-bound"]  # the ratios stay, flagged
    for s in summary["speed"]:  # in the order of the runs, since no faster one is named
        assert f"| {s['a']} vs {s['b']} | environment-bound | {s['ratio_a_over_b']:.2f}x | " \
               f"{s['a_tokens_per_s']:,.0f} vs {s['b_tokens_per_s']:,.0f} |" in md
    html = (tmp_path / "report" / "report.html").read_text()
    assert html.index("MLX ran on its reference BLAS") < html.index("<th>speed</th>")
    terminal = terminal_table(summary).splitlines()
    header = next(i for i, line in enumerate(terminal) if line.startswith("speed "))
    assert terminal[header - 1] == f"! {first}" and terminal[header - 2] == ""
    column = SPEED_HEADERS.index("faster")  # text_table puts two spaces or more between columns
    cells = [re.split(r"\s{2,}", line)[column] for line in terminal[header:] if line.startswith("MLX vs torch")]
    assert cells == ["environment-bound", "environment-bound"]


def test_an_optimized_blas_leaves_the_verdict_naming_the_faster_framework(tmp_path):
    summary = report(tmp_path, OPENBLAS)
    assert summary["verdicts"]["speed_environment"] == []
    assert not any(s["environment_bound"] for s in summary["speed"])
    md = (tmp_path / "report" / "report.md").read_text()
    assert faster_cells(md) == ["torch", "torch"]
    assert "environment-bound" not in md


def test_runs_given_different_threads_are_environment_bound_and_the_line_names_the_mismatch(tmp_path):
    summary = report(tmp_path, OPENBLAS, torch_config={"threads_per_rank": 2})
    lines = summary["verdicts"]["speed_environment"]
    assert lines == ["Speed is environment-bound (mlx x1 vs torch x1, mlx x2 vs torch x2): the two runs were given "
                     "different threads per rank (1 vs 2), so the ratio below measures what each was given, not the "
                     "framework. Fix: run both with the same --threads-per-rank, --global-batch-size and --seq-len"]
    md = (tmp_path / "report" / "report.md").read_text()
    assert speed_section(md)[0].startswith("- **Speed is environment-bound (mlx x1 vs torch x1, mlx x2 vs torch x2):** "
                                           "the two runs were given different threads per rank (1 vs 2)")
    assert faster_cells(md) == ["environment-bound", "environment-bound"]


def test_a_summary_from_before_blas_kind_is_read_from_its_description_and_a_recorded_fix_is_kept():
    assert blas_of({"blas": "bundled (mlx wheel's reference BLAS; no system OpenBLAS found)"}) == \
        {"kind": "reference", "chosen": None, "fix": REFERENCE_FIX}
    assert blas_of({"blas": "openblas (/usr/lib/libopenblas.so, preloaded; Haswell)"})["kind"] is None
    assert blas_of({"blas_kind": "reference", "blas_chosen": "flag", "blas_fix": "dpcompare run --mlx-blas auto"}) == \
        {"kind": "reference", "chosen": "flag", "fix": "dpcompare run --mlx-blas auto"}


@pytest.mark.parametrize("device", ["gpu", "cuda"])
def test_a_gpu_run_is_not_bound_by_the_blas_it_loaded(tmp_path, device):
    summary = report(tmp_path, {**REFERENCE, "device": device})
    assert not any("reference BLAS" in line for line in summary["verdicts"]["speed_environment"])
