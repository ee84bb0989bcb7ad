"""The model's op classes, MLX against torch, on this machine: ms per training step of matmul, attention,
softmax/cross-entropy, norms/activations/RoPE and the optimizer, beside each class's lower bound, from the same
code every 1-rank run profiles with (common/train/opprofile.py) and the same table the report shows.

    python benchmarks/bench_ops.py [--preset tiny --seq-len 128 --batch 8] [--rounds 2] [--out runs/bench/ops.json]
    python benchmarks/bench_ops.py --preset small --seq-len 256 --batch 8     # TinyStories + GPT-2, as bench_gap
    python benchmarks/bench_ops.py --exp                                      # the exp micro-benchmark below

The default is the demo's shape (configs/demo.toml: tiny, seq 128, global batch 8, 1 thread). Each round runs
`dpcompare run --nproc 1` for both frameworks (the order alternates between rounds), with --profile-steps 0 and
the op profile on, then builds the report from the run directories (`dpcompare report` does the same) and prints
its op-class table and the speed verdict's op class; with several rounds, the report of the last one and every
round's class times in the JSON.

--exp: ops where MLX on a CPU is the limit: each op on the `small` head's logits (2048 tokens x 50257, float32),
MLX against torch, one thread each, minimum of a few calls after a warmup. The time breakdown
(common/train/breakdown.py) put MLX's gap to torch on `small` in the cross-entropy; this isolates the op behind
it: the exponential inside logsumexp/softmax. MLX runs twice, in child processes, once with the fused kernels
mx.compile builds with MLX's own flags (`--mlx-cpu-jit baseline`) and once with -march=native (`native`,
dpcompare's default on Linux x86): uncompiled ops use MLX's prebuilt kernels and do not change; compiled ones
do. A minimal reproduction to send upstream is printed with the table (docs/benchmarks.md has it too).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import benchlib  # noqa: E402

SHAPE = (2048, 50257)
REPEATS = 3

REPRO = """import time, mlx.core as mx
x = mx.random.normal((2048, 50257)); mx.eval(x)
for f in (mx.exp, mx.compile(lambda z: mx.exp(z - 1.0)), lambda z: mx.logsumexp(z, axis=-1)):
    mx.eval(f(x)); t = time.perf_counter(); mx.eval(f(x)); print(time.perf_counter() - t)"""


def best(fn, sync) -> float:
    sync(fn())
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        sync(fn())
        times.append(time.perf_counter() - start)
    return min(times)


def mlx_times() -> dict:
    import mlx.core as mx
    import mlx.nn as nn

    from mlx_impl.step import cross_entropy

    x = mx.random.normal(SHAPE)
    t = mx.random.randint(0, SHAPE[1], (SHAPE[0],))
    mx.eval(x, t)
    grad = mx.grad(lambda z: nn.losses.cross_entropy(z, t, reduction="none").sum())
    ours = mx.compile(lambda z: cross_entropy(z, t))
    ours_grad = mx.compile(mx.grad(lambda z: cross_entropy(z, t).sum()))
    # A graph of one op runs MLX's prebuilt kernel even under mx.compile; two or more fuse into a JIT kernel.
    exp_fused = mx.compile(lambda z: mx.exp(z - 1.0))
    ops = {"exp": lambda: mx.exp(x), "exp(x - 1), mx.compile": lambda: exp_fused(x), "max (row)": lambda: x.max(axis=-1),
           "logsumexp (row)": lambda: mx.logsumexp(x, axis=-1), "softmax (row)": lambda: mx.softmax(x, axis=-1),
           "cross_entropy forward": lambda: nn.losses.cross_entropy(x, t, reduction="none"),
           "cross_entropy forward+backward": lambda: grad(x),
           "dpcompare cross_entropy forward, mx.compile": lambda: ours(x),
           "dpcompare cross_entropy forward+backward, mx.compile": lambda: ours_grad(x)}
    return {name: best(fn, mx.eval) for name, fn in ops.items()}


def mlx_times_in_child(jit: str) -> dict:
    """MLX's times in a fresh process whose fused kernels are built with `--mlx-cpu-jit jit`'s flags."""
    from compare.machine.environment import mlx_cpu_jit
    from common.config import RunConfig

    _, jit_env = mlx_cpu_jit(jit, RunConfig().cache_path)
    out = subprocess.run([sys.executable, __file__, "--mlx-child"], env={**os.environ, **jit_env},
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.splitlines()[-1])


def torch_times() -> dict:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    x = torch.randn(SHAPE)
    t = torch.randint(0, SHAPE[1], (SHAPE[0],))
    xr = x.clone().requires_grad_()

    def fwd_bwd():
        xr.grad = None
        F.cross_entropy(xr, t, reduction="none").sum().backward()
        return xr.grad

    ops = {"exp": lambda: torch.exp(x), "exp(x - 1), mx.compile": lambda: torch.exp(x - 1.0), "max (row)": lambda: x.max(dim=-1).values,
           "logsumexp (row)": lambda: torch.logsumexp(x, -1), "softmax (row)": lambda: torch.softmax(x, -1),
           "cross_entropy forward": lambda: F.cross_entropy(x, t, reduction="none"),
           "cross_entropy forward+backward": fwd_bwd}
    times = {name: best(fn, lambda r: None) for name, fn in ops.items()}
    # torch has no mx.compile counterpart here: its eager kernels are already vectorised. The project's
    # torch loss is F.cross_entropy (torch_impl/step.py), so the same figures stand for both rows.
    times["dpcompare cross_entropy forward, mx.compile"] = times["cross_entropy forward"]
    times["dpcompare cross_entropy forward+backward, mx.compile"] = times["cross_entropy forward+backward"]
    return times


def op_class_rounds(a: argparse.Namespace) -> None:
    """Both frameworks' 1-rank runs with the op profile, alternating, then the report's op-class table."""
    from common.train.opclasses import OP_CLASSES
    from compare.report.opclass_table import opclass_blocks
    from compare.report.parity import Tolerances
    from compare.report.verdict_table import text_table
    from compare.report.writer import write_report

    root = a.out.with_suffix("")
    rounds = []
    for r in range(a.rounds):
        dirs = []
        for framework in (("mlx", "torch") if r % 2 == 0 else ("torch", "mlx")):
            out = root / f"round{r}" / framework
            benchlib.dpcompare_run(out, framework, 1, a.preset, a.steps, a.seq_len, a.batch,
                                   extra=["--profile-steps", "0", "--op-profile", "--dtype", a.dtype])
            dirs.append(out)
        summary = write_report(sorted(dirs), root / f"round{r}" / "report", Tolerances(), {})
        rounds.append(summary)
        print(f"round {r + 1}: " + ", ".join(f"{run['label']} {run['tokens_per_s']:,.0f} tokens/s" for run in summary["runs"]))
    for block in opclass_blocks(rounds[-1]["runs"]):
        if block[0] == "table":
            print("\n" + "\n".join(text_table(block[1], block[2], right=frozenset(range(1, len(block[1]))))))
        elif block[0] in ("p", "h2") and len(block[1]) < 120:
            print("\n" + block[1])
        elif block[0] == "ul":
            print("\n".join(f"! {line}" for line in block[1]))
    for s in rounds[-1]["speed"]:
        print(f"\n{s['faster']} is {s['speedup']:.2f}x faster than {s['slower']}; the op class that differs most: "
              f"{s.get('op_class_gap') or '-'}")
    rows = [{"round": i, "label": run["label"], "tokens_per_s": run["tokens_per_s"],
             **{f"{name} ms": 1e3 * run["op_profile"]["classes"][name]["s"] for name in OP_CLASSES},
             "step ms": 1e3 * run["op_profile"]["reference_step_s"], "outside share": run["op_profile"]["outside_share"],
             "profile s": run["op_profile"]["wall_s"]}
            for i, summary in enumerate(rounds) for run in summary["runs"] if run.get("op_profile")]
    benchlib.write_result(a.out, "ops", {"preset": a.preset, "seq_len": a.seq_len, "batch": a.batch, "steps": a.steps,
                                         "dtype": a.dtype, "rounds": a.rounds, "runs": str(root)}, rows)


def exp_table(a: argparse.Namespace) -> None:
    baseline, native, torch = mlx_times_in_child("baseline"), mlx_times_in_child("native"), torch_times()
    rows = [{"op": op, "mlx_baseline_ms": 1e3 * baseline[op], "mlx_native_ms": 1e3 * native[op],
             "torch_ms": 1e3 * torch[op], "mlx_over_torch": native[op] / torch[op]} for op in baseline]
    benchlib.print_table(rows, [("op", "op", ""), ("mlx_baseline_ms", "MLX ms (JIT baseline)", ",.0f"),
                                ("mlx_native_ms", "MLX ms (JIT native)", ",.0f"), ("torch_ms", "torch ms", ",.0f"),
                                ("mlx_over_torch", "MLX native / torch", ".1f")],
                         title=f"ops on {SHAPE[0]} x {SHAPE[1]} float32, 1 thread")
    print("\nminimal reproduction (MLX):\n" + REPRO)
    benchlib.write_result(a.out, "ops_exp", {"shape": SHAPE, "repeats": REPEATS, "out": str(a.out)}, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench/ops.json"),
                        help="the JSON result; the runs go beside it (runs/bench/ops/)")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="global batch size")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of both frameworks, alternating")
    parser.add_argument("--exp", action="store_true", help="the exp micro-benchmark instead (see above)")
    parser.add_argument("--quick", action="store_true", help="one round (run_all.py)")
    parser.add_argument("--mlx-child", action="store_true", help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.mlx_child:
        print(json.dumps(mlx_times()))
    elif a.exp:
        exp_table(a)
    else:
        a.rounds = 1 if a.quick else a.rounds
        op_class_rounds(a)


if __name__ == "__main__":
    main()
