"""A restarted run (--max-restarts, compare/launch/restarts.py) in words: one line per restart, for the
terminal and the report, read from summary.json's `restarts`."""
from __future__ import annotations

import re

# compare/launch/watchdog.py's diagnoses: "... failed in step S: WORDS" and "... in step S; rank R reports: WORDS"
RANK_WORDS = re.compile(r"in step \d+(?::|; rank \d+ reports:) (.+)", re.S)


def restart_line(record: dict, max_restarts: int) -> str:
    """One line per restart, printed after the run and shown in the report."""
    how = (f"a survivor saved step {record['resumed_from']}" if record["how"] == "survivor_checkpoint"
           else f"last checkpoint, step {record['resumed_from']}")
    size = (f"; shrank {record['nproc_before']} -> {record['nproc_after']} ranks "
            f"(grad accum {record['grad_accum_after']}, same global batch"
            f"{', ' + record['strategy_after'] if record.get('passed_over') and 'ddp instead' in record['passed_over'] else ''})"
            if record["nproc_after"] != record["nproc_before"] else "")
    took = f", first step after {record['seconds']:.1f} s" if record.get("seconds") is not None else ""
    return (f"restart {record['attempt']}/{max_restarts}: rank {record['rank']} {record['cause']} in step "
            f"{record['step']}{reason(record)}; resumed from {how} ({record['steps_lost']} steps lost){size}{took}")


def reason(record: dict, limit: int = 160) -> str:
    """The rank's own words where it raised an error (a death or a stop has none), first line, shortened:
    without them a start that failed for another reason than the one expected cannot be told from it."""
    found = RANK_WORDS.search(record.get("error") or "")
    message = found.group(1).strip().splitlines()[0].strip() if found and found.group(1).strip() else ""
    if not message:
        return ""
    return f" ({message[:limit - 3]}...)" if len(message) > limit else f" ({message})"


def restart_blocks(rows: list[dict]) -> list[tuple]:
    """The report's "Restarts" section: what each restarted run lost, and whether it shrank."""
    items = [f"{r['label']}: {restart_line(record, r.get('max_restarts') or len(r['restarts']))}"
             for r in rows for record in r.get("restarts") or []]
    return [("h2", "Restarts"), ("ul", items)] if items else []
