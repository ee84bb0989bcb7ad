"""The comparison report: summary.json, report.md, a self-contained report.html and plots/*.png.

It opens with the answers (do the curves agree, which framework is faster, how DP scales), then the
evidence: per-run table, parity numbers, MFU with its formula, fairness settings, environment and the
commands that reproduce every run. findings.py computes the numbers, render.py lays them out as blocks,
markup.py writes those as markdown and HTML.

It reads run directories and starts no run: the greedy continuations (<run_dir>/sample.json) and the
diagnoses of failed cross-framework pairs (<out>/diagnosis/*/finding.json) are written by
`dpcompare compare` before it writes the report (compare/matrix.py); where they are missing, the report
leaves them out. (MFU's denominator is the exception: the CPU matmul peak and the GPU name are found
on this machine when the context does not give them, see below.)
"""
from __future__ import annotations

import json

import time
from dataclasses import asdict
from pathlib import Path

from common.errors import UserError
from common.metrics import write_json

from .contributions import largest_line
from .diagnoses import read_diagnoses
from .environment_bound import environment_lines
from .findings import (environment_info, fairness_info, memory_table, run_row, scaling_table, speed_table,
                       verdicts)
from .markup import to_html, to_markdown
from .mfu import PeakFinder
from .parity import Tolerances, judge, load_run
from .plots import make_plots
from .render import report_blocks
from .terminal import terminal_table
from .samples import samples_summary

__all__ = ["write_report", "terminal_table"]


def write_report(run_dirs: list[Path], out_dir: Path, tol: Tolerances, context: dict | None = None) -> dict:
    """Judge, measure and render; returns what summary.json holds.

    context: "command" (the dpcompare command line), "peaks" (measured_peaks()-style CPU peaks, used for
    every thread count; when absent they are measured, on the runs' own machine only), "accelerator"
    (GPU name for the known-peak table; detected locally when absent), "samples" (the greedy continuations
    section as samples_summary() returns it; read from the runs' sample.json when absent).
    """
    context = context or {}
    out_dir = Path(out_dir)
    if (out_dir / "run_config.json").exists():
        raise UserError(f"{out_dir} is a run directory: the report's summary.json would replace the run's; "
                        "pass --out DIR")
    runs = [load_run(Path(d)) for d in run_dirs]
    if not runs:
        raise UserError("no run directories to report on")
    parity = judge(runs, tol)
    read_diagnoses(parity, out_dir)
    peaks = PeakFinder(runs, context)
    rows = [run_row(run, parity, peaks) for run in runs]
    scaling = scaling_table(rows)
    speed = speed_table(rows)
    memory = memory_table(rows)
    fairness = fairness_info(runs, rows, context)
    verdict = verdicts(parity, speed, scaling, memory, rows, fairness, context.get("baseline"))
    bound = environment_lines(speed, runs, fairness)  # marks the speed pairs that measure the machine
    verdict.update(speed_environment=bound, lines=bound + verdict["lines"])
    chain = context.get("contributions")  # compare --recipes A,B: the gap choice by choice (contributions.py)
    if chain and (top := largest_line(chain)):
        verdict.update(notes=[top] + verdict["notes"], lines=[top] + verdict["lines"])
    summary = {
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        "verdicts": verdict,
        "runs": rows,
        "parity": parity,
        "speed": speed,
        "scaling": scaling,
        "memory": memory,
        "mfu": peaks.describe(runs),
        "tolerances": asdict(tol),
        "baseline": context.get("baseline"),
        "samples": context["samples"] if "samples" in context else samples_summary(runs),
        # The pretrained checkpoints the runs started from (--init-from): folder and weights hash, once each.
        "init_from": list({json.dumps(r.summary["init_from"], sort_keys=True): r.summary["init_from"]
                           for r in runs if r.summary.get("init_from")}.values()),
        "contributions": chain,
        "fairness": fairness,
        "environment": environment_info(runs, rows, peaks),
        "commands": {"compare": context.get("command"),
                     "runs": [{"label": r["label"], "launcher": r["command"], "dpcompare": r["rerun"]}
                              for r in rows]},
    }
    made = make_plots(runs, parity, rows, scaling, out_dir / "plots")
    summary["plots"] = {name: f"plots/{file}" for name, file in (made or {}).items()}
    if made is None:
        summary["fairness"]["notes"].append("figures skipped: matplotlib is not installed (pip install matplotlib)")
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "summary.json", summary)
    blocks = report_blocks(summary)
    (out_dir / "report.md").write_text(to_markdown(blocks))
    (out_dir / "report.html").write_text(to_html(blocks, out_dir))
    return summary
