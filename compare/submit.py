"""`dpcompare compare --submit slurm`: every run of the comparison as its own sbatch job, then the report.

Each run gets an sbatch script in its run directory (`job.sbatch`, kept so it can be read and submitted
again) that runs `dpcompare run` with that run's whole config, given as flags with absolute paths; inside
its allocation that run starts its ranks with srun (compare/launch/slurm.py). This process submits them all,
follows them through squeue (queued, running with the step its rank 0 reached, finished), and returns their
run directories for the report once every job has ended. Ctrl-C (or SIGTERM, SIGHUP) cancels the jobs it
submitted and waits for them to write their summaries.
"""
from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from common.config import RunConfig
from common.errors import UserError
from common.metrics import read_json

from .flags import RUN_FLAGS
from .machine.environment import PROJECT_ROOT
from .launch.watchdog import progress_bar

SCRIPT = "job.sbatch"
POLL_S = 1.0
CANCEL_WAIT_S = 60.0  # for cancelled jobs to stop their ranks and write summary.json (KillWait is 30 s by default)
SLURM_TIMEOUT_S = 30
STATE_WORDS = {"PENDING": "queued", "CONFIGURING": "starting", "RUNNING": "running", "COMPLETING": "ending",
               "SUSPENDED": "suspended", "REQUEUED": "queued again"}


@dataclass(frozen=True)
class SubmitOptions:
    partition: str | None = None
    time: str | None = None
    nodes: int | None = None
    account: str | None = None
    dry_run: bool = False
    cwd: Path = field(default_factory=Path.cwd)  # the jobs start here, so relative paths mean what they meant here


def add_submit_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--submit", choices=["slurm"],
                        help="submit every run as its own sbatch job (its script in the run directory), follow "
                             "them, then report (docs/clusters.md)")
    parser.add_argument("--partition", help="--submit: the Slurm partition (sbatch --partition)")
    parser.add_argument("--time", help="--submit: each job's time limit (sbatch --time, e.g. 00:30:00)")
    parser.add_argument("--nodes", type=int, help="--submit: nodes per job (sbatch --nodes; at most its ranks)")
    parser.add_argument("--account", help="--submit: the account to charge (sbatch --account)")
    parser.add_argument("--dry-run", action="store_true", help="--submit: print the scripts, submit nothing")


def submit_options(args) -> SubmitOptions | None:
    """The --submit flags checked before anything is prepared; None when the runs start here."""
    given = [flag for flag, value in (("--partition", args.partition), ("--time", args.time), ("--nodes", args.nodes),
                                      ("--account", args.account), ("--dry-run", args.dry_run)) if value]
    if not args.submit:
        if given:
            raise UserError(f"{', '.join(given)} go{'es' * (len(given) == 1)} with --submit slurm")
        return None
    if args.nodes is not None and args.nodes <= 0:
        raise UserError(f"--nodes must be positive, got {args.nodes}")
    if args.launcher == "local":
        raise UserError("--submit slurm runs every run through srun in its own job; drop --launcher local")
    if not args.dry_run:
        for tool in ("sbatch", "squeue", "scancel"):
            if shutil.which(tool) is None:
                raise UserError(f"--submit slurm: {tool} is not on PATH (run on a Slurm login node, or --dry-run "
                                "to see the scripts)")
    return SubmitOptions(args.partition, args.time, args.nodes, args.account, args.dry_run)


def run_flags(cfg: RunConfig) -> list[str]:
    """`dpcompare run` flags that build `cfg` again: every field that differs from its default, by its own flag
    where it has one, else --set; paths that exist here are made absolute."""
    defaults = RunConfig().to_dict()
    by_field = {flag.lstrip("-").replace("-", "_"): (flag, kind) for flag, kind, _ in RUN_FLAGS}
    by_field.update({name: (f"--{name}", None) for name in ("overwrite", "quiet", "resume")})
    values = cfg.to_dict()
    values["cache_dir"] = str(cfg.cache_path.resolve())
    for name in ("dataset", "tokenizer", "init_from"):
        if values[name] and Path(values[name]).exists():
            values[name] = str(Path(values[name]).resolve())
    argv = ["--framework", cfg.framework, "--nproc", str(cfg.nproc), "--out", str(Path(cfg.out).resolve())]
    for name, value in values.items():
        if name in ("framework", "nproc", "out", "model") or value == defaults[name]:
            continue
        flag, kind = by_field.get(name, (None, str))
        if flag and kind is None:  # an on/off switch, on
            argv.append(flag)
        elif isinstance(value, bool):
            argv += ["--set", f"{name}={str(value).lower()}"]
        elif flag:
            argv += [flag, str(value)]
        else:
            argv += ["--set", f"{name}={value}"]
    for name, value in cfg.model.items():
        argv += ["--set", f"model.{name}={value}"]
    return argv


