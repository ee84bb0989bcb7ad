"""`dpcompare plan --from RUN_DIR`: how far a measured run scales, per strategy and world size, over a link,
and whether it fits in memory; and `compare`'s `prediction` in every N > 1 run's summary.json.

Both calibrate the cost model (common/costmodel/) on a measured run (its time breakdown, its peak memory) and predict
with a link: from `--fabric FILE` (what `dpcompare doctor --fabric --out FILE` measured, the entry of the
run's framework), from `--link-gbps G --latency-us L` (the wire, by hand), or else from the run's own
`link` record (summary.json; loopback figures from docs/benchmarks.md where it has none). docs/scaling.md
explains the model and every assumption.
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import replace
from pathlib import Path

from common.costmodel.calibrate import Calibration, calibrate
from common.costmodel.fit import fit_host_costs
from common.costmodel.levels import Links, links_from_record
from common.costmodel.links import loopback_link
from common.costmodel.memory import WORKSPACE_BYTES, predicted_peak
from common.costmodel.predict import predict
from common.costmodel.workload import workload_of
from compare.plan_links import choose_links, describe_links, links_json, predicted_backend
from compare.plan_meshes import mesh_plan, mesh_table
from compare.report.labels import run_dirname
from common.config import MLX_SPLIT_BACKENDS
from common.errors import UserError
from common.metrics import read_json, write_json
from common.model.spec import ModelSpec, preset
from common.parallel import STRATEGIES, layout

FABRIC_KIND = "dpcompare doctor --fabric"
DEFAULT_NPROC = "2,4,8,16,64"


# ---- reading runs ---------------------------------------------------------------------------------
def read_run(run_dir: Path) -> tuple[dict, ModelSpec]:
    """(summary.json, the model spec the run trained) of a finished run, or a one-line UserError."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"run directory {run_dir} not found" if not run_dir.exists() else
                        f"{run_dir} is not a directory: --from takes a run directory")
    summary = read_json(run_dir / "summary.json")
    if not isinstance(summary, dict):
        raise UserError(f"{run_dir} has no readable summary.json: is it a finished run directory?")
    if "runs" in summary and "breakdown" not in summary:  # a compare directory's report summary
        runs = sorted(p.name for p in run_dir.iterdir() if (p / "run_config.json").exists())
        raise UserError(f"{run_dir} is a comparison, not a run: pass one of its runs to --from "
                        f"({', '.join(runs) or 'none finished'})")
    if not summary.get("breakdown"):
        raise UserError(f"{run_dir}'s summary.json has no time breakdown to calibrate on (a run with "
                        "--profile-steps 0, or one that did not finish)")
    return summary, run_spec(run_dir, summary)


def run_spec(run_dir: Path, summary: dict) -> ModelSpec:
    """The model spec a run trained (run_config.json), or a one-line UserError."""
    spec = (read_json(run_dir / "run_config.json") or {}).get("spec")
    try:
        if spec is None:  # older runs: the preset with its overrides (the tokenizer's vocabulary unknown)
            cfg = summary.get("config") or {}
            spec = {**preset(cfg.get("preset", "small")).to_dict(), **(cfg.get("model") or {})}
        return ModelSpec.from_dict(spec)
    except (TypeError, ValueError) as err:
        raise UserError(f"{run_dir}: cannot read the model spec: {err}") from None


def calibrate_run(run_dir: Path) -> Calibration:
    summary, spec = read_run(run_dir)
    return calibrate(summary, spec, source=str(run_dir))


# ---- links ---------------------------------------------------------------------------------------
def fabric_record(rows, where: str, link: dict | None = None) -> dict:
    """What `doctor --fabric --out FILE` writes: one entry per backend measured (compare/machine/fabric.py's
    Measured rows), in the units the cost model reads."""
    keys = ("framework", "backend", "ranks", "device", "latency_s", "bandwidth_Bps", "large_bytes", "error")
    return {"kind": FABRIC_KIND, "created": time.strftime("%Y-%m-%d %H:%M:%S"), "where": where, "link": link,
            "backends": [{k: getattr(r, k) for k in keys} for r in rows]}


