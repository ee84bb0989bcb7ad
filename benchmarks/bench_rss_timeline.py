"""Where each rank's peak RSS comes from: when it is reached, in which call, and how much of it is glibc's
heap holding memory that was freed but not returned.

    python benchmarks/bench_rss_timeline.py [--framework torch] [--strategy fsdp] [--preset base]
                                            [--layers 12] [--nproc 2] [--steps 4] [--set KEY=VALUE ...]
    (pp: one micro-batch per sequence of the global batch unless --set pp_microbatches=N)

One `dpcompare run` (bench_memory.py's shape by default: `base`, vocabulary 50,000, `model.n_kv_heads=4`,
seq 128, global batch 2) with benchmarks/rss_probe/ on PYTHONPATH, so that every rank samples its own
resident set every 0.5 ms and writes a line at each new maximum (benchmarks/rss_probe/sitecustomize.py).
Then, per rank:

    peak          the highest sample, beside summary.json's peak_rss_bytes (the kernel's VmHWM)
    at            seconds since the rank started, and its phase: the innermost project call on the stack
    heap kept     glibc's free-but-kept heap at the peak (mallinfo2 fordblks): memory that a malloc_trim
                  would give back (common/train/heap.py); in use = live allocations from the heap, mmapped =
                  allocations above glibc's mmap threshold
    climb         the first sample past each 10 % of the peak, with its phase: what the memory is made of,
                  in the order it arrives
    stack         the peak's stack, the project's frames (and the framework call they made)

It found the heap effect that torch fsdp now releases (docs/benchmarks.md, "torch fsdp returns its freed
heap"). Linux only; the heap figures need glibc 2.33 or later. The probe costs the rank a thread that wakes
every 0.5 ms (--period-ms): step times of a probed run are not the run's own.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import benchlib
from common.metrics import read_jsonl  # noqa: E402 - benchlib puts the project on sys.path
from compare.launch.watchdog import read_ranks  # noqa: E402

MiB = 2**20
PROBE_DIR = Path(__file__).resolve().parent / "rss_probe"
PROJECT_DIRS = ("common/", "mlx_impl/", "torch_impl/", "compare/")
ENTRY_POINTS = tuple(f"{d}launch.py" for d in PROJECT_DIRS)


def project_frames(stack: list[str]) -> list[str]:
    """The stack's frames in this project, paths from the repository root, plus the first frame outside it
    that the innermost project frame called (the framework's call that allocated)."""
    root = str(benchlib.REPO) + os.sep
    kept, called = [], None
    for frame in stack:
        if frame.startswith(root) and frame[len(root):].startswith(PROJECT_DIRS):
            kept.append(frame[len(root):])
            called = None
        elif kept and called is None:
            called = frame.rsplit("/", 1)[-1]
    return kept + ([f"  -> {called}"] if called else [])


def phase(stack: list[str]) -> str:
    """The innermost project frame's function (file:function), or the innermost frame where there is none."""
    frames = [f for f in project_frames(stack) if not f.startswith("  ->")]
    if not frames:  # before the rank's own code runs, or in a call that left no project frame
        return f"outside the project ({stack[-1].rsplit('/', 1)[-1]})" if stack else "no Python frame"
    path, _, name = frames[-1].partition(" ")
    path = path.split(":")[0]
    where = f"{path}:{name}"
    # A module's top level is an import, except the rank's entry point (python -m {framework}_impl.launch).
    return f"importing ({where})" if name == "<module>" and not path.endswith(ENTRY_POINTS) else where


def read_probe(path: Path) -> tuple[dict, list[dict]]:
    """(the header line, the samples) of one process's probe file; a line cut by the process's end is dropped."""
    lines = read_jsonl(path)
    return (lines[0], lines[1:]) if lines else ({}, [])


def rank_pids(run_dir: Path, world_size: int) -> dict[int, int]:
    """pid -> rank, from the ranks' status files (common/metrics.py RankStatus)."""
    return {info["pid"]: rank for rank, info in read_ranks(run_dir, world_size).items() if "pid" in info}


def climb(samples: list[dict], peak: int) -> list[tuple[int, float, str]]:
    """(percent, t_s, phase) of the first sample past each 10 % of the peak."""
    out, next_mark = [], 10
    for s in samples:
        while next_mark <= 100 and s["rss_bytes"] >= peak * next_mark / 100:
            out.append((next_mark, s["t_s"], phase(s["stack"])))
            next_mark += 10
    return out


def mib(value) -> str:
    return "-" if value is None else f"{value / MiB:,.0f}"


def report(run_dir: Path, probe_dir: Path, summary: dict) -> list[dict]:
    """One row per rank that wrote a probe file (the launcher's and the probes' own files are not ranks'),
    printed as it goes."""
    pids, rows = rank_pids(run_dir, int(summary.get("world_size") or 1)), []
    peaks = dict(enumerate(summary.get("peak_rss_bytes") or []))  # rank -> VmHWM
    for path in sorted(probe_dir.glob("*.jsonl")):
        header, samples = read_probe(path)
        rank = pids.get(header.get("pid"))
        if rank is None or not samples:
            continue
        top = max(samples, key=lambda s: s["rss_bytes"])
        rows.append({"rank": rank, "peak_bytes": top["rss_bytes"], "vmhwm_bytes": peaks.get(rank),
                     "t_s": top["t_s"], "phase": phase(top["stack"]),
                     **{k: top.get(k) for k in ("rss_anon_bytes", "rss_file_bytes", "heap_bytes", "heap_in_use_bytes",
                                                "heap_free_bytes", "mmapped_bytes")},
                     "stack": project_frames(top["stack"]), "climb": climb(samples, top["rss_bytes"])})
    rows.sort(key=lambda r: r["rank"])
    for r in rows:
        print(f"\nrank {r['rank']}: peak RSS {mib(r['peak_bytes'])} MiB sampled (VmHWM {mib(r['vmhwm_bytes'])}) "
              f"at {r['t_s']:.1f} s, in {r['phase']}")
        print(f"  RssAnon {mib(r['rss_anon_bytes'])} MiB, RssFile {mib(r['rss_file_bytes'])} MiB")
        if r["heap_bytes"] is not None:
            print(f"  glibc heap {mib(r['heap_bytes'])} MiB: in use {mib(r['heap_in_use_bytes'])}, "
                  f"free but kept {mib(r['heap_free_bytes'])}; mmapped {mib(r['mmapped_bytes'])} MiB")
        print("  climb (first sample past each 10 % of the peak):")
        for percent, t_s, where in r["climb"]:
            print(f"    {percent:3d} %  {t_s:7.2f} s  {where}")
        print("  stack at the peak (project frames, innermost last):")
        for frame in r["stack"][-12:]:
            print(f"    {frame}")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench/rss_timeline.json"))
    parser.add_argument("--framework", default="torch", choices=("mlx", "torch"))
    parser.add_argument("--strategy", default="fsdp")
    parser.add_argument("--preset", default="base")
    parser.add_argument("--layers", type=int, default=12, help="model.n_layers of base (12 is the preset's; other presets: --set model.n_layers=N)")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--period-ms", type=float, default=0.5, help="the probe's sampling period")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="more dpcompare --set overrides (after the defaults)")
    parser.add_argument("--quick", action="store_true", help="run_all.py: `small`, 2 steps")
    a = parser.parse_args()
    if not sys.platform.startswith("linux"):
        print("bench_rss_timeline: needs Linux (/proc/self/statm)", file=sys.stderr)
        return 2
    if a.quick:
        a.preset, a.steps = "small", 2
    sets = ["model.vocab_size=50000", "model.n_kv_heads=4"] if a.preset == "base" else []
    sets += [f"model.n_layers={a.layers}"] if a.preset == "base" else []
    if a.strategy == "pp" and not any(x.startswith("pp_microbatches=") for x in a.set):
        sets.append(f"pp_microbatches={a.batch}")  # dpcompare's default (4) must divide the batch
    sets += a.set
    extra = ["--strategy", a.strategy, "--profile-steps", "0"] + [x for s in sets for x in ("--set", s)]

    with tempfile.TemporaryDirectory(prefix="bench_rss_") as work:
        probe_dir, run_dir = Path(work) / "probe", Path(work) / "run"
        probe_dir.mkdir()
        os.environ.update({"DPCOMPARE_RSS_PROBE": str(probe_dir), "DPCOMPARE_RSS_PROBE_MS": str(a.period_ms),
                           "PYTHONPATH": os.pathsep.join(filter(None, [str(PROBE_DIR), os.environ.get("PYTHONPATH")]))})
        print(f"bench_rss_timeline: {a.framework} {a.strategy} x{a.nproc}, {a.preset} ({' '.join(sets) or 'preset'}), "
              f"seq {a.seq_len}, global batch {a.batch}, {a.steps} steps; probe every {a.period_ms} ms", flush=True)
        try:
            summary = benchlib.dpcompare_run(run_dir, a.framework, a.nproc, a.preset, a.steps, a.seq_len, a.batch,
                                             extra=extra)
        except RuntimeError as err:  # the run's own one-line error (exit 2: dpcompare refused the flags)
            print(f"bench_rss_timeline: {str(err).strip().splitlines()[-1]}", file=sys.stderr)
            return 2 if str(err).startswith("dpcompare run failed (2)") else 1
        rows = report(run_dir, probe_dir, summary)
        if not rows:
            print("bench_rss_timeline: no rank wrote a probe file (is benchmarks/rss_probe on the ranks' path?)",
                  file=sys.stderr)
            return 1
    benchlib.write_result(a.out, "rss_timeline", vars(a) | {"out": str(a.out), "sets": sets}, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
