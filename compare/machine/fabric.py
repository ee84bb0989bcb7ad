"""`dpcompare doctor --fabric`: all-reduce latency and bandwidth for every backend usable here, and what
they mean for a training step.

Each backend runs `python -m {mlx,torch}_impl.probe` (common/costmodel/probe.py) on every rank, started by the
launchers that start training (compare/launch/launchers.py): 2 local ranks, or one rank per host of an MLX
`--hostfile` through mlx.launch (ssh; ring, jaccl or jaccl-ring, as the hostfile or --backend says).
Everything shares one time budget (55 s by default): each job gets its share of what is left and is
killed when it overruns it. A host that ssh cannot reach ends the command with one line, before any job.

From the two ends of the sweep: latency is the median time of the smallest message, bandwidth the size
of the largest over its median time less that latency. The gradient sync of a step is estimated as
buckets x latency + gradient bytes / bandwidth, for the chosen preset's fp32 gradients, and compared with
the step's compute time at the device's peak (the shortest a step can take): when the sync alone is
longer, the network cannot keep up and a warning says so.
"""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from common.config import RunConfig
from common.placement import LINK_BACKENDS
from common.errors import UserError
from common.costmodel.rates import NO_DELAY_NOTE, describe_rate, parse_rate
from common.costmodel.probe import RESULT_PREFIX, fit
from common.model.flops import flops_per_token, known_peak_flops
from common.metrics import read_json
from common.model.spec import preset
from common.model.weights import num_parameters

from ..launch.hosts import check_hosts_for, read_mlx_hostfile, unanswered
from ..launch.launchers import build_command
from ..launch.netns import EmulatedLink, check_can_emulate
from . import environment as env
from .backends import MLX_PROBE, TORCH_PROBE, probe

PROJECT_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TIME_BUDGET_S = 55.0
LATENCY_BYTES = 4096
SSH_TIMEOUT_S = 8
# What a job spends outside the timed loop: interpreter and framework start, init, teardown.
STARTUP_S = {"mlx": 4.0, "torch": 12.0}


@dataclass
class Measured:
    framework: str
    backend: str
    ranks: int
    device: str = ""
    latency_s: float | None = None
    bandwidth_Bps: float | None = None   # algorithm bandwidth of the largest message
    large_bytes: int = 0
    calls: int = 0
    wall_s: float = 0.0
    error: str | None = None
    raw: list = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.framework} {self.backend}"

    def sync_s(self, grad_bytes: int, bucket_bytes: int) -> float:
        """One step's gradient all-reduce: a latency per bucket plus the bytes at the measured bandwidth."""
        return math.ceil(grad_bytes / bucket_bytes) * self.latency_s + grad_bytes / self.bandwidth_Bps


