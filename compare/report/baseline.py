"""Golden baselines: guard a training setup in CI.

`dpcompare compare ... --save-baseline FILE.json` keeps, per run, the full-precision per-step losses and
grad norms, the eval losses and the config fingerprint (everything that changes the numbers: config
fields outside parity.RUN_ONLY_KEYS, the model spec, the data). `--against FILE.json` judges each run
against the baseline run of the same framework, strategy and world size with the usual parity checks
(per-step loss over the first steps, moving-average curve, eval loss); a run whose config differs from
the baseline's is judged all the same, and its verdict names the fields that differ.
"""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import numpy as np

from common.errors import UserError
from common.metrics import read_json, write_json

from .parity import RUN_ONLY_KEYS, RunData, Tolerances, curve_check, eval_check, load_run, per_step_check

FORMAT = "dpcompare-baseline"
VERSION = 1
# Config fields that never change the numbers: how a run executes (parity's list) and where it reports.
IGNORED_KEYS = RUN_ONLY_KEYS | {"report_to"}


def fingerprint_fields(run: RunData) -> dict:
    """What must be equal for two runs to compute the same numbers, as flat `field: value` pairs."""
    fields = {k: v for k, v in run.config.items() if k not in IGNORED_KEYS}
    for section in ("spec", "data"):
        fields.update({f"{section}.{k}": v for k, v in (run.run_config.get(section) or {}).items()})
    return fields


def fingerprint(fields: dict) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]


def save_baseline(run_dirs: list[Path], path: Path) -> dict:
    """Write the baseline of every finished run; returns what was written. Unfinished runs are listed
    under "skipped" and not kept."""
    runs = [load_run(Path(d)) for d in run_dirs]
    entries, skipped = [], []
    for run in runs:
        if not run.ok:
            skipped.append({"label": run.label, "run_dir": str(run.run_dir), "reason": run.problem})
            continue
        fields = fingerprint_fields(run)
        train = sorted(run.train, key=lambda r: r["step"])
        evals = sorted(run.eval_losses().items())
        entries.append({
            "label": run.label, "framework": run.framework, "strategy": run.strategy, "dtype": run.dtype,
            "world_size": run.world_size, "run_dir": str(run.run_dir),
            "steps": [int(r["step"]) for r in train],
            "loss": [float(r["loss"]) for r in train],
            "grad_norm": [None if r.get("grad_norm") is None else float(r["grad_norm"]) for r in train],
            "eval_steps": [s for s, _ in evals], "eval_loss": [x for _, x in evals],
            "fingerprint": fingerprint(fields), "config": fields,
            "device": run.summary.get("device"), "versions": run.summary.get("versions"),
        })
    if not entries:
        raise UserError("no finished run to save as a baseline")
    baseline = {"format": FORMAT, "version": VERSION, "created": time.strftime("%Y-%m-%d %H:%M:%S"),
                "runs": entries, "skipped": skipped}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, baseline)  # json writes floats with repr: they read back bit for bit
    return baseline


def read_baseline(path: Path) -> dict:
    data = read_json(Path(path), None)
    if data is None:
        raise UserError(f"baseline {path} is missing or not valid JSON")
    if data.get("format") != FORMAT or data.get("version") != VERSION:
        raise UserError(f"{path} is not a dpcompare baseline (format {data.get('format')!r}, version "
                        f"{data.get('version')!r}; this dpcompare reads {FORMAT!r} version {VERSION})")
    return data


def judge_against(run_dirs: list[Path], path: Path, tolerances: Tolerances | None = None) -> list[dict]:
    """One verdict per run: "pass", "fail", "no baseline" (no baseline run of its framework, strategy
    and world size) or "skipped" (the run did not finish). Each has a one-line "message"."""
    tol = tolerances or Tolerances()
    baseline = read_baseline(path)
    verdicts = []
    for run in (load_run(Path(d)) for d in run_dirs):
        key = (run.framework, run.strategy, run.dtype, run.world_size)
        base = next((b for b in baseline["runs"] if (b["framework"], b["strategy"], b.get("dtype", "float32"),
                                                     b["world_size"]) == key), None)
        verdicts.append(judge_run(run, base, tol, str(path)))
    return verdicts


