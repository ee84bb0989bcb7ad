"""The command lines that start a run's ranks: one function per launcher, and a table that picks one.

One rank runs as plain python (`mlx.launch -n 1` crashes). MLX ring on one machine goes through
`compare.launch.spawn` (what `mlx.launch -n N` does, without its busy output relay), across hosts through
`mlx.launch --hostfile` (ssh), as are jaccl and jaccl-ring (Thunderbolt RDMA between Macs) and MLX's
nccl (CUDA); MLX MPI through `mpirun` directly (mlx.launch's MPI mode passes `--output :raw`, which Open MPI 4 rejects),
torch on one machine through `compare.launch.spawn` too (torchrun's agent costs seconds of start-up), across
hosts through `torchrun`. Several nodes (`--nnodes N --node-rank R`, one `dpcompare run` per node):
torch uses torchrun's static rendezvous, so ranks follow --node-rank; an MLX ring node starts its rank
directly with MLX_RANK and MLX_HOSTFILE exactly as `mlx.launch` sets them, so no ssh is needed.
Inside a Slurm allocation every rank is a task of one `srun` step, whatever the framework (slurm.py).
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from common.config import RunConfig
from common.errors import UserError
from common.kernels import PIN_ENV
from common.peers import PEERS
from common.model.spec import ModelSpec

from ..machine import environment as env
from ..machine.kernels import kernels_line
from .hosts import RING_HOSTFILE, effective_backend, interface_toward
from .netns import EmulatedLink
from .slurm import srun_job, uses_slurm


@dataclass
class Job:
    """What a launcher starts: `python -m MODULE ARGS` once per rank, with `env` added to every rank's
    environment (a launcher may add to it)."""
    cfg: RunConfig
    run_dir: Path
    backend: str
    module: str
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    link: EmulatedLink | None = None  # --link: ranks in shaped network namespaces (netns.py)

    @property
    def rank_argv(self) -> list[str]:
        return [sys.executable, "-m", self.module, *self.args]

    def spawner(self, *how: str) -> list[str]:
        """compare.launch.spawn starting this machine's ranks of the job."""
        netns = self.link.spawn_args() if self.link else []
        # --max-restarts: dpcompare's watchdog stops the job itself, once a survivor saved its last step.
        keep = ["--keep-survivors"] if self.cfg.max_restarts else []
        keep += ["--rank-speed", self.cfg.rank_speed] if self.cfg.rank_speed and self.cfg.nproc > 1 else []  # SIGSTOP/SIGCONT duty cycle
        return [sys.executable, "-m", "compare.launch.spawn", "--ranks", str(self.cfg.nproc), *how, *netns, *keep, "--",
                *self.rank_argv]


def plain_python(job: Job) -> list[str]:
    return job.rank_argv


def mlx_ring_node(job: Job) -> list[str]:
    # This node's rank of a ring job, as mlx.launch would start it on this host, minus the ssh.
    job.env.update(MLX_RANK=str(job.cfg.node_rank), MLX_HOSTFILE=str(job.run_dir.resolve() / RING_HOSTFILE))
    return job.rank_argv


def torch_spawner(job: Job) -> list[str]:
    # Our own spawner, as for the MLX ring: torchrun's agent adds seconds of start-up. On Linux with gloo the
    # training ranks are forked from one process that imported torch (common/train/forkranks.py): 2.1 CPU-s per
    # rank. Only torch_impl.launch forks; another module (doctor's probe) would start as one rank, not N.
    fork = ["--fork"] if sys.platform == "linux" and job.backend == "gloo" and job.module == "torch_impl.launch" \
        else []
    return job.spawner("--torch", *fork)


def torchrun_nodes(job: Job) -> list[str]:
    # static: ranks follow --node-rank (c10d ignores it and numbers nodes by arrival), node 0
    # hosts the store at the endpoint. max-restarts 0: a failed node ends the job.
    cfg = job.cfg
    launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={cfg.nproc}",
                f"--nnodes={cfg.nnodes}", f"--node-rank={cfg.node_rank}",
                f"--rdzv-endpoint={cfg.rdzv_endpoint}", "--rdzv-backend=static", "--max-restarts=0"]
    host = cfg.rdzv_endpoint.rpartition(":")[0].strip("[]") or cfg.rdzv_endpoint
    if job.backend == "gloo" and not os.environ.get("GLOO_SOCKET_IFNAME"):
        interface = interface_toward(host)
        if interface:
            job.env["GLOO_SOCKET_IFNAME"] = interface
    return launcher + ["-m", job.module, *job.args]


