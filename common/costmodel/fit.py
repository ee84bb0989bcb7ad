"""Host work per byte an axis's collectives move, fitted on one N=2 run of a strategy: what a ddp N=1 calibration
cannot see.

A strategy's collectives cost the host more than the link's time: torch FSDP2's hooks and flat-buffer copies,
DTensor's dispatch around tp's all-reduces, the many small sends of an MLX pipeline, a ddp sync's bucket copies.
None of it runs in the N=1 run the model is calibrated on, and each strategy's share differs by framework, CPU
and model size (a constant fitted on `small` over-predicted torch fsdp on `tiny` by 80 %, docs/scaling.md).

The fit: an N=2 run of the strategy, predicted from the calibration with that axis's host work at 0 over the link
the run measured; the step it measured beyond that prediction, divided by the bytes the axis's collectives move
per step (calls x payload), is the axis's host seconds per byte (none below 0: a run faster than its prediction
gets 0, and a note). A prediction at N > 2, of that strategy or of a mesh with that axis, then charges each byte
the axis moves that much (common/parallel/layout.py `axis_host_s`), once, where the compute is stretched for ranks
sharing cores (predict.py: most of it is waiting inside a collective, which leaves the core to another rank), but
as many times as ranks share a core for torch's fsdp, whose copies are the rank's own work (`host_stretches`).

In the unit of the axis's strategy (Layout.host_unit): per byte, but per call for torch's tp, whose DTensor
dispatch costs each call the same whatever it carries (common/parallel/tp.py has the measurements).

Per byte, not per call: the work is mostly copies (buckets, flat buffers, DTensor's redistributions, a pipeline's
serialised sends) and waits that grow with the payload. The two agree for a strategy alone, whose calls move the
same bytes at N=2 and N=4; they differ in a mesh, where another axis halves what each call carries (dp=2,tp=2's
dp all-reduces half the gradients). Recomputed on every kept run of docs/scaling.md ("Sitting 5", "Sitting 6"):
with a core per rank 22 of 32 layouts within 20 % per byte, 15 per call; on 2 shared cores 78 of 119 and 83, where
a wait per call that no N=2 run measures (ranks taking turns on a core) is missing and per call happened to cover it.
"""
from __future__ import annotations

from dataclasses import replace

from common.costmodel.axes import axis_times
from common.costmodel.calibrate import Calibration
from common.costmodel.levels import links_from_record
from common.costmodel.links import loopback_link
from common.costmodel.predict import outer_waits, predict
from common.costmodel.workload import Workload
from common.errors import UserError
from common.parallel import layout
from common.parallel.fsdp import reduce_scatter_traffic


def fit_host_costs(cal: Calibration, runs: list[tuple]) -> Calibration:
    """`cal` with each run's axis fitted: `runs` holds (its name, its summary.json, ranks per core it ran at) and,
    optionally, the calibration of the N=1 run trained beside it (None: `cal`).

    Beside it, where there is one: the host work is what the N=2 run measured beyond its prediction from the
    N=1 run of the same sitting. Fitted against another N=1 run (the one a mesh's row is calibrated on), the fit
    took in whatever the machine did between the two: on the lent 16-core machine MLX's N=1 step measured
    0.139-0.214 s across the compares of one sitting (docs/scaling.md, "Sitting 7")."""
    per_unit = {"byte": dict(cal.host_s_per_byte), "call": dict(cal.host_s_per_call)}
    fitted_on, notes = dict(cal.fitted_on), list(cal.notes)
    for source, summary, shared, *beside in runs:
        axis, seconds, note = fit_one(beside[0] if beside and beside[0] is not None else cal, summary, source, shared)
        unit = layout(summary.get("strategy", "ddp"), 2).host_unit(cal.workload.framework)
        per_unit["call" if unit == "byte" else "byte"].pop(axis, None)
        per_unit[unit][axis], fitted_on[axis] = seconds, source
        if note:
            notes.append(note)
    return replace(cal, host_s_per_byte=per_unit["byte"], host_s_per_call=per_unit["call"], fitted_on=fitted_on,
                   notes=notes)


