"""The command lines that start a run's ranks, one launcher per framework and backend.

One rank runs as plain python (`mlx.launch -n 1` crashes). MLX ring on one machine goes through
`compare.launch.spawn` (what `mlx.launch -n N` does, without its busy output relay), across hosts through
`mlx.launch --hostfile` (ssh), as are jaccl and jaccl-ring (Thunderbolt RDMA between Macs) and MLX's
nccl (CUDA); MLX MPI through `mpirun` directly (mlx.launch's MPI mode passes `--output :raw`, which Open MPI 4 rejects),
torch on one machine through `compare.launch.spawn` too (torchrun's agent costs seconds of start-up), across
hosts through `torchrun`. Several nodes (`--nnodes N --node-rank R`, one `dpcompare run` per node):
torch uses torchrun's static rendezvous, so ranks follow --node-rank; an MLX ring node starts its rank
directly with MLX_RANK and MLX_HOSTFILE exactly as `mlx.launch` sets them, so no ssh is needed.
"""
from __future__ import annotations

import functools
import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from common.config import BACKENDS, RunConfig
from common.errors import UserError

from ..machine import environment as env

RING_HOSTFILE = "ring_hosts.json"  # MLX_HOSTFILE of a node-rank MLX ring job, written into the run dir
RING_STARTING_PORT = 32323  # mlx.launch's default --starting-port, for hostfiles that give IPs only


@dataclass
class MlxHostfile:
    """An mlx.launch hostfile, in either form mlx.launch and `mlx.distributed_config` write: the list of
    hosts (`[{"ssh": "mac1", "ips": ["10.0.0.1"], "rdma": [null, "rdma_en3"]}, ...]`) or the object
    `{"backend": "jaccl", "envs": ["MLX_METAL_FAST_SYNCH=1"], "hosts": [...]}`."""
    hosts: list[dict]
    backend: str = ""
    envs: list[str] = field(default_factory=list)


