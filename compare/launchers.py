"""The command lines that start a run's ranks, one launcher per framework and backend.

One rank runs as plain python (`mlx.launch -n 1` crashes). MLX ring on one machine goes through
`compare.spawn` (what `mlx.launch -n N` does, without its busy output relay), across hosts through
`mlx.launch --hostfile` (ssh); MLX MPI through `mpirun` directly (mlx.launch's MPI mode passes `--output :raw`, which Open MPI 4 rejects),
torch through `torchrun`. Several nodes (`--nnodes N --node-rank R`, one `dpcompare run` per node):
torch uses torchrun's static rendezvous, so ranks follow --node-rank; an MLX ring node starts its rank
directly with MLX_RANK and MLX_HOSTFILE exactly as `mlx.launch` sets them, so no ssh is needed.
"""
from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

from common.config import RunConfig
from common.errors import UserError

from . import environment as env

RING_HOSTFILE = "ring_hosts.json"  # MLX_HOSTFILE of a node-rank MLX ring job, written into the run dir
RING_STARTING_PORT = 32323  # mlx.launch's default --starting-port, for hostfiles that give IPs only


def check_hostfile(cfg: RunConfig) -> None:
    if not cfg.hostfile:
        return
    path = Path(cfg.hostfile)
    if not path.is_file():
        raise UserError(f"hostfile {path} not found")
    if cfg.framework == "mlx" and cfg.nnodes > 1:
        ring_hosts(cfg)
    elif cfg.framework == "mlx" and cfg.resolved_backend != "mpi":
        try:
            hosts = json.loads(path.read_text())
            if not isinstance(hosts, list) or not all(isinstance(h, dict) and "ssh" in h for h in hosts):
                raise ValueError("expected a list of {\"ssh\": ..., \"ips\": [...]} objects")
        except ValueError as err:
            raise UserError(f"hostfile {path} does not parse as an MLX JSON hostfile: {err}") from None
        if len(hosts) != cfg.nproc:
            raise UserError(f"hostfile {path} lists {len(hosts)} hosts but --nproc is {cfg.nproc}")


def ring_hosts(cfg: RunConfig) -> list[list[str]]:
    """The MLX_HOSTFILE of a node-rank MLX ring job: one list of "ip:port" per rank, as mlx.launch writes it.

    --hostfile holds either that list itself (`[["10.0.0.1:5000"], ["10.0.0.2:5000"]]`, ports of your
    choice) or mlx.launch's hostfile (`[{"ssh": "mac1", "ips": ["10.0.0.1"]}, ...]`), whose ports are
    assigned the way mlx.launch does: 32323 upwards, one per rank and IP.
    """
    path = Path(cfg.hostfile)
    try:
        hosts = json.loads(path.read_text())
        if not isinstance(hosts, list) or not hosts:
            raise ValueError("expected a JSON list with one entry per node")
        if all(isinstance(h, dict) for h in hosts):
            port, ring = RING_STARTING_PORT, []
            for h in hosts:
                ips = h.get("ips")
                if not isinstance(ips, list) or not ips or not all(isinstance(ip, str) and ip for ip in ips):
                    raise ValueError(f"entry {h} needs \"ips\": [\"IP\", ...] (the ring backend connects to IPs)")
                ring.append([f"{ip}:{port + i}" for i, ip in enumerate(ips)])
                port += len(ips)
        elif all(isinstance(h, list) and h for h in hosts):
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


def build_command(cfg: RunConfig, run_dir: Path) -> tuple[list[str], dict, str]:
    """(argv, extra environment, BLAS description) that start every rank of this run."""
    entry = [sys.executable, "-m", f"{cfg.framework}_impl.launch", str(run_dir)]
    extra = env.thread_env(cfg.threads_per_rank)
    if cfg.tune_malloc:
        extra.update(env.malloc_env())
    blas = "framework default"
    if cfg.framework == "mlx":
        blas, blas_env = env.mlx_blas(cfg.mlx_blas)
        extra.update(blas_env)
    backend = cfg.resolved_backend
    if cfg.nproc == 1 and not cfg.hostfile and cfg.nnodes == 1:
        return entry, extra, blas
    if cfg.framework == "mlx" and cfg.nnodes > 1:
        # This node's rank of a ring job, as mlx.launch would start it on this host, minus the ssh.
        extra.update(MLX_RANK=str(cfg.node_rank), MLX_HOSTFILE=str(Path(run_dir).resolve() / RING_HOSTFILE))
        return entry, extra, blas
    if cfg.framework == "torch":
        launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={cfg.nproc}"]
        if cfg.nnodes > 1:
            # static: ranks follow --node-rank (c10d ignores it and numbers nodes by arrival), node 0
            # hosts the store at the endpoint. max-restarts 0: a failed node ends the job.
            launcher += [f"--nnodes={cfg.nnodes}", f"--node-rank={cfg.node_rank}",
                         f"--rdzv-endpoint={cfg.rdzv_endpoint}", "--rdzv-backend=static", "--max-restarts=0"]
            host = cfg.rdzv_endpoint.rpartition(":")[0].strip("[]") or cfg.rdzv_endpoint
            if backend == "gloo" and not os.environ.get("GLOO_SOCKET_IFNAME"):
                interface = interface_toward(host)
                if interface:
                    extra["GLOO_SOCKET_IFNAME"] = interface
        else:
            launcher += ["--standalone"]  # picks a free rendezvous port itself
        return launcher + ["-m", "torch_impl.launch", str(run_dir)], extra, blas
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
        spawner = [sys.executable, "-m", "compare.spawn", "--ranks", str(cfg.nproc),
                   "--ring-hostfile", str(Path(run_dir).resolve() / RING_HOSTFILE)]
        return spawner + ["--"] + entry, extra, blas
    launcher = env.mlx_launch_command() + ["--backend", backend]
    if cfg.hostfile:
        launcher += ["--hostfile", cfg.hostfile]
    else:
        launcher += ["-n", str(cfg.nproc)]
    if backend == "ring":
        launcher += ["--starting-port", str(env.free_port_block(cfg.nproc + 1))]
    if backend == "nccl":
        launcher += ["--nccl-port", str(env.free_port_block(1))]
    return launcher + ["--"] + entry, extra, blas

