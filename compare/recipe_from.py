"""`dpcompare compare --recipe-from RUN_A,RUN_B`: the user's own two runs (an mlx_lm.lora run and a Trainer/trl run,
read by common/imported/), each reproduced on identical batches in both frameworks, and the gap between their
logged curves explained (docs/your-runs.md).

Each run becomes a recipe file in OUT/recipes/; the chain from A's recipe to B's runs as `--recipes` runs it
(compare/chain.py), in MLX and torch. Three comparisons follow:
- each run against its reproduction, in the framework it was made on, per logged step: the reproduction's mean
  over the run's logging window against the logged mean. The data order and the adapters' initial values are
  dpcompare's, not the run's, so this is judged on the curve tolerance (--curve-rtol), and said so;
- MLX against torch under each recipe: recipe A's report and the last link's report judge them per step;
- A against B: at the last step both runs logged, the logged gap split into rows that telescope, so they sum to it:
  A's run to its reproduction, each choice of the chain (in A's framework), MLX to torch under recipe B (measured
  on identical batches), B's reproduction to B's run. The choices' rows are the recipes' share; the others are the
  remainder (data order, initial values, hardware, the frameworks' numerics), every one measured.
The report in OUT is written again with that section after its verdict (summary.json `your_runs`).
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from common.errors import UserError
from common.imported import ImportedRun, read_run
from common.imported.run import from_json, write_recipe

FRAMEWORK_NAMES = {"mlx": "MLX", "torch": "torch"}


def imported_runs(text: str, start_dir: Path) -> list[ImportedRun]:
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    if len(items) != 2:
        raise UserError(f"--recipe-from takes two runs, RUN_A,RUN_B (folders, or recipe files import-run wrote); "
                        f"got {text!r}")
    return [from_json(start_dir / i) if i.endswith(".json") else read_run(start_dir / i) for i in items]


def prepare(args, check_out) -> tuple[list[ImportedRun], Path, list[Path]]:
    """Read both runs, refuse what cannot run, fill the run's shape into flags not given, write the two recipes."""
    if getattr(args, "recipes", None) or getattr(args, "recipe", None):
        raise UserError("--recipe-from makes both recipes from your runs; drop --recipes and --recipe")
    runs = imported_runs(args.recipe_from, args.start_dir)
    if not getattr(args, "init_from", None) and not getattr(args, "preset", None):
        names = " and ".join(repr(r.model) for r in runs if r.model) or "no model"
        raise UserError(f"--recipe-from: pass --init-from DIR, the local folder of the model your runs trained from "
                        f"(they name {names}; nothing is downloaded), or --preset NAME to stand in for it")
    if not getattr(args, "dataset", None):
        raise UserError("--recipe-from: pass --dataset FILE, the records both runs trained on")
    frameworks = [f.strip() for f in str(args.frameworks).split(",")]
    if sorted(frameworks) != ["mlx", "torch"]:
        raise UserError("--recipe-from runs each recipe in MLX and in torch: give --frameworks mlx,torch")
    notes = []
    for name, value in runs[0].shape().items():  # a flag not given takes run A's value (one shape for the chain)
        if getattr(args, name, None) is None:
            setattr(args, name, value)
            other = runs[1].shape().get(name)
            if other is not None and other != value:
                notes.append(f"{name} {value} (run A's; run B had {other})")
    if notes:
        print(f"dpcompare: note: the chain runs at one shape: {', '.join(notes)}; give the flag to choose",
              file=sys.stderr)
    out = Path(args.out or args.start_dir / "runs/compare")
    check_out(out, bool(getattr(args, "overwrite", None)))  # a run directory or a comparison: refused, untouched
    created = not out.exists()
    paths = [write_recipe(run, out / "recipes" / f"{side}-{run.tool}.json") for side, run in zip("ab", runs)]
    args.recipes = ",".join(str(p) for p in paths)
    return runs, (out if created else Path()), paths


def run_recipe_from(args, run_chain, check_out) -> int:
    """`run_chain` and `check_out` are compare/matrix.py's (passed in: matrix imports this module)."""
    runs, created, paths = prepare(args, check_out)
    try:
        code = run_chain(args)
    except UserError:  # refused before anything ran: leave nothing behind
        for p in paths:
            p.unlink(missing_ok=True)
        if paths and paths[0].parent.is_dir() and not any(paths[0].parent.iterdir()):
            paths[0].parent.rmdir()
        if created != Path() and created.exists():
            shutil.rmtree(created, ignore_errors=True)
        raise
    out = paths[0].parent.parent
    section = your_runs(runs, out, getattr(args, "curve_rtol", None) or 0.02, str(paths[1]))
    (out / "your_runs.json").write_text(json.dumps(section, indent=1) + "\n")
    rewrite_report(out, section)
    print("\n".join(render(section)))
    return code