def read_mlx_hostfile(path: str | Path) -> MlxHostfile:
    """Parse the JSON hostfile; a ValueError names what is wrong (callers add the path)."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as err:
        raise ValueError(err.strerror or str(err)) from None
    except json.JSONDecodeError as err:
        raise ValueError(f"not JSON ({err})") from None
    backend, envs = "", []
    if isinstance(data, dict):
        unknown = set(data) - {"backend", "envs", "hosts"}
        if unknown or "hosts" not in data:
            raise ValueError("expected {\"backend\": ..., \"envs\": [...], \"hosts\": [...]}"
                             + (f" (unknown keys: {', '.join(sorted(unknown))})" if unknown else ""))
        backend, envs, data = data.get("backend") or "", data.get("envs") or [], data["hosts"]
        if not isinstance(envs, list) or not all(isinstance(e, str) and "=" in e for e in envs):
            raise ValueError("\"envs\" must be a list of \"NAME=VALUE\" strings")
    if not isinstance(data, list) or not data or not all(isinstance(h, dict) and isinstance(h.get("ssh"), str)
                                                         and h["ssh"] for h in data):
        raise ValueError("expected a list of {\"ssh\": HOST, \"ips\": [...]} objects, one per rank")
    for host in data:
        ips = host.setdefault("ips", [])
        if not isinstance(ips, list) or not all(isinstance(ip, str) and ip for ip in ips):
            raise ValueError(f"host {host['ssh']}: \"ips\" must be a list of IP strings")
        host.setdefault("rdma", [])
    return MlxHostfile(hosts=data, backend=backend, envs=envs)


def effective_backend(cfg: RunConfig) -> str:
    """--backend, else the backend an MLX JSON hostfile names (as mlx.launch does), else the default."""
    if cfg.backend == "auto" and cfg.framework == "mlx" and cfg.hostfile and cfg.nnodes == 1:
        try:
            named = read_mlx_hostfile(cfg.hostfile).backend
        except ValueError:
            named = ""  # not an MLX JSON hostfile (an MPI one, or broken: check_hostfile says which)
        if named:
            return named
    return cfg.resolved_backend


def with_hostfile_backend(cfg: RunConfig) -> RunConfig:
    backend = effective_backend(cfg)
    if backend == cfg.resolved_backend:
        return cfg
    if backend not in BACKENDS["mlx"] or backend == "mpi":
        raise UserError(f"hostfile {cfg.hostfile} names backend {backend!r}; dpcompare starts ring, nccl, jaccl "
                        "and jaccl-ring jobs from an MLX hostfile (MPI: --backend mpi with a text hostfile)")
    return cfg.replace(backend=backend)


def check_hostfile(cfg: RunConfig) -> None:
    if not cfg.hostfile:
        return
    path = Path(cfg.hostfile)
    if not path.is_file():
        raise UserError(f"hostfile {path} not found")
    backend = effective_backend(cfg)
    if cfg.framework == "mlx" and cfg.nnodes > 1:
        ring_hosts(cfg)
    elif cfg.framework == "mlx" and backend != "mpi":
        try:
            hostfile = read_mlx_hostfile(path)
            check_hosts_for(backend, hostfile.hosts)
        except ValueError as err:
            raise UserError(f"hostfile {path} does not parse as an MLX JSON hostfile for {backend}: {err}") from None
        if len(hostfile.hosts) != cfg.nproc:
            raise UserError(f"hostfile {path} lists {len(hostfile.hosts)} hosts but --nproc is {cfg.nproc}")


def check_hosts_for(backend: str, hosts: list[dict]) -> None:
    """What mlx.launch needs of the hosts for `backend`, checked before anything starts."""
    if backend == "ring":
        missing = [h["ssh"] for h in hosts if not h["ips"]]
        if missing:
            raise ValueError(f"the ring connects to IPs: give {', '.join(missing)} \"ips\"")
    elif not hosts[0]["ips"]:
        raise ValueError(f"rank 0 ({hosts[0]['ssh']}) needs \"ips\": the other ranks connect to it")
    if backend in ("jaccl", "jaccl-ring"):
        n = len(hosts)
        for i, host in enumerate(hosts):
            rdma = host["rdma"]
            if not isinstance(rdma, list) or len(rdma) != n or rdma[i] is not None:
                raise ValueError(f"host {host['ssh']}: \"rdma\" must list one RDMA device per host, null for "
                                 "itself (mlx.distributed_config --backend jaccl writes it)")
            peers = {(i - 1) % n, (i + 1) % n} if backend == "jaccl-ring" else set(range(n))
            missing = [hosts[j]["ssh"] for j in sorted(peers - {i}) if rdma[j] is None]
            if missing:
                raise ValueError(f"host {host['ssh']} lists no RDMA device toward {', '.join(missing)}")


def ring_hosts(cfg: RunConfig) -> list[list[str]]:
    """The MLX_HOSTFILE of a node-rank MLX ring job: one list of "ip:port" per rank, as mlx.launch writes it.

    --hostfile holds either that list itself (`[["10.0.0.1:5000"], ["10.0.0.2:5000"]]`, ports of your
    choice) or mlx.launch's hostfile (either form, see MlxHostfile), whose ports are assigned the way
    mlx.launch does: 32323 upwards, one per rank and IP.
    """
    path = Path(cfg.hostfile)
    try:
        hosts = json.loads(path.read_text())
        if isinstance(hosts, dict) or (isinstance(hosts, list) and hosts and all(isinstance(h, dict) for h in hosts)):
            port, ring = RING_STARTING_PORT, []
            for h in read_mlx_hostfile(path).hosts:
                if not h["ips"]:
                    raise ValueError(f"entry {h} needs \"ips\": [\"IP\", ...] (the ring backend connects to IPs)")
                ring.append([f"{ip}:{port + i}" for i, ip in enumerate(h["ips"])])
                port += len(h["ips"])
        elif isinstance(hosts, list) and hosts and all(isinstance(h, list) and h for h in hosts):
            ring = hosts
            for address in (a for h in hosts for a in h):
                host, sep, port_text = str(address).rpartition(":")
                if not (sep and host and port_text.isdigit() and 0 < int(port_text) < 65536):
                    raise ValueError(f"{address!r} is not IP:PORT")
        else:
            raise ValueError("expected mlx.launch's [{\"ssh\": ..., \"ips\": [...]}, ...] or a ring list "
                             "[[\"IP:PORT\", ...], ...]")
    except (OSError, ValueError) as err:
        raise UserError(f"hostfile {path} does not parse as an MLX ring hostfile: {err}") from None
    if len(ring) != cfg.nnodes:
        raise UserError(f"hostfile {path} lists {len(ring)} nodes but --nnodes is {cfg.nnodes}")
    return ring


# Backends that only some builds have, and what it takes to get them; ring, gloo and (with mpirun) mpi
# are in every build dpcompare installs.
OPTIONAL_BACKENDS = {
    ("mlx", "jaccl"): "RDMA over Thunderbolt 5: macOS 26.2 or later, RDMA enabled in recoveryOS",
    ("mlx", "jaccl-ring"): "RDMA over Thunderbolt 5: macOS 26.2 or later, RDMA enabled in recoveryOS",
    ("mlx", "nccl"): "NVIDIA GPUs with mlx[cuda] installed",
    ("torch", "nccl"): "NVIDIA GPUs with torch's CUDA build",
}
# One expression per framework, backend or device to check, printed as 0 or 1 by a fresh interpreter.
PROBES = {
    ("mlx", "backend"): "mx.distributed.is_available({name!r})",
    ("mlx", "device"): "mx.is_available(mx.gpu)",
    ("torch", "nccl"): "dist.is_available() and dist.is_nccl_available() and torch.cuda.is_available()",
    ("torch", "cuda"): "torch.cuda.is_available()",
    ("torch", "mps"): "torch.backends.mps.is_available()",
}
PROBE_IMPORTS = {"mlx": "import mlx.core as mx", "torch": "import torch, torch.distributed as dist"}


def check_available(cfg: RunConfig) -> None:
    """Exit 2 before anything starts when this machine's framework build lacks the backend or the device."""
    backend, checks = effective_backend(cfg), []
    need = OPTIONAL_BACKENDS.get((cfg.framework, backend))
    if need is not None and cfg.world_size > 1:
        name = {"jaccl-ring": "jaccl"}.get(backend, backend)
        expr = PROBES[(cfg.framework, "backend" if cfg.framework == "mlx" else backend)].format(name=name)
        checks.append((expr, f"has no {backend} backend; it needs {need}"))
    if cfg.device in ("cuda", "mps", "gpu"):
        key = ("mlx", "device") if cfg.framework == "mlx" else ("torch", "mps" if cfg.device == "mps" else "cuda")
        checks.append((PROBES[key], f"sees no {cfg.device} device"))
    if not checks:
        return
    code = PROBE_IMPORTS[cfg.framework] + "; " + "; ".join(f"print(int(bool({expr})))" for expr, _ in checks)
    answers = probe_flags(code, len(checks))
    for (_, problem), ok in zip(checks, answers):
        if ok is False:
            version = env.version(cfg.framework) or "not installed"
            flag = f"--backend {backend}" if "backend" in problem else f"--device {cfg.device}"
            raise UserError(f"{flag}: {cfg.framework} {version} on this machine ({sys.platform}) {problem}")


