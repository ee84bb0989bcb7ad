"""Start one run (a framework at a world size) as subprocesses, watch every rank, write summary.json.

Launchers: one rank runs as plain python (`mlx.launch -n 1` crashes); MLX ring through `mlx.launch`;
MLX MPI through `mpirun` directly (mlx.launch's MPI mode passes `--output :raw`, which Open MPI 4
rejects); torch through `torchrun`. `mlx.launch` exits 0 even when a rank dies, so exit codes are not
trusted: every rank writes ranks/rank{r}.json (status, pid, heartbeat), and the watchdog below ends the
whole job when a rank fails, dies without a word, stops, or no rank makes progress for
`collective_timeout_s`.

Several nodes (`--nnodes N --node-rank R`, one `dpcompare run` per node, each with its own `--out`):
this process starts and watches only this node's ranks (torch: ranks R*nproc .. R*nproc+nproc-1 under
torchrun's static rendezvous, so ranks follow --node-rank; MLX ring: rank R, started directly with
MLX_RANK and MLX_HOSTFILE exactly as `mlx.launch` sets them, so no ssh is needed). Node 0 writes
metrics.jsonl; every node writes its summary.json. A stall or a failing local rank ends this node's job.
"""
from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from common.config import RunConfig
from common.errors import UserError
from common.metrics import read_json, read_metrics, throughput_stats, write_json
from common.spec import ModelSpec

from . import environment as env

PROJECT_ROOT = Path(__file__).resolve().parents[1]
RUN_FILES = ("run_config.json", "metrics.jsonl", "summary.json", "log.txt", "ranks", "checkpoints",
             "ring_hosts.json")
RING_HOSTFILE = "ring_hosts.json"  # MLX_HOSTFILE of a node-rank MLX ring job, written into the run dir
RING_STARTING_PORT = 32323  # mlx.launch's default --starting-port, for hostfiles that give IPs only
POLL_S = 0.2
KILL_GRACE_S = 3.0
STARTUP_GRACE_S = 120.0  # imports and data opening before a rank's first heartbeat


@dataclass
class Inputs:
    """What every run of a comparison shares: one token cache, one model spec, one seed checkpoint."""
    token_cache: Path
    spec: ModelSpec
    seed_checkpoint: Path
    cache_meta: dict


def prepare_inputs(cfg: RunConfig) -> Inputs:
    from common.sampler import GlobalSampler
    from common.sequences import SequenceView
    from common.tokencache import prepare_tokens

    cache = prepare_tokens(cfg.dataset, cfg.tokenizer, cache_dir=cfg.cache_path, split=cfg.dataset_split,
                           text_field=cfg.text_field, streaming=cfg.streaming, val_fraction=cfg.val_fraction,
                           builtin_vocab_size=cfg.builtin_vocab_size, builtin_bytes=cfg.builtin_corpus_bytes,
                           progress=not cfg.quiet)
    spec = cfg.model_spec(vocab_size=int(cache.meta["vocab_size"]))
    view = SequenceView(cache.split("train"), cfg.seq_len, cfg.sequence)
    GlobalSampler(view.num_samples, cfg.global_batch_size, cfg.seed)  # fails early when data is too small
    seed_dir = Path(cfg.init_from) if cfg.init_from else seed_checkpoint(spec, cfg.seed, cfg.cache_path)
    if cfg.init_from:
        from common.weights import load_pretrained

        init_spec, _ = load_pretrained(seed_dir)
        if init_spec != spec:
            raise UserError(f"--init-from {seed_dir}: its config does not match the run's model spec "
                            f"({init_spec} vs {spec})")
    return Inputs(token_cache=Path(cache.path), spec=spec, seed_checkpoint=seed_dir, cache_meta=cache.meta)


def seed_checkpoint(spec: ModelSpec, seed: int, cache_dir: Path) -> Path:
    """The seeded numpy init, written once per (spec, seed) and shared by every run and framework."""
    from common.weights import init_weights, save_pretrained

    key = hashlib.sha256(json.dumps([spec.to_dict(), seed], sort_keys=True).encode()).hexdigest()[:16]
    final = Path(cache_dir) / "seeds" / key
    if (final / "model.safetensors").exists() and (final / "config.json").exists():
        return final
    tmp = final.with_name(f".{key}.tmp{os.getpid()}")
    save_pretrained(tmp, spec, init_weights(spec, seed))
    try:
        os.replace(tmp, final)
    except OSError:  # another process won the race; its copy is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def check_run_dir(run_dir: Path, resume: bool, overwrite: bool, clear: bool = False) -> None:
    """Never silently overwrite a run: refuse, resume it, or (--overwrite) remove only dpcompare's files
    (and only when `clear`, i.e. once every other check has passed)."""
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"output path {run_dir} exists and is not a directory")
    holds_run = run_dir.is_dir() and any((run_dir / name).exists() for name in RUN_FILES)
    if holds_run and not (resume or overwrite):
        raise UserError(f"{run_dir} already holds a run; pass --resume to continue it, --overwrite to "
                        "replace it, or choose another --out")
    if holds_run and overwrite and not resume and clear:
        for name in RUN_FILES:
            target = run_dir / name
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
    parent = run_dir if run_dir.exists() else next(p for p in run_dir.parents if p.exists())
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise UserError(f"cannot write to output directory {run_dir}: {parent} is not a writable directory")


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


