"""Which kernels an MLX rank computes with, where the choice depends on the machine: the build of its compiled
CPU kernels (--mlx-cpu-jit, compare/machine/environment.py), its exp (--mlx-exp, mlx_impl/fast_exp.py), the
route of its bfloat16 matmuls on a CPU (--mlx-bf16-matmul, mlx_impl/kernels.py `matmul`), its cross-entropy's
shift and the blocks of queries its float32 attention core runs in (no flag for these two: always timed on a Linux
CPU; mlx_impl/model.py `set_cross_entropy`, mlx_impl/attention.py `set_attention`).

A selectable kernel's `auto` is decided by measuring, not by a rule about CPUs: each candidate is timed at the
run's own shapes on this machine (mlx_impl/kernel_choice.py) and the faster one is taken (`faster`, a pure
function). The timings are cached per machine (CPU model and flags), MLX version, kernel build and shape
(`KernelCache`), so they are measured once; an MLX upgrade drops the old entries. Read by the rank
(mlx_impl/step.py) and by doctor and the report (compare/machine/kernels.py) alike: framework-free.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:
    from common.config import RunConfig
    from common.model.spec import ModelSpec

# Each selectable kernel: its candidates, the first the one MLX computes by itself (kept on a tie), and the unit
# of its timings.
CANDIDATES = {"exp": ("native", "fused"), "bf16_matmul": ("native", "fp32"),
              "cross_entropy": ("native", "shift", "tree", "tree_shift"),
              "attention": ("whole", "halves", "quarters")}
UNITS = {"exp": "ns per element", "bf16_matmul": "ps per multiply-add", "cross_entropy": "ns per logit",
         "attention": "ns per score", "blas": "ps per multiply-add"}  # blas: compare/machine/blas.py
# Bump when a timed kernel changes (mlx_impl/fast_exp.py, the fp32 route, the attention core): the cached timings are
# then stale, and when the native kernels are built otherwise (compare/machine/environment.py JIT_CACHE_GENERATION).
# 4: the attention core's causal bias made once per length. 5: the strided kernels' unit-stride inner loop
# (compare/machine/strided_kernels.py), which makes the exp with its shift inside 5x faster.
KERNELS_REVISION = 5
CACHE_FILE = "kernel-choice.json"


def faster(timings: Mapping[str, float]) -> str:
    """The candidate with the smallest time; on a tie the one listed first (MLX's own, where it is first)."""
    if not timings:
        raise ValueError("no timings to choose from")
    return min(timings, key=lambda name: (timings[name], list(timings).index(name)))


def native_cpu_kernels(choice: str) -> bool:
    """Whether --mlx-cpu-jit `choice` builds MLX's compiled CPU kernels with -march=native on this machine
    (compare/machine/environment.py mlx_cpu_jit: Linux x86-64 with a g++)."""
    return choice != "baseline" and sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64") \
        and shutil.which("g++") is not None


def measures(device: str, system: str) -> bool:
    """Whether `auto` measures here: on a Linux CPU. Metal and CUDA keep MLX's own kernels (fast there, and
    the fp32 route is a CPU matter), as does macOS's CPU (Accelerate)."""
    return device == "cpu" and system.startswith("linux")


# Pins every `auto` kernel without a flag value to one candidate, for runs that must compute with the same kernels
# whenever they are made (a run and its resume, or two runs an hour apart on a machine whose load moves the
# timings): "native" (each kernel MLX's own), or KERNEL=CANDIDATE pairs, "exp=fused,attention=halves". The test
# suite pins "native" (tests/conftest.py); summary.json's BLAS line names what was pinned.
PIN_ENV = "DPCOMPARE_MLX_KERNELS"


def pinned_kernels(value: str | None = None) -> dict[str, str]:
    """{kernel: candidate} that $DPCOMPARE_MLX_KERNELS (or `value`) pins; a UserError for a name it cannot hold."""
    from common.errors import UserError

    text = (os.environ.get(PIN_ENV, "") if value is None else value).strip()
    if not text or text == "auto":
        return {}
    if text == "native":
        return {kernel: names[0] for kernel, names in CANDIDATES.items()}
    pins = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        kernel, _, name = item.partition("=")
        if kernel not in CANDIDATES or name not in CANDIDATES[kernel]:
            allowed = "; ".join(f"{k}={'|'.join(v)}" for k, v in CANDIDATES.items())
            raise UserError(f"{PIN_ENV}={text!r}: {item!r} is not a kernel and one of its candidates; allowed: "
                            f"native, or a comma list of {allowed}")
        pins[kernel] = name
    return pins


def fixed_choice(cfg: RunConfig, kernel: str, device: str, system: str, pins: bool = True) -> str | None:
    """The candidate a run uses without measuring: the one named on the command line, MLX's own where `auto`
    does not measure (`measures`), MLX's own bf16 matmul in a float32 run (none happen), or the one pinned
    ($DPCOMPARE_MLX_KERNELS). None: measure."""
    chosen = {"exp": cfg.mlx_exp, "bf16_matmul": cfg.mlx_bf16_matmul}.get(kernel, "auto")  # no flag for the rest
    if chosen != "auto":
        return chosen
    if not measures(device, system) or (kernel == "bf16_matmul" and cfg.dtype != "bfloat16") \
            or (kernel == "attention" and cfg.dtype != "float32"):  # bfloat16's core is the step-by-step form
        return CANDIDATES[kernel][0]
    return pinned_kernels().get(kernel) if pins else None  # None: measure


def measured_shape(cfg: RunConfig, kernel: str, spec: ModelSpec, exp: str = "native") -> tuple[int, ...]:
    """The shape a kernel is timed at, from the run's own: the attention scores (micro-batch, heads, seq, seq)
    for the exp (its softmax), the MLP's up projection (micro-batch x seq, dim, ffn) for the bf16 matmul, the
    logits (micro-batch x seq, vocab) for the cross-entropy and the attention core's q, k and v (micro-batch, heads,
    kv heads, seq, head dim) for its blocks, these two with the index of the run's `exp` in CANDIDATES["exp"] last
    (they are timed with that exp)."""
    if kernel == "exp":
        return (cfg.micro_batch_size, spec.n_heads, cfg.seq_len, cfg.seq_len)
    if kernel == "cross_entropy":
        return (cfg.micro_batch_size * cfg.seq_len, spec.vocab_size, CANDIDATES["exp"].index(exp))
    if kernel == "attention":
        return attention_shape(cfg.micro_batch_size, cfg.seq_len, spec, exp)
    return (cfg.micro_batch_size * cfg.seq_len, spec.dim, spec.ffn_dim)


def attention_shape(rows: int, seq_len: int, spec: ModelSpec, exp: str = "native") -> tuple[int, ...]:
    """The attention core's timed shape: (micro-batch, heads, kv heads, seq, head dim, the exp's index)."""
    return (rows, spec.n_heads, spec.n_kv_heads, seq_len, spec.head_dim, CANDIDATES["exp"].index(exp))


def cpu_signature() -> str:
    """A short hash of this CPU's model and flags: what a kernel's speed (and a -march=native build) depends on."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = [platform.processor()]
    wanted = [line for line in lines if line.startswith(("model name", "flags"))][:2]
    return hashlib.sha256("\n".join(wanted).encode()).hexdigest()[:12]


def mlx_version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("mlx")
    except importlib.metadata.PackageNotFoundError:
        return "none"


@dataclass(frozen=True)
class Identity:
    """What a kernel's timings hold for: this CPU, this MLX, this kernel build (--mlx-cpu-jit's flags)."""
    machine: str
    mlx: str
    build: str

    @classmethod
    def here(cls, cpu_jit: str, environ: Mapping[str, str] | None = None) -> Identity:
        """This machine and MLX, with the kernels --mlx-cpu-jit `cpu_jit` builds and the BLAS `environ` (the
        timing's environment: this process's where None) loads (`blas_of`)."""
        build = "native" if native_cpu_kernels(cpu_jit) else "baseline"
        blas = blas_of(os.environ if environ is None else environ)
        return cls(cpu_signature(), mlx_version(), f"{build}-{blas}-r{KERNELS_REVISION}")


def blas_of(environ: Mapping[str, str]) -> str:
    """The BLAS a timing's matmuls reach, from its environment: the preloaded library's name and OpenBLAS's core
    where one is set, else MLX's own. A timing with matmuls in it (the bf16 route, the attention core) depends on
    it: the demo's attention core timed 75.9 ns per score under MLX's own BLAS (a test's run without OpenBLAS)
    against 6.9 with it, and that entry, keyed without the BLAS, was read by the runs that have it."""
    preload = environ.get("LD_PRELOAD", "")
    name = next((Path(p).name.split(".so")[0] for p in preload.replace(":", " ").split() if "blas" in p.lower()), "")
    return f"{name}:{environ.get('OPENBLAS_CORETYPE', '')}" if name else "own"


class KernelCache:
    """kernel-choice.json in the cache folder: one entry per identity, kernel and shape, holding the timings and
    the choice. Entries of another MLX version are dropped when an entry is written."""

    def __init__(self, root: Path):
        self.path = Path(root) / CACHE_FILE

    @staticmethod
    def key(identity: Identity, kernel: str, shape: tuple[int, ...]) -> str:
        return json.dumps([identity.machine, identity.mlx, identity.build, kernel, list(shape)])

    def get(self, identity: Identity, kernel: str, shape: tuple[int, ...], contended: bool = False) -> dict | None:
        """The entry, or None: none stored, or one timed while other work took the CPU from the timing (`contended`),
        which only the ranks of the run that timed it take (contended=True), so that they agree with their
        launcher; the next launch times it again, up to MAX_TRIES timings in all (`put` keeps each candidate's
        best), after which it is kept: under a load that never ends (a CI run's), every launch timed it again."""
        from common.metrics import read_json

        entry = (read_json(self.path, {}) or {}).get(self.key(identity, kernel, shape))
        if not (isinstance(entry, dict) and "choice" in entry and "timings" in entry):
            return None
        settled = not was_contended(entry.get("cpu_share")) or entry.get("tries", 1) >= MAX_TRIES
        return entry if contended or settled else None

    def put(self, identity: Identity, kernel: str, shape: tuple[int, ...], timings: Mapping[str, float],
            cpu_share: float | None = None, extra: Mapping | None = None) -> dict:
        """Store the timings and their choice; `cpu_share`: the timing's CPU time over its wall time (was_contended);
        `extra`: what else the reader of the entry needs (the BLAS's GFLOP/s and rejected libraries). The machine's
        load when it was timed is kept beside it, for whoever wonders why a choice looks wrong."""
        from common.metrics import read_json, write_json

        entries = {k: v for k, v in (read_json(self.path, {}) or {}).items()
                   if _mlx_of(k) == identity.mlx}  # an MLX upgrade invalidates every older timing
        key = self.key(identity, kernel, shape)
        before = entries.get(key) if isinstance(entries.get(key), dict) else {}
        if before and was_contended(before.get("cpu_share")) and set(before.get("timings", {})) == set(timings):
            # timed again after a timing under load: load only slows a candidate, so each keeps its best time
            timings = {name: min(t, before["timings"][name]) for name, t in timings.items()}
            shares = [x for x in (before.get("cpu_share"), cpu_share) if x is not None]
            cpu_share = max(shares) if shares else None
        tries = (before.get("tries", 1) + 1) if before else 1
        entry = {"choice": faster(timings), "timings": dict(timings), "unit": UNITS[kernel],
                 "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "tries": tries,
                 "cpu_share": None if cpu_share is None else round(cpu_share, 2), **load_now(), **(extra or {})}
        entries[key] = entry
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_json(self.path, entries)  # atomic: concurrent ranks never read half a file
        except OSError:
            pass  # a read-only cache costs a measurement next time, nothing more
        return entry


def load_now() -> dict:
    """The machine's load as a timing ends: the 1-minute load average, the tasks running now (the timing's own
    among them) and the CPUs; empty where /proc/loadavg is missing (macOS). Recorded, not judged: cpu_share is the
    timing's own measure of what it lost (was_contended), where a load average lags a minute behind."""
    try:
        fields = Path("/proc/loadavg").read_text().split()
        return {"load_1m": float(fields[0]), "running_tasks": int(fields[3].split("/")[0]), "cpus": os.cpu_count()}
    except (OSError, ValueError, IndexError):
        return {}


MAX_TRIES = 3  # timings of one kernel and shape under load before the best of them is kept (KernelCache.get)
MIN_CPU_SHARE = 0.8  # a timing whose process ran less of its wall time than this shared the CPU with other work


def was_contended(cpu_share: float | None) -> bool:
    """Whether a timing shared its CPU: its process's CPU time over its wall time under MIN_CPU_SHARE (a one-thread
    timing alone on a core reads about 1). Beside other work the candidates' times move unevenly: the attention
    core at the demo's shape read whole 11.0, halves 6.97, quarters 16.3 ns per score beside a busy loop on each of
    the Intel Xeon VM's two cores (cpu_share 0.57), against 6.9, 6.5 and 7.1 alone, and a choice made then was kept
    until MLX changed. None (not recorded): kept."""
    return cpu_share is not None and cpu_share < MIN_CPU_SHARE


def _mlx_of(key: str) -> str | None:
    try:
        return json.loads(key)[1]
    except (ValueError, IndexError, TypeError):
        return None


def describe(kernel: str, choice: str, entry: dict | None) -> str:
    """`fused (measured: fused 3.1, native 9.8 ns per element)`, or the choice alone where nothing was measured."""
    if entry is None:
        return choice
    timings = ", ".join(f"{name} {value:.3g}" for name, value in
                        sorted(entry["timings"].items(), key=lambda item: item[0] != choice))
    return f"{choice} (measured: {timings} {UNITS[kernel]})"
