"""`plan --model` against measured runs (issue 56): calibrate on `tiny` at N=1, predict other models before they are
trained, then train them and print predicted against measured step time and peak RSS per rank.

    python benchmarks/bench_plan_model.py [--models small,base] [--nproc 1,2] [--strategies ddp,fsdp]
                                          [--frameworks mlx,torch] [--steps 8] [--out runs/bench/plan_model.json]
                                          [--keep DIR]
    python benchmarks/bench_plan_model.py --again DIR   # predict again from DIR's kept runs, print against them

Per framework: one `dpcompare run` of tiny at N=1 (the builtin data) and, at N=2, one of tiny per strategy (`plan
--fit`: the host work its collectives cost; --no-fit leaves them out), then `dpcompare plan --from it --model M` with
M's config.json written for GPT-2's vocabulary (the targets train on TinyStories with GPT-2's tokenizer), then one
`dpcompare run` of M per strategy and N, the frameworks alternating. Predicted and measured are each the run's median
step and its largest peak RSS over ranks. The runs load the machine (both cores, minutes for `base`): every figure is
as good as the machine was quiet, so the load average is printed beside it.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

import benchlib
from common.model.hfconfig import to_hf_config
from common.model.spec import PRESETS

GPT2_VOCAB = 50257


def plan_rows(cal_dir: Path, model_dir: Path, args, out: Path, fits: list[Path]) -> list[dict]:
    argv = benchlib.DPCOMPARE + ["plan", "--from", str(cal_dir), *[a for d in fits for a in ("--fit", str(d))],
                                 "--model", str(model_dir), "--nproc",
                                 ",".join(str(n) for n in args.nproc if n > 1) or "2", "--strategies", args.strategies,
                                 "--seq-len", str(args.seq_len), "--global-batch-size", str(args.batch), "--out", str(out)]
    proc = subprocess.run(argv, cwd=benchlib.REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"plan failed: {proc.stderr[-2000:]}")
    return json.loads((out / "plan.json").read_text())["predictions"]


def run(out: Path, framework: str, preset: str, nproc: int, strategy: str, args, data: list[str]) -> dict:
    argv = benchlib.DPCOMPARE + ["run", "--framework", framework, "--nproc", str(nproc), "--preset", preset,
                                 "--strategy", strategy, "--steps", str(args.steps), "--seq-len", str(args.seq_len),
                                 "--global-batch-size", str(args.batch), "--eval-every", "0", "--no-op-profile",
                                 *data, "--out", str(out), "--quiet", "--overwrite"]
    proc = subprocess.run(argv, cwd=benchlib.REPO, capture_output=True, text=True)
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    if proc.returncode != 0 or summary.get("status") != "ok":
        raise RuntimeError(f"run failed: {summary.get('error') or proc.stderr[-2000:]}")
    if not args.keep_checkpoints:  # --again predicts from the summaries; a kept 1B checkpoint is 5 GB
        benchlib.drop_checkpoints(out)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="small,base")
    parser.add_argument("--nproc", default="1,2")
    parser.add_argument("--strategies", default="ddp,fsdp")
    parser.add_argument("--frameworks", default="mlx,torch")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--no-fit", dest="fit", action="store_false",
                        help="predict without the tiny N=2 run of each strategy (`plan --fit`: its host work)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench/plan_model.json"))
    parser.add_argument("--keep", type=Path, default=None,
                        help="keep the runs and plans in this new folder (to predict again from the same runs)")
    parser.add_argument("--keep-checkpoints", action="store_true",
                        help="with --keep, keep each run's final checkpoint too (by default dropped after the run)")
    parser.add_argument("--again", type=Path, default=None, metavar="KEPT",
                        help="train nothing: predict again from the tiny runs kept in KEPT (--keep) and print the "
                             "predictions against KEPT's runs of the models (after a change to the cost model)")
    args = parser.parse_args()
    if args.again is not None:
        return again(args)
    if args.keep is not None and args.keep.exists():
        raise SystemExit(f"bench_plan_model: --keep {args.keep} exists; give a new folder")
    args.nproc = [int(n) for n in args.nproc.split(",")]
    frameworks = args.frameworks.split(",")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-plan-model-") as tmp:
        root = Path(tmp) if args.keep is None else args.keep
        root.mkdir(parents=True, exist_ok=True)
        predictions = {}
        for fw in frameworks:
            cal = root / f"tiny-{fw}"
            run(cal, fw, "tiny", 1, "ddp", args, benchlib.BUILTIN)
            fits = []  # each split strategy's host work, fitted on a tiny N=2 run of it (ddp's at N=2 too)
            for strategy in (args.strategies.split(",") if args.fit and 2 in args.nproc else []):
                fits.append(root / f"tiny-{fw}-{strategy}-2")
                run(fits[-1], fw, "tiny", 2, strategy, args, benchlib.BUILTIN)
            for model in args.models.split(","):
                folder = root / f"model-{model}"
                folder.mkdir(exist_ok=True)
                spec = PRESETS[model].with_(vocab_size=GPT2_VOCAB)
                (folder / "config.json").write_text(json.dumps(to_hf_config(spec)))
                for r in plan_rows(cal, folder, args, root / f"plan-{fw}-{model}", fits):
                    if "impossible" not in r:
                        predictions[(fw, model, r["strategy"], r["world_size"])] = r
        for model in args.models.split(","):
            for n in args.nproc:
                for strategy in args.strategies.split(","):
                    if n == 1 and strategy != "ddp":
                        continue
                    for fw in frameworks:  # the frameworks alternate
                        p = predictions.get((fw, model, strategy, n))
                        if p is None:
                            continue
                        load = benchlib.wait_for_quiet(max_wait_s=30)
                        s = run(root / f"{fw}-{model}-{strategy}-{n}", fw, model, n, strategy, args, benchlib.TINYSTORIES)
                        rows.append(compared(fw, model, p, s, load))
                        benchlib.print_table(rows[-1:], COLUMNS)
    benchlib.print_table(rows, COLUMNS, "plan --model: predicted from tiny N=1 against measured")
    benchlib.write_result(args.out, "plan_model", vars(args) | {"out": str(args.out)}, rows)


def compared(fw: str, model: str, p: dict, s: dict, load: float) -> dict:
    """One row: plan's prediction `p` against the run's summary.json `s` (its median step, its largest peak RSS)."""
    rss = max(r for r in s["peak_rss_bytes"] if r)
    return {"framework": fw, "model": model, "strategy": p["strategy"], "N": p["world_size"],
            "predicted_s": p["step_s"], "measured_s": s["step_time_s"], "step_error": p["step_s"] / s["step_time_s"] - 1,
            "predicted_mb": p["memory_bytes"]["total"] / 1e6, "measured_mb": rss / 1e6,
            "rss_error": p["memory_bytes"]["total"] / rss - 1, "load": load, "peak_at": p.get("memory_peak_at")}


def again(args) -> None:
    """The rows of a kept sitting, predicted again from its own tiny runs, beside the runs it measured."""
    kept, rows = args.again, []
    frameworks = [fw for fw in args.frameworks.split(",") if (kept / f"tiny-{fw}").is_dir()]
    if not frameworks:
        raise SystemExit(f"bench_plan_model: --again {kept} holds no kept tiny run (tiny-mlx, tiny-torch)")
    args.nproc = [int(n) for n in args.nproc.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench-plan-model-again-") as tmp:
        for fw in frameworks:
            fits = sorted(kept.glob(f"tiny-{fw}-*-2"))
            for model in args.models.split(","):
                for p in plan_rows(kept / f"tiny-{fw}", kept / f"model-{model}", args, Path(tmp) / f"{fw}-{model}", fits):
                    run_dir = kept / f"{fw}-{model}-{p['strategy']}-{p['world_size']}"
                    if "impossible" not in p and (run_dir / "summary.json").exists():
                        rows.append(compared(fw, model, p, json.loads((run_dir / "summary.json").read_text()),
                                             float("nan")))
    benchlib.print_table(rows, COLUMNS[:-1] + [("peak_at", "peak at", "s")],
                         f"plan --model predicted again from {kept}'s tiny runs against its measured runs")


COLUMNS = [("framework", "framework", "s"), ("model", "model", "s"), ("strategy", "strategy", "s"), ("N", "N", "d"),
           ("predicted_s", "pred s", ".3f"), ("measured_s", "meas s", ".3f"), ("step_error", "step err", "+.1%"),
           ("predicted_mb", "pred MB", ",.0f"), ("measured_mb", "meas MB", ",.0f"), ("rss_error", "RSS err", "+.1%"),
           ("load", "load", ".1f")]


if __name__ == "__main__":
    main()
