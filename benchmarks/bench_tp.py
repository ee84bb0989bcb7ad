"""Strategies side by side at N=2: per-rank training-state bytes, tokens/s and the communication share of a
step, for each framework (written for tp vs ddp; any strategy `--strategy` takes runs through it).

    python benchmarks/bench_tp.py [--quick] [--strategies ddp,tp] [--preset base] [--out runs/bench/tp.json]

Each row is one `dpcompare run --nproc 2 --set strategy=S`, read from its summary.json:
- state bytes per rank: what Trainer.state_bytes() says it holds (parameters, gradients, AdamW moments);
- tokens/s: median over the steps after the warmup;
- comm bytes per step: counted in the step's collectives (summary `comm_bytes_per_step`), next to the
  estimate from the shapes (common/parallel/tp.py);
- comm share: the step's all-reduces replayed back to back at the same sizes and count (replay_rank.py, started
  as the runner starts ranks), over the median step time. tp's all-reduces sit on the critical path, so for tp this
  is the time the step spends communicating; DDP can overlap its buckets with the backward pass (torch does),
  so for ddp it is an upper bound. ddp's replay uses whole buckets (MLX's all_reduce_size, DDP's
  bucket_cap_mb), as many as the gradient bytes fill.

`base` is big for a 2-core CPU: by default few steps, a short sequence and a small batch, so tp's
activation all-reduces are small next to ddp's gradient all-reduce (their bytes grow with tokens per step, ddp's
with parameters: they cross at about parameters / (4 x layers x dim) tokens, ~4,900 for base). base has 3 kv
heads, which do not split over 2 ranks: the benchmark sets model.n_kv_heads=4 (same for every row), and keeps
base's 50000-token vocabulary (model.vocab_size) although the builtin tokenizer uses fewer of them.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import benchlib

from common.config import RunConfig

WORLD = 2


def replay_times(framework: str, plans: list[tuple[int, int]], work: Path) -> dict[tuple[int, int], float]:
    """Median seconds for COUNT back-to-back all-reduces of SIZE bytes at N=2 (replay_rank.py), per (SIZE, COUNT)."""
    out = work / f"replay_{framework}.json"
    benchlib.launch_script(benchlib.REPO / "benchmarks" / "replay_rank.py",
                           [framework, RunConfig(framework=framework).resolved_backend, str(out),
                            *(f"{size}:{count}" for size, count in plans)], framework, WORLD)
    return {(r["size_bytes"], r["count"]): benchlib.median(r["times_s"]) for r in json.loads(out.read_text())}


def messages(strategy: str, framework: str, s: dict, spec: dict, seq_len: int, batch: int) -> tuple[int, int]:
    """(message size in bytes, messages per step) of one step's all-reduces (ddp: whole buckets, rounded up)."""
    total = s["comm_bytes_per_step"] or 0
    if strategy == "tp":  # 4 per layer and micro-step, each (batch, seq, dim) float32
        size = batch * seq_len * spec["dim"] * 4
    else:
        cfg = s["config"]
        size = int((cfg["all_reduce_size_mb"] if framework == "mlx" else cfg["bucket_cap_mb"]) * 2**20)
        size = min(size, total) if total else size
    size -= size % 4
    return size, (-(-total // size) if size else 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench/tp.json"))
    parser.add_argument("--quick", action="store_true", help="one run per row instead of two")
    parser.add_argument("--strategies", default="ddp,tp")
    parser.add_argument("--frameworks", default="mlx,torch")
    parser.add_argument("--preset", default="base")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--set", action="append", default=[], help="extra config fields, KEY=VALUE")
    a = parser.parse_args()
    repeats = 1 if a.quick else 2
    model = ["model.n_kv_heads=4", "model.vocab_size=50000"] if a.preset == "base" else []
    settings = model + a.set

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_tp_") as work:
        work = Path(work)
        for framework in a.frameworks.split(","):
            runs = []
            for strategy in a.strategies.split(","):
                extra = [x for kv in [f"strategy={strategy}", *settings] for x in ("--set", kv)]
                got = []
                for _ in range(repeats):
                    benchlib.wait_for_quiet()
                    run_dir = work / f"{framework}_{strategy}"
                    got.append(benchlib.dpcompare_run(run_dir, framework, WORLD, a.preset, a.steps, a.seq_len,
                                                      a.batch, extra=extra))
                spec = json.loads((run_dir / "run_config.json").read_text())["spec"]
                runs.append((strategy, got, spec))
            plans = {strategy: messages(strategy, framework, got[-1], spec, a.seq_len, a.batch)
                     for strategy, got, spec in runs}
            benchlib.wait_for_quiet()
            times = replay_times(framework, sorted({p for p in plans.values() if p[0]}), work)
            for strategy, got, spec in runs:
                size, count = plans[strategy]
                step_s = benchlib.median([s["step_time_s"] for s in got])
                comm_s = times[size, count] if size else 0.0
                last = got[-1]
                rows.append({
                    "framework": framework, "strategy": strategy, "nproc": WORLD, "preset": a.preset,
                    "tokens_per_s": benchlib.median([s["tokens_per_s"] for s in got]), "step_time_s": step_s,
                    "state_bytes_per_rank": [sum(b.values()) for b in last["state_bytes"]],
                    "state_bytes": last["state_bytes"],
                    "comm_bytes_per_step": last["comm_bytes_per_step"],
                    "comm_bytes_per_step_estimate": last["comm_bytes_per_step_estimate"],
                    "allreduce_size_bytes": size, "allreduces_per_step": count, "comm_s_per_step": comm_s,
                    "comm_share": comm_s / step_s if step_s else None,
                    "peak_rss_bytes": last["peak_rss_bytes"], "runs_tokens_per_s": [s["tokens_per_s"] for s in got],
                })

    for r in rows:
        r["state_MB_rank0"] = r["state_bytes_per_rank"][0] / 1e6
        r["comm_MB"] = (r["comm_bytes_per_step"] or 0) / 1e6
        r["comm_MB_est"] = (r["comm_bytes_per_step_estimate"] or 0) / 1e6
        r["rss_MB_rank0"] = (r["peak_rss_bytes"][0] or 0) / 1e6
    benchlib.print_table(rows, [("framework", "framework", ""), ("strategy", "strategy", ""),
                                ("state_MB_rank0", "state MB/rank", ",.0f"), ("rss_MB_rank0", "peak RSS MB", ",.0f"),
                                ("tokens_per_s", "tokens/s", ",.0f"), ("step_time_s", "step s", ".3f"),
                                ("comm_MB", "comm MB/step", ",.1f"), ("comm_MB_est", "estimate", ",.1f"),
                                ("comm_s_per_step", "comm s", ".3f"), ("comm_share", "comm share", ".1%")],
                        title=f"{a.preset} at N={WORLD}, seq {a.seq_len}, global batch {a.batch}, {a.steps} steps")
    benchlib.write_result(a.out, "tp", vars(a) | {"out": str(a.out), "settings": settings}, rows)


if __name__ == "__main__":
    main()