def sizes_for(max_mb: float) -> list[int]:
    large = max(int(max_mb * 2**20) // 4 * 4, 2 * LATENCY_BYTES)
    middle = [s for s in (2**20,) if LATENCY_BYTES < s < large]
    return [LATENCY_BYTES, *middle, large]


def probe_frameworks(mlx_needed: bool = True, torch_needed: bool = True) -> tuple[dict, dict]:
    """backends.py's probes of the frameworks, side by side (importing torch takes seconds)."""

    def run(framework: str, code: str, needed: bool) -> dict:
        if not needed:
            return {"error": "not needed"}
        return probe(code, timeout=60) if env.version(framework) else {"error": "not installed"}

    with ThreadPoolExecutor(2) as pool:
        mlx = pool.submit(run, "mlx", MLX_PROBE, mlx_needed)
        torch = pool.submit(run, "torch", TORCH_PROBE, torch_needed)
        return mlx.result(), torch.result()


def usable_backends(nproc: int, hostfile: str | None, backend: str | None) -> list[tuple[str, str, str]]:
    """(framework, backend, device) of every job to run; with a hostfile, MLX across its hosts only
    (torch across hosts needs one torchrun per host, which this machine cannot start)."""
    wanted = {name.strip() for name in (backend or "").split(",") if name.strip()}
    only_mlx = hostfile or (wanted and all(name.startswith("mlx:") for name in wanted))
    mlx, torch = probe_frameworks(torch_needed=not only_mlx)
    mlx_ok = mlx.get("backends", {})
    if hostfile:
        named = backend or read_mlx_hostfile(hostfile).backend or "ring"
        if not mlx_ok.get({"jaccl-ring": "jaccl"}.get(named, named)):
            raise UserError(f"--backend {named}: this machine's MLX ({env.version('mlx') or 'not installed'}, "
                            f"{sys.platform}) has no {named} backend")
        return [("mlx", named, "auto")]
    # MLX reduces on the device training uses: the GPU on a Mac (Metal), the CPU elsewhere but for nccl.
    mlx_device = "auto" if sys.platform == "darwin" else "cpu"
    gpus = len(torch.get("cuda_devices", []))
    candidates = [("mlx", "ring", mlx_device, mlx_ok.get("ring")),
                  ("mlx", "mpi", mlx_device, mlx_ok.get("mpi") and env.mpirun()),
                  ("mlx", "nccl", "cuda", mlx_ok.get("nccl") and gpus >= nproc),
                  ("torch", "gloo", "cpu", torch.get("backends", {}).get("gloo")),
                  ("torch", "nccl", "cuda", torch.get("backends", {}).get("nccl") and gpus >= nproc)]
    jobs = [(f, b, d) for f, b, d, ok in candidates if ok]
    if wanted:  # a comma list of backend names (every framework's) or framework:backend
        chosen = [job for job in jobs if {job[1], f"{job[0]}:{job[1]}"} & wanted]
        if not chosen:
            raise UserError(f"--backend {backend}: not usable here; usable: "
                            f"{', '.join(f'{f}:{b}' for f, b, _ in jobs) or 'none'}")
        jobs = chosen
    return jobs


def check_reachable(hostfile: str, timeout_s: float = SSH_TIMEOUT_S) -> list[dict]:
    """The hostfile's hosts, after checking that ssh reaches every one (mlx.launch starts ranks over ssh)."""
    try:
        hosts = read_mlx_hostfile(hostfile).hosts
    except ValueError as err:
        raise UserError(f"hostfile {hostfile} does not parse as an MLX JSON hostfile: {err}") from None
    # the probe a restart asks too (compare/launch/hosts.py): mlx.launch runs 127.0.0.1 locally
    for host, problem in unanswered(hosts, timeout_s).items():
        raise UserError(f"host {host} cannot be reached over ssh (mlx.launch needs passwordless ssh to "
                        f"every host): {problem}")
    return hosts


def run_job(framework: str, backend: str, device: str, nproc: int, hostfile: str | None, sizes: list[int],
            budget_s: float, max_calls: int, link: str | None = None) -> Measured:
    ranks = len(read_mlx_hostfile(hostfile).hosts) if hostfile else nproc
    row = Measured(framework, backend, ranks)
    if link and backend not in LINK_BACKENDS[framework]:
        row.error = f"not measured: --link emulates TCP links for {', '.join(sum(LINK_BACKENDS.values(), ()))} only"
        return row
    emulated = EmulatedLink(link, ranks) if link else None
    cfg = RunConfig(framework=framework, nproc=ranks, backend=backend, hostfile=hostfile or "",
                    device="cuda" if device == "cuda" else "auto")  # cuda: the nccl default, and mlx.launch
    measure_s = max(1.0, budget_s * 0.85 - STARTUP_S[framework])
    args = ["--backend", backend, "--sizes", ",".join(map(str, sizes)), "--max-calls", str(max_calls),
            "--budget-bytes", str(64 * sizes[-1]), "--time-budget-s", f"{measure_s:.1f}",
            "--device", device,
            "--timeout-s", f"{max(5.0, budget_s):.0f}"]
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="dpcompare-fabric-") as work, emulated or nullcontext():
        argv, extra, _ = build_command(cfg, Path(work), module="probe", args=args, link=emulated)
        child_env = env.child_env({**extra, "PYTHONUNBUFFERED": "1"})
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                text=True, env=child_env, cwd=PROJECT_ROOT, start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=budget_s)
        except subprocess.TimeoutExpired:
            _kill(proc)
            stdout, stderr = proc.communicate()
            row.error = f"no result within {budget_s:.0f} s (a rank could not connect, or the link is very slow)"
    row.wall_s = time.time() - started
    result = next((json.loads(line[len(RESULT_PREFIX):]) for line in stdout.splitlines()
                   if line.startswith(RESULT_PREFIX)), None)
    if result is None:
        if row.error is None:
            lines = [ln for ln in (stderr + stdout).splitlines() if ln.strip()]
            reason = next((ln for ln in reversed(lines) if "fabric rank" in ln or "Error" in ln), None)
            row.error = (reason or (lines[-1] if lines else f"exit code {proc.returncode}")).strip()[:300]
        return row
    return summarize(row, result)