@functools.lru_cache(maxsize=None)  # `run` checks before preparing the data and again before launching
def probe_flags(code: str, count: int, timeout_s: float = 60) -> list[bool | None]:
    """Run `code`, which prints `count` lines of 0 or 1, in a fresh interpreter; None where it cannot tell."""
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return [None] * count
    lines = out.stdout.strip().splitlines()[-count:]
    if out.returncode != 0 or len(lines) != count or any(line not in ("0", "1") for line in lines):
        return [False if "ModuleNotFoundError" in out.stderr else None] * count
    return [line == "1" for line in lines]


def device_note(cfg: RunConfig) -> str | None:
    """A line for summary.json and the report when a run does not run where it was asked to."""
    if cfg.framework == "torch" and cfg.device == "mps" and cfg.world_size > 1:
        return (f"torch x{cfg.world_size} ran on the CPU with gloo: DDP cannot all-reduce MPS tensors, so "
                "--device mps applies to one rank only")
    return None


def interface_toward(host: str) -> str | None:
    """The network interface this machine reaches `host` through (Linux, macOS), or None.

    gloo binds to the address the hostname resolves to, which is often 127.0.x.1 (Debian's /etc/hosts)
    or an interface the peers cannot reach; naming the interface toward the rendezvous host fixes that.
    """
    import fcntl
    import struct

    request = {"linux": 0x8915, "darwin": 0xC0206921}.get(sys.platform)  # SIOCGIFADDR
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((host, 9))  # UDP: no packet is sent, the kernel just picks the route
            address = sock.getsockname()[0]
            for _, name in socket.if_nameindex():
                try:
                    reply = fcntl.ioctl(sock.fileno(), request, struct.pack("256s", name.encode()[:15]))
                except OSError:
                    continue
                if socket.inet_ntoa(reply[20:24]) == address:
                    return name
    except (OSError, TypeError, ValueError):
        return None
    return None