def judge_run(run: RunData, base: dict | None, tol: Tolerances, path: str) -> dict:
    result = {"kind": "baseline", "label": run.label, "run_dir": str(run.run_dir), "framework": run.framework,
              "strategy": run.strategy, "dtype": run.dtype, "world_size": run.world_size, "baseline": path,
              "checks": {}, "config_differences": {}}
    if not run.ok:
        return {**result, "verdict": "skipped", "message": f"{run.label}: not judged against the baseline "
                                                           f"({run.problem})"}
    if base is None:
        return {**result, "verdict": "no baseline",
                "message": f"{run.label}: {path} has no {result['strategy']} run of {run.framework} at "
                           f"{run.world_size} rank(s)"}
    fields = fingerprint_fields(run)
    differences = {k: [base["config"].get(k), fields.get(k)] for k in sorted(set(fields) | set(base["config"]))
                   if base["config"].get(k) != fields.get(k)}
    mine = run.losses()
    theirs = dict(zip(base["steps"], base["loss"]))
    steps = sorted(set(mine) & set(theirs))
    result.update(config_differences=differences, fingerprint=fingerprint(fields),
                  baseline_fingerprint=base["fingerprint"], steps_compared=len(steps),
                  baseline_steps=len(base["steps"]), run_steps=len(mine))
    if steps:
        ya, yb = np.array([mine[s] for s in steps]), np.array([theirs[s] for s in steps])
        first = [i for i, s in enumerate(steps) if s <= tol.parity_steps]
        # The same run again: the tolerances of a cross-framework pair in its dtype (relative in bf16).
        limit, relative = tol.per_step("cross_framework", run.dtype)
        curve_rtol, eval_rtol = tol.trend("cross_framework", run.dtype)
        diff = np.abs(ya - yb) / (np.maximum(np.abs(yb), 1e-12) if relative else 1.0)
        result["checks"] = {
            "per_step": per_step_check(steps, diff, first, limit, tol.parity_steps, relative),
            "curve": curve_check(ya, yb, curve_rtol, tol.curve_window),
            "eval": eval_check(run.eval_losses(), dict(zip(base["eval_steps"], base["eval_loss"])), eval_rtol),
        }
        norms = {int(r["step"]): r.get("grad_norm") for r in run.train}
        base_norms = dict(zip(base["steps"], base["grad_norm"]))
        rel = [abs(norms[s] - base_norms[s]) / max(abs(base_norms[s]), 1e-12) for s in steps
               if norms.get(s) is not None and base_norms.get(s) is not None]
        result["grad_norm_max_rel_diff"] = max(rel) if rel else None
    outcomes = [c["verdict"] for c in result["checks"].values()]
    result["verdict"] = "fail" if "fail" in outcomes else "pass" if "pass" in outcomes else "no data"
    result["message"] = baseline_message(result)
    return result


def baseline_message(v: dict) -> str:
    checks = v["checks"]
    if v["verdict"] == "no data":
        text = f"{v['label']}: no step in common with its baseline"
    elif v["verdict"] == "pass":
        step = checks["per_step"]
        text = (f"{v['label']} matches its baseline: max {'relative ' if step.get('relative') else ''}|Δloss| "
                f"{step.get('max_rel_diff', step.get('max_abs_diff', 0)):.2e} over the first "
                f"{step.get('steps_compared', 0)} steps (tolerance {step['tolerance']:g})")
    else:
        reasons = []
        step, curve, ev = checks["per_step"], checks["curve"], checks["eval"]
        if step["verdict"] == "fail":
            reasons.append(f"max {'relative ' if step.get('relative') else ''}|Δloss| "
                           f"{step.get('max_rel_diff', step.get('max_abs_diff', 0)):.2e} at step {step['at_step']} "
                           f"(tolerance {step['tolerance']:g})")
        if curve["verdict"] == "fail":
            reasons.append(f"moving averages differ by {curve['max_rel_diff']:.2%} (tolerance {curve['tolerance']:.0%})")
        if ev["verdict"] == "fail":
            reasons.append(f"eval loss differs by {ev['max_rel_diff']:.2%} at step {ev['at_step']} "
                           f"(tolerance {ev['tolerance']:.0%})")
        text = f"{v['label']} departs from its baseline: " + "; ".join(reasons)
    if v["config_differences"]:
        changed = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in v["config_differences"].items())
        text += f"; config differs from the baseline's: {changed}"
    return text


def baseline_failed(verdicts: list[dict] | None) -> bool:
    return any(v["verdict"] == "fail" for v in verdicts or [])


def apply_baseline_flags(args, run_dirs: list[Path], tolerances: Tolerances) -> list[dict] | None:
    """--against (judged first, so both flags may name one file) and --save-baseline of `compare` and
    `report`; returns the --against verdicts, None without it. Prints one line per verdict."""
    verdicts = None
    if getattr(args, "against", None):
        verdicts = judge_against(run_dirs, Path(args.against), tolerances)
        for v in verdicts:
            print(f"baseline {v['verdict'].upper()}: {v['message']}")
    if getattr(args, "save_baseline", None):
        saved = save_baseline(run_dirs, Path(args.save_baseline))
        print(f"baseline: {len(saved['runs'])} run(s) saved to {args.save_baseline}")
    return verdicts
