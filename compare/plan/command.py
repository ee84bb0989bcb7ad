"""`dpcompare plan --from RUN_DIR`: how far a measured run scales, per strategy and world size (or per mesh,
--meshes), over a link, and whether it fits in memory; it writes plan.json and plan.png and prints the table.

It calibrates the cost model (common/costmodel/) on the run (runs.py: its time breakdown, its peak memory), fits
host work on --fit runs, and predicts over a link (links.py): from `--fabric FILE` (what `dpcompare doctor --fabric
--out FILE` measured, the entry of the run's framework), from `--link-gbps G --latency-us L` (the wire, by hand),
or else from the run's own `link` record (summary.json; loopback figures from docs/benchmarks.md where it has
none). docs/scaling.md explains the model and every assumption.
"""
from __future__ import annotations

import math
import sys
from dataclasses import replace
from pathlib import Path

from common.config import MLX_SPLIT_BACKENDS
from common.costmodel.calibrate import calibrate
from common.costmodel.fit import fit_host_costs
from common.costmodel.levels import Links
from common.costmodel.links import polling_threads
from common.data.shares import parse_speeds
from common.errors import UserError
from common.metrics import write_json
from common.parallel import STRATEGIES
from compare.plan.links import choose_links, describe_links, links_json, predicted_backend
from compare.plan.meshes import mesh_plan, mesh_table
from compare.plan.predictions import fit_backend_note
from compare.plan.runs import cores_shared_by, measured_points, n1_beside, read_run
from compare.plan.table import make_plan, plot, table
from compare.plan.uneven import Machines, uneven_lines, uneven_plan

DEFAULT_NPROC = "2,4,8,16,64"


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


def run_plan(args) -> int:
    from_runs = args.from_run if isinstance(args.from_run, list) else [args.from_run]
    world_sizes = parse_ints(args.nproc, "nproc")
    strategies = parse_strategies(args.strategies)
    if args.device_memory_gb is not None and not (math.isfinite(args.device_memory_gb) and args.device_memory_gb > 0):
        raise UserError(f"--device-memory-gb must be a positive number, got {args.device_memory_gb}")
    sharing = getattr(args, "ranks_per_machine", 1)
    sharing = 1 if sharing is None else sharing
    if sharing < 1:
        raise UserError(f"--ranks-per-machine must be a positive whole number, got {sharing}")
    if getattr(args, "model", None):  # a model the run did not train: compare/plan/model_plan.py
        from compare.plan.model_plan import model_plan

        return model_plan(args, from_runs, world_sizes, strategies)
    if len(from_runs) > 1:
        raise UserError("several --from runs are read with --model (one run per framework); without it give one")
    run_dir = Path(from_runs[0])
    summary, spec = read_run(run_dir)
    # Each layout is predicted on the backend it would run on (an N=1 run ran on none; MLX's meshes split on
    # mpi, its one-axis layouts run on ring), over the link as that backend sees it (a --fabric file's entry,
    # or its loopback figures).
    fit_on = [(d, s, cores_shared_by(s), n1_beside(Path(d), s)) for d in getattr(args, "fit", None) or [] for s in [read_run(Path(d))[0]]]
    fits = tuple((d, s) for d, s, *_ in fit_on)  # their loopback, where the run measured none (links.fit_loopback)
    backend = predicted_backend(summary)
    link, link_how = choose_links(args, summary, backend, fits)
    routes = {backend: (link, link_how)}

    def runs_on(mesh_text: str) -> tuple[str, Links]:
        mine = predicted_backend(summary, mesh_text)
        if mine not in routes:
            routes[mine] = choose_links(args, summary, mine, fits)
        return mine, routes[mine][0]
    cal = calibrate(summary, spec, source=str(run_dir))
    if fit_on:
        cal = fit_host_costs(cal, fit_on)
    if getattr(args, "meshes", False) and summary.get("framework") == "mlx":
        # an MLX mesh needs a group split: MPI (or nccl), whatever backend the fits ran on
        note = fit_backend_note(fit_on, MLX_SPLIT_BACKENDS, "MLX's meshes run")
        cal = replace(cal, notes=[*cal.notes, note]) if note else cal
    memory = args.device_memory_gb * 1e9 if args.device_memory_gb else None  # a machine's
    meshes = mesh_plan(cal, link, world_sizes, memory, runs_on, sharing) if getattr(args, "meshes", False) else None
    rows = meshes["rows"] if meshes else make_plan(cal, link, strategies, world_sizes, memory, backend, sharing)
    uneven = None
    if getattr(args, "rank_speed", None):
        n = max(min([w for w in world_sizes if w > 1] or [2]), max(int(i.split(":")[0]) for i in
                                                                  args.rank_speed.split(",")) + 1)
        uneven = uneven_plan(make_plan(cal, link, ["ddp"], [n - 1, n], memory, backend, sharing),
                             parse_speeds(args.rank_speed, n), n, cal.workload.global_batch_size,
                             shared_machines(summary, sharing, backend))
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
            "device_memory_bytes": memory, "ranks_per_machine": sharing, "calibration": {k: v for k, v in vars(cal).items() if k not in ("workload", "link")},
            "predictions": rows, "measured": points, "figure": "plan.png" if drawn else None,
            **({"best": meshes["best"], "refused": meshes["refused"]} if meshes else {}),
            **({"uneven": uneven} if uneven else {})})
    except OSError as err:
        raise UserError(f"cannot write the plan into {out}: {err.strerror}") from None
    print(f"plan from {what}\nlink {link_text}")
    for axis, seconds in cal.host_s_per_byte.items():
        print(f"host work on {axis}: {1e9 * seconds:.3g} ms per MB its collectives move, fitted on "
              f"{cal.fitted_on[axis]}")
    for axis, seconds in cal.host_s_per_call.items():
        print(f"host work on {axis}: {1e3 * seconds:.3g} ms per call, fitted on {cal.fitted_on[axis]}")
    print()
    if memory and sharing > 1:
        print(f"fits: up to {sharing} ranks share each machine's {args.device_memory_gb:g} GB")
    print(mesh_table(meshes, args.device_memory_gb) if meshes else table(rows, args.device_memory_gb))
    if getattr(args, "rank_speed", None):  # ranks of unequal speed (compare/plan/uneven.py, docs/uneven.md)
        for line in uneven_lines(uneven):
            print(line)
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


def shared_machines(summary: dict, sharing: int, backend: str | None) -> Machines:
    """`--ranks-per-machine` ranks on machines of the calibration run's cores (a CPU run's; on a GPU the cores do
    not compute, and a cluster of one rank per machine shares none): compare/plan/uneven.py."""
    cpus = (summary.get("machine") or {}).get("cpus")
    if sharing < 2 or not cpus or str(summary.get("device", "cpu")).startswith(("cuda", "gpu", "mps")):
        return Machines()
    return Machines(sharing, cpus, summary.get("threads_per_rank") or 1,
                    polling_threads(summary.get("framework", ""), backend))