def mlx_mpirun(job: Job) -> list[str]:
    exe = env.mpirun()
    if exe is None:
        raise UserError("--backend mpi: mpirun not found (Debian: apt install openmpi-bin libopenmpi-dev)")
    lib = env.libmpi()
    if lib:
        job.env["MLX_MPI_LIBNAME"] = Path(lib).name if lib.startswith("/usr/lib") else lib
    # Open MPI takes an mpirun started by its absolute path as `--prefix` its folder's parent, and puts that bin/
    # first on the ranks' PATH (/usr/bin), ahead of the -march=native g++ MLX's kernels are to be built with
    # (environment.mlx_cpu_jit): measured, 0 of 36 kernels of an MPI job had AVX. On this machine alone the
    # prefix finds nothing the PATH does not, so a local job starts it by name, which resolves to the same file.
    argv = [exe if job.cfg.hostfile else "mpirun", "-np", str(job.cfg.nproc)]
    rank_argv = job.rank_argv
    if job.link:
        argv, rank_argv = mpirun_over_link(job.link, argv, rank_argv, job.env)
    if job.cfg.hostfile:
        argv += ["--hostfile", job.cfg.hostfile]
    if env.mpirun_is_openmpi():
        if os.geteuid() == 0:
            argv += ["--allow-run-as-root"]
        argv += ["--oversubscribe"]
        for key in list(job.env) + ["PYTHONPATH", "DPCOMPARE_LAUNCH_TIME", "PYTHONUNBUFFERED",
                                    "DPCOMPARE_SUPERVISOR"]:
            argv += ["-x", key]
    return argv + rank_argv


def mpirun_over_link(link: EmulatedLink, argv: list[str], rank_argv: list[str], env: dict) -> tuple[list, list]:
    """mpirun in rank 0's namespace, each rank entering its own by its MPI rank, talking TCP over the shaped
    subnet (not shared memory). A rank reaches mpirun's PMIx server over loopback otherwise, which another
    namespace does not share: the server takes connections on the subnet (init and finalize only)."""
    subnet = link.addresses[0].rsplit(".", 1)[0] + ".0/24"
    env.update(PMIX_MCA_ptl_tcp_remote_connections="1", PMIX_MCA_ptl_tcp_if_include=subnet,
               OMPI_MCA_oob_tcp_if_include=subnet)
    argv = ["ip", "netns", "exec", link.namespaces[0], *argv, "--mca", "btl", "self,tcp",
            "--mca", "btl_tcp_if_include", subnet]
    enter = f'exec ip netns exec "{link.tag}r$OMPI_COMM_WORLD_RANK" "$@"'
    return argv, ["sh", "-c", enter, "rank", *rank_argv]


def mlx_ring_spawner(job: Job) -> list[str]:
    # One machine: our own spawner, since mlx.launch's output relay keeps a core busy.
    return job.spawner("--ring-hostfile", str(job.run_dir.resolve() / RING_HOSTFILE))


def mlx_launch(job: Job) -> list[str]:
    """mlx.launch: ring across hosts (ssh), jaccl and jaccl-ring (Thunderbolt RDMA, always a hostfile), and
    nccl, where it sets NCCL_HOST_IP, NCCL_PORT, MLX_WORLD_SIZE and one CUDA_VISIBLE_DEVICES per rank."""
    cfg, backend = job.cfg, job.backend
    launcher = env.mlx_launch_command() + ["--backend", backend]
    if cfg.hostfile:
        # Ranks on other hosts get only what mlx.launch exports: the hostfile's "envs" and these.
        launcher += ["--hostfile", cfg.hostfile] + [f"--env={k}={v}" for k, v in job.env.items()]
    else:
        launcher += ["-n", str(cfg.nproc)]
    if backend == "ring":
        launcher += ["--starting-port", str(env.free_port_block(cfg.nproc + 1))]
    if backend == "nccl":
        launcher += ["--nccl-port", str(env.free_port_block(1))]
    return launcher + ["--"] + job.rank_argv


