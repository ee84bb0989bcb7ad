"""`dpcompare diagnose`: when parity fails, say where.

Both frameworks take one training step from the same weights (the seed checkpoint, or a run's
checkpoint with its optimizer state) on the same global batch, in one process each
(`python -m {mlx,torch}_impl.diagnose`, see common/train/step_record.py). Their records are compared in the
order a bug would show:

    forward    every module's output, in the order the modules finish, then the logits
    loss       the loss each Trainer reports for the step
    gradient   every parameter's gradient, from the output end back (a wrong backward shows first
               where it happens, and spreads towards the embedding)
    update     every parameter's change in the optimizer step

A tensor diverges when max |a - b| exceeds its tolerance: rtol x the larger max |value| of the two
(rounding differences scale with the values) plus a small atol; for updates, plus two float32 spacings
of the parameter's largest weight (an update is a difference of two stored float32 weights). The first diverging entry, in that
order, is where the frameworks part: `first_divergence` in diagnosis.json.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from common.checkpoint.store import latest_checkpoint
from common.config import FRAMEWORKS, RunConfig
from common.train.step_record import STAGES, DiagnosisPlan, read_store
from common.errors import UserError
from common.metrics import read_json, write_json
from common.runplan import RunPlan

from .machine import environment as env

PROJECT_ROOT = Path(__file__).resolve().parents[1]
# Relative tolerance per stage and dtype. Largest fp32 differences measured between MLX and torch at
# the first step of `small` (TinyStories + GPT-2, seq 256), relative to the tensor's largest value:
# forward 7e-6, loss 2e-8, gradient 1.3e-6, update 3e-4 (plus one float32 spacing of the weights).
# The planted bugs of tests/integration/test_diagnose.py are 100x-10,000x above their tolerance.
RTOL = {
    "float32": {"forward": 1e-4, "loss": 1e-6, "gradient": 1e-3, "update": 2e-2},
    "bfloat16": {"forward": 5e-2, "loss": 1e-2, "gradient": 2e-1, "update": 5e-1},
}
ATOL = 1e-9  # all-zero tensors (gradients of unused embedding rows) compare equal, not 0 <= 0 * rtol
WORKER_TIMEOUT_S = 3600


class DiagnosisError(Exception):
    """A worker failed; the message names the framework and its log."""


def diagnose(cfg: RunConfig | None, out_dir: Path, *, from_run: Path | None = None, step: int | None = None,
             frameworks=FRAMEWORKS, keep_tensors: bool = False, inputs=None) -> dict:
    """Run both workers and compare; writes out_dir/diagnosis.json and returns what it holds.

    cfg: the run's config (world size, output paths and launcher fields are ignored: one process each).
    None with `from_run`: that run's own config. from_run/step: start from the run's checkpoint after
    `step` completed steps (default: its latest), with its optimizer state, on the batch of step + 1.
    inputs: compare.launch.runner.Inputs when the caller already has them (the token cache is then reused).
    """
    from .launch.runner import prepare_inputs

    out_dir = Path(out_dir)
    checkpoint, done = find_checkpoint(Path(from_run), step) if from_run else (None, 0)
    if cfg is None:
        if from_run is None:
            raise UserError("diagnose needs a config or --from RUN_DIR")
        cfg = run_config(Path(from_run))
    frameworks = list(frameworks)
    if len(frameworks) != 2:
        raise UserError(f"diagnose compares two frameworks, got {', '.join(frameworks)}")
    # One process each, so the strategy is ddp's: fsdp, tp and pp refuse one rank (they compute the same model).
    cfg = cfg.replace(nproc=1, nnodes=1, node_rank=0, hostfile="", resume=False, out=str(out_dir), strategy="ddp")
    inputs = inputs or prepare_inputs(cfg)
    out_dir.mkdir(parents=True, exist_ok=True)
    plan = out_dir / "diagnose_plan.json"
    DiagnosisPlan(cfg, inputs.spec, inputs.token_cache, inputs.seed_checkpoint, checkpoint, done).write(plan)
    stores = {}
    for framework in frameworks:
        stores[framework] = out_dir / "tensors" / framework
        run_worker(cfg.replace(framework=framework, backend="auto"), plan, stores[framework], out_dir)
    result = compare_stores(stores[frameworks[0]], stores[frameworks[1]], RTOL[cfg.dtype])
    result.update(frameworks=frameworks, dtype=cfg.dtype, step=done + 1,
                  weights=str(checkpoint or inputs.seed_checkpoint),
                  weights_from="checkpoint" if checkpoint else "seed checkpoint", out_dir=str(out_dir))
    write_json(out_dir / "diagnosis.json", result)
    if not keep_tensors:
        shutil.rmtree(out_dir / "tensors", ignore_errors=True)
    return result


def diagnose_pair(pair: dict, out_dir: Path, keep_tensors: bool = False) -> dict:
    """Diagnose a failed cross-framework verdict of compare/report/parity.py (`pair` as judge() returns it):
    the first step of its runs' config, from the seed checkpoint, single process."""
    cfg = run_config(Path(pair["a_dir"]))
    a, b = (read_json(Path(d) / "summary.json", None) or {} for d in (pair["a_dir"], pair["b_dir"]))
    frameworks = [s.get("framework") or cfg.framework for s in (a, b)]
    return diagnose(cfg, out_dir, frameworks=frameworks, keep_tensors=keep_tensors)


