"""`dpcompare compare`: every framework x world size on the same data, weights and schedule, then a report.

Runs go one at a time so they never compete for cores. The token cache and the seed checkpoint are
prepared once, before the first run, and every run reads the same files.
"""
from __future__ import annotations

import shlex
import sys
from pathlib import Path

from common.config import FRAMEWORKS
from common.errors import ParityError, UserError

from .runner import launch, prepare_inputs


def parse_list(text: str, name: str, kind=str, allowed=None) -> list:
    items = [item.strip() for item in str(text).split(",") if item.strip()]
    if not items:
        raise UserError(f"--{name} needs at least one value")
    try:
        values = [kind(item) for item in items]
    except ValueError:
        raise UserError(f"--{name} must be a comma list of {kind.__name__}s, got {text!r}") from None
    if allowed is not None:
        for value in values:
            if value not in allowed:
                raise UserError(f"unknown {name[:-1] if name.endswith('s') else name} {value!r}; allowed: "
                                f"{', '.join(allowed)}")
    if kind is int and any(v <= 0 for v in values):
        raise UserError(f"--{name} values must be positive, got {text!r}")
    return values


def run_matrix(args) -> int:
    from .cli import config_from_args

    frameworks = parse_list(args.frameworks, "frameworks", allowed=FRAMEWORKS)
    world_sizes = parse_list(args.nproc, "nproc", kind=int)
    # The backend flag names one framework's backend; `auto` lets each framework pick its own.
    base = config_from_args(args, framework=frameworks[0], nproc=max(world_sizes))
    out = Path(base.out or "runs/compare")
    check_run_dir_for_compare(out, base.overwrite)
    configs = {(fw, n): base.replace(framework=fw, nproc=n,
                                     backend=base.backend if fw == frameworks[0] else "auto")
               for fw in frameworks for n in world_sizes}
    inputs = prepare_inputs(base)
    out.mkdir(parents=True, exist_ok=True)
    run_dirs, failed = [], []
    for (fw, n), cfg in configs.items():
        run_dir = out / f"{fw}-n{n}"
        print(f"== {fw} x{n} ({cfg.resolved_backend if n > 1 else 'single process'}) -> {run_dir}",
              file=sys.stderr, flush=True)
        try:
            summary = launch(cfg.replace(out=str(run_dir)), inputs, run_dir)
        except UserError as err:
            summary = {"status": "failed", "error": str(err)}
        except KeyboardInterrupt as stop:  # a signal stops the whole matrix: no further run starts
            raise matrix_interrupted(stop, run_dirs, out, args, failed)
        if summary["status"] != "ok":
            failed.append((fw, n, summary.get("error")))
            print(f"   failed: {summary.get('error')}", file=sys.stderr, flush=True)
        run_dirs.append(run_dir)
    command = "dpcompare " + shlex.join(sys.argv[1:]) if sys.argv else ""
    return finish(run_dirs, out, args, {"command": command}, failed)


def matrix_interrupted(stop: KeyboardInterrupt, run_dirs: list[Path], out: Path, args, failed: list):
    """No report from a half-finished matrix unless asked (--report-on-interrupt): its verdicts would
    silently lack runs. `dpcompare report` still builds one from whatever finished."""
    if getattr(args, "report_on_interrupt", False) and run_dirs:
        finish(run_dirs, out, args, {"command": "dpcompare " + shlex.join(sys.argv[1:])}, failed)
    stop.detail = (f"{getattr(stop, 'detail', None) or 'interrupted'}; the comparison stopped there "
                   f"(dpcompare report {out} reports the runs that finished)")
    return stop


def check_run_dir_for_compare(out: Path, overwrite: bool) -> None:
    if (out / "summary.json").exists() and not overwrite:
        raise UserError(f"{out} already holds a comparison; pass --overwrite or choose another --out")
    if out.exists() and not out.is_dir():
        raise UserError(f"output path {out} exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / ".write_probe").write_text("")
        (out / ".write_probe").unlink()
    except OSError as err:
        raise UserError(f"cannot write to output directory {out}: {err.strerror}") from None


def finish(run_dirs: list[Path], out: Path, args, context: dict, failed: list) -> int:
    from .report import terminal_table, write_report

    tol = tolerances_from_args(args)
    summary = write_report(run_dirs, out, tol, context)
    print(terminal_table(summary))
    print(f"\nreport: {out / 'report.html'}  ({out / 'report.md'}, {out / 'summary.json'})")
    if failed:
        for fw, n, error in failed:
            print(f"dpcompare: error: {fw} x{n} failed: {error}", file=sys.stderr)
        return 1
    if getattr(args, "strict", False) and not summary.get("verdicts", {}).get("all_pass", True):
        raise ParityError("a parity verdict failed (--strict); see the report")
    return 0


def tolerances_from_args(args):
    from .parity import Tolerances

    tol = Tolerances()
    for name, field in (("loss_atol", "loss_atol"), ("parity_steps", "parity_steps"), ("curve_rtol", "curve_rtol")):
        value = getattr(args, name, None)
        if value is not None:
            if value <= 0:
                raise UserError(f"--{name.replace('_', '-')} must be positive, got {value}")
            setattr(tol, field, value)
    return tol


def rebuild_report(args) -> int:
    run_dirs: list[Path] = []
    for given in map(Path, args.runs):
        if (given / "run_config.json").exists():
            run_dirs.append(given)
        elif given.is_dir() and any(p.joinpath("run_config.json").exists() for p in given.iterdir() if p.is_dir()):
            run_dirs += sorted(p for p in given.iterdir() if (p / "run_config.json").exists())
        else:
            raise UserError(f"{given} is neither a run directory nor a directory of runs")
    if args.out:
        out = Path(args.out)
    elif len(args.runs) == 1:  # a compare directory holds its report; a single run gets a report/ inside
        given = Path(args.runs[0])
        out = given / "report" if (given / "run_config.json").exists() else given
    else:
        out = Path("runs/report")
    out.mkdir(parents=True, exist_ok=True)
    return finish(run_dirs, out, args, {"command": "dpcompare " + shlex.join(sys.argv[1:])}, failed=[])