def rewrite_report(out: Path, section: dict) -> None:
    """The report in OUT again, with the section after its verdict (summary.json keeps it as `your_runs`)."""
    from common.metrics import write_json

    from .report.markup import to_html, to_markdown
    from .report.render import report_blocks
    summary = json.loads((out / "summary.json").read_text())
    summary["your_runs"] = section
    write_json(out / "summary.json", summary)
    blocks = report_blocks(summary)
    at = next((i + 1 for i, b in enumerate(blocks) if b[0] == "verdict"), len(blocks))
    blocks[at:at] = report_section(section)
    (out / "report.md").write_text(to_markdown(blocks))
    (out / "report.html").write_text(to_html(blocks, out))


def report_section(section: dict) -> list[tuple]:
    """The section as the report's blocks (compare/report/markup.py): a verdict table, the gap table, the figure."""
    lines = render(section)
    tables, current, texts = [], [], []
    for line in lines[1:]:
        if line.startswith("|"):
            current.append([c.strip() for c in line.strip("|").split("|")])
        elif current:
            tables.append(current)
            current = []
        if line and not line.startswith(("|", "#", "![")):
            texts.append(line)
    if current:
        tables.append(current)
    blocks: list[tuple] = [("h2", "Your runs against their reproductions")]
    for k, rows in enumerate(tables):
        blocks.append(("table", tuple(rows[0]), [tuple(r) for r in rows[2:]]))
        if k < len(texts):
            blocks.append(("p", texts[k]))
    gap = section["gap"]
    if "error" not in gap:
        blocks.insert(3, ("p", f"The gap at step {gap['step']}: your run B {gap['logged']['B']:.4f} - your run A "
                               f"{gap['logged']['A']:.4f} = {gap['gap']:+.4f}"))
    elif texts[1:]:
        blocks.append(("p", gap["error"]))
    if section.get("plot"):
        blocks.append(("figs", [("your runs' logged curves beside their reproductions", section["plot"], True)]))
    return blocks


def _runs_of(link_dir: Path) -> dict[str, Path]:
    """{framework: run dir} of a link's runs at its smallest world size."""
    found: dict[str, tuple[int, Path]] = {}
    for cfg_path in sorted(link_dir.glob("*/run_config.json")):
        saved = json.loads(cfg_path.read_text())
        framework, n = saved["config"]["framework"], int(saved.get("world_size", 1))
        if saved["config"].get("peer"):
            continue
        if framework not in found or n < found[framework][0]:
            found[framework] = (n, cfg_path.parent)
    return {f: d for f, (_, d) in found.items()}


def _losses(run_dir: Path) -> dict[int, float]:
    from .report.parity import load_run
    return load_run(run_dir).losses()


def window_mean(losses: dict[int, float], step: int, window: int) -> float | None:
    steps = range(max(1, step - window + 1), step + 1)
    return sum(losses[s] for s in steps) / len(steps) if all(s in losses for s in steps) else None


def your_runs(runs: list[ImportedRun], out: Path, tolerance: float, b_recipe: str = "") -> dict:
    links = sorted(p for p in (out / "links").iterdir() if p.is_dir())
    ends = [_runs_of(links[0]), _runs_of(links[-1])]
    curves = [{f: _losses(d) for f, d in end.items()} for end in ends]
    pairs = []
    for side, run, curve in zip("AB", runs, curves):
        repro = curve.get(run.framework, {})
        points = [(s, v, window_mean(repro, s, run.log_window)) for s, v in zip(run.logged_steps, run.logged_loss)]
        points = [p for p in points if p[2] is not None]
        worst = max((abs(r - v) / abs(v) for _, v, r in points if v), default=None)
        mlx_torch = _max_delta(curve.get("mlx", {}), curve.get("torch", {}))
        pairs.append({"side": side, "tool": run.tool, "path": run.path, "framework": run.framework,
                      "window": run.log_window, "points": points, "max_rel": worst, "tolerance": tolerance,
                      "verdict": None if worst is None else ("pass" if worst <= tolerance else "differs"),
                      "mlx_vs_torch_max_abs": mlx_torch})
    section = {"pairs": pairs, "gap": gap_table(runs, out, links, b_recipe), "plot": _figure(pairs, curves, out)}
    return section


def _max_delta(a: dict, b: dict) -> float | None:
    common = set(a) & set(b)
    return max(abs(a[s] - b[s]) for s in common) if common else None