def run_config(run_dir: Path) -> RunConfig:
    return RunPlan.read(run_dir).config


def find_checkpoint(run_dir: Path, step: int | None) -> tuple[Path, int]:
    if step is None:
        found = latest_checkpoint(run_dir)
        if found is None:
            raise UserError(f"{run_dir} holds no checkpoint")
        return found, int(found.name.split("_")[-1])
    found = run_dir / "checkpoints" / f"step_{step:06d}"
    if not found.is_dir():
        have = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
        raise UserError(f"{run_dir} has no checkpoint of step {step} (has: {', '.join(have) or 'none'})")
    return found, step


def run_worker(cfg: RunConfig, plan: Path, store: Path, out_dir: Path) -> None:
    """One framework's worker as a subprocess, with the threads and BLAS its training ranks would get."""
    shutil.rmtree(store, ignore_errors=True)
    extra = env.thread_env(cfg.threads_per_rank)
    if cfg.framework == "mlx":
        extra.update(env.mlx_blas(cfg.mlx_blas)[1])
    child_env = env.child_env(extra)
    log = out_dir / f"log_{cfg.framework}.txt"
    argv = [sys.executable, "-m", f"{cfg.framework}_impl.diagnose", str(plan), str(store)]
    started = time.time()
    with open(log, "w") as handle:
        try:
            code = subprocess.run(argv, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  env=child_env, cwd=PROJECT_ROOT, timeout=WORKER_TIMEOUT_S).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    if code != 0 or not (store / "manifest.json").exists():
        tail = log.read_text()[-1500:].strip().splitlines()
        raise DiagnosisError(f"the {cfg.framework} diagnosis worker failed ({code}) after "
                             f"{time.time() - started:.0f} s: {tail[-1] if tail else 'no output'} (log: {log})")


# ---- comparing two records -----------------------------------------------------------------------