def fit_one(cal: Calibration, s: dict, source: str, cores_shared_by: float = 1.0) -> tuple[str, float, str]:
    """(axis, host seconds per unit of the axis's strategy's host work (Layout.host_unit: a byte moved, or a
    call), a note or "") from one finished one-axis run at N >= 2 of cal's workload."""
    strategy, n = s.get("strategy", "ddp"), int(s.get("world_size") or 1)
    if s.get("status") != "ok" or not s.get("step_time_s"):
        raise UserError(f"{source}: only a finished run with a measured step can be fitted on")
    if (s.get("config") or {}).get("mesh") or n < 2:
        raise UserError(f"{source}: fit on a run of one strategy at 2 ranks or more, not "
                        f"{(s.get('config') or {}).get('mesh') or f'{strategy} x{n}'}")
    w = cal.workload
    if (s.get("framework"), s.get("dtype") or "float32") != (w.framework, w.dtype) \
            or int(s.get("tokens_per_step") or w.tokens_per_step) != w.tokens_per_step:
        raise UserError(f"{source}: a {s.get('framework')} {s.get('dtype')} run of "
                        f"{s.get('tokens_per_step')} tokens per step cannot be fitted against the calibration's "
                        f"{w.framework} {w.dtype} run of {w.tokens_per_step}")
    backend = s.get("backend") or cal.backend
    link = links_from_record(s.get("link"), w.framework, backend) or loopback_link(backend)
    lay = layout(strategy, n)
    axis = lay.axis_name
    bare = replace(cal, host_s_per_byte={**cal.host_s_per_byte, axis: 0.0}, host_s_per_call={**cal.host_s_per_call, axis: 0.0},
                   cores_shared_by=cores_shared_by)
    p = predict(bare, strategy, n, link, backend=backend, cores_shared_by=cores_shared_by)
    moved = lay.host_quantity(p.collectives, w.framework)
    if not moved:
        raise UserError(f"{source}: {strategy} x{n} moves no bytes in collectives to fit a host cost on")
    beyond = float(s["step_time_s"]) - p.step_s
    # over the slow link between machines the prediction hides the host work behind the link's time (predict.py)
    hidden = outer_waits(lay, bare, axis_times(lay, w, reduce_scatter_traffic(w.framework, backend), link)).get(axis, 0.0)
    note = (f"{source}: measured {float(s['step_time_s']):.3g} s per step, under the {p.step_s:.3g} s predicted "
            f"without host work: {axis}'s host work fitted as 0" if beyond < 0 else "")
    # host work that takes turns on shared cores (Layout.host_stretches) was paid that many times over (predict.py)
    turns = cores_shared_by if lay.host_stretches(axis, w.framework) else 1.0
    return axis, (beyond + hidden) / moved / turns if beyond > 0 else 0.0, note


def carried_to(cal: Calibration, run: Workload, backend: str) -> Calibration:
    """`cal` (a calibration moved to another model, `plan --model`) with each axis's host work per byte, fitted on
    an N=2 run of the calibration's model `run`, charged per call of that axis instead: seconds per byte x the fit
    run's bytes per call, over the target's bytes per call. A tiny model's calls carry kilobytes, and what its N=2
    run spends beyond the link is what each call costs the host, not its bytes: carried per byte to `small` (113 MB
    a step), torch's tiny fits put small's ddp x2 at +132 % and fsdp x2 at +269 % of the measured step (Intel Xeon
    VM, issue 56); per call they put torch's fsdp 38 % short, where fsdp's own constants (per call and per byte of
    heap released, from `small` and `base` runs) charge more: where those charge more at the target, they stand.
    Axes already charged per call (Layout.host_unit) keep their figure."""
    target = cal.workload
    if not cal.host_s_per_byte or (target.spec, target.seq_len, target.global_batch_size) == \
            (run.spec, run.seq_len, run.global_batch_size):
        return cal
    rs = reduce_scatter_traffic(target.framework, backend)
    per_byte = {}
    for axis, seconds in cal.host_s_per_byte.items():
        strategy = next((s for s in ("ddp", "fsdp", "tp", "pp") if layout(s, 2).axis_name == axis), None)
        if strategy is None:
            per_byte[axis] = seconds
            continue
        lay = layout(strategy, 2)
        carried = seconds * _bytes_per_call(lay, run, rs) / max(_bytes_per_call(lay, target, rs), 1.0)
        colls = [c for a in lay.axis_collectives(target, rs) for c in a.collectives]
        if lay.unfitted_host_s(target, colls, cal.on_cpu, cal.releases_heap) <= carried * lay.host_quantity(
                colls, target.framework):
            per_byte[axis] = carried
        # else the strategy's own constants, measured on bigger models' runs, charge more: they stand (torch fsdp's
        # per call and heap release: small and base at -26/-31 % with them, -38/-38 % carried per call)
    return replace(cal, host_s_per_byte=per_byte)


def _bytes_per_call(lay, w: Workload, rs: str) -> float:
    colls = [c for axis in lay.axis_collectives(w, rs) for c in axis.collectives]
    calls = sum(c.calls for c in colls)
    return sum(c.calls * c.nbytes for c in colls) / calls if calls else 0.0
