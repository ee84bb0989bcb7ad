"""Slurm: a run's ranks as one `srun` job step inside an allocation (salloc, or an sbatch script).

Inside an allocation (SLURM_JOB_ID set) `--launcher auto` starts the ranks with srun on the allocation's
nodes, `--launcher slurm` insists on it and `--launcher local` uses this machine's launchers as elsewhere.
Every task runs compare.launch.slurm_rank, which turns Slurm's task variables into those the framework
reads (what torchrun or mlx.launch would have set) and execs the rank:
- torch: RANK, WORLD_SIZE and LOCAL_RANK from SLURM_PROCID, SLURM_NTASKS and SLURM_LOCALID; the TCP store on
  the first rank's host (the first host of the node list, expanded by `scontrol show hostnames`);
- MLX ring: an MLX_HOSTFILE with one address per rank, written from the node list;
- MLX MPI: srun --mpi=pmix (Open MPI reads its rank from PMIx; pmi2 where pmix is missing).
Ranks fill the nodes in order, as many per node as the allocation gives it (SLURM_TASKS_PER_NODE).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from common.config import RunConfig
from common.errors import UserError

from ..machine import environment as env
from .slurm_rank import RING_HOSTFILE_ENV, expand_counts

RING_HOSTFILE = "slurm_ring_hosts.json"  # in the run directory: the MLX ring's addresses, one per rank
RANK_HOSTFILE = "slurm_hosts.txt"        # SLURM_HOSTFILE: rank r's host on line r (ranks over several nodes)
SCONTROL_TIMEOUT_S = 30


@dataclass(frozen=True)
class Allocation:
    """The Slurm job this process runs in: its id, its nodes in order and how many tasks each may run."""
    job_id: str
    nodes: tuple[str, ...]
    tasks_per_node: tuple[int, ...]

    @property
    def tasks(self) -> int:
        return sum(self.tasks_per_node)


def in_allocation(environ=None) -> bool:
    return bool((os.environ if environ is None else environ).get("SLURM_JOB_ID"))


def uses_slurm(cfg: RunConfig) -> bool:
    """Whether this run's ranks are a Slurm job step: --launcher slurm, or auto inside an allocation (but not
    with a hostfile, several nodes started by hand, or an emulated link: those name their own ranks)."""
    if cfg.launcher == "slurm":
        return True
    return cfg.launcher == "auto" and in_allocation() and not (cfg.hostfile or cfg.nnodes > 1 or cfg.link)


def hostnames(nodelist: str) -> list[str]:
    """The hosts of a Slurm node list ("node[01-03],gpu7"), in order, as `scontrol show hostnames` gives them."""
    if not re.search(r"[\[\],]", nodelist):
        return [nodelist]  # one plain host name: nothing to expand
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        raise UserError(f"the node list {nodelist!r} needs `scontrol show hostnames` to expand, and scontrol is "
                        "not on PATH")
    try:
        proc = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True, text=True,
                              timeout=SCONTROL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise UserError(f"scontrol show hostnames {nodelist} did not answer in {SCONTROL_TIMEOUT_S} s") from None
    hosts = proc.stdout.split()
    if proc.returncode != 0 or not hosts:
        raise UserError(f"scontrol show hostnames {nodelist} failed: {proc.stderr.strip() or 'no hosts'}")
    return hosts


def allocation(environ=None) -> Allocation:
    """The allocation described by the job's variables; a UserError when they are missing or inconsistent."""
    environ = os.environ if environ is None else environ
    job_id = environ.get("SLURM_JOB_ID")
    if not job_id:
        raise UserError("--launcher slurm runs inside a Slurm allocation (salloc, sbatch), and SLURM_JOB_ID is not "
                        "set; use `dpcompare compare --submit slurm`, or --launcher local")
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    counts_text = environ.get("SLURM_TASKS_PER_NODE") or environ.get("SLURM_JOB_CPUS_PER_NODE")
    if not nodelist or not counts_text:
        raise UserError(f"Slurm job {job_id}: SLURM_JOB_NODELIST or SLURM_TASKS_PER_NODE is not set")
    nodes = hostnames(nodelist)
    try:
        counts = expand_counts(counts_text)
    except ValueError as err:
        raise UserError(f"Slurm job {job_id}: {err}") from None
    if len(counts) != len(nodes):
        raise UserError(f"Slurm job {job_id}: {len(nodes)} nodes ({nodelist}) but tasks for {len(counts)} "
                        f"({counts_text})")
    return Allocation(job_id, tuple(nodes), tuple(counts))


def check(cfg: RunConfig) -> None:
    """What a run through srun needs, refused before anything is prepared: an allocation, srun, and as many
    tasks as ranks."""
    if not uses_slurm(cfg):
        return
    alloc = allocation()
    if shutil.which("srun") is None:
        raise UserError(f"Slurm job {alloc.job_id}: srun is not on PATH (it starts the ranks); use --launcher local "
                        "to start them on this host")
    if cfg.nproc > alloc.tasks:
        raise UserError(f"Slurm job {alloc.job_id} has {alloc.tasks} task{'s' * (alloc.tasks != 1)} "
                        f"({', '.join(alloc.nodes)}) and --nproc is {cfg.nproc}: allocate at least {cfg.nproc} "
                        f"(salloc -n {cfg.nproc}, #SBATCH --ntasks={cfg.nproc}) or pass a smaller --nproc")