def _kill(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=3)
            return
        except subprocess.TimeoutExpired:
            continue


def summarize(row: Measured, result: dict) -> Measured:
    row.device, row.raw = result.get("device", ""), result["results"]
    row.calls = sum(len(r["times_s"]) for r in row.raw)
    figures = fit(row.raw)
    row.latency_s, row.bandwidth_Bps, row.large_bytes = (figures["latency_s"], figures["bandwidth_Bps"],
                                                         figures["large_bytes"])
    if row.latency_s is None:
        row.error = "no all-reduce finished within the time budget"
    elif row.bandwidth_Bps is None:
        row.error = "only the smallest message fit in the time budget: no bandwidth (raise --time-budget-s)"
    return row


def cached_cpu_peak(framework: str) -> float | None:
    """The matmul peak `dpcompare doctor --peak` measured and cached here (one thread), without measuring."""
    from .peak import cache_key, cache_path

    entry = (read_json(cache_path(), {}) or {}).get(cache_key(1, env.mlx_blas("auto")[0], "cpu"))
    flops = entry["peaks"].get(framework, {}).get("flops") if entry else None
    return flops or None


def device_peak(row: Measured) -> tuple[str, float] | None:
    """(where the figure comes from, FLOP/s) of the device the ranks reduced on."""
    if row.device.startswith(("gpu", "cuda")):
        from .peak import accelerator_name

        name = accelerator_name()
        known = known_peak_flops(name or "")
        return (f"the {known[0]}'s peak", known[1]) if known else None
    flops = cached_cpu_peak(row.framework)
    return (f"{row.framework}'s CPU matmul peak from doctor --peak", flops) if flops else None


@dataclass
class Workload:
    preset: str
    seq_len: int
    global_batch_size: int

    @property
    def spec(self):
        return preset(self.preset)

    @property
    def grad_bytes(self) -> int:
        return 4 * num_parameters(self.spec)  # fp32 gradients, all-reduced once per optimizer step

    def compute_at_peak_s(self, ranks: int, peak_flops: float) -> float:
        tokens = self.global_batch_size * self.seq_len / ranks
        return tokens * flops_per_token(self.spec, self.seq_len) / peak_flops


def bucket_bytes(framework: str) -> int:
    defaults = RunConfig()
    return int((defaults.all_reduce_size_mb if framework == "mlx" else defaults.bucket_cap_mb) * 2**20)


