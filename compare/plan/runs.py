"""Reading finished runs for the cost model: a run's summary and model spec, its calibration, the ddp N=1 run
trained beside it, how many ranks shared each of its cores, and the runs beside it of the same workload (the plan
figure's measured points). Everything here reads run directories; nothing predicts."""
from __future__ import annotations

from pathlib import Path

from common.costmodel.calibrate import Calibration, calibrate
from common.errors import UserError
from common.metrics import read_json
from common.model.spec import ModelSpec, preset
from compare.report.labels import run_dirname


def read_run(run_dir: Path) -> tuple[dict, ModelSpec]:
    """(summary.json, the model spec the run trained) of a finished run, or a one-line UserError."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"run directory {run_dir} not found" if not run_dir.exists() else
                        f"{run_dir} is not a directory: --from takes a run directory")
    summary = read_json(run_dir / "summary.json")
    if not isinstance(summary, dict):
        raise UserError(f"{run_dir} has no readable summary.json: is it a finished run directory?")
    if "runs" in summary and "breakdown" not in summary:  # a compare directory's report summary
        runs = sorted(p.name for p in run_dir.iterdir() if (p / "run_config.json").exists())
        raise UserError(f"{run_dir} is a comparison, not a run: pass one of its runs to --from "
                        f"({', '.join(runs) or 'none finished'})")
    if not summary.get("breakdown"):
        raise UserError(f"{run_dir}'s summary.json has no time breakdown to calibrate on (a run with "
                        "--profile-steps 0, or one that did not finish)")
    return summary, run_spec(run_dir, summary)


def run_spec(run_dir: Path, summary: dict) -> ModelSpec:
    """The model spec a run trained (run_config.json), or a one-line UserError."""
    spec = (read_json(run_dir / "run_config.json") or {}).get("spec")
    try:
        if spec is None:  # older runs: the preset with its overrides (the tokenizer's vocabulary unknown)
            cfg = summary.get("config") or {}
            spec = {**preset(cfg.get("preset", "small")).to_dict(), **(cfg.get("model") or {})}
        return ModelSpec.from_dict(spec)
    except (TypeError, ValueError) as err:
        raise UserError(f"{run_dir}: cannot read the model spec: {err}") from None


def calibrate_run(run_dir: Path) -> Calibration:
    summary, spec = read_run(run_dir)
    return calibrate(summary, spec, source=str(run_dir))


def n1_beside(run_dir: Path, s: dict) -> Calibration | None:
    """The calibration of the ddp N=1 run of the compare that trained `run_dir` (the sibling compare names so), to
    fit `run_dir`'s host work against (common/costmodel/fit.py); None where there is none of its workload."""
    beside = run_dir.parent / run_dirname(s.get("framework", ""), 1, "ddp", s.get("dtype") or "float32")
    o = read_json(beside / "summary.json") if beside != run_dir else None
    if not isinstance(o, dict) or o.get("status") != "ok" or o.get("strategy", "ddp") != "ddp" \
            or (o.get("dtype"), o.get("tokens_per_step")) != (s.get("dtype"), s.get("tokens_per_step")):
        return None
    try:
        return calibrate_run(beside)
    except UserError:
        return None


def cores_shared_by(s: dict) -> float:
    """How many ranks' threads share each core of the machine a local CPU run ran on (summary.json's machine,
    threads_per_rank): 4 one-thread ranks on 2 cores, 2; 1 on a GPU, across hosts, or with cores to spare.
    The N=1 run it is calibrated on had a core to itself, so its compute is stretched that much."""
    cfg = s.get("config") or {}
    cpus = (s.get("machine") or {}).get("cpus")
    if str(s.get("device", "cpu")).startswith(("cuda", "gpu", "mps")) or not cpus or cfg.get("hostfile") \
            or (cfg.get("nnodes") or 1) > 1:
        return 1.0
    return max(1.0, (s.get("world_size") or 1) * (s.get("threads_per_rank") or 1) / cpus)


def measured_points(run_dir: Path, summary: dict) -> list[dict]:
    """Runs next to RUN_DIR (a compare directory) of the same framework, dtype and workload: the figure's
    measured points."""
    cfg = summary.get("config") or {}
    same = ("preset", "seq_len", "global_batch_size", "grad_accum")
    points = []
    for other in sorted(Path(run_dir).resolve().parent.glob("*/summary.json")):
        s = read_json(other) or {}
        c = s.get("config") or {}
        if (s.get("status") == "ok" and s.get("tokens_per_s") and s.get("framework") == summary.get("framework")
                and s.get("dtype") == summary.get("dtype") and all(c.get(k) == cfg.get(k) for k in same)):
            points.append({"run": other.parent.name, "strategy": s.get("strategy", "ddp"),
                           "world_size": s.get("world_size"), "tokens_per_s": s["tokens_per_s"],
                           "step_s": s.get("step_time_s"), "link": (s.get("link") or {}).get("requested")})
    return points
