"""Where the diagnosis of a failed cross-framework pair lies, and reading it into the report.

`dpcompare compare` diagnoses every cross-framework pair whose per-step check failed, once its runs have
trained (compare/matrix.py), and writes the one-line finding to <out>/diagnosis/<a>-vs-<b>/finding.json
beside `dpcompare diagnose`'s own diagnosis.json. The report reads the finding; it starts nothing.
"""
from __future__ import annotations

from pathlib import Path

from common.metrics import read_json

FINDING_FILE = "finding.json"


def failed_cross_framework_pairs(parity: dict) -> list[dict]:
    """The pairs a diagnosis is for: cross-framework, per-step check failed (judge()'s parity dict)."""
    return [pair for pair in parity["cross_framework"]
            if pair.get("checks", {}).get("per_step", {}).get("verdict") == "fail"]


def diagnosis_dir(out_dir: Path, pair: dict) -> Path:
    return Path(out_dir) / "diagnosis" / f"{pair['a']}-vs-{pair['b']}".replace(" ", "_")


def read_diagnoses(parity: dict, out_dir: Path) -> None:
    """Each failed pair's finding, where one was written, into the pair (pair["diagnosis"]): the report
    puts it under the pair's verdict."""
    for pair in failed_cross_framework_pairs(parity):
        found = read_json(diagnosis_dir(out_dir, pair) / FINDING_FILE, None)
        if isinstance(found, dict) and "finding" in found:
            pair["diagnosis"] = found
