"""`compare`'s predictions in each run's summary.json: `prediction` in every N > 1 run (its step from the N=1
run of the same framework, over the link the job measured, its axes fitted on N=2 runs beside it) and
`memory_prediction` in every run (the predicted peak per rank from the shapes and the measured fixed footprint).
benchmarks/bench_plan.py and predict_runs.py call predicted_record and fit_runs the same way. docs/scaling.md
explains the model and every assumption.
"""
from __future__ import annotations

from pathlib import Path

from common.costmodel.calibrate import Calibration
from common.costmodel.fit import fit_host_costs
from common.costmodel.levels import links_from_record
from common.costmodel.links import loopback_link
from common.costmodel.memory import WORKSPACE_BYTES, predicted_peak
from common.costmodel.predict import predict
from common.costmodel.workload import workload_of
from common.metrics import read_json, write_json
from common.parallel import layout
from common.parallel.mesh import STRATEGY_AXIS
from compare.plan.runs import calibrate_run, cores_shared_by, n1_beside, run_spec


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
                fitted = fit_runs(s, {**fits, **runs})
                record.update(predicted_record(source, s, strategy, fitted))
                notes = [record.get("fit_note"), unfitted_note(s, fitted)]
                record["fit_note"] = "; ".join(n for n in notes if n) or None
            except Exception as err:  # noqa: BLE001 - a run the model cannot read must not cost the report
                record["note"] = f"no prediction: {err}"
        s["prediction"] = record
        write_json(run_dir / "summary.json", s)


def fit_runs(s: dict, candidates: dict[Path, dict]) -> list[tuple[str, dict, float, Calibration | None]]:
    """The N=2 one-axis runs among `candidates` to fit run `s`'s axes on (one per axis), for a run at N > 2,
    each with the N=1 run trained beside it. A run on `s`'s backend first, where both are at hand: a fit measures
    the host work of the backend it ran on, and MLX's meshes run on MPI while its one-axis runs default to ring.
    On the lent 16-core machine ring's tp x2 took 0.75-0.91 of its N=1 step in three sittings, MPI's 0.67 in one;
    on the Zen 4 the two fits predicted MLX's meshes alike (docs/scaling.md, "Sitting 10")."""
    axes = set(axes_to_fit(s))
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


def axes_to_fit(s: dict) -> list[str]:
    """The mesh axes of run `s` that a 2-rank run of their strategy fits: every axis at N > 2, none below."""
    n = s.get("world_size") or 1
    return layout(s.get("strategy", "ddp"), n, (s.get("config") or {}).get("mesh") or "").mesh.names if n > 2 else []


def unfitted_note(s: dict, fits: list[tuple]) -> str | None:
    """One line where run `s` (N > 2) has an axis that none of `fits` measured: how the comparison would fit it.
    Unfitted, pp=2,tp=2 on 2 shared cores read 21-49 % short on loopback (both frameworks, 2026-11-29), fitted
    within 20 % by the median (docs/scaling.md)."""
    measured = {layout(o.get("strategy", "ddp"), 2).axis_name for _, o, *_ in fits}
    strategy_of = {axis: strategy for strategy, axis in STRATEGY_AXIS.items()}
    missing = [strategy_of[a] for a in axes_to_fit(s) if a not in measured]
    if not missing:
        return None
    n = s["world_size"]
    how = ("`dpcompare plan --fit` takes them from a loopback comparison's 2-rank runs (two levels need 2 groups)"
           if (s.get("link") or {}).get("group_size") else
           f"a comparison with them (--strategies {','.join(missing)} --nproc 1,2,{n}) fits it")
    return f"not fitted: no 2-rank {' or '.join(missing)} run here to measure its host work on; {how} (docs/scaling.md)"


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


# ---- the predicted peak memory of every run ----------------------------------------------------------
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
    if s.get("adapters"):  # LoRA: the frozen base (float32 or quantized) and the adapters' state alone
        per_rank = [lora_peak(s, spec, n, f) for f in fixed]
    else:
        per_rank = [predicted_peak(strategy, workload_of(s, spec), n, f, rank, fmt, mesh)
                    for rank, f in enumerate(fixed)]
    if on_gpu:  # a GPU allocator's peak: no host workspace (the checkpoint's copies are host memory too)
        for parts in per_rank:
            parts.update(workspace=0.0, checkpoint=0.0, saving=0.0, peak_at="step")
            parts["total"] = parts["step"] = parts["step"] - WORKSPACE_BYTES.get(s.get("framework"), 0.0)
    peaks = [p["total"] for p in per_rank]
    return {"basis": "framework peak" if on_gpu else "peak RSS", "parts": per_rank[0], "peak_bytes": peaks,
            "peak_at": [p["peak_at"] for p in per_rank],
            "measured_bytes": measured, "error": [p / m - 1 if m else None for p, m in zip(peaks, measured)]}


def lora_peak(s: dict, spec, n: int, fixed: float) -> dict:
    """A LoRA run's predicted peak per rank (ddp): common/costmodel/model_memory.py's parts with the rank's measured
    fixed footprint and the framework's workspace as its overhead, in predicted_peak's record shape."""
    from common.costmodel.model_memory import JOB_FIXED_BYTES, model_memory
    from common.model.lora import trained_parameters_of
    from common.model.quantize import base_storage_of

    a, q = s["adapters"], s.get("base_quantization") or {"bits": 0, "group_size": 0}
    trained = trained_parameters_of(a["rank"], a["alpha"], ",".join(a["targets"]), a.get("layers", 0))
    storage = base_storage_of(q["bits"], q["group_size"])
    workspace = WORKSPACE_BYTES.get(s.get("framework"), 0.0)
    # the rank's measured fixed footprint holds its job's communication state already (model_memory adds it at N > 1)
    job = JOB_FIXED_BYTES.get(s.get("framework"), 0.0) if n > 1 else 0.0
    parts = model_memory(layout("ddp", n), workload_of(s, spec), trained, storage, fixed + workspace - job)
    total = parts.pop("total")
    return {**parts, "fixed": fixed, "workspace": workspace, "checkpoint": 0.0, "step": total, "saving": 0.0,
            "peak_at": "step", "total": total}
