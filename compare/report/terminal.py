"""What `dpcompare compare` and `dpcompare report` print at the end: one line per run, then the verdict as
a table of the judged pairs (compare/report/verdict_table.py) and the lines that follow it.

The verdict fits a screen for any matrix: after the pairs come only the speed of MLX against torch at each
configuration, the notes no table shows, and each warning once. Every strategy and dtype speed ratio and the
scaling and memory tables by run group are in the report, and here with --verbose; without it, each run's
scaling efficiency and state per rank stand in its line of the run table.
"""
from __future__ import annotations

from .contributions import terminal_lines as contribution_lines
from .render import fmt, pct
from .verdict_table import asked_speed, memory_cells, scaling_cells, speed_cells, table_cells, text_table

RUN_HEADERS = ("run", "N", "status", "final loss", "tokens/s", "scaling", "RSS/rank MB", "state MB/rank (x ddp)",
               "parity")


def terminal_table(summary: dict, verbose: bool = False) -> str:
    body = []
    for r in summary["runs"]:
        rss = [m for m in r.get("peak_rss_mb") or [] if m is not None]
        body.append((r["label"], str(r["world_size"]), r["status"], fmt(r.get("final_loss"), ".4f"),
                     fmt(r.get("tokens_per_s"), ",.0f"), pct(r.get("scaling_efficiency"), ".0f"),
                     fmt(max(rss) if rss else None, ",.0f"), state_cell(r), r.get("parity", "-")))
    lines = text_table(RUN_HEADERS, body, right=frozenset({1, 3, 4, 5, 6, 7}))
    return "\n".join(lines + contribution_lines(summary) + [""] + terminal_verdict(summary, verbose))


def state_cell(row: dict) -> str:
    """Parameters + gradients + optimizer state one rank holds, MB, and against its ddp run's."""
    ratio = row.get("state_vs_ddp")
    return fmt(row.get("state_total_mb"), ",.1f") + (f" ({ratio:.2f}x)" if ratio is not None else "")


def terminal_verdict(summary: dict, verbose: bool = False) -> list[str]:
    """The headline, the pairs' table (verdicts in capitals), the failures' sentences, the speed table, the
    notes, then each warning once; with `verbose`, every speed ratio and the scaling and memory tables too."""
    verdicts = summary["verdicts"]
    lines = [f"verdict: {verdicts['headline']}"]
    if verdicts.get("pairs"):
        headers, body = table_cells(verdicts["pairs"])
        lines += [""] + text_table(headers, [(row[0].upper(), *row[1:]) for row in body])
    if verdicts.get("failures"):
        lines += [""] + [f"! {line}" for line in verdicts["failures"]]
    speed = summary.get("speed") or []
    shown = speed if verbose else asked_speed(speed)
    if shown:
        lines += [""] + [f"! {line}" for line in verdicts.get("speed_environment") or []] + text_table(*speed_cells(shown))
    more = [t for t in (scaling_cells(summary.get("scaling") or {}), memory_cells(summary.get("memory") or []))
            if t]
    notes = verdicts.get("notes", verdicts.get("lines", []))  # "notes" since issue 59; older summaries: "lines"
    if verbose:
        for table in more:
            lines += [""] + text_table(*table)
    elif len(shown) < len(speed) or more:
        names = [headers[0] for headers, _ in more]  # "scaling", "memory"
        notes = [f"In the report, or with --verbose: {held_back(len(speed) - len(shown), names)}"] + notes
    tail = [f"- {line}" for line in notes] + [f"! {w}" for w in verdicts.get("warnings", [])]
    return lines + ([""] + tail if tail else [])


def held_back(ratios: int, tables: list[str]) -> str:
    """What the terminal leaves to the report: "22 more speed ratios (each strategy vs ddp, bf16 vs fp32);
    scaling and memory by run group"."""
    parts = [f"{ratios} more speed ratio{'s' * (ratios != 1)} (each strategy vs ddp, bf16 vs fp32)"] if ratios else []
    return "; ".join(parts + ([f"{' and '.join(tables)} by run group"] if tables else []))