# (when it applies, given the config and the effective backend; the launcher): the first row that applies
# starts the job, so the order matters (a torch job across nodes is torchrun whatever its backend).
LAUNCHERS: tuple[tuple[Callable[[RunConfig, str], bool], Callable[[Job], list[str]]], ...] = (
    (lambda cfg, backend: uses_slurm(cfg), srun_job),  # inside a Slurm allocation: one srun step (slurm.py)
    (lambda cfg, backend: cfg.nproc == 1 and not cfg.hostfile and cfg.nnodes == 1, plain_python),
    (lambda cfg, backend: cfg.framework == "mlx" and cfg.nnodes > 1, mlx_ring_node),
    (lambda cfg, backend: cfg.framework == "torch" and cfg.nnodes == 1, torch_spawner),
    (lambda cfg, backend: cfg.framework == "torch", torchrun_nodes),
    (lambda cfg, backend: backend == "mpi", mlx_mpirun),
    (lambda cfg, backend: backend == "ring" and not cfg.hostfile, mlx_ring_spawner),
    (lambda cfg, backend: True, mlx_launch),
)


def launcher_for(cfg: RunConfig, backend: str) -> Callable[[Job], list[str]]:
    return next(start for applies, start in LAUNCHERS if applies(cfg, backend))


def rank_environment(cfg: RunConfig, spec: ModelSpec | None = None) -> tuple[dict[str, str], str]:
    """(environment every rank gets, BLAS description): threads, allocator, BLAS and MLX's CPU kernels."""
    extra = env.thread_env(cfg.threads_per_rank)
    if cfg.tune_malloc:
        extra.update(env.malloc_env())
    if cfg.trace and cfg.framework == "mlx":  # Metal allows a capture only when set at start (mlx_impl/trace.py)
        extra["MTL_CAPTURE_ENABLED"] = "1"
    blas = "framework default"
    if cfg.framework == "mlx":
        blas, blas_env = env.mlx_blas(cfg.mlx_blas, cfg.cache_path)
        extra.update(blas_env)
        if not cfg.hostfile:  # the wrapper compiler and kernel cache exist on this host only
            jit, jit_env = env.mlx_cpu_jit(cfg.mlx_cpu_jit, cfg.cache_path)
            blas += f"; fused CPU kernels: {jit}"
            extra.update(jit_env)
        blas += f"; {kernels_line(cfg, spec)}"  # auto's timed choices (compare/machine/kernels.py)
    if os.environ.get(PIN_ENV):  # MLX's pinned kernels, to other hosts' ranks too (torch's ignore it)
        extra[PIN_ENV] = os.environ[PIN_ENV]
    return extra, blas


def build_command(cfg: RunConfig, run_dir: Path, module: str = "launch", args: list[str] | None = None,
                  link: EmulatedLink | None = None, spec: ModelSpec | None = None) -> tuple[list[str], dict, str]:
    """(argv, extra environment, BLAS description) that start every rank of this run.

    Every rank runs `python -m {framework}_impl.{module} ARGS` (default: the training entry with the run
    directory; `doctor --fabric` starts `fabric` the same way)."""
    extra, blas = rank_environment(cfg, spec)  # spec: the run's model (its vocabulary), where known
    # a peer's trainer (common/peers.py) is started as its framework's ranks are, as one more module
    rank_module = PEERS[cfg.peer].module if cfg.peer and module == "launch" else f"{cfg.framework}_impl.{module}"
    job = Job(cfg, Path(run_dir), effective_backend(cfg), rank_module,
              [str(run_dir)] if args is None else list(args), extra, link)
    argv = launcher_for(cfg, job.backend)(job)
    if cfg.rank_speed and cfg.world_size > 1 and "compare.launch.spawn" not in argv:  # only our spawner holds every rank's pid
        raise UserError(f"--rank-speed emulates slow ranks on one machine, from the ranks dpcompare starts itself "
                        f"(ring, torch); not through {argv[0]} ({cfg.framework} on {job.backend})")
    return argv, job.env, blas


def device_note(cfg: RunConfig) -> str | None:
    """A line for summary.json and the report when a run does not run where it was asked to."""
    if cfg.framework == "torch" and cfg.device == "mps" and cfg.world_size > 1:
        return (f"torch x{cfg.world_size} ran on the CPU with gloo: DDP cannot all-reduce MPS tensors, so "
                "--device mps applies to one rank only")
    return None
