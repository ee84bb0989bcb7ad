"""The cost model against measured runs: predicted and measured step time at N (2 by default), per framework and
strategy, on loopback and on shaped links (issue 24's acceptance: within 15 %), one level or two.

    python benchmarks/bench_plan.py [--preset small] [--links none,1gbit,200mbit] [--strategies ddp,fsdp,tp]
                                    [--steps 12] [--out runs/bench/plan.json]
    # N=4 as two machines of 2: a link `OUTER/INNER` is --link OUTER --link-inner INNER --group-size 2
    python benchmarks/bench_plan.py --preset tiny --nproc 4 --group-size 2 --links none,100mbit/1gbit \
        --strategies ddp,fsdp,tp,pp --set model.n_layers=4 --set model.n_kv_heads=4
    # and meshes (issue 37), each its own compare at --nproc 1,N (the N=1 calibration, ddp and the mesh at N)
    ... --meshes "dp=2,pp=2;dp=2,tp=2;fsdp=2,tp=2"   # MLX's meshes run on MPI
    # an earlier sitting's tables again, with the model as it is now (the same flags, its --keep directory)
    ... --recompute DIR
    # and each axis's host work per byte moved fitted on an N=2 run of its strategy (common/costmodel/fit.py): the
    # strategies' compare runs at --nproc 1,2,N, and every row at N shows its error unfitted and fitted
    ... --fit

Per link one `dpcompare compare --nproc 1,2` (with `--link RATE` unless the link is `none`: plain loopback).
compare writes each N=2 run's `prediction` (compare/plan/predictions.py: calibrated on the N=1 run of the same framework
and dtype, over the link the job measured); this reads them back next to the measured step. `--link` needs
root and `ip` (the emulated links of issue 24); on a machine without them use `--links none`.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
from contextlib import nullcontext
from pathlib import Path

import benchlib
from compare.plan import fit_runs, predicted_record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench/plan.json"))
    parser.add_argument("--quick", action="store_true", help="fewer steps")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--links", default="none,1gbit,200mbit")
    parser.add_argument("--strategies", default="ddp,fsdp,tp", help="one-axis strategies at N ('' for none)")
    parser.add_argument("--meshes", default="", help="meshes at N, ';'-separated: 'dp=2,pp=2;fsdp=2,tp=2'")
    parser.add_argument("--frameworks", default="mlx,torch")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--nproc", type=int, default=2, help="the N predicted from N=1")
    parser.add_argument("--group-size", type=int, default=2, help="ranks per machine for a two-level link OUTER/INNER")
    parser.add_argument("--set", action="append", default=[], help="config fields, as dpcompare's --set")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--no-wait", action="store_true", help="start at once, whatever the load")
    parser.add_argument("--fit", action="store_true", help="fit each axis's host work on an N=2 run of its "
                        "strategy (the strategies' compare adds N=2) and show both errors")
    parser.add_argument("--keep", type=Path, help="train the compares under this directory and keep them")
    parser.add_argument("--fit-on", type=Path, action="append", default=[], metavar="KEPT",
                        help="also fit on the N=2 runs kept under KEPT by an earlier sitting's --keep (one on "
                        "loopback with --nproc 2, say, before one with --strategies '' over a two-level link)")
    parser.add_argument("--recompute", type=Path, metavar="KEPT", help="train nothing: the tables again from a "
                        "--keep directory of an earlier sitting (the same flags), with the model as it is now")
    parser.add_argument("--keep-checkpoints", action="store_true",
                        help="with --keep, keep each run's final checkpoint too (by default dropped once the run's "
                        "summary is read: the tables are made again from summaries alone)")
    parser.add_argument("--profile-steps", type=int, default=3, help="breakdown rounds of every run (its N=1 "
                        "calibration needs them; at 200mbit a `small` fsdp step takes ~8 s)")
    parser.add_argument("--repeat", type=int, default=1, metavar="K",
                        help="K sittings, one after another (each under KEEP/repI, fitted on its own N=2 runs), "
                        "then each layout's median error and how many sittings put it within 20 %%")
    a = parser.parse_args()
    if a.repeat < 1:
        parser.error(f"--repeat {a.repeat}: needs 1 or more sittings")
    steps = max(6, a.steps // 2) if a.quick else a.steps
    kept = a.recompute or a.keep
    for folder in [a.recompute, *a.fit_on]:
        if folder and not folder.is_dir():
            parser.error(f"{folder}: no such directory")
    rows: list[dict] = []
    with (nullcontext(str(kept)) if kept else tempfile.TemporaryDirectory(prefix="bench_plan_")) as work:
        for i in range(a.repeat):
            where = Path(work) / f"rep{i}" if a.repeat > 1 else Path(work)
            rows += [r | {"sitting": i} for r in sitting(a, steps, where, i, rows)]
    columns = [("link", "link", ""), ("run", "run", ""), ("n1_step_s", "N=1 s", ".4f"),
               ("load_average_at_start", "load", ".1f"), ("measured_step_s", "measured s", ".4f")]
    if a.repeat > 1:
        columns.insert(0, ("sitting", "sitting", "d"))
    if a.fit:
        columns += [("unfitted_step_s", "unfitted s", ".4f"), ("unfitted_error", "unfitted", "+.1%"),
                    ("fitted_on", "fitted on", "")]
    columns += [("predicted_step_s", "predicted s", ".4f"), ("error", "error", "+.1%")]
    title = f"{a.preset}, N={a.nproc} predicted from N=1" + (", each axis fitted on its strategy's N=2 run" if a.fit else "")
    benchlib.print_table(rows, columns, title)
    summary = medians(rows) if a.repeat > 1 else []
    if summary:
        benchlib.print_table(summary, [("link", "link", ""), ("run", "run", ""), ("errors", "errors", ""),
                                       ("median_error", "median", "+.1%"), ("within", "within 20 %", "")],
                             f"each layout over the {a.repeat} sittings")
    benchlib.write_result(a.out, "plan", vars(a) | {"steps": steps}, rows, **({"medians": summary} if summary else {}))


def sitting(a, steps: int, work: Path, index: int, earlier: list[dict]) -> list[dict]:
    """One sitting: per link, the strategies' compare and one compare per mesh, under `work`. Fitted (--fit) on
    --fit-on's N=2 runs (its repI folder where it has one) and on this sitting's own."""
    rows: list[dict] = []
    fit_dirs: list[Path] = []  # N=2 runs to fit the runs at N on (--fit)
    for kept_fits in a.fit_on:
        own = kept_fits / f"rep{index}"
        fit_dirs += [q.parent for q in sorted((own if own.is_dir() else kept_fits).glob("*/*-n2/summary.json"))]
    for link in a.links.split(","):
        # two ranks on 2 cores: another job's process halves a rank
        load = float("nan") if a.recompute else benchlib.load_average() if a.no_wait else benchlib.wait_for_quiet()
        outer, _, inner = link.partition("/")
        levels = ["--link", outer] + (["--link-inner", inner, "--group-size", str(a.group_size)] if inner else [])
        # one compare for the one-axis strategies, then one per mesh (a compare adds one mesh); with --fit the
        # strategies' compare adds N=2 where the link allows 2 ranks (two levels need two groups: there the
        # N=2 runs of an earlier link's compare, loopback's, are fitted on)
        nprocs = f"1,2,{a.nproc}" if a.fit and a.nproc > 2 and not inner else f"1,{a.nproc}"
        jobs = ([("", ["--nproc", nprocs, "--strategies", a.strategies])] if a.strategies else []) + [
            (f"-mesh{i}", ["--nproc", f"1,{a.nproc}", "--mesh", mesh])
            for i, mesh in enumerate(filter(None, a.meshes.split(";")))]
        base = work / link.replace("/", "-")  # the strategies' compare: with --fit every row's N=1
        for suffix, shape in jobs:
            out = work / (link.replace("/", "-") + suffix)
            rows += measure(a, steps, link, levels, out, shape, load, fit_dirs, base if a.strategies else None)
            fit_dirs += [p.parent for p in out.glob("*-n2/summary.json")] if a.fit and a.nproc > 2 else []
            benchlib.write_result(a.out, "plan", vars(a) | {"steps": steps, "partial": True},
                                  earlier + [r | {"sitting": index} for r in rows])
    return rows


def medians(rows: list[dict]) -> list[dict]:
    """Per (link, run): every sitting's error, their median, and in how many it was within 20 %."""
    by: dict[tuple, list[float]] = {}
    for r in rows:
        if r.get("error") is not None:
            by.setdefault((r["link"], r["run"]), []).append(r["error"])
    return [{"link": link, "run": run, "errors": " ".join(f"{e:+.0%}" for e in errors),
             "median_error": statistics.median(errors), "within": f"{sum(abs(e) <= 0.2 for e in errors)} of {len(errors)}"}
            for (link, run), errors in by.items()]