def sbatch_script(cfg: RunConfig, options: SubmitOptions) -> str:
    """The job that runs `cfg`: one task per rank, its output beside the run, dpcompare as the job's process."""
    run_dir = Path(cfg.out).resolve()
    header = [f"--job-name=dpcompare-{run_dir.name}", f"--ntasks={cfg.nproc}", f"--output={run_dir}/slurm-%j.out",
              f"--chdir={options.cwd.resolve()}"]
    if options.nodes:
        header.append(f"--nodes={min(options.nodes, cfg.nproc)}")
    header += [f"--{name}={value}" for name, value in (("partition", options.partition), ("time", options.time),
                                                        ("account", options.account)) if value]
    command = [sys.executable, "-m", "compare.cli", "run", *run_flags(cfg)]
    return "\n".join([
        "#!/bin/bash",
        *(f"#SBATCH {line}" for line in header),
        f"# Written by `dpcompare compare --submit slurm`: the run {run_dir.name} of the comparison in {run_dir.parent}.",
        f"# `sbatch {run_dir / SCRIPT}` submits it again (add --overwrite below to replace a finished run).",
        "# dpcompare starts the ranks as one srun step of this allocation (docs/clusters.md). exec makes it the",
        "# job's own process: scancel's SIGTERM reaches it, and it stops the ranks and writes summary.json.",
        f"export PYTHONPATH={shlex.quote(str(PROJECT_ROOT))}${{PYTHONPATH:+:$PYTHONPATH}}",
        "exec " + wrapped(command), ""])


def wrapped(argv: list[str], width: int = 100) -> str:
    """A shell command, one `--flag value` pair after another, broken into lines of about `width`."""
    words, i = [], 0
    while i < len(argv):
        pair = argv[i:i + 2] if argv[i].startswith("--") and i + 1 < len(argv) and \
            not argv[i + 1].startswith("--") else argv[i:i + 1]
        words.append(shlex.join(pair))
        i += len(pair)
    lines, line = [], ""
    for word in words:
        if line and len(line) + len(word) + 1 > width:
            lines.append(line)
            line = "  " + word
        else:
            line = f"{line} {word}" if line else word
    return " \\\n".join(lines + [line])


@dataclass
class Submitted:
    label: str
    cfg: RunConfig
    job_id: str
    submitted_at: float
    state: str = "submitted"
    bar: object = None

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.out)


def print_scripts(configs: dict, options: SubmitOptions) -> int:
    for (label, run_dir), cfg in configs.items():
        print(f"# ---- {label}: {Path(run_dir).resolve() / SCRIPT}")
        print(sbatch_script(cfg, options))
    return 0


def submit_runs(configs: dict, options: SubmitOptions) -> tuple[list[Path], list[tuple[str, str]]]:
    """Submit every run, follow the jobs to their end: (run directories, [(label, error)] of failed runs).
    A stop signal cancels the jobs, waits for them, and is raised again with `run_dirs` (those that ended)."""
    jobs: list[Submitted] = []
    try:
        for (label, run_dir), cfg in configs.items():
            script = Path(run_dir).resolve() / SCRIPT
            script.parent.mkdir(parents=True, exist_ok=True)
            script.write_text(sbatch_script(cfg, options))
            job_id = sbatch(script)
            jobs.append(Submitted(label, cfg, job_id, time.time()))
            print(f"== {label}: job {job_id} submitted ({script})", file=sys.stderr, flush=True)
        follow(jobs)
    except (KeyboardInterrupt, UserError) as stop:
        cancel([job for job in jobs if job.state != "finished"])
        stop.run_dirs = [job.run_dir for job in jobs if finished_summary(job)]
        raise
    failed = []
    for job in jobs:
        summary = finished_summary(job)
        if summary is None:
            failed.append((job.label, f"job {job.job_id} ended ({final_state(job.job_id)}) without writing "
                                      f"summary.json; see {job.run_dir.resolve()}/slurm-{job.job_id}.out"))
        elif summary.get("status") != "ok":
            failed.append((job.label, summary.get("error")))
    return [job.run_dir for job in jobs], failed


