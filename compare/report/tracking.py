"""`--report-to tensorboard,wandb,trackio`: a run's metrics where users look.

Written by the launcher from the run's metrics.jsonl once the run has ended, not by rank 0 while it
trains: metrics.jsonl is already the one record of a run (rank 0 writes it, flushed per line), so the
trackers get exactly what the report shows; nothing extra runs inside the timed training processes
(an event-writer thread would compete for the cores being measured); MLX ranks need no torch or
TensorFlow writer; a tracker that fails cannot kill a training run; and a resumed run is written
again whole, without duplicated steps. The price: the curves appear when the run ends, not live.

Per step: loss, lr, grad norm, tokens/s (rank 0's metrics, i.e. the global ones); eval loss where
evaluated. The trackers are optional (`pip install dpcompare[tracking]`); wandb and trackio log
offline / locally unless their own settings (WANDB_MODE, a trackio space) say otherwise.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

from common.errors import UserError
from common.metrics import read_json, read_metrics

TRAIN_TAGS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
              "tokens_per_s": "train/tokens_per_s"}
EVAL_TAG = "eval/loss"
TENSORBOARD_DIR = "tensorboard"
PROJECT = "dpcompare"
INSTALL_HINT = "pip install 'dpcompare[tracking]'"


def parse_report_to(text: str) -> list[str]:
    """The trackers of a --report-to value ("" and "none": none); RunConfig has validated the names."""
    return [n.strip() for n in str(text or "").split(",") if n.strip() and n.strip() != "none"]


def check_installed(report_to: str) -> None:
    """Before a run starts: every tracker asked for must be installed."""
    for name in parse_report_to(report_to):
        if importlib.util.find_spec(name) is None:
            raise UserError(f"--report-to {name}: {name} is not installed ({INSTALL_HINT})")


def report_run_safely(run_dir: Path, report_to: str) -> dict[str, str]:
    """report_run for the launcher: a tracker's failure is a warning, never a failed run."""
    try:
        return report_run(run_dir, report_to)
    except Exception as err:  # noqa: BLE001 - the run itself is done and recorded
        print(f"dpcompare: warning: --report-to {report_to}: {type(err).__name__}: {err}", file=sys.stderr)
        return {}


def report_run(run_dir: Path, report_to: str) -> dict[str, str]:
    """Write the run's metrics to every tracker asked for; returns {tracker: where}."""
    run_dir = Path(run_dir)
    names = parse_report_to(report_to)
    if not names:
        return {}
    train, evals = read_metrics(run_dir / "metrics.jsonl")
    plan = read_json(run_dir / "run_config.json", None) or {}
    name = f"{(plan.get('config') or {}).get('framework', 'run')}-n{plan.get('world_size', 1)}-{run_dir.name}"
    start = (run_dir / "run_config.json").stat().st_mtime if (run_dir / "run_config.json").exists() else 0.0
    writers = {"tensorboard": write_tensorboard, "wandb": write_wandb, "trackio": write_trackio}
    return {tracker: writers[tracker](run_dir, name, plan.get("config") or {}, train, evals, start)
            for tracker in names}


def scalars(train: list[dict], evals: list[dict], start: float):
    """(step, wall time, {tag: value}) in step order; wall times rebuilt from the step times."""
    rows, wall = [], start
    for row in train:
        wall += row.get("step_time_s") or 0.0
        rows.append((int(row["step"]), wall, {tag: float(row[key]) for key, tag in TRAIN_TAGS.items()
                                              if row.get(key) is not None}))
    walls = {step: w for step, w, _ in rows}
    rows += [(int(e["step"]), walls.get(int(e["step"]), wall), {EVAL_TAG: float(e["eval_loss"])})
             for e in evals if e.get("eval_loss") is not None]
    return sorted(rows, key=lambda r: r[0])


def write_tensorboard(run_dir: Path, name: str, config: dict, train, evals, start: float) -> str:
    try:
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter
    except ImportError:
        raise UserError(f"--report-to tensorboard: tensorboard is not installed ({INSTALL_HINT})") from None
    logdir = run_dir / TENSORBOARD_DIR
    shutil.rmtree(logdir, ignore_errors=True)  # written whole each time: a resumed run has no duplicate steps
    writer = EventFileWriter(str(logdir))
    try:
        for step, wall, values in scalars(train, evals, start):
            summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=tag, simple_value=value)
                                                 for tag, value in values.items()])
            writer.add_event(event_pb2.Event(wall_time=wall, step=step, summary=summary))
    finally:
        writer.close()
    return str(logdir)


def write_wandb(run_dir: Path, name: str, config: dict, train, evals, start: float) -> str:
    try:
        import wandb
    except ImportError:
        raise UserError(f"--report-to wandb: wandb is not installed ({INSTALL_HINT})") from None
    run = wandb.init(project=os.environ.get("WANDB_PROJECT", PROJECT), name=name, config=config,
                     dir=str(run_dir), mode=os.environ.get("WANDB_MODE", "offline"), reinit=True)
    try:
        for step, _, values in scalars(train, evals, start):
            run.log(values, step=step)
    finally:
        run.finish()
    return str(run_dir / "wandb")


def write_trackio(run_dir: Path, name: str, config: dict, train, evals, start: float) -> str:
    try:
        import trackio
    except ImportError:
        raise UserError(f"--report-to trackio: trackio is not installed ({INSTALL_HINT})") from None
    trackio.init(project=os.environ.get("TRACKIO_PROJECT", PROJECT), name=name, config=config)
    try:
        for step, _, values in scalars(train, evals, start):
            trackio.log(values, step=step)
    finally:
        trackio.finish()
    return f"trackio project {os.environ.get('TRACKIO_PROJECT', PROJECT)} (trackio show)"