def watched_ranks(cfg: RunConfig) -> list[int]:
    """The ranks this process starts and watches: all of them, or this node's with --nnodes > 1."""
    if cfg.nnodes > 1:
        return list(range(cfg.node_rank * cfg.nproc, (cfg.node_rank + 1) * cfg.nproc))
    return list(range(cfg.nproc))


def check_resumable(cfg: RunConfig, inputs: Inputs, run_dir: Path) -> None:
    """Validate the checkpoint a --resume would load before anything is started or written."""
    from common.checkpoint import latest_checkpoint, load_checkpoint
    from common.loop import resume_fingerprints

    latest = latest_checkpoint(run_dir) if cfg.resume else None
    if latest is not None:
        load_checkpoint(latest, inputs.spec, resume_fingerprints(cfg, inputs.cache_meta, str(inputs.token_cache)))


def build_command(cfg: RunConfig, run_dir: Path) -> tuple[list[str], dict, str]:
    """(argv, extra environment, BLAS description) that start every rank of this run."""
    entry = [sys.executable, "-m", f"{cfg.framework}_impl.launch", str(run_dir)]
    extra = env.thread_env(cfg.threads_per_rank)
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
            for key in list(extra) + ["PYTHONPATH", "DPCOMPARE_LAUNCH_TIME", "PYTHONUNBUFFERED"]:
                argv += ["-x", key]
        return argv + entry, extra, blas
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


def write_plan(cfg: RunConfig, inputs: Inputs, run_dir: Path) -> None:
    write_json(run_dir / "run_config.json", {
        "config": cfg.to_dict(), "spec": inputs.spec.to_dict(), "token_cache": str(inputs.token_cache),
        "seed_checkpoint": str(inputs.seed_checkpoint), "world_size": cfg.nproc * cfg.nnodes,
        "backend": cfg.resolved_backend, "data": {k: inputs.cache_meta.get(k) for k in
                                                 ("num_documents", "num_tokens", "vocab_size", "tokenizer")},
    })


def launch(cfg: RunConfig, inputs: Inputs, run_dir: Path) -> dict:
    """Run every rank to the end (or to the first failure) and return the summary written to disk."""
    run_dir = Path(run_dir)
    check_run_dir(run_dir, cfg.resume, cfg.overwrite)
    check_hostfile(cfg)
    check_resumable(cfg, inputs, run_dir)
    argv, extra_env, blas = build_command(cfg, run_dir)
    check_run_dir(run_dir, cfg.resume, cfg.overwrite, clear=True)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"cannot write to output directory {run_dir}: {err.strerror}") from None
    write_plan(cfg, inputs, run_dir)
    if "MLX_HOSTFILE" in extra_env:
        write_json(Path(extra_env["MLX_HOSTFILE"]), ring_hosts(cfg))
    shutil.rmtree(run_dir / "ranks", ignore_errors=True)
    started = time.time()
    child_env = {**os.environ, **extra_env, "PYTHONUNBUFFERED": "1", "DPCOMPARE_LAUNCH_TIME": str(started),
                 "PYTHONPATH": os.pathsep.join(filter(None, [str(PROJECT_ROOT), os.environ.get("PYTHONPATH")]))}
    with open(run_dir / "log.txt", "a") as log:
        shown = {k: v for k, v in extra_env.items() if k.startswith(("MLX_RANK", "MLX_HOSTFILE", "GLOO_"))}
        log.write(f"$ {shlex.join([f'{k}={v}' for k, v in shown.items()] + argv)}\n")
        log.flush()
        # A session of its own: the whole job can be signalled at once, and nothing outlives it.
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=child_env, cwd=PROJECT_ROOT, start_new_session=True)
        try:
            failure = watch(proc, run_dir, cfg)
        except KeyboardInterrupt:
            stop_job(proc, run_dir)
            failure = {"error": "interrupted by the user", "failed_rank": None}
    summary = summarize(cfg, run_dir, argv, blas, time.time() - started, failure)
    write_json(run_dir / "summary.json", summary)
    return summary


