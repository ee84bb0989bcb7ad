"""The comparison report: summary.json, report.md, a self-contained report.html and plots/*.png.

It opens with the answers (do the curves agree, which framework is faster, how DP scales), then the
evidence: per-run table, parity numbers, MFU with its formula, fairness settings, environment and the
commands that reproduce every run. findings.py computes the numbers, render.py writes them out.
"""
from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

from common.errors import UserError
from common.metrics import write_json

from .findings import environment_info, fairness_info, run_row, scaling_table, speed_table, verdicts
from .markup import to_html, to_markdown
from .mfu import PeakFinder
from .parity import Tolerances, judge, load_run
from .plots import make_plots
from .render import report_blocks, terminal_table

__all__ = ["write_report", "terminal_table"]


def write_report(run_dirs: list[Path], out_dir: Path, tol: Tolerances, context: dict | None = None) -> dict:
    """Judge, measure and render; returns what summary.json holds.

    context: "command" (the dpcompare command line), "peaks" (measured_peaks()-style CPU peaks, used for
    every thread count; when absent they are measured, on the runs' own machine only), "accelerator"
    (GPU name for the known-peak table; detected locally when absent).
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
    if context.get("diagnose"):
        diagnose_failures(parity, out_dir)
    peaks = PeakFinder(runs, context)
    rows = [run_row(run, parity, peaks) for run in runs]
    scaling = scaling_table(rows)
    speed = speed_table(rows)
    fairness = fairness_info(runs, rows, context)
    summary = {
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        "verdicts": verdicts(parity, speed, scaling, rows, fairness, context.get("baseline")),
        "runs": rows,
        "parity": parity,
        "speed": speed,
        "scaling": scaling,
        "mfu": peaks.describe(runs),
        "tolerances": asdict(tol),
        "baseline": context.get("baseline"),
        "samples": samples_for(runs, context),
        "fairness": fairness,
        "environment": environment_info(runs, rows, peaks),
        "commands": {"compare": context.get("command"),
                     "runs": [{"label": r["label"], "launcher": r["command"], "dpcompare": r["rerun"]}
                              for r in rows]},
    }
    summary["plots"] = {name: f"plots/{file}" for name, file in
                        make_plots(runs, parity, rows, scaling, out_dir / "plots").items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "summary.json", summary)
    blocks = report_blocks(summary)
    (out_dir / "report.md").write_text(to_markdown(blocks))
    (out_dir / "report.html").write_text(to_html(blocks, out_dir))
    return summary


def diagnose_failures(parity: dict, out_dir: Path) -> None:
    """Run `dpcompare diagnose` for every cross-framework pair whose per-step check failed; the finding
    goes into the pair (pair["diagnosis"]) and under its verdict."""
    from ..diagnose import diagnose_pair, finding

    for pair in parity["cross_framework"]:
        if pair.get("checks", {}).get("per_step", {}).get("verdict") != "fail":
            continue
        name = f"{pair['a']}-vs-{pair['b']}".replace(" ", "_")
        try:
            result = diagnose_pair(pair, out_dir / "diagnosis" / name)
            pair["diagnosis"] = {"finding": finding(result), "first_divergence": result.get("first_divergence"),
                                 "file": str(out_dir / "diagnosis" / name / "diagnosis.json")}
        except Exception as err:  # noqa: BLE001 - a failed diagnosis must not cost the report
            pair["diagnosis"] = {"finding": f"diagnosis failed: {err}", "first_divergence": None}


def samples_for(runs: list, context: dict) -> dict:
    """A greedy continuation of a fixed prompt from each finished run's final weights (compare/samples.py),
    and whether the texts agree across frameworks."""
    if "samples" in context:
        return context["samples"]
    from .samples import PROMPT, continuations

    done = [r for r in runs if r.ok]
    found = continuations([r.run_dir for r in done]) if done else {}
    texts = {r.label: found.get(str(r.run_dir), {}) for r in done}
    fp32 = {label: s["text"] for label, s in texts.items() if "text" in s and " bf16 " not in f" {label} "}
    return {"prompt": PROMPT, "by_run": texts,
            "fp32_identical": len(set(fp32.values())) <= 1 if len(fp32) > 1 else None}
