"""Hostfiles: reading mlx.launch's JSON hostfile and a node-rank ring list, checking them against the run
before anything starts, and the backend a hostfile names. Also the network interface toward a host, which
gloo needs across machines.
"""
from __future__ import annotations

import json
import os
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path

from common.config import BACKENDS, RunConfig
from common.errors import UserError

RING_HOSTFILE = "ring_hosts.json"  # MLX_HOSTFILE of a node-rank MLX ring job, written into the run dir
RING_STARTING_PORT = 32323  # mlx.launch's default --starting-port, for hostfiles that give IPs only
HOST_WAIT_ENV = "DPCOMPARE_HOST_WAIT_S"
HOST_WAIT_S = 300.0      # how long a restart without --min-nproc waits for a host of its hostfile to answer


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
    if cfg.max_restarts:
        host_wait_s()  # a restart may wait for a host: a bad value is refused now, not after a failure
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


def host_wait_s() -> float:
    """DPCOMPARE_HOST_WAIT_S, else HOST_WAIT_S; a UserError (one line, exit 2) where it is not a number >= 0."""
    text = os.environ.get(HOST_WAIT_ENV, "").strip()
    if not text:
        return HOST_WAIT_S
    try:
        wait_s = float(text)
    except ValueError:
        wait_s = -1.0
    if not wait_s >= 0 or wait_s == float("inf"):
        raise UserError(f"{HOST_WAIT_ENV}={text!r}: expected the seconds a restart waits for a host, a number >= 0")
    return wait_s


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


def unanswered(hosts: list[dict], timeout_s: float) -> dict[str, str]:
    """The hosts among `hosts` (a hostfile's) that ssh does not reach within `timeout_s`, each with why. The
    probe `doctor --fabric` makes (compare/machine/fabric.py): `ssh -o BatchMode=yes HOST true`;
    127.0.0.1 always answers (mlx.launch runs it locally)."""
    import shutil
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    remote = list(dict.fromkeys(h["ssh"] for h in hosts if h["ssh"] != "127.0.0.1"))
    if not remote:
        return {}
    if shutil.which("ssh") is None:
        return {host: "ssh is not installed here" for host in remote}

    def problem(host: str) -> str | None:
        cmd = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={max(1, int(timeout_s))}", host, "true"]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s + 2, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return f"no answer within {timeout_s:g} s"
        if out.returncode != 0:
            return (out.stderr.strip().splitlines() or [f"ssh exited {out.returncode}"])[-1]
        return None

    with ThreadPoolExecutor(len(remote)) as pool:
        found = dict(zip(remote, pool.map(problem, remote)))
    return {host: why for host, why in found.items() if why}