def watch(proc: subprocess.Popen, run_dir: Path, cfg: RunConfig) -> dict | None:
    """None when every rank finished ok; else {"error", "failed_rank"} after stopping the job.

    With --nnodes > 1 only this node's ranks are watched (they are local processes); the others are
    watched by their own node's dpcompare, and a peer that is gone shows here as a stall or a timeout."""
    expected = watched_ranks(cfg) if cfg.nnodes > 1 else list(range(cfg.nproc * cfg.nnodes))
    local = cfg.nnodes > 1 or not cfg.hostfile
    lead = expected[0]
    bar = progress_bar(cfg)
    start, last_progress, last_seen = time.time(), time.time(), None
    while True:
        code = proc.poll()
        ranks = read_ranks(run_dir, expected)
        seen = tuple((r.get("step"), r.get("status")) for r in ranks.values())
        if seen != last_seen:
            last_seen, last_progress = seen, time.time()
        if bar is not None and lead in ranks:
            bar.n = ranks[lead].get("step", 0)
            if "loss" in ranks[lead]:
                bar.set_postfix(loss=f"{ranks[lead]['loss']:.4f}", refresh=False)
            bar.refresh()
        failure = diagnose(ranks, expected, local, code)
        stalled = time.time() - last_progress
        limit = cfg.collective_timeout_s + (STARTUP_GRACE_S if len(ranks) < len(expected) or
                                            all(r.get("step", 0) == r.get("start_step", 0) and
                                                r.get("status") != "running" for r in ranks.values()) else 0)
        stall = failure is None and code is None and stalled > limit
        if stall:
            culprit = slowest(ranks, expected)
            info = ranks.get(culprit, {})
            state = "is stopped (SIGSTOP?)" if process_state(info.get("pid")) == "T" else "looks hung"
            failure = {"failed_rank": culprit,
                       "error": f"rank {culprit} (pid {info.get('pid')}) {state} in step {info.get('step', 0) + 1}: "
                                f"no rank {'on this node ' if cfg.nnodes > 1 else ''}made progress for "
                                f"{stalled:.0f} s (collective timeout {cfg.collective_timeout_s:g} s)"}
            if culprit not in ranks:  # its status file appears once the framework has joined every rank
                failure["error"] = (f"rank {culprit} never started: no status from it after {stalled:.0f} s "
                                    "(a rank waits until every rank of the job has joined)")
        if failure is not None and cfg.nnodes > 1 and (stall or is_peer_error(failure["error"])):
            failure["error"] += (f" [node {cfg.node_rank} of {cfg.nnodes}: a rank on another node may have "
                                 "failed, or the network between the nodes is down; see their logs]")
        if failure is not None:
            if bar is not None:
                bar.close()
            stop_job(proc, run_dir)
            return failure
        if code is not None:
            if bar is not None:
                bar.close()
            return None
        time.sleep(POLL_S)


def diagnose(ranks: dict, world, local: bool, exit_code: int | None) -> dict | None:
    """`world`: the number of ranks (0..world-1) or the list of rank ids this process watches."""
    expected = list(range(world)) if isinstance(world, int) else list(world)
    failed = [r for r in ranks.values() if r.get("status") == "failed"]
    for rank, info in sorted(ranks.items()):
        if info.get("status") in ("ok", "failed") or not local:
            continue
        state = process_state(info.get("pid"))
        if state is None or state == "Z":
            return {"failed_rank": rank, "error": f"rank {rank} (pid {info.get('pid')}) died in step "
                                                  f"{info.get('step', 0) + 1} without reporting an error "
                                                  "(killed by a signal or out of memory?)"}
    if failed:
        # A peer's timeout error points at the wrong rank; a real error message names the culprit.
        first = min(failed, key=lambda r: (is_peer_error(r.get("error", "")), r["rank"]))
        silent = [r for r in expected if ranks.get(r, {}).get("status") not in ("failed", "ok")]
        if is_peer_error(first.get("error", "")) and silent:
            culprit = silent[0]
            state = process_state(ranks.get(culprit, {}).get("pid")) if local else "?"
            what = "is stopped (SIGSTOP?)" if state == "T" else "stopped responding"
            return {"failed_rank": culprit, "error": f"rank {culprit} {what} in step "
                                                     f"{ranks.get(culprit, {}).get('step', 0) + 1}; rank "
                                                     f"{first['rank']} reports: {first.get('error')}"}
        return {"failed_rank": first["rank"], "error": f"rank {first['rank']} failed in step "
                                                       f"{first.get('step', 0) + 1}: {first.get('error')}"}
    if exit_code is not None:
        missing = [r for r in expected if ranks.get(r, {}).get("status") != "ok"]
        if missing:
            return {"failed_rank": missing[0],
                    "error": f"rank {missing[0]} ended without finishing (launcher exit code {exit_code})"}
    return None


