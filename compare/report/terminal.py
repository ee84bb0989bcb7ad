"""What `dpcompare compare` and `dpcompare report` print at the end: one line per run, then the verdict as
a table of the judged pairs (compare/report/verdict_table.py) and the lines that follow it."""
from __future__ import annotations

from .render import fmt, pct
from .verdict_table import terminal_verdict, text_table

RUN_HEADERS = ("run", "N", "status", "final loss", "tokens/s", "scaling", "RSS/rank MB", "parity")


def terminal_table(summary: dict) -> str:
    body = []
    for r in summary["runs"]:
        rss = [m for m in r.get("peak_rss_mb") or [] if m is not None]
        body.append((r["label"], str(r["world_size"]), r["status"], fmt(r.get("final_loss"), ".4f"),
                     fmt(r.get("tokens_per_s"), ",.0f"), pct(r.get("scaling_efficiency"), ".0f"),
                     fmt(max(rss) if rss else None, ",.0f"), r.get("parity", "-")))
    lines = text_table(RUN_HEADERS, body, right=frozenset({1, 3, 4, 5, 6}))
    return "\n".join(lines + [""] + terminal_verdict(summary))
