"""A restarted run (--max-restarts, compare/launch/restarts.py) in words: one line per restart, for the
terminal and the report, read from summary.json's `restarts`."""
from __future__ import annotations


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
            f"{record['step']}; resumed from {how} ({record['steps_lost']} steps lost){size}{took}")


def restart_blocks(rows: list[dict]) -> list[tuple]:
    """The report's "Restarts" section: what each restarted run lost, and whether it shrank."""
    items = [f"{r['label']}: {restart_line(record, r.get('max_restarts') or len(r['restarts']))}"
             for r in rows for record in r.get("restarts") or []]
    return [("h2", "Restarts"), ("ul", items)] if items else []