def compare_stores(dir_a: Path, dir_b: Path, rtol: dict) -> dict:
    """Per-stage rows {name, max_abs_diff, tolerance, max_abs, ratio, diverges} and the first divergence."""
    manifest_a, entries_a = read_store(dir_a)
    manifest_b, entries_b = read_store(dir_b)
    by_key = {(e["stage"], e["name"]): e for e in entries_b}
    grads_a = {e["name"]: dir_a / e["file"] for e in entries_a if e["stage"] == "gradient"}
    grads_b = {e["name"]: dir_b / e["file"] for e in entries_b if e["stage"] == "gradient"}
    stages: dict[str, list[dict]] = {stage: [] for stage in STAGES}
    for entry in entries_a:
        other = by_key.pop((entry["stage"], entry["name"]), None)
        gradients = None
        if entry["stage"] == "update" and entry["name"] in grads_a and entry["name"] in grads_b:
            gradients = (grads_a[entry["name"]], grads_b[entry["name"]])
        stages[entry["stage"]].append(
            compare_entry(dir_a, entry, dir_b, other, rtol[entry["stage"]], gradients))
    for (stage, name), entry in by_key.items():  # only the second framework has it
        stages[stage].append({"name": name, "shape": entry["shape"], "max_abs_diff": float("inf"),
                              "tolerance": 0.0, "ratio": float("inf"), "diverges": True,
                              "problem": f"only {manifest_b['framework']} has it"})
    first = None
    for stage in STAGES:
        rows = stages[stage][::-1] if stage == "gradient" else stages[stage]
        first = next(({"stage": stage, "module": r["name"], "max_abs_diff": r["max_abs_diff"],
                       "tolerance": r["tolerance"], **({"problem": r["problem"]} if "problem" in r else {})}
                      for r in rows if r["diverges"]), None)
        if first:
            break
    bugs = {m["framework"]: m["bug"] for m in (manifest_a, manifest_b) if m.get("bug")}
    return {"first_divergence": first, "stages": stages, "largest": largest(stages),
            "loss": {manifest_a["framework"]: stages["loss"][0].get("a") if stages["loss"] else None,
                     manifest_b["framework"]: stages["loss"][0].get("b") if stages["loss"] else None},
            "grad_norm": {m["framework"]: m["grad_norm"] for m in (manifest_a, manifest_b)},
            "lr": manifest_a["lr"], "global_tokens": manifest_a["global_tokens"],
            "devices": {m["framework"]: m["device"] for m in (manifest_a, manifest_b)},
            **({"injected_bugs": bugs} if bugs else {})}


def compare_entry(dir_a: Path, entry: dict, dir_b: Path, other: dict | None, rtol: float,
                  gradients: tuple[Path, Path] | None = None) -> dict:
    """One tensor of both records. `gradients` (update stage): the two frameworks' gradients of that
    parameter; elements whose gradients differ by more than 0.1 % are left out of the comparison."""
    row = {"name": entry["name"], "shape": entry["shape"]}
    if other is None or other["shape"] != entry["shape"]:
        problem = ("only the first framework has it" if other is None else
                   f"shapes differ: {entry['shape']} vs {other['shape']}")
        return {**row, "max_abs_diff": float("inf"), "tolerance": 0.0, "ratio": float("inf"),
                "diverges": True, "problem": problem}
    a = np.load(dir_a / entry["file"], mmap_mode="r")
    b = np.load(dir_b / other["file"], mmap_mode="r")
    ga, gb = (np.load(path, mmap_mode="r") for path in gradients) if gradients else (None, None)
    diff, scale, skipped = max_abs_diff(a, b, ga, gb)
    tolerance = ATOL + rtol * scale + 2 * entry.get("rounding", 0.0)
    row.update(max_abs_diff=diff, tolerance=tolerance, max_abs=scale,
               ratio=diff / tolerance, diverges=not diff <= tolerance)  # NaN diverges
    if gradients:
        row["undetermined_elements"] = skipped
    if a.ndim == 0:
        row.update(a=float(a), b=float(b))
    return row


# Adam divides by sqrt(v): where the frameworks' gradients of an element differ in sign or size
# (rounding, on gradients close to 0), their updates of it may differ by up to the learning rate;
# within 0.1 %, by at most lr / 4000 at the first step.
# Such elements say nothing about the optimizer; the gradient stage has judged them already.
GRADIENT_AGREEMENT = 1e-3