def is_peer_error(message: str) -> bool:
    """Errors a rank raises because a peer is gone or silent, not because of its own fault."""
    text = message.lower()
    return any(word in text for word in ("timed out", "timeout", "connection", "broken pipe", "peer", "sigterm"))


def slowest(ranks: dict, world) -> int:
    for rank in (range(world) if isinstance(world, int) else world):
        if rank not in ranks:
            return rank
        if process_state(ranks[rank].get("pid")) == "T":
            return rank
    return min(ranks, key=lambda r: (ranks[r].get("step", 0), ranks[r].get("heartbeat", 0)))


def process_state(pid: int | None) -> str | None:
    """Linux state letter (R, S, T stopped, Z zombie) or None when gone; "?" where /proc is absent."""
    if not pid:
        return "?"
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None
    except OSError:
        try:
            os.kill(pid, 0)
            return "?"
        except ProcessLookupError:
            return None
        except PermissionError:
            return "?"


def read_ranks(run_dir: Path, world) -> dict[int, dict]:
    """Status files of ranks 0..world-1, or of the rank ids in `world` when it is a list."""
    ranks = {}
    for rank in (range(world) if isinstance(world, int) else world):
        data = read_json(run_dir / "ranks" / f"rank{rank}.json")
        if data:
            ranks[rank] = data
    return ranks


def stop_job(proc: subprocess.Popen, run_dir: Path) -> None:
    """SIGTERM the job's process group and every known rank, then SIGKILL what is left."""
    pids = {info.get("pid") for info in read_ranks(run_dir, 4096).values()} - {None}
    targets = [("group", proc.pid)] + [("pid", p) for p in pids]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for kind, ident in targets:
            try:
                if kind == "group":
                    os.killpg(ident, sig)
                else:
                    os.kill(ident, signal.SIGCONT)  # a stopped rank cannot act on SIGTERM
                    os.kill(ident, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.time() + KILL_GRACE_S
        while time.time() < deadline and (proc.poll() is None or any(process_state(p) not in (None, "Z") for p in pids)):
            time.sleep(0.05)
    proc.wait()


def progress_bar(cfg: RunConfig):
    if cfg.quiet:
        return None
    from tqdm import tqdm

    # disable=None turns the bar off when stderr is not a terminal (CI logs, pipes).
    return tqdm(total=cfg.steps, desc=f"{cfg.framework} x{cfg.nproc * cfg.nnodes}", unit="step",
                disable=None, leave=False, dynamic_ncols=True)


def summarize(cfg: RunConfig, run_dir: Path, argv: list[str], blas: str, wall_s: float,
              failure: dict | None) -> dict:
    world = cfg.nproc * cfg.nnodes
    ranks = read_ranks(run_dir, world)
    train_rows, eval_rows = read_metrics(run_dir / "metrics.jsonl")
    mine = watched_ranks(cfg) if cfg.nnodes > 1 else list(range(world))
    rank0 = ranks.get(0, ranks.get(mine[0], {}))
    stats = throughput_stats(train_rows, cfg.timing_warmup_steps)
    summary = {
        "framework": cfg.framework, "world_size": world, "backend": cfg.resolved_backend if world > 1 else "none",
        "device": rank0.get("device", cfg.device), "status": "failed" if failure else "ok",
        # A node other than 0 has no metrics.jsonl: its own ranks' status files say how far it got.
        "steps": train_rows[-1]["step"] if train_rows else
                 min(ranks.get(r, {}).get("step", 0) for r in mine) if cfg.nnodes > 1 else 0,
        **stats,
        "warmup_steps": cfg.timing_warmup_steps,
        "compile_s": rank0.get("compile_s"), "time_to_first_step_s": rank0.get("time_to_first_step_s"),
        "wall_s": wall_s,
        "peak_mem_bytes": [ranks.get(r, {}).get("peak_mem_bytes") for r in range(world)],
        "peak_rss_bytes": [ranks.get(r, {}).get("peak_rss_bytes") for r in range(world)],
        "blas": blas, "threads_per_rank": cfg.threads_per_rank,
        "versions": env.versions(), "machine": env.machine(),
        "final_loss": train_rows[-1]["loss"] if train_rows else rank0.get("loss") if cfg.nnodes > 1 else None,
        "final_eval_loss": eval_rows[-1]["eval_loss"] if eval_rows else None,
        "tokens_per_step": train_rows[-1]["tokens"] if train_rows else None,
        "command": shlex.join(argv), "config": cfg.to_dict(),
    }
    if cfg.nnodes > 1:
        summary.update(nnodes=cfg.nnodes, node_rank=cfg.node_rank, node_ranks=mine)
    if failure:
        summary.update(failure)
    return summary
