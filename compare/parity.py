"""Do the loss curves agree? Cross-framework pairs at each world size, and DP invariance (N vs 1).

Three checks per pair, each with its own tolerance (Tolerances):
    per_step  max |loss_a - loss_b| over the first `parity_steps` steps. In fp32 from identical weights
              and batches the curves start equal up to summation order; this catches a wrong gradient,
              optimizer or data order immediately, before chaotic divergence sets in.
    curve     max relative difference of the moving averages (window `curve_window`) over all common
              steps: after many steps rounding differences grow, so only the trend is compared.
    eval      max relative difference of eval losses at common eval steps.
Runs are paired only when their configs agree on everything that changes the numbers; the rest
(framework, ranks, backend, threads, output paths) is what the comparison is about.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from common.metrics import read_json, read_metrics


@dataclass
class Tolerances:
    loss_atol: float = 1e-4     # per-step absolute loss difference, fp32
    parity_steps: int = 20      # steps compared step by step
    curve_rtol: float = 0.02    # relative difference of the moving averages
    curve_window: int = 10      # moving-average window, steps
    eval_rtol: float = 0.02     # relative difference of eval losses
    dp_atol: float = 1e-4       # per-step absolute difference, N ranks vs 1


# Config keys that may differ between runs that are still compared: how and where a run executes,
# never what it computes. (grad_accum splits the same global batch differently, like nproc does.)
RUN_ONLY_KEYS = frozenset({
    "framework", "strategy", "nproc", "nnodes", "node_rank", "rdzv_endpoint", "hostfile", "backend", "device",
    "threads_per_rank", "mlx_blas", "all_reduce_size_mb", "bucket_cap_mb", "torch_compile", "grad_accum",
    "collective_timeout_s", "timing_warmup_steps", "eval_every", "checkpoint_every", "out", "resume",
    "overwrite", "quiet", "cache_dir",
})


@dataclass
class RunData:
    run_dir: Path
    summary: dict
    train: list[dict]
    evals: list[dict]
    run_config: dict
    label: str = ""
    problem: str = field(default="")  # why the run is skipped; empty when it can be judged

    @property
    def config(self) -> dict:
        return self.summary.get("config") or self.run_config.get("config") or {}

    @property
    def framework(self) -> str:
        return self.summary.get("framework") or self.config.get("framework", "?")

    @property
    def world_size(self) -> int:
        return int(self.summary.get("world_size") or self.run_config.get("world_size") or
                   self.config.get("nproc", 1) * self.config.get("nnodes", 1))

    @property
    def status(self) -> str:
        return self.summary.get("status", "incomplete")

    @property
    def ok(self) -> bool:
        return not self.problem

    def losses(self) -> dict[int, float]:
        return {int(r["step"]): float(r["loss"]) for r in self.train if r.get("loss") is not None}

    def eval_losses(self) -> dict[int, float]:
        return {int(r["step"]): float(r["eval_loss"]) for r in self.evals if r.get("eval_loss") is not None}


def load_run(run_dir: Path) -> RunData:
    """A run directory as written by compare/runner.py; never raises on a broken or unfinished run,
    it gets a `problem` instead, so a report can still list it."""
    run_dir = Path(run_dir)
    summary = read_json(run_dir / "summary.json", None) or {}
    run_config = read_json(run_dir / "run_config.json", None) or {}
    train, evals = read_metrics(run_dir / "metrics.jsonl")
    run = RunData(run_dir, summary, train, evals, run_config)
    run.label = f"{run.framework} x{run.world_size}"
    if not summary and not run_config:
        run.problem = f"no run files in {run_dir}"
    elif not summary:
        run.problem = "incomplete: no summary.json (still running, or the launcher was killed)"
    elif run.status != "ok":
        run.problem = f"{run.status}: {summary.get('error', 'no error recorded')}"
    elif not train:
        run.problem = "no training steps in metrics.jsonl"
    elif run.config.get("steps") and run.losses() and max(run.losses()) < run.config["steps"]:
        run.problem = f"incomplete: {max(run.losses())} of {run.config['steps']} steps"
    return run


def assign_labels(runs: list[RunData]) -> None:
    """"mlx x2" alone when unique; backend, then directory name appended where needed."""
    base = [f"{r.framework} x{r.world_size}" for r in runs]
    for run, label in zip(runs, base):
        run.label = label
        if base.count(label) > 1 and run.world_size > 1:
            run.label = f"{label} {run.summary.get('backend') or run.run_config.get('backend', '')}".strip()
    labels = [r.label for r in runs]
    for run in runs:
        if labels.count(run.label) > 1:
            run.label = f"{run.label} ({run.run_dir.name})"


def comparable(a: RunData, b: RunData) -> dict:
    """{key: [a's value, b's value]} for every difference that changes the numbers; empty = comparable."""
    diffs = {}
    ca, cb = a.config, b.config
    for key in sorted(set(ca) | set(cb)):
        if key not in RUN_ONLY_KEYS and ca.get(key) != cb.get(key):
            diffs[key] = [ca.get(key), cb.get(key)]
    for section in ("spec", "data"):
        sa, sb = a.run_config.get(section) or {}, b.run_config.get(section) or {}
        for key in sorted(set(sa) | set(sb)):
            if sa.get(key) != sb.get(key):
                diffs[f"{section}.{key}"] = [sa.get(key), sb.get(key)]
    return diffs


def moving_average(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean; the first window-1 points average what exists so far (no padding artefacts)."""
    sums = np.cumsum(np.insert(values, 0, 0.0))
    idx = np.arange(1, len(values) + 1)
    lo = np.maximum(idx - window, 0)
    return (sums[idx] - sums[lo]) / (idx - lo)


