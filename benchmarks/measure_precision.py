"""How far bf16 moves the loss, per framework and between them: the measurements behind
common/model/precision.py DEFAULT_TOLERANCES["bfloat16"] (docs/precision.md).

    python benchmarks/measure_precision.py --preset tiny --seeds 0,1,2,3,4 --out runs/precision/tiny.json
    python benchmarks/measure_precision.py --preset small --seeds 0,1 --steps 10 --seq-len 256 --batch 4 \
        --eval-every 10 --dp-seeds 0 --out runs/precision/small.json

Per seed: `dpcompare run` for MLX and torch in float32 and bfloat16 at N=1, and bfloat16 at N=2 for the
seeds in --dp-seeds; same seed checkpoint and batches throughout. The metrics are those of
compare/report/parity.py, relative where bf16 needs it:
    step_rel   max |a - b| / |b| over the first --parity-steps steps
    curve_rel  max relative difference of the moving averages (window 10) over all steps
    eval_rel   max relative difference of the eval losses
Run directories are kept under --work and reused when complete, so an interrupted measurement resumes.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

import benchlib

from compare.report.parity import moving_average

WINDOW = 10


def curves(run_dir: Path) -> tuple[dict[int, float], dict[int, float]]:
    train, evals = {}, {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "loss" in row:
            train[row["step"]] = row["loss"]
        if "eval_loss" in row:
            evals[row["step"]] = row["eval_loss"]
    return train, evals


def compare(a: Path, b: Path, parity_steps: int) -> dict:
    (ta, ea), (tb, eb) = curves(a), curves(b)
    steps = sorted(set(ta) & set(tb))
    ya, yb = np.array([ta[s] for s in steps]), np.array([tb[s] for s in steps])
    first = np.array(steps) <= parity_steps
    step_rel = np.abs(ya - yb) / np.abs(yb)
    ma, mb = moving_average(ya, WINDOW), moving_average(yb, WINDOW)
    common = sorted(set(ea) & set(eb))
    return {"step_rel": float(step_rel[first].max()), "step_abs": float(np.abs(ya - yb)[first].max()),
            "curve_rel": float((np.abs(ma - mb) / np.abs(mb)).max()),
            "eval_rel": max((abs(ea[s] - eb[s]) / abs(eb[s]) for s in common), default=None)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/precision/tiny.json"))
    parser.add_argument("--work", type=Path, default=None, help="run directories (default: next to --out)")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--dp-seeds", default=None, help="seeds that also run bf16 at N=2 (default: all)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", default="2e-3")
    parser.add_argument("--warmup-steps", default="20")
    parser.add_argument("--eval-every", default="50")
    parser.add_argument("--parity-steps", type=int, default=20)
    parser.add_argument("--set", action="append", default=[], help="KEY=VALUE passed to every run")
    a = parser.parse_args()
    seeds = [int(s) for s in a.seeds.split(",")]
    dp_seeds = seeds if a.dp_seeds is None else [int(s) for s in a.dp_seeds.split(",") if s]
    work = a.work or a.out.with_suffix("")

    def run(framework: str, dtype: str, nproc: int, seed: int) -> Path:
        out = work / f"seed{seed}" / f"{framework}-{dtype}-n{nproc}"
        summary = out / "summary.json"
        if not (summary.exists() and json.loads(summary.read_text()).get("status") == "ok"):
            benchlib.dpcompare_run(out, framework, nproc, a.preset, a.steps, a.seq_len, a.batch, extra=[
                "--dtype", dtype, "--seed", str(seed), "--lr", a.lr, "--warmup-steps", a.warmup_steps,
                "--eval-every", a.eval_every,
                # An MLX bf16 `small` step on a CPU can take over a minute: not a hang.
                "--collective-timeout-s", "900", *[x for kv in a.set for x in ("--set", kv)]])
        return out

    rows = []
    for seed in seeds:
        r = {(fw, dt, 1): run(fw, dt, 1, seed) for fw in ("mlx", "torch") for dt in ("float32", "bfloat16")}
        if seed in dp_seeds:
            r.update({(fw, "bfloat16", 2): run(fw, "bfloat16", 2, seed) for fw in ("mlx", "torch")})
        pairs = {"mlx vs torch, fp32": (r["mlx", "float32", 1], r["torch", "float32", 1]),
                 "mlx vs torch, bf16": (r["mlx", "bfloat16", 1], r["torch", "bfloat16", 1]),
                 "mlx bf16 vs fp32": (r["mlx", "bfloat16", 1], r["mlx", "float32", 1]),
                 "torch bf16 vs fp32": (r["torch", "bfloat16", 1], r["torch", "float32", 1])}
        if seed in dp_seeds:
            pairs.update({"mlx vs torch, bf16, N=2": (r["mlx", "bfloat16", 2], r["torch", "bfloat16", 2]),
                          "mlx bf16 N=2 vs N=1": (r["mlx", "bfloat16", 2], r["mlx", "bfloat16", 1]),
                          "torch bf16 N=2 vs N=1": (r["torch", "bfloat16", 2], r["torch", "bfloat16", 1])})
        for name, (x, y) in pairs.items():
            rows.append({"seed": seed, "pair": name, **compare(x, y, a.parity_steps)})
            print(f"seed {seed}  {name:24s} " + "  ".join(
                f"{k} {rows[-1][k]:.2e}" for k in ("step_abs", "step_rel", "curve_rel", "eval_rel")
                if rows[-1][k] is not None), flush=True)

    worst = {}
    for row in rows:
        w = worst.setdefault(row["pair"], {"pair": row["pair"], "seeds": 0})
        w["seeds"] += 1
        for k in ("step_abs", "step_rel", "curve_rel", "eval_rel"):
            if row[k] is not None:
                w[k] = max(w.get(k, 0.0), row[k])
    benchlib.print_table(list(worst.values()), [("pair", "pair", ""), ("seeds", "seeds", "d"),
                                                ("step_abs", "step abs", ".2e"), ("step_rel", "step rel", ".2e"),
                                                ("curve_rel", "curve rel", ".2e"), ("eval_rel", "eval rel", ".2e")],
                         title=f"max over seeds {a.seeds}: {a.preset}, seq {a.seq_len}, batch {a.batch}, "
                               f"{a.steps} steps, lr {a.lr}; step = first {a.parity_steps} steps")
    benchlib.write_result(a.out, "precision", {**vars(a), "out": str(a.out), "work": str(work)}, rows,
                          worst=list(worst.values()))


if __name__ == "__main__":
    main()