def sized_to_allocation(cfg: RunConfig, nproc_given: bool) -> RunConfig:
    """`dpcompare run` through srun without --nproc: one rank per task of the job."""
    if nproc_given or not uses_slurm(cfg):
        return cfg
    return cfg.replace(nproc=allocation().tasks)


def rank_hosts(alloc: Allocation, nproc: int) -> list[str]:
    """Rank r's host: the nodes filled in order, each with as many ranks as it has tasks."""
    hosts = [node for node, count in zip(alloc.nodes, alloc.tasks_per_node) for _ in range(count)]
    return hosts[:nproc]


def mpi_plugin() -> str:
    """srun's PMI for MPI ranks: pmix where srun offers it (Open MPI 4 and 5 read it), else pmi2."""
    try:
        listing = subprocess.run(["srun", "--mpi=list"], capture_output=True, text=True, timeout=SCONTROL_TIMEOUT_S)
        offered = (listing.stdout + listing.stderr).split()
    except (OSError, subprocess.TimeoutExpired):
        offered = []
    return "pmix" if "pmix" in offered else "pmi2"


def is_this_host(node: str) -> bool:
    name = socket.gethostname()
    return node in (name, name.split(".")[0])


def address_of(host: str, single_host: bool) -> str:
    """The address ranks reach `host` at: loopback when every rank runs on this host (its name need not
    resolve, or may resolve to a loopback alias such as Debian's 127.0.1.1), else an IPv4 address of the name,
    or the name where it resolves to none from here (the MLX ring connects to addresses)."""
    if single_host and is_this_host(host):
        return "127.0.0.1"
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host


def srun_job(job) -> list[str]:
    """The launcher (compare/launch/launchers.py): every rank of `job` as one srun step. `job` is a Job."""
    cfg = job.cfg
    check(cfg)
    alloc = allocation()
    hosts = rank_hosts(alloc, cfg.nproc)
    nodes = list(dict.fromkeys(hosts))
    argv = [shutil.which("srun"), f"--ntasks={cfg.nproc}", f"--nodes={len(nodes)}", "--kill-on-bad-exit=1",
            "--label", f"--job-name=dpcompare-{cfg.framework}-x{cfg.nproc}"]
    run_dir = job.run_dir.resolve()
    if len(nodes) > 1:  # rank r on line r's host, the layout the MLX ring's hostfile and the store assume
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / RANK_HOSTFILE).write_text("".join(f"{host}\n" for host in hosts))
        job.env["SLURM_HOSTFILE"] = str(run_dir / RANK_HOSTFILE)
        argv.append("--distribution=arbitrary")
    else:
        argv.append(f"--nodelist={nodes[0]}")
    if cfg.world_size > 1 and job.backend == "mpi":
        argv.append(f"--mpi={mpi_plugin()}")
        lib = env.libmpi()
        if lib:
            job.env["MLX_MPI_LIBNAME"] = Path(lib).name if lib.startswith("/usr/lib") else lib
    elif cfg.world_size > 1 and cfg.framework == "mlx":
        # Written now, not by the ranks: every rank must read the same ports. Ports free here are a guess
        # for other nodes; a port that is taken there fails the job at start.
        base = env.free_port_block(cfg.nproc)
        run_dir.mkdir(parents=True, exist_ok=True)
        ring = [[f"{address_of(host, len(nodes) == 1)}:{base + rank}"] for rank, host in enumerate(hosts)]
        (run_dir / RING_HOSTFILE).write_text(json.dumps(ring))
        job.env[RING_HOSTFILE_ENV] = str(run_dir / RING_HOSTFILE)
    elif cfg.world_size > 1:  # torch: env:// rendezvous, the store on rank 0's host
        master = address_of(hosts[0], True) if len(nodes) == 1 else hosts[0]  # each node resolves the name
        job.env.update(MASTER_ADDR=master, MASTER_PORT=str(env.free_port_block(1)))
    return argv + [sys.executable, "-m", "compare.launch.slurm_rank", *job.rank_argv]


def this_host_only(cfg: RunConfig) -> bool:
    """False when the ranks run through srun on some other host: their pids mean nothing here (watchdog)."""
    if not uses_slurm(cfg):
        return True
    try:
        nodes = allocation().nodes
    except UserError:
        return True
    return all(is_this_host(node) for node in nodes)


def allocation_revoked(cfg: RunConfig) -> bool:
    """Whether the allocation this run's ranks ran in has ended (scancel, its time limit): their deaths then
    are a stop, not a failure. salloc does not signal its command when its job is cancelled."""
    if not uses_slurm(cfg) or not in_allocation():
        return False
    job_id = os.environ["SLURM_JOB_ID"]
    try:
        proc = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True,
                              timeout=SCONTROL_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return False
    if proc.returncode != 0 and "Invalid job id" not in proc.stderr:
        return False  # the controller did not answer: no claim either way
    return proc.stdout.strip() != "RUNNING"