def measure(a, steps: int, link: str, levels: list[str], out: Path, shape: list[str], load: float,
            fit_dirs: list[Path], base: Path | None) -> list[dict]:
    """One compare (N=1 and the runs at N that `shape` asks for); a row per run at N: measured and predicted
    (with --fit: its prediction fitted on the N=2 runs of this compare and of `fit_dirs`, and without, both
    calibrated on the N=1 run of `base`, the strategies' compare of this link, which the fits were measured
    against: a mesh's compare trains an N=1 run of its own, and MLX's moved 0.120 -> 0.169 s between two)."""
    argv = benchlib.DPCOMPARE + [
        "compare", "--frameworks", a.frameworks, *shape, "--preset", a.preset, "--steps", str(steps), "--seq-len",
        str(a.seq_len), "--global-batch-size", str(a.batch), "--eval-every", "0", "--profile-steps",
        str(a.profile_steps), *benchlib.data_args(a.preset), "--out", str(out), "--quiet", "--no-samples",
        "--device", a.device,
        *[x for item in a.set for x in ("--set", item)], *([] if link == "none" else levels)]
    rows = []
    if not a.recompute:  # with it, the compare ran in an earlier sitting and its runs are read again
        proc = subprocess.run(argv, cwd=benchlib.REPO, capture_output=True, text=True)
        if proc.returncode not in (0, 1):  # 1: a run failed, its row says so; anything else: the compare did
            raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    for summary_path in sorted(out.glob(f"*-n{a.nproc}/summary.json")):
        s = json.loads(summary_path.read_text())
        if "--mesh" in shape and s.get("strategy") != "mesh":
            continue  # the mesh's compare also runs ddp at N: the strategies' compare has that row
        p = s.get("prediction") or {}
        source = json.loads((out / p["from"] / "summary.json").read_text()) if p.get("from") else {}
        fitted = {}
        if a.fit and p.get("step_s") and p.get("from"):
            cal_dir = base / p["from"] if base is not None and (base / p["from"]).is_dir() else out / p["from"]
            source = json.loads((cal_dir / "summary.json").read_text())
            unfitted = predicted_record(cal_dir, s, s.get("strategy", "ddp"))  # compare's own may be fitted
            candidates = {d: json.loads((d / "summary.json").read_text())
                          for d in [*(q.parent for q in out.glob("*-n2/summary.json")), *fit_dirs]}
            p = predicted_record(cal_dir, s, s.get("strategy", "ddp"), fit_runs(s, candidates))
            fitted = {"unfitted_step_s": unfitted["step_s"], "unfitted_error": unfitted["step_s"] / s["step_time_s"] - 1,
                      "fitted_on": ",".join(sorted(p.get("fitted_on", {}))) or "-",
                      "host_s_per_byte": p.get("host_s_per_byte"), "host_s_per_call": p.get("host_s_per_call")}
        rows.append({**fitted, "link": link, "run": summary_path.parent.name, "status": s.get("status"),
                     "measured_step_s": s.get("step_time_s"), "predicted_step_s": p.get("step_s"),
                     "error": (p["step_s"] / s["step_time_s"] - 1) if p.get("step_s") and s.get("step_time_s")
                     else None, "predicted_from": p.get("from"), "link_used": p.get("link"),
                     "measured_link": s.get("link"), "note": p.get("note"), "levels": p.get("levels"),
                     "n1_step_s": source.get("step_time_s"), "load_average_at_start": load})
    if a.keep and not a.keep_checkpoints:
        benchlib.drop_checkpoints(out)
    return rows


if __name__ == "__main__":
    main()