def write_fabric(path: str, rows, where: str, link: dict | None = None) -> None:
    try:
        write_json(Path(path), fabric_record(rows, where, link))
    except OSError as err:
        raise UserError(f"cannot write {path}: {err.strerror}") from None


# ---- the plan ------------------------------------------------------------------------------------
def parse_ints(text: str, name: str) -> list[int]:
    try:
        values = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise UserError(f"--{name} must be a comma list of whole numbers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise UserError(f"--{name} must be a comma list of positive whole numbers, got {text!r}")
    return sorted(set(values))


def parse_strategies(text: str) -> list[str]:
    values = [v.strip() for v in str(text).split(",") if v.strip()]
    for v in values:
        if v not in STRATEGIES:
            raise UserError(f"unknown strategy {v!r}; allowed: {', '.join(STRATEGIES)}")
    if not values:
        raise UserError("--strategies needs at least one of " + ", ".join(STRATEGIES))
    return values


def make_plan(cal: Calibration, link: Links, strategies: list[str], world_sizes: list[int],
              device_memory_bytes: float | None, backend: str | None = None) -> list[dict]:
    """One row per strategy and N: the prediction on `backend` (the calibration's by default), or why that split
    is impossible."""
    rows = []
    for strategy in strategies:
        for n in sorted({1, *world_sizes}) if strategy == "ddp" else world_sizes:  # ddp x1: the baseline
            if n == 1 and strategy != "ddp":
                continue  # fsdp and tp need 2 ranks or more; ddp at 1 is the baseline
            try:
                rows.append(predict(cal, strategy, n, link if n > 1 else None, device_memory_bytes,
                                    backend=backend if n > 1 else None).to_dict())
            except UserError as err:
                # The check's advice (--set, --nproc) is for a run; a plan only needs the reason.
                rows.append({"strategy": strategy, "world_size": n,
                             "impossible": str(err).split("; ")[0].split(": run on")[0]})
    return rows


def measured_points(run_dir: Path, summary: dict) -> list[dict]:
    """Runs next to RUN_DIR (a compare directory) of the same framework, dtype and workload: the figure's
    measured points."""
    cfg = summary.get("config") or {}
    same = ("preset", "seq_len", "global_batch_size", "grad_accum")
    points = []
    for other in sorted(Path(run_dir).resolve().parent.glob("*/summary.json")):
        s = read_json(other) or {}
        c = s.get("config") or {}
        if (s.get("status") == "ok" and s.get("tokens_per_s") and s.get("framework") == summary.get("framework")
                and s.get("dtype") == summary.get("dtype") and all(c.get(k) == cfg.get(k) for k in same)):
            points.append({"run": other.parent.name, "strategy": s.get("strategy", "ddp"),
                           "world_size": s.get("world_size"), "tokens_per_s": s["tokens_per_s"],
                           "step_s": s.get("step_time_s"), "link": (s.get("link") or {}).get("requested")})
    return points


def plot(rows: list[dict], points: list[dict], title: str, path: Path) -> bool:
    """Draw the plan's figure at path; False without matplotlib (plan.json and the table still say it all)."""
    from compare.report.plots import plt  # matplotlib with the Agg backend, or None: chosen once, there

    if plt is None:
        return False

    colors = {"ddp": "#1f77b4", "fsdp": "#2ca02c", "tp": "#9467bd"}
    fig, ax = plt.subplots(figsize=(7, 4.4))
    for strategy in dict.fromkeys(r.get("label", r["strategy"]) for r in rows):  # --meshes: one line per mesh
        line = [r for r in rows if r.get("label", r["strategy"]) == strategy and "impossible" not in r]
        if line:
            ax.plot([r["world_size"] for r in line], [r["tokens_per_s"] for r in line], marker="o",
                    color=colors.get(strategy), label=f"{strategy}, predicted")
    for strategy in dict.fromkeys(p["strategy"] for p in points):
        mine = [p for p in points if p["strategy"] == strategy]
        ax.scatter([p["world_size"] for p in mine], [p["tokens_per_s"] for p in mine], marker="x", s=70,
                   color=colors.get(strategy), label=f"{strategy}, measured (over its own link)", zorder=3)
    ax.set_xscale("log", base=2)
    sizes = sorted({r["world_size"] for r in rows} | {p["world_size"] for p in points})
    ax.set_xticks(sizes, [str(n) for n in sizes])
    ax.set_xlabel("ranks N")
    ax.set_ylabel("tokens/s (whole job)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3, which="both")
    if ax.get_legend_handles_labels()[0]:  # every split impossible and nothing measured: no legend
        ax.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return True


def table(rows: list[dict], device_memory_gb: float | None) -> str:
    header = ("strategy", "N", "step s", "tokens/s", "efficiency", "exposed comm", "memory/rank GB") + \
        (("fits",) if device_memory_gb else ())
    body, impossible = [], {}
    for i, r in enumerate(rows):
        if "impossible" in r:
            impossible[i] = f"not possible: {r['impossible']}"
            body.append((r["strategy"], str(r["world_size"])))
            continue
        cells = (r["strategy"], str(r["world_size"]), f"{r['step_s']:.4g}", f"{r['tokens_per_s']:,.0f}",
                 f"{100 * r['efficiency']:.0f}%", f"{100 * r['exposed_share']:.0f}%", f"{r['memory_bytes']['total'] / 1e9:.3f}")
        body.append(cells + (("yes" if r["fits"] else "NO",) if device_memory_gb else ()))
    widths = [max(len(row[i]) for row in [header] + body if i < len(row)) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(header, widths)).rstrip()]
    for i, row in enumerate(body):
        line = "  ".join(c.ljust(w) for c, w in zip(row, widths))
        lines.append((line + "  " + impossible[i]) if i in impossible else line.rstrip())
    return "\n".join(lines)


def run_plan(args) -> int:
    run_dir = Path(args.from_run)
    summary, spec = read_run(run_dir)
    world_sizes = parse_ints(args.nproc, "nproc")
    strategies = parse_strategies(args.strategies)
    if args.device_memory_gb is not None and not (math.isfinite(args.device_memory_gb) and args.device_memory_gb > 0):
        raise UserError(f"--device-memory-gb must be a positive number, got {args.device_memory_gb}")
    # Each layout is predicted on the backend it would run on (an N=1 run ran on none; MLX's meshes split on
    # mpi, its one-axis layouts run on ring), over the link as that backend sees it (a --fabric file's entry,
    # or its loopback figures).
    backend = predicted_backend(summary)
    link, link_how = choose_links(args, summary, backend)
    routes = {backend: (link, link_how)}

    def runs_on(mesh_text: str) -> tuple[str, Links]:
        mine = predicted_backend(summary, mesh_text)
        if mine not in routes:
            routes[mine] = choose_links(args, summary, mine)
        return mine, routes[mine][0]
    cal = calibrate(summary, spec, source=str(run_dir))
    fit_on = [(d, s, cores_shared_by(s), n1_beside(Path(d), s)) for d in getattr(args, "fit", None) or [] for s in [read_run(Path(d))[0]]]
    if fit_on:
        cal = fit_host_costs(cal, fit_on)
    if getattr(args, "meshes", False) and summary.get("framework") == "mlx":
        # an MLX mesh needs a group split: MPI (or nccl), whatever backend the fits ran on
        note = fit_backend_note(fit_on, MLX_SPLIT_BACKENDS, "MLX's meshes run")
        cal = replace(cal, notes=[*cal.notes, note]) if note else cal
    memory = args.device_memory_gb * 1e9 if args.device_memory_gb else None
    meshes = mesh_plan(cal, link, world_sizes, memory, runs_on) if getattr(args, "meshes", False) else None
    rows = meshes["rows"] if meshes else make_plan(cal, link, strategies, world_sizes, memory, backend)
    out = Path(args.out) if args.out else run_dir / "plan"
    points = measured_points(run_dir, summary)
    w = cal.workload
    what = (f"{w.framework} {summary.get('strategy', 'ddp')} x{cal.world_size} ({run_dir}), "
            f"{(summary.get('config') or {}).get('preset', '?')}, {w.tokens_per_step:,} tokens per step, {w.dtype}")
    link_text = describe_links(link, link_how)
    several = any(on[0] != link for on in routes.values())  # the meshes' backend sees another link (its loopback)
    if several:
        link_text = "\n".join(f"({b}) {describe_links(*on)}" for b, on in routes.items())
    try:
        out.mkdir(parents=True, exist_ok=True)
        drawn = plot(rows, points, f"predicted from {what}\nlink {link.name}", out / "plan.png")
        write_json(out / "plan.json", {
            "from": str(run_dir), "calibrated_on": what, "link": links_json(link, link_how), "backend": backend,
            **({"links_by_backend": {b: links_json(*on) for b, on in routes.items()}} if several else {}),
            "device_memory_bytes": memory, "calibration": {k: v for k, v in vars(cal).items() if k not in ("workload", "link")},
            "predictions": rows, "measured": points, "figure": "plan.png" if drawn else None,
            **({"best": meshes["best"], "refused": meshes["refused"]} if meshes else {})})
    except OSError as err:
        raise UserError(f"cannot write the plan into {out}: {err.strerror}") from None
    print(f"plan from {what}\nlink {link_text}")
    for axis, seconds in cal.host_s_per_byte.items():
        print(f"host work on {axis}: {1e9 * seconds:.3g} ms per MB its collectives move, fitted on "
              f"{cal.fitted_on[axis]}")
    for axis, seconds in cal.host_s_per_call.items():
        print(f"host work on {axis}: {1e3 * seconds:.3g} ms per call, fitted on {cal.fitted_on[axis]}")
    print()
    print(mesh_table(meshes, args.device_memory_gb) if meshes else table(rows, args.device_memory_gb))
    print()
    for strategy in strategies if not meshes else ():
        feasible = [r for r in rows if r["strategy"] == strategy and "impossible" not in r]
        if feasible:
            print(f"{strategy} x{feasible[-1]['world_size']}: bottleneck is {feasible[-1]['bottleneck']}")
    for note in cal.notes:
        print(f"note: {note}", file=sys.stderr)
    figure = f"({out / 'plan.png'})" if drawn else "(no figure: matplotlib is not installed)"
    print(f"\nplan: {out / 'plan.json'}  {figure}; assumptions: docs/scaling.md")
    return 0


# ---- compare: a prediction in every N > 1 run ------------------------------------------------------
def add_predictions(run_dirs: list[Path], fit_dirs: list[Path] = ()) -> None:
    """Every finished N > 1 run's summary.json gets `prediction`, made from the N=1 run of the same
    framework, strategy and dtype (for fsdp, tp and pp, which need 2 ranks: the ddp one), over the link the
    job measured (its `link` record; loopback figures where it has none). Each axis of a run at N > 2 is
    fitted on an N=2 run of that axis's strategy among these runs and `fit_dirs`, where there is one
    (common/costmodel/fit.py): never on the run itself, so a prediction is never fitted on what it predicts."""
    runs = {Path(d): read_json(Path(d) / "summary.json") or {} for d in run_dirs}
    fits = {Path(d): read_json(Path(d) / "summary.json") or {} for d in fit_dirs}
    for run_dir, s in runs.items():
        if s.get("status") != "ok" or (s.get("world_size") or 1) < 2:
            continue
        strategy = s.get("strategy", "ddp")

        def one(want: str):
            return next((d for d, o in runs.items() if o.get("status") == "ok" and o.get("world_size") == 1
                         and o.get("framework") == s.get("framework") and o.get("dtype") == s.get("dtype")
                         and o.get("strategy", "ddp") == want), None)

        source = one(strategy) or one("ddp")
        record = {"from": source.name if source else None}
        if source is None:
            record["note"] = "no N=1 run of this framework and dtype to predict from"
        else:
            if strategy != "ddp":
                record["note"] = f"{strategy} has no N=1 run: predicted from the ddp N=1 run"
            try:
                record.update(predicted_record(source, s, strategy, fit_runs(s, {**fits, **runs})))
            except Exception as err:  # noqa: BLE001 - a run the model cannot read must not cost the report
                record["note"] = f"no prediction: {err}"
        s["prediction"] = record
        write_json(run_dir / "summary.json", s)


def n1_beside(run_dir: Path, s: dict) -> Calibration | None:
    """The calibration of the ddp N=1 run of the compare that trained `run_dir` (the sibling compare names so), to
    fit `run_dir`'s host work against (common/costmodel/fit.py); None where there is none of its workload."""
    beside = run_dir.parent / run_dirname(s.get("framework", ""), 1, "ddp", s.get("dtype") or "float32")
    o = read_json(beside / "summary.json") if beside != run_dir else None
    if not isinstance(o, dict) or o.get("status") != "ok" or o.get("strategy", "ddp") != "ddp" \
            or (o.get("dtype"), o.get("tokens_per_step")) != (s.get("dtype"), s.get("tokens_per_step")):
        return None
    try:
        return calibrate_run(beside)
    except UserError:
        return None


def fit_runs(s: dict, candidates: dict[Path, dict]) -> list[tuple[str, dict, float, Calibration | None]]:
    """The N=2 one-axis runs among `candidates` to fit run `s`'s axes on (one per axis), for a run at N > 2,
    each with the N=1 run trained beside it. A run on `s`'s backend first, where both are at hand: a fit measures
    the host work of the backend it ran on, and MLX's meshes run on MPI while its one-axis runs default to ring.
    On the lent 16-core machine ring's tp x2 took 0.75-0.91 of its N=1 step in three sittings, MPI's 0.67 in one;
    on the Zen 4 the two fits predicted MLX's meshes alike (docs/scaling.md, "Sitting 10")."""
    n = s.get("world_size") or 1
    mesh = (s.get("config") or {}).get("mesh") or ""
    axes = set(layout(s.get("strategy", "ddp"), n, mesh).mesh.names) if n > 2 else set()
    out: dict[str, tuple[str, dict, float, Calibration | None]] = {}
    for d, o in sorted(candidates.items(), key=lambda kv: kv[1].get("backend") != s.get("backend")):
        if (o.get("status") != "ok" or o.get("world_size") != 2 or (o.get("config") or {}).get("mesh")
                or (o.get("framework"), o.get("dtype")) != (s.get("framework"), s.get("dtype"))
                or o.get("tokens_per_step") != s.get("tokens_per_step")):
            continue
        axis = layout(o.get("strategy", "ddp"), 2).axis_name
        if axis in axes and axis not in out:
            out[axis] = (d.name, o, cores_shared_by(o), n1_beside(d, o))
    return list(out.values())


def predicted_record(source: Path, s: dict, strategy: str, fits: list[tuple] = ()) -> dict:
    """The `prediction` fields of run summary `s`, calibrated on the run in `source` and fitted on `fits`."""
    link = links_from_record(s.get("link"), s.get("framework", ""), s.get("backend", ""))
    link_note = "the job's link record"
    if link is None:
        link, link_note = loopback_link(s.get("backend") or "gloo"), "no link record: assumed loopback"
    cal = fit_host_costs(calibrate_run(source), list(fits))
    fit_note = fit_backend_note(fits, (s.get("backend"),), "this run is") if s.get("backend") else None
    p = predict(cal, strategy, s["world_size"], link, backend=s.get("backend"),
                mesh=(s.get("config") or {}).get("mesh") or "", cores_shared_by=cores_shared_by(s))
    measured = s.get("step_time_s")
    return {"step_s": p.step_s, "tokens_per_s": p.tokens_per_s, "compute_s": p.compute_s,
            "exposed_comm_s": p.exposed_comm_s, "memory_bytes_per_rank": p.memory_bytes["total"], "link": link.name,
            "levels": p.levels, "cores_shared_by": cores_shared_by(s),
            "host_s_per_byte": cal.host_s_per_byte, "host_s_per_call": cal.host_s_per_call, "fitted_on": cal.fitted_on,
            "link_source": f"{link_note} ({link.source})", "caveat": p.caveat, "fit_note": fit_note,
            "step_error": (p.step_s / measured - 1) if measured else None}


def fit_backend_note(fits: list[tuple], backends: tuple, what: str) -> str | None:
    """One line where some of `fits` ((name, summary.json, ...) per fitted run) ran on a backend outside
    `backends`, the ones the predicted runs use: a fit measures the host work of its own backend. On the lent
    16-core machine MLX's tp x2 took 0.75-0.91 of its N=1 step on ring in three sittings, 0.67 on MPI in one, and
    the ring-fitted predictions of MLX's dp2 x tp2 and fsdp2 x tp2 on MPI came out 12-41 % high (sittings 5a, 5b
    and 7 of docs/scaling.md), the MPI-fitted ones -10 and +19 % (sitting 5c); None where every fit ran on one of
    `backends`."""
    other = [f"{Path(str(name)).name} ({summary.get('backend')})" for name, summary, *_ in fits
             if summary.get("backend") and summary.get("backend") not in backends]
    if not other:
        return None
    on = " or ".join(backends)
    return (f"{what} on {on}, but {', '.join(other)} ran on another backend, whose host work differs: "
            f"for a closer prediction fit on N=2 runs with --backend {backends[0]}")


def cores_shared_by(s: dict) -> float:
    """How many ranks' threads share each core of the machine a local CPU run ran on (summary.json's machine,
    threads_per_rank): 4 one-thread ranks on 2 cores, 2; 1 on a GPU, across hosts, or with cores to spare.
    The N=1 run it is calibrated on had a core to itself, so its compute is stretched that much."""
    cfg = s.get("config") or {}
    cpus = (s.get("machine") or {}).get("cpus")
    if str(s.get("device", "cpu")).startswith(("cuda", "gpu", "mps")) or not cpus or cfg.get("hostfile") \
            or (cfg.get("nnodes") or 1) > 1:
        return 1.0
    return max(1.0, (s.get("world_size") or 1) * (s.get("threads_per_rank") or 1) / cpus)


# ---- compare: the predicted peak memory of every run ------------------------------------------------
def add_memory_predictions(run_dirs: list[Path]) -> None:
    """Every finished run's summary.json (N=1 too) gets `memory_prediction`: the cost model's peak per rank
    from the shapes and the rank's measured fixed footprint (common/costmodel/memory.py's predicted_peak), beside
    the measured one, so the report can show what each rank's memory is made of."""
    for run_dir in map(Path, run_dirs):
        s = read_json(run_dir / "summary.json")
        if not isinstance(s, dict) or s.get("status") != "ok":
            continue
        try:
            s["memory_prediction"] = memory_record(run_dir, s)
        except Exception as err:  # noqa: BLE001 - a run the model cannot read must not cost the report
            s["memory_prediction"] = {"note": f"no prediction: {err}"}
        write_json(run_dir / "summary.json", s)


def memory_record(run_dir: Path, s: dict) -> dict:
    """{"basis", "parts" (rank 0's terms), "peak_bytes", "peak_at" (step or checkpoint), "measured_bytes" and
    "error" per rank}. On a
    CPU the peak is the process's RSS, fixed footprint included; on a GPU the framework's allocator peak,
    which holds neither the runtime nor the workspace the CPU figure was measured with (both taken as 0)."""
    spec = run_spec(Path(run_dir), s)
    n, strategy = int(s.get("world_size") or 1), s.get("strategy", "ddp")
    on_gpu = str(s.get("device", "")).startswith(("cuda", "gpu", "mps"))
    measured = s.get("peak_mem_bytes" if on_gpu else "peak_rss_bytes") or [None] * n
    fixed = [0.0] * n if on_gpu else [f or 0.0 for f in (s.get("fixed_rss_bytes") or [None] * n)]
    fmt = (s.get("config") or {}).get("checkpoint_format", "hf")
    mesh = (s.get("config") or {}).get("mesh") or ""
    per_rank = [predicted_peak(strategy, workload_of(s, spec), n, f, rank, fmt, mesh) for rank, f in enumerate(fixed)]
    if on_gpu:  # a GPU allocator's peak: no host workspace (the checkpoint's copies are host memory too)
        for parts in per_rank:
            parts.update(workspace=0.0, checkpoint=0.0, saving=0.0, peak_at="step")
            parts["total"] = parts["step"] = parts["step"] - WORKSPACE_BYTES.get(s.get("framework"), 0.0)
    peaks = [p["total"] for p in per_rank]
    return {"basis": "framework peak" if on_gpu else "peak RSS", "parts": per_rank[0], "peak_bytes": peaks,
            "peak_at": [p["peak_at"] for p in per_rank],
            "measured_bytes": measured, "error": [p / m - 1 if m else None for p, m in zip(peaks, measured)]}
