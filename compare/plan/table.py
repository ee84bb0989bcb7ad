"""A plan's rows and how they are shown: make_plan predicts each strategy at each N from a calibration over a
link (`plan --meshes` makes its rows per mesh: meshes.py), table prints those rows, plot draws either kind beside
the measured points. Nothing here reads a run: the calibration and the link come from the caller.
"""
from __future__ import annotations

from pathlib import Path

from common.costmodel.calibrate import Calibration
from common.costmodel.levels import Links
from common.costmodel.predict import predict
from common.errors import UserError


def make_plan(cal: Calibration, link: Links, strategies: list[str], world_sizes: list[int],
              device_memory_bytes: float | None, backend: str | None = None, ranks_per_machine: int = 1) -> list[dict]:
    """One row per strategy and N: the prediction on `backend` (the calibration's by default), or why that split
    is impossible. `device_memory_bytes`: a machine's, shared by up to `ranks_per_machine` ranks (rank_share)."""
    rows = []
    for strategy in strategies:
        for n in sorted({1, *world_sizes}) if strategy == "ddp" else world_sizes:  # ddp x1: the baseline
            if n == 1 and strategy != "ddp":
                continue  # fsdp and tp need 2 ranks or more; ddp at 1 is the baseline
            try:
                rows.append(predict(cal, strategy, n, link if n > 1 else None,
                                    rank_share(device_memory_bytes, ranks_per_machine, n),
                                    backend=backend if n > 1 else None).to_dict())
            except UserError as err:
                # The check's advice (--set, --nproc) is for a run; a plan only needs the reason.
                rows.append({"strategy": strategy, "world_size": n,
                             "impossible": str(err).split("; ")[0].split(": run on")[0]})
    return rows


def rank_share(machine_bytes: float | None, ranks_per_machine: int, n: int) -> float | None:
    """What one rank of an N-rank job may use of its machine's memory, where `ranks_per_machine` ranks share one
    (fewer where the job has fewer)."""
    return machine_bytes / max(1, min(ranks_per_machine, n)) if machine_bytes else None


def fit_cell(r: dict) -> str:
    """The fit column: NO, `tight` (fits with less to spare than the memory prediction's accuracy: `tight` in
    plan.json, set by plan --model) or yes."""
    return "NO" if not r["fits"] else "tight" if r.get("tight") else "yes"


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
        body.append(cells + ((fit_cell(r),) if device_memory_gb else ()))
    widths = [max(len(row[i]) for row in [header] + body if i < len(row)) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(header, widths)).rstrip()]
    for i, row in enumerate(body):
        line = "  ".join(c.ljust(w) for c, w in zip(row, widths))
        lines.append((line + "  " + impossible[i]) if i in impossible else line.rstrip())
    return "\n".join(lines)


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
