"""Collectives: all-reduce latency and bandwidth against message size, the gradient sync's share of a step,
and sweeps of MLX's all_reduce_size and DDP's bucket_cap_mb.

    python benchmarks/bench_collectives.py [--quick] [--parts allreduce,share,knobs] [--out runs/bench/collectives.json]

1. all_sum of a float32 buffer, 4 KB .. 256 MB, for MLX ring, MLX MPI and torch gloo at N=2 (allreduce_rank.py,
   started as the runner starts ranks); plus the `small` model's gradient size. Plot next to the JSON.
   Times are per call (median, and the 10th percentile: on a busy 2-core machine a rank that sleeps in a
   blocking receive often waits 4 or 8 ms to run again (times come in 4 ms steps); MPI busy-polls and does not).
2. Sync share at N=2 on `small`: the bare loops with and without the gradient all-reduce (bare_*.py
   --no-sync), back to back: share = (step with sync - step without) / step with sync, median over the
   pairs. Target <= 10 %.
   torch twice: DDP's defaults, and DDP as torch_impl/step.py configures it (--ddp-as-suite).
3. `dpcompare run` at N=2 on `small` for several --all-reduce-size-mb (MLX) and --bucket-cap-mb (torch).
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import benchlib
import numpy as np
from bench_overhead import bare_tokens_per_s

from common.model.spec import preset
from common.model.weights import num_parameters

TARGET_SHARE = 0.10
SIZES = [4096 * 4 ** k for k in range(10)]  # 4 KB .. 1 GB; capped by --max-mb
BACKENDS = [("mlx", "ring"), ("mlx", "mpi"), ("torch", "gloo")]
VOCAB = 50257  # `small` on TinyStories with GPT-2's tokenizer


def sweep(framework: str, backend: str, sizes: list[int], work: Path) -> list[dict]:
    out = work / f"allreduce_{framework}_{backend}.json"
    benchlib.launch_script(benchlib.REPO / "benchmarks" / "allreduce_rank.py", [framework, backend, str(out),
                           *map(str, sizes)], framework, 2, backend=backend)
    name = f"{framework} {backend}"
    rows = []
    for r in json.loads(out.read_text())["results"]:
        t, fast = benchlib.median(r["times_s"]), float(np.percentile(r["times_s"], 10))
        # N=2: algorithm and bus bandwidth coincide (busbw = algbw * 2 (N-1) / N).
        rows.append({"backend": name, "size_bytes": r["size_bytes"], "time_s": t, "latency_us": t * 1e6,
                     "p10_latency_us": fast * 1e6, "busbw_GBps": r["size_bytes"] / t / 1e9,
                     "p10_busbw_GBps": r["size_bytes"] / fast / 1e9, "calls": len(r["times_s"])})
    return rows


def plot(rows: list[dict], grad_bytes: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (lat, bw) = plt.subplots(1, 2, figsize=(11, 4))
    for name in dict.fromkeys(r["backend"] for r in rows):
        mine = sorted((r for r in rows if r["backend"] == name), key=lambda r: r["size_bytes"])
        x = [r["size_bytes"] for r in mine]
        lat.plot(x, [r["latency_us"] for r in mine], marker="o", label=name)
        bw.plot(x, [r["busbw_GBps"] for r in mine], marker="o", label=name)
    for ax, label in ((lat, "time per all-reduce (µs)"), (bw, "bandwidth (GB/s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel(label)
        ax.axvline(grad_bytes, color="grey", linestyle=":", label="small's gradients")
        ax.grid(True, which="both", alpha=0.3)
    lat.set_yscale("log")
    bw.legend()
    fig.suptitle("all-reduce at N=2 on this machine (float32 sum, median per size)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def sync_share(a, allreduce: list[dict], grad_bytes: int, work: Path) -> list[dict]:
    rows = []
    for framework, label, extra in (("mlx", "mlx ring", []), ("torch", "torch gloo, DDP defaults", []),
                                    ("torch", "torch gloo, DDP as dpcompare", ["--ddp-as-suite"])):
        synced, unsynced = [], []
        for _ in range(1 if a.quick else 5):  # back-to-back pairs: a pair shares its load
            benchlib.wait_for_quiet()
            for no_sync, times in (([], synced), (["--no-sync"], unsynced)):
                times.append(a.batch * a.seq_len / bare_tokens_per_s(framework, 2, VOCAB, a, work, extra + no_sync))
        backend = {"mlx": "mlx ring", "torch": "torch gloo"}[framework]
        isolated = next(r["time_s"] for r in allreduce if r["backend"] == backend and r["size_bytes"] == grad_bytes)
        pair_shares = [(s - u) / s for s, u in zip(synced, unsynced)]
        step = benchlib.median(synced)
        rows.append({"framework": framework, "backend": label, "step_s": step,
                     "step_no_sync_s": benchlib.median(unsynced), "sync_share": benchlib.median(pair_shares),
                     "pair_shares": pair_shares, "allreduce_grads_s": isolated, "isolated_share": isolated / step,
                     "steps_s": synced, "steps_no_sync_s": unsynced,
                     "met": benchlib.median(pair_shares) <= TARGET_SHARE})
    benchlib.print_table(rows, [("backend", "backend", ""), ("step_s", "step (s)", ".3f"),
                                ("step_no_sync_s", "no sync (s)", ".3f"), ("sync_share", "sync share (median of pairs)", ".1%"),
                                ("allreduce_grads_s", f"all-reduce {grad_bytes / 2**20:.0f} MB (s)", ".3f"),
                                ("isolated_share", "its share", ".1%"), ("met", f"<={TARGET_SHARE:.0%}", "")],
                         title=f"gradient sync at N=2, small, seq {a.seq_len}, global batch {a.batch} (bare loops)")
    return rows


def knob_sweeps(a, work: Path) -> list[dict]:
    rows = []
    for framework, flag, values in (("mlx", "--all-reduce-size-mb", [4, 32] if a.quick else [1, 8, 32, 128]),
                                    ("torch", "--bucket-cap-mb", [5, 25] if a.quick else [1, 5, 25, 100])):
        runs = {value: [] for value in values}
        for _ in range(1 if a.quick else 2):  # the values alternate, so each sees the same load
            for value in values:
                benchlib.wait_for_quiet()
                s = benchlib.dpcompare_run(work / "run", framework, 2, "small", a.steps, a.seq_len, a.batch,
                                           extra=[flag, str(value)])
                runs[value].append(s["step_time_s"])
        for value, steps in runs.items():
            step = benchlib.median(steps)
            rows.append({"framework": framework, "knob": flag.lstrip("-"), "mb": value, "step_time_s": step,
                         "tokens_per_s": a.batch * a.seq_len / step, "runs_step_time_s": steps})
    benchlib.print_table(rows, [("framework", "framework", ""), ("knob", "option", ""), ("mb", "MB", "g"),
                                ("tokens_per_s", "tok/s", ".0f"), ("step_time_s", "step (s)", ".3f")],
                         title="dpcompare run at N=2 on small, by all-reduce chunk / bucket size")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench/collectives.json"))
    parser.add_argument("--quick", action="store_true", help="one sync-share pair, two sweep points each")
    parser.add_argument("--parts", default="allreduce,share,knobs", help="which of the three parts to run")
    parser.add_argument("--max-mb", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    a = parser.parse_args()
    a.preset, a.threads, parts = "small", 1, a.parts.split(",")
    grad_bytes = 4 * (num_parameters(preset("small").with_(vocab_size=VOCAB)) + 1)  # + the loss riding along
    # Without the full sweep, the gradient size alone (for the isolated all-reduce time of part 2).
    sizes = sorted([s for s in SIZES if s <= a.max_mb * 2**20] + [grad_bytes]) if "allreduce" in parts else [grad_bytes]
    png = a.out.with_suffix(".png") if "allreduce" in parts else None

    with tempfile.TemporaryDirectory(prefix="bench_collectives_") as work:
        work = Path(work)
        allreduce = []
        for framework, backend in BACKENDS:
            benchlib.wait_for_quiet()
            allreduce += sweep(framework, backend, sizes, work)
        benchlib.print_table(allreduce, [("backend", "backend", ""), ("size_bytes", "bytes", ",d"),
                                         ("latency_us", "median (µs)", ",.0f"), ("p10_latency_us", "p10 (µs)", ",.0f"),
                                         ("busbw_GBps", "GB/s", ".2f"), ("p10_busbw_GBps", "p10 GB/s", ".2f"),
                                         ("calls", "calls", "d")], title="all-reduce at N=2 (median per size)")
        if png:
            png.parent.mkdir(parents=True, exist_ok=True)
            plot(allreduce, grad_bytes, png)
            print(f"plot: {png}")
        share = sync_share(a, allreduce, grad_bytes, work) if "share" in parts else []
        knobs = knob_sweeps(a, work) if "knobs" in parts else []

    benchlib.write_result(a.out, "collectives", {**vars(a), "out": str(a.out), "sizes": sizes, "grad_bytes": grad_bytes,
                                                 "target_share": TARGET_SHARE}, allreduce,
                          sync_share=share, knob_sweeps=knobs, plot=str(png) if png else None)


if __name__ == "__main__":
    main()