def fabric(nproc: int = 2, hostfile: str | None = None, backend: str | None = None, max_mb: float = 32.0,
           time_budget_s: float = DEFAULT_TIME_BUDGET_S, max_calls: int = 20,
           workload: Workload | None = None, link: str | None = None,
           rows_out: list | None = None) -> tuple[str, int]:
    """(the report, exit code): 0 when every backend was measured, 1 when one failed. `link`: the local
    ranks talk over an emulated link of that rate (compare/launch/netns.py). `rows_out` receives the
    Measured rows (doctor --fabric --out writes them for `dpcompare plan`)."""
    started = time.time()
    if link:
        if hostfile:
            raise UserError(f"--link {link} emulates a link between local ranks; it cannot go with --hostfile")
        check_can_emulate(link)
    workload = workload or Workload("small", 128, 8)
    if hostfile:
        hosts = check_reachable(hostfile, min(SSH_TIMEOUT_S, max(1.0, time_budget_s / 4)))
        named = backend or read_mlx_hostfile(hostfile).backend or "ring"
        try:
            check_hosts_for(named, hosts)
        except ValueError as err:
            raise UserError(f"hostfile {hostfile} does not fit backend {named}: {err}") from None
    jobs = usable_backends(nproc, hostfile, backend)
    sizes = sizes_for(max_mb)
    rows = []
    for i, (framework, name, device) in enumerate(jobs):
        left = time_budget_s - (time.time() - started)
        share = left / (len(jobs) - i)
        if share < 3:
            rows.append(Measured(framework, name, nproc, error="skipped: the time budget is spent"))
            continue
        rows.append(run_job(framework, name, device, nproc, hostfile, sizes, share, max_calls, link))
    report = render(rows, workload, hostfile, nproc, time.time() - started, link)
    if rows_out is not None:
        rows_out.extend(rows)
    return report, 1 if any(r.error for r in rows) else 0


def render(rows: list[Measured], workload: Workload, hostfile: str | None, nproc: int, wall_s: float,
           link: str | None = None) -> str:
    where = f"across the hosts of {hostfile}" if hostfile else f"{nproc} local ranks on this machine"
    if link:
        where += f", over an emulated {describe_rate(parse_rate(link))} link ({NO_DELAY_NOTE})"
    lines = [f"fabric: all-reduce (float32 sum) over {where}; median of the timed calls", ""]
    header = ("backend", "ranks", "device", f"latency ({LATENCY_BYTES // 1024} KB)", "bandwidth", "bus bandwidth",
              "calls", "job s")
    table = []
    for r in rows:
        if r.error:
            table.append((r.name, str(r.ranks), r.device or "-", "failed", r.error, "", "", f"{r.wall_s:.1f}"))
            continue
        bus = r.bandwidth_Bps * 2 * (r.ranks - 1) / r.ranks
        table.append((r.name, str(r.ranks), r.device, f"{r.latency_s * 1e6:,.0f} µs",
                      f"{r.bandwidth_Bps / 1e9:.2f} GB/s ({r.large_bytes / 2**20:g} MB)", f"{bus / 1e9:.2f} GB/s",
                      str(r.calls), f"{r.wall_s:.1f}"))
    widths = [max(len(h), *(len(t[i]) for t in table)) if table else len(h) for i, h in enumerate(header)]
    lines.append("  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip())
    lines += ["  ".join(c.ljust(w) for c, w in zip(t, widths)).rstrip() for t in table]

    grad_mb = workload.grad_bytes / 2**20
    tokens = workload.global_batch_size * workload.seq_len
    lines += ["", f"gradient sync per optimizer step for {workload.preset} ({grad_mb:,.1f} MB of fp32 gradients; "
                  f"global batch {workload.global_batch_size} x {workload.seq_len} tokens):"]
    for r in rows:
        if r.error:
            continue
        sync = r.sync_s(workload.grad_bytes, bucket_bytes(r.framework))
        peak = device_peak(r)
        text = f"  {r.name:<11} ~{sync * 1e3:,.0f} ms per step"
        if peak is None:
            lines.append(text + "; no peak known for this device to compare with (`dpcompare doctor --peak` "
                                "measures the CPU's)")
            continue
        compute = workload.compute_at_peak_s(r.ranks, peak[1])
        lines.append(text + f"; its compute takes at least {compute * 1e3:,.0f} ms per rank ({tokens / r.ranks:,.0f} "
                            f"tokens at {peak[1] / 1e12:.3g} TFLOP/s: {peak[0]})")
        if sync > compute:
            lines.append(f"  WARNING {r.name}: the sync alone outlasts the compute, so the network sets the pace. "
                         f"It needs {workload.grad_bytes / compute / 1e9:.2f} GB/s or more (measured "
                         f"{r.bandwidth_Bps / 1e9:.2f}), or more tokens per step (--global-batch-size, --grad-accum).")
    lines += ["", f"doctor --fabric took {wall_s:.1f} s"]
    return "\n".join(lines)