def compare_pair(a: RunData, b: RunData, kind: str, tol: Tolerances) -> dict:
    result = {"kind": kind, "a": a.label, "b": b.label, "a_dir": str(a.run_dir), "b_dir": str(b.run_dir),
              "world_size": [a.world_size, b.world_size]}
    diffs = comparable(a, b)
    if diffs:
        return {**result, "comparable": False, "differences": diffs, "verdict": "not comparable",
                "checks": {}}
    la, lb = a.losses(), b.losses()
    steps = sorted(set(la) & set(lb))
    if not steps:
        return {**result, "comparable": True, "differences": {}, "verdict": "no data", "checks": {}}
    ya, yb = np.array([la[s] for s in steps]), np.array([lb[s] for s in steps])
    abs_diff = np.abs(ya - yb)
    atol = tol.dp_atol if kind == "dp_invariance" else tol.loss_atol
    first = [i for i, s in enumerate(steps) if s <= tol.parity_steps]
    checks = {"per_step": per_step_check(steps, abs_diff, first, atol, tol.parity_steps)}
    if kind == "cross_framework":
        checks["curve"] = curve_check(ya, yb, tol)
        checks["eval"] = eval_check(a.eval_losses(), b.eval_losses(), tol.eval_rtol)
    verdicts = [c["verdict"] for c in checks.values() if c["verdict"] in ("pass", "fail")]
    verdict = "fail" if "fail" in verdicts else ("pass" if verdicts else "no data")
    return {**result, "comparable": True, "differences": {}, "verdict": verdict, "checks": checks,
            "common_steps": len(steps),
            "diff_series": {"steps": steps, "abs_diff": [float(x) for x in abs_diff]}}


def per_step_check(steps: list[int], abs_diff: np.ndarray, first: list[int], atol: float, k: int) -> dict:
    if not first:
        return {"verdict": "no data", "steps_compared": 0, "tolerance": atol, "parity_steps": k}
    worst = max(first, key=lambda i: abs_diff[i])
    value = float(abs_diff[worst])
    return {"verdict": "pass" if value <= atol else "fail", "max_abs_diff": value, "at_step": steps[worst],
            "steps_compared": len(first), "tolerance": atol, "parity_steps": k,
            "mean_abs_diff": float(np.mean(abs_diff[first]))}


def curve_check(ya: np.ndarray, yb: np.ndarray, tol: Tolerances) -> dict:
    ma, mb = moving_average(ya, tol.curve_window), moving_average(yb, tol.curve_window)
    rel = np.abs(ma - mb) / np.maximum(np.abs(mb), 1e-12)
    value = float(rel.max())
    return {"verdict": "pass" if value <= tol.curve_rtol else "fail", "max_rel_diff": value,
            "at_index": int(rel.argmax()), "window": tol.curve_window, "steps_compared": len(ya),
            "tolerance": tol.curve_rtol, "final_rel_diff": float(rel[-1])}


def eval_check(ea: dict[int, float], eb: dict[int, float], rtol: float) -> dict:
    steps = sorted(set(ea) & set(eb))
    if not steps:
        return {"verdict": "no data", "steps_compared": 0, "tolerance": rtol}
    rel = [abs(ea[s] - eb[s]) / max(abs(eb[s]), 1e-12) for s in steps]
    worst = int(np.argmax(rel))
    return {"verdict": "pass" if rel[worst] <= rtol else "fail", "max_rel_diff": float(rel[worst]),
            "at_step": steps[worst], "steps_compared": len(steps), "tolerance": rtol,
            "a": [ea[s] for s in steps], "b": [eb[s] for s in steps], "steps": steps}


def judge(runs: list[RunData], tol: Tolerances) -> dict:
    """Every verdict and the numbers behind it, JSON-able. Verdicts: pass, fail, not comparable, no data."""
    assign_labels(runs)
    usable = [r for r in runs if r.ok]
    skipped = [{"label": r.label, "run_dir": str(r.run_dir), "status": r.status, "reason": r.problem}
               for r in runs if not r.ok]
    order = {"mlx": 0, "torch": 1}
    usable.sort(key=lambda r: (r.world_size, order.get(r.framework, 9), r.framework))
    cross = [compare_pair(a, b, "cross_framework", tol)
             for i, a in enumerate(usable) for b in usable[i + 1:]
             if a.world_size == b.world_size and a.framework != b.framework]
    dp = []
    for framework in dict.fromkeys(r.framework for r in usable):
        baseline = next((r for r in usable if r.framework == framework and r.world_size == 1), None)
        if baseline is None:
            continue
        dp += [compare_pair(r, baseline, "dp_invariance", tol)
               for r in usable if r.framework == framework and r.world_size > 1]
    pairs = cross + dp
    verdicts = [p["verdict"] for p in pairs]
    if "fail" in verdicts:
        overall = "fail"
    elif "pass" in verdicts:
        overall = "pass"
    elif "not comparable" in verdicts:
        overall = "not comparable"
    else:
        overall = "no data"
    return {"tolerances": asdict(tol), "overall": overall, "all_pass": "fail" not in verdicts,
            "runs": [{"label": r.label, "run_dir": str(r.run_dir), "framework": r.framework,
                      "world_size": r.world_size, "status": r.status, "judged": r.ok} for r in runs],
            "skipped": skipped, "cross_framework": cross, "dp_invariance": dp}


def run_verdict(parity: dict, label: str) -> str:
    """The worst verdict among the pairs a run takes part in ("-" when it is in none)."""
    verdicts = [p["verdict"] for p in parity["cross_framework"] + parity["dp_invariance"]
                if label in (p["a"], p["b"])]
    for worst in ("fail", "not comparable", "no data", "pass"):
        if worst in verdicts:
            return worst
    return "-"