def gap_table(runs: list[ImportedRun], out: Path, links: list[Path], b_recipe: str = "") -> dict:
    """The logged gap at the last step both runs logged, as rows that telescope (module docstring)."""
    a, b = runs
    common = sorted(set(a.logged_steps) & set(b.logged_steps))
    if not common:
        return {"error": "the two runs logged no step in common; no gap table"}
    step, window = common[-1], a.log_window
    logged = {"A": a.logged_loss[a.logged_steps.index(step)], "B": b.logged_loss[b.logged_steps.index(step)]}
    home = a.framework
    chain = [window_mean(_losses(_runs_of(d)[home]), step, window) for d in links]
    b_home, b_own = chain[-1], window_mean(_losses(_runs_of(links[-1])[b.framework]), step, window)
    if None in chain or b_own is None:
        return {"error": f"a reproduction has no loss at step {step}; no gap table"}
    rows = [{"row": f"your run A -> its reproduction ({FRAMEWORK_NAMES[home]}, dpcompare's data order and "
                    "initial adapters)", "kind": "remainder", "delta": chain[0] - logged["A"]}]
    for k, link in enumerate(links[1:], start=1):
        choice = link.name.split("-", 1)[1].removesuffix(f"-{Path(b_recipe).stem}")
        rows.append({"row": f"recipe: {choice}", "kind": "recipe", "delta": chain[k] - chain[k - 1]})
    rows.append({"row": f"{FRAMEWORK_NAMES[home]} -> {FRAMEWORK_NAMES[b.framework]} under recipe B (identical "
                        "batches)", "kind": "remainder", "delta": b_own - b_home})
    rows.append({"row": "B's reproduction -> your run B (data order, initial adapters, hardware)", "kind": "remainder",
                 "delta": logged["B"] - b_own})
    total = sum(r["delta"] for r in rows)
    return {"step": step, "window": window, "logged": logged, "gap": logged["B"] - logged["A"], "rows": rows,
            "recipes": sum(r["delta"] for r in rows if r["kind"] == "recipe"),
            "remainder": sum(r["delta"] for r in rows if r["kind"] == "remainder"),
            "rows_sum": total, "sum_error": abs(total - (logged["B"] - logged["A"]))}


def _figure(pairs: list[dict], curves: list[dict], out: Path) -> str | None:
    from .report.plots import DPI, plt
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, pair, curve in zip(axes, pairs, curves):
        for framework, losses in sorted(curve.items()):
            steps = sorted(losses)
            ax.plot(steps, [losses[s] for s in steps], linewidth=1,
                    label=f"reproduction, {FRAMEWORK_NAMES.get(framework, framework)} (per step)")
        if pair["points"]:
            ax.plot([p[0] for p in pair["points"]], [p[2] for p in pair["points"]], "s", markerfacecolor="none",
                    label=f"reproduction, mean of {pair['window']} step(s)")
            ax.plot([p[0] for p in pair["points"]], [p[1] for p in pair["points"]], "o", label="your run (logged)")
        ax.set_title(f"run {pair['side']}: {pair['tool']} ({Path(pair['path']).name})", fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("train loss")
        ax.legend(fontsize=7)
    path = out / "plots" / "your-runs.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    return "plots/your-runs.png"


def render(section: dict) -> list[str]:
    lines = ["## Your runs against their reproductions", "",
             "| verdict | run | made on | logged points | curve max rel. Δ | MLX vs torch, same recipe, max abs. Δloss |",
             "|---|---|---|---|---|---|"]
    for p in section["pairs"]:
        rel = "–" if p["max_rel"] is None else f"{p['max_rel']:.2%} ≤ {p['tolerance']:.0%}" if p["verdict"] == \
            "pass" else f"{p['max_rel']:.2%} > {p['tolerance']:.0%}"
        mt = "–" if p["mlx_vs_torch_max_abs"] is None else f"{p['mlx_vs_torch_max_abs']:.2e}"
        lines.append(f"| {p['verdict'] or 'no curve'} | {p['side']}: {p['tool']} {Path(p['path']).name} | "
                     f"{p['framework']} | {len(p['points'])} | {rel} | {mt} |")
    lines += ["", "Judged on the curve tolerance: the reproduction reads the same records but in dpcompare's data "
              "order and from dpcompare's initial adapters, not your runs'."]
    gap = section["gap"]
    if "error" in gap:
        return lines + ["", gap["error"]]
    lines += ["", f"### The gap at step {gap['step']}: your run B {gap['logged']['B']:.4f} - your run A "
              f"{gap['logged']['A']:.4f} = {gap['gap']:+.4f}", "",
              "| row | kind | Δ loss |", "|---|---|---|"]
    lines += [f"| {r['row']} | {r['kind']} | {r['delta']:+.2e} |" for r in gap["rows"]]
    lines += [f"| recipes (the chain's rows) | sum | {gap['recipes']:+.5f} |",
              f"| remainder (measured) | sum | {gap['remainder']:+.5f} |",
              f"| rows + remainder | total | {gap['rows_sum']:+.5f} (logged gap {gap['gap']:+.5f}, "
              f"off by {gap['sum_error']:.1e}) |", "",
              f"Reproductions are means over run A's logging window ({gap['window']} step(s)) ending at the step."]
    if section.get("plot"):
        lines += ["", f"![your runs]({section['plot']})"]
    return lines