def sbatch(script: Path) -> str:
    proc = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True,
                          timeout=SLURM_TIMEOUT_S)
    if proc.returncode != 0:
        message = " ".join(proc.stderr.split()) or f"exit code {proc.returncode}"
        raise UserError(f"sbatch {script} failed: {message}")
    return proc.stdout.strip().split(";")[0]


def queue_states(job_ids: list[str]) -> dict[str, str] | None:
    """{job id: state (and the reason a queued job waits)} of the jobs still in the queue; None when squeue
    did not answer (the controller is busy or restarting: ask again)."""
    try:
        proc = subprocess.run(["squeue", "-h", "-j", ",".join(job_ids), "-o", "%i %T %r"], capture_output=True,
                              text=True, timeout=SLURM_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None
    if proc.returncode != 0:
        return {} if "Invalid job id" in proc.stderr else None  # every one of them has left the queue
    states = {}
    for line in proc.stdout.splitlines():
        job_id, state, reason = (line.split(None, 2) + ["", ""])[:3]
        states[job_id] = state if state != "PENDING" or reason in ("", "None") else f"{state} {reason}"
    return states


def follow(jobs: list[Submitted]) -> None:
    """Print each job's state as it changes and a progress bar per running job, until every job has ended."""
    while any(job.state != "finished" for job in jobs):
        states = queue_states([job.job_id for job in jobs if job.state != "finished"])
        for job in (j for j in jobs if j.state != "finished" and states is not None):
            state = states.get(job.job_id)
            word = "finished" if state is None else STATE_WORDS.get(state.split()[0], state.split()[0].lower())
            if state and state.startswith("PENDING "):
                word += f" ({state.split(None, 1)[1]})"
            if word != job.state:
                job.state = word
                print(f"== {job.label}: job {job.job_id} {word}", file=sys.stderr, flush=True)
            if word == "running":
                show_step(job)
            elif job.bar is not None and word == "finished":
                job.bar.close()
        if any(job.state != "finished" for job in jobs):
            time.sleep(POLL_S)


def show_step(job: Submitted) -> None:
    """The run's progress as a local run shows it: its rank 0's step and loss (compare/launch/watchdog.py)."""
    if job.bar is None:
        job.bar = progress_bar(job.cfg)
        if job.bar is None:
            return
        job.bar.set_description(job.label, refresh=False)
    status = read_json(job.run_dir / "ranks" / "rank0.json") or {}
    job.bar.n = status.get("step", 0)
    if "loss" in status:
        job.bar.set_postfix(loss=f"{status['loss']:.4f}", refresh=False)
    job.bar.refresh()


def finished_summary(job: Submitted) -> dict | None:
    """The summary.json this job wrote (an older one, from before it was submitted, does not count)."""
    path = job.run_dir / "summary.json"
    try:
        fresh = path.stat().st_mtime >= job.submitted_at - 1  # a second of slack for coarse file clocks
    except OSError:
        return None
    return read_json(path) if fresh else None


def cancel(jobs: list[Submitted]) -> None:
    """scancel the jobs, then wait for them to leave the queue: each one's dpcompare stops its ranks and writes
    summary.json ("interrupted") on the SIGTERM scancel sends."""
    if not jobs:
        return
    ids = [job.job_id for job in jobs]
    print(f"dpcompare: cancelling job{'s' * (len(ids) > 1)} {', '.join(ids)}", file=sys.stderr, flush=True)
    subprocess.run(["scancel", *ids], capture_output=True, timeout=SLURM_TIMEOUT_S)
    deadline = time.time() + CANCEL_WAIT_S
    while time.time() < deadline:
        states = queue_states(ids)
        if states == {}:
            break
        time.sleep(POLL_S)
    for job in jobs:
        if job.bar is not None:
            job.bar.close()
        job.state = "finished"


def final_state(job_id: str) -> str:
    """How a job ended (COMPLETED, FAILED, CANCELLED, TIMEOUT, ...), while the controller still remembers it."""
    try:
        proc = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True,
                              timeout=SLURM_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return "state unknown"
    fields = dict(item.split("=", 1) for item in proc.stdout.split() if "=" in item)
    return " ".join(filter(None, [fields.get("JobState"), f"exit code {fields['ExitCode']}"
                                  if "ExitCode" in fields else ""])) or "state unknown"