def max_abs_diff(a: np.ndarray, b: np.ndarray, ga: np.ndarray | None = None, gb: np.ndarray | None = None,
                 rows: int = 4096) -> tuple[float, float, int]:
    """(max |a - b|, max(|a|, |b|), elements left out) in blocks, so the logits of a big vocabulary stay
    cheap; with gradients ga, gb only where they agree within GRADIENT_AGREEMENT."""
    def blocks(x):
        return x.reshape(-1, x.shape[-1]) if x.ndim > 1 else x.reshape(1, -1)

    a2, b2 = blocks(a), blocks(b)
    g2 = (blocks(ga), blocks(gb)) if ga is not None else None
    diff = scale = 0.0
    skipped = 0
    for start in range(0, a2.shape[0], rows):
        x = np.asarray(a2[start:start + rows], dtype=np.float64)
        y = np.asarray(b2[start:start + rows], dtype=np.float64)
        if not (np.isfinite(x).all() and np.isfinite(y).all()) and not np.array_equal(x, y, equal_nan=True):
            return float("nan"), float("nan"), skipped
        scale = max(scale, float(np.max(np.abs(x), initial=0.0)), float(np.max(np.abs(y), initial=0.0)))
        delta = np.abs(x - y)
        if g2 is not None:
            u = np.asarray(g2[0][start:start + rows], dtype=np.float64)
            v = np.asarray(g2[1][start:start + rows], dtype=np.float64)
            agree = np.abs(u - v) <= GRADIENT_AGREEMENT * np.maximum(np.abs(u), np.abs(v))
            skipped += int(agree.size - agree.sum())
            delta = delta[agree]
        diff = max(diff, float(np.max(delta, initial=0.0)))
    return diff, scale, skipped


def largest(stages: dict, count: int = 12) -> list[dict]:
    """The entries furthest beyond (or closest to) their tolerance, over every stage."""
    rows = [{"stage": stage, **{k: r[k] for k in ("name", "max_abs_diff", "tolerance", "ratio", "diverges")}}
            for stage, rows in stages.items() for r in rows]
    rows.sort(key=lambda r: -r["ratio"] if r["ratio"] == r["ratio"] else float("-inf"))
    return rows[:count]


# ---- what people read ----------------------------------------------------------------------------

def finding(result: dict) -> str:
    """One line: where the frameworks part, or that they do not."""
    a, b = result.get("frameworks", ["a", "b"])
    first = result.get("first_divergence")
    source = ("the seed checkpoint" if result.get("weights_from") != "checkpoint" else
              f"{Path(result['weights']).parent.parent.name}'s {Path(result['weights']).name}")
    where = f"step {result.get('step', 1)}, from {source}"
    if first is None:
        return f"diagnosis ({where}): {a} and {b} agree at every module, the loss, every gradient and update"
    if "problem" in first:
        return f"diagnosis ({where}): first divergence at {first['stage']} {first['module']}: {first['problem']}"
    return (f"diagnosis ({where}): {a} and {b} first diverge at {first['stage']} {first['module']}: "
            f"max |Δ| {first['max_abs_diff']:.3g} > tolerance {first['tolerance']:.3g}")


def table(result: dict, count: int = 12) -> str:
    lines = [finding(result), "", f"{'stage':<9} {'name':<48} {'max |Δ|':>10} {'tolerance':>10} {'ratio':>9}"]
    for row in result["largest"][:count]:
        mark = "  <- diverges" if row["diverges"] else ""
        lines.append(f"{row['stage']:<9} {row['name']:<48} {row['max_abs_diff']:>10.3g} {row['tolerance']:>10.3g} "
                     f"{row['ratio']:>9.3g}{mark}")
    losses = result.get("loss") or {}
    if losses:
        lines.append("loss: " + ", ".join(f"{fw} {value:.9f}" for fw, value in losses.items() if value is not None))
    return "\n".join(lines)