def build_command(cfg: RunConfig, run_dir: Path, module: str = "launch",
                  args: list[str] | None = None) -> tuple[list[str], dict, str]:
    """(argv, extra environment, BLAS description) that start every rank of this run.

    Every rank runs `python -m {framework}_impl.{module} ARGS` (default: the training entry with the run
    directory; `doctor --fabric` starts `fabric` the same way)."""
    rank_args = [str(run_dir)] if args is None else list(args)
    entry = [sys.executable, "-m", f"{cfg.framework}_impl.{module}", *rank_args]
    extra = env.thread_env(cfg.threads_per_rank)
    if cfg.tune_malloc:
        extra.update(env.malloc_env())
    if cfg.trace and cfg.framework == "mlx":  # Metal allows a capture only when set at start (mlx_impl/trace.py)
        extra["MTL_CAPTURE_ENABLED"] = "1"
    blas = "framework default"
    if cfg.framework == "mlx":
        blas, blas_env = env.mlx_blas(cfg.mlx_blas)
        extra.update(blas_env)
        if not cfg.hostfile:  # the wrapper compiler and kernel cache exist on this host only
            jit, jit_env = env.mlx_cpu_jit(cfg.mlx_cpu_jit, cfg.cache_path)
            blas += f"; fused CPU kernels: {jit}"
            extra.update(jit_env)
    backend = effective_backend(cfg)
    if cfg.nproc == 1 and not cfg.hostfile and cfg.nnodes == 1:
        return entry, extra, blas
    if cfg.framework == "mlx" and cfg.nnodes > 1:
        # This node's rank of a ring job, as mlx.launch would start it on this host, minus the ssh.
        extra.update(MLX_RANK=str(cfg.node_rank), MLX_HOSTFILE=str(Path(run_dir).resolve() / RING_HOSTFILE))
        return entry, extra, blas
    spawner = [sys.executable, "-m", "compare.launch.spawn", "--ranks", str(cfg.nproc)]  # one machine's ranks
    if cfg.framework == "torch" and cfg.nnodes == 1:
        # Our own spawner, as for the MLX ring: torchrun's agent adds seconds of start-up.
        return spawner + ["--torch", "--"] + entry, extra, blas
    if cfg.framework == "torch":
        # static: ranks follow --node-rank (c10d ignores it and numbers nodes by arrival), node 0
        # hosts the store at the endpoint. max-restarts 0: a failed node ends the job.
        launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={cfg.nproc}",
                    f"--nnodes={cfg.nnodes}", f"--node-rank={cfg.node_rank}",
                    f"--rdzv-endpoint={cfg.rdzv_endpoint}", "--rdzv-backend=static", "--max-restarts=0"]
        host = cfg.rdzv_endpoint.rpartition(":")[0].strip("[]") or cfg.rdzv_endpoint
        if backend == "gloo" and not os.environ.get("GLOO_SOCKET_IFNAME"):
            interface = interface_toward(host)
            if interface:
                extra["GLOO_SOCKET_IFNAME"] = interface
        return launcher + ["-m", f"torch_impl.{module}", *rank_args], extra, blas
    if backend == "mpi":
        exe = env.mpirun()
        if exe is None:
            raise UserError("--backend mpi: mpirun not found (Debian: apt install openmpi-bin libopenmpi-dev)")
        lib = env.libmpi()
        if lib:
            extra["MLX_MPI_LIBNAME"] = Path(lib).name if lib.startswith("/usr/lib") else lib
        argv = [exe, "-np", str(cfg.nproc)]
        if cfg.hostfile:
            argv += ["--hostfile", cfg.hostfile]
        if env.mpirun_is_openmpi():
            if os.geteuid() == 0:
                argv += ["--allow-run-as-root"]
            argv += ["--oversubscribe"]
            for key in list(extra) + ["PYTHONPATH", "DPCOMPARE_LAUNCH_TIME", "PYTHONUNBUFFERED",
                                      "DPCOMPARE_SUPERVISOR"]:
                argv += ["-x", key]
        return argv + entry, extra, blas
    if backend == "ring" and not cfg.hostfile:
        # One machine: our own spawner, since mlx.launch's output relay keeps a core busy.
        return spawner + ["--ring-hostfile", str(Path(run_dir).resolve() / RING_HOSTFILE), "--"] + entry, \
            extra, blas
    # mlx.launch: ring across hosts (ssh), jaccl and jaccl-ring (Thunderbolt RDMA, always a hostfile), and
    # nccl, where it sets NCCL_HOST_IP, NCCL_PORT, MLX_WORLD_SIZE and one CUDA_VISIBLE_DEVICES per rank.
    launcher = env.mlx_launch_command() + ["--backend", backend]
    if cfg.hostfile:
        # Ranks on other hosts get only what mlx.launch exports: the hostfile's "envs" and these.
        launcher += ["--hostfile", cfg.hostfile] + [f"--env={k}={v}" for k, v in extra.items()]
    else:
        launcher += ["-n", str(cfg.nproc)]
    if backend == "ring":
        launcher += ["--starting-port", str(env.free_port_block(cfg.nproc + 1))]
    if backend == "nccl":
        launcher += ["--nccl-port", str(env.free_port_block(1))]
    return launcher + ["--"] + entry, extra, blas

