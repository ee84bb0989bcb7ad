"""`dpcompare plan --meshes`: for each N, every mesh of the axes dp, fsdp, cp, tp and pp whose sizes multiply to N,
predicted over the link (one, or two levels: common/costmodel/levels.py puts each axis on the level its ranks
share), with its memory per rank; the fastest named, and the fastest that fits --device-memory-gb.

A mesh of one axis is that strategy (dp=4 is ddp x4); a mesh of several is the composed object of
common/parallel/ (strategy "mesh"). Which meshes are valid for the model is the objects' own `check` (tp dividing
the heads, a block per pp stage, the compositions the frameworks run): a mesh it refuses is counted, not listed.
"""
from __future__ import annotations

from typing import Callable

from common.costmodel.calibrate import Calibration
from common.costmodel.levels import Links
from common.costmodel.predict import predict
from common.errors import UserError
from common.parallel.mesh import AXIS_ORDER, DATA_AXES, STRATEGY_AXIS
from compare.plan.table import fit_cell, rank_share

# Outermost first, as common/parallel/mesh.py lays ranks out: pp across machines, tp (and cp beside it) inside one.
AXES = AXIS_ORDER
RunsOn = Callable[[str], "tuple[str, Links]"]  # mesh text -> (backend, the link as it sees it)
ONE_AXIS_STRATEGY = {axis: strategy for strategy, axis in STRATEGY_AXIS.items()}


def factorisations(n: int, axes: tuple[str, ...] = AXES) -> list[tuple[tuple[str, int], ...]]:
    """Every way to write n as a product of axis sizes of 2 or more, the axes in `axes`' order, each at most once,
    one data axis (dp or fsdp) at most; n = 1 has one, the empty mesh."""
    if n == 1:
        return [()]
    out = []
    for i, name in enumerate(axes):
        for size in range(2, n + 1):
            if n % size:
                continue
            later = tuple(a for a in axes[i + 1:] if not (name in DATA_AXES and a in DATA_AXES))
            out += [((name, size), *rest) for rest in factorisations(n // size, later)]
    return sorted(out, key=lambda mesh: [AXES.index(a) for a, _ in mesh] + [s for _, s in mesh])


def candidate(mesh: tuple[tuple[str, int], ...]) -> tuple[str, str]:
    """(strategy, mesh text) of a factorisation: ddp x1 for the empty one, the strategy of a lone axis, else
    strategy "mesh" over "dp=2,tp=2"."""
    if not mesh:
        return "ddp", ""
    if len(mesh) == 1:
        return ONE_AXIS_STRATEGY[mesh[0][0]], ""
    return "mesh", ",".join(f"{name}={size}" for name, size in mesh)


def label(mesh: tuple[tuple[str, int], ...]) -> str:
    return ",".join(f"{name}={size}" for name, size in mesh) or "dp=1"


def mesh_plan(cal: Calibration, links: Links, world_sizes: list[int], device_memory_bytes: float | None,
              runs_on: RunsOn | None = None, ranks_per_machine: int = 1) -> dict:
    """{"rows": one per valid mesh and N (predict()'s dict with `label` and `backend`), "refused": {N: [(label,
    reason)]}, "best": {N: {"fastest", "fastest_fitting"}} (labels, or None)}. `runs_on(mesh text)`: the backend
    a mesh runs on and the link as that backend sees it (compare/plan/command.py; MLX's meshes split on mpi, its
    one-axis layouts run on ring); by default the calibration's backend over `links` for every mesh."""
    runs_on = runs_on or (lambda _mesh: (cal.backend, links))
    rows: list[dict] = []
    refused: dict[int, list] = {}
    best: dict[int, dict] = {}
    for n in sorted({1, *world_sizes}):
        mine = []
        for mesh in factorisations(n):
            strategy, text = candidate(mesh)
            backend, on = runs_on(text) if n > 1 else ("none", None)  # one rank: no backend, no link
            try:
                row = predict(cal, strategy, n, on, rank_share(device_memory_bytes, ranks_per_machine, n),
                              backend=backend, mesh=text).to_dict()
            except UserError as err:
                refused.setdefault(n, []).append((label(mesh), str(err).split("; ")[0]))
                continue
            mine.append({**row, "label": label(mesh), "backend": backend})
        rows += mine
        fastest = min(mine, key=lambda r: r["step_s"], default=None)
        fitting = min((r for r in mine if r["fits"] is not False), key=lambda r: r["step_s"], default=None)
        best[n] = {"fastest": fastest and fastest["label"], "fastest_fitting": fitting and fitting["label"]}
    return {"rows": rows, "refused": refused, "best": best}


def mesh_table(plan: dict, device_memory_gb: float | None) -> str:
    """The rows as a text table, each N's fastest marked, then one line per N naming the fastest (that fits)."""
    header = ("mesh", "N", "step s", "tokens/s", "exposed comm", "memory/rank GB", "backend", "links") + \
        (("fits",) if device_memory_gb else ())
    body = []
    for r in plan["rows"]:
        n = r["world_size"]
        mark = (" *" if plan["best"][n]["fastest"] == r["label"] else "") + (" †" if r.get("caveat") else "")
        levels = ", ".join(f"{axis} {level}" for axis, level in r["levels"].items()) or "–"
        cells = (r["label"] + mark, str(n), f"{r['step_s']:.4g}", f"{r['tokens_per_s']:,.0f}",
                 f"{100 * r['exposed_share']:.0f}%", f"{r['memory_bytes']['total'] / 1e9:.3f}",
                 r.get("backend") or "–", levels)
        body.append(cells + ((fit_cell(r),) if device_memory_gb else ()))
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, *body]]
    lines.append("")
    lines += [f"† {caveat}" for caveat in dict.fromkeys(r["caveat"] for r in plan["rows"] if r.get("caveat"))]
    for n, best in plan["best"].items():
        if n == 1:
            continue
        dagger = {r["label"] for r in plan["rows"] if r["world_size"] == n and r.get("caveat")}
        line = f"N={n}: fastest {best['fastest'] or 'none'}" + (" †" if best["fastest"] in dagger else "")
        if device_memory_gb:
            line += f"; fastest that fits {device_memory_gb:g} GB: {best['fastest_fitting'] or 'none'}"
        if plan["refused"].get(n):
            line += f" ({len(plan['refused'][n])} meshes refused for this model: see plan.json)"
        lines.append(line)
    return "\n".join(lines)
