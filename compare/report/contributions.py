"""The gap between two recipes' curves, explained choice by choice (`dpcompare compare --recipes A,B`).

compare/chain.py runs recipe A, then A with one more of B's choices at each link, in the fixed order of
common/recipes.py CHOICES, until every choice is B's. Here each link's runs are read back and each choice's row is
what its link changed: the loss at the last step and at a middle one, tokens/s and peak RSS per rank, against the
link before. The rows telescope, so they sum to the whole gap (B's figure minus A's) up to float64 rounding; the
table states the sum and the order, since interactions make a choice's row depend on the ones taken before it.
One table per framework and world size the chain ran in.
"""
from __future__ import annotations

from pathlib import Path

from .parity import load_run


def link_figures(run_dir: Path) -> dict:
    """One run's figures a row needs: its losses by step, tokens/s, and the largest peak RSS of its ranks (MB)."""
    run = load_run(run_dir)
    rss = [b for b in run.summary.get("peak_rss_bytes") or [] if b is not None]
    return {"losses": run.losses(), "tokens_per_s": run.summary.get("tokens_per_s"),
            "spread": (run.summary.get("tokens_per_s_p10"), run.summary.get("tokens_per_s_p90")),
            "peak_rss_mb": max(rss) / 2**20 if rss else None, "ok": run.ok and run.summary.get("status") == "ok"}


def within_spread(before: dict, after: dict) -> bool:
    """A tokens/s change is noise where either run's median lies inside the other's p10-p90 (as the speed table
    reads "overlap: noise"): a short run's few timed steps spread wider than most choices move them."""
    def inside(value, spread):
        return None not in (value, *spread) and spread[0] <= value <= spread[1]
    return inside(after["tokens_per_s"], before["spread"]) or inside(before["tokens_per_s"], after["spread"])


def contributions(recipes: tuple[str, str], links: list[dict], series: dict[str, list[Path]]) -> dict:
    """`links`: [{"choice", "a", "b"}] in the order taken (link 0, recipe A, has none); `series`: {"mlx x1": [run
    dir of link 0, link 1, ...]}. Returns summary.json's `contributions`."""
    tables = []
    for label, run_dirs in series.items():
        figures = [link_figures(d) for d in run_dirs]
        if not all(f["ok"] for f in figures):
            tables.append({"series": label, "error": "a run of the chain did not finish; no table"})
            continue
        common = sorted(set.intersection(*(set(f["losses"]) for f in figures)))
        last, middle = common[-1], common[(len(common) - 1) // 2]
        rows = []
        for link, before, after in zip(links, figures, figures[1:]):
            rows.append({**link,
                         "loss_last": after["losses"][last] - before["losses"][last],
                         "loss_middle": after["losses"][middle] - before["losses"][middle],
                         "tokens_per_s": _delta(after["tokens_per_s"], before["tokens_per_s"]),
                         "tokens_per_s_noise": within_spread(before, after),
                         "peak_rss_mb": _delta(after["peak_rss_mb"], before["peak_rss_mb"])})
        first, end = figures[0], figures[-1]
        gap = {"loss_last": end["losses"][last] - first["losses"][last],
               "loss_middle": end["losses"][middle] - first["losses"][middle],
               "tokens_per_s": _delta(end["tokens_per_s"], first["tokens_per_s"]),
               "peak_rss_mb": _delta(end["peak_rss_mb"], first["peak_rss_mb"])}
        sums = {key: sum(r[key] for r in rows) for key in ("loss_last", "loss_middle")}
        tables.append({"series": label, "steps": {"last": last, "middle": middle}, "rows": rows, "gap": gap,
                       "rows_sum": sums, "sum_error": max(abs(sums[k] - gap[k]) for k in sums),
                       "endpoints": {"a_loss_last": first["losses"][last], "b_loss_last": end["losses"][last]}})
    return {"recipes": list(recipes), "order": [link["choice"] for link in links], "tables": tables}


def fmt(value, spec: str) -> str:
    return "–" if value is None else format(value, spec)  # as render.py's (which imports this module)


def _delta(after, before):
    return None if after is None or before is None else after - before


def write_chain_figure(table: dict, series: dict[str, list[Path]], out_dir: Path) -> str | None:
    """The first series' loss curve at every link, and each curve less recipe A's: what each choice does to the
    curve, step by step (OUT/plots/chain.png); None without matplotlib or data."""
    from .plots import DPI, plt

    if plt is None or not series:
        return None
    label, run_dirs = next(iter(series.items()))
    curves = [load_run(d).losses() for d in run_dirs]
    if not all(curves):
        return None
    names = [table["recipes"][0]] + [f"+ {choice}" for choice in table["order"]]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
    palette = plt.get_cmap("viridis")
    for k, (name, curve) in enumerate(zip(names, curves)):
        steps = sorted(curve)
        colour = palette(k / max(1, len(curves) - 1))
        top.plot(steps, [curve[s] for s in steps], color=colour, label=name, linewidth=1)
        bottom.plot(steps, [curve[s] - curves[0].get(s, float("nan")) for s in steps], color=colour, linewidth=1)
    a, b = table["recipes"]
    top.set_title(f"{label}: from {a} to {b}, one choice more at each link; the last is {b}")
    top.set_ylabel("loss")
    top.legend(fontsize=7, ncol=2)
    bottom.set_ylabel(f"loss less {a}'s")
    bottom.set_xlabel("step")
    path = Path(out_dir) / "plots" / "chain.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    return "plots/chain.png"


def largest_line(table: dict) -> str | None:
    """The verdict's line: the choice that moved the last step's loss most, in the first series with a table."""
    for t in table["tables"]:
        if t.get("rows"):
            top = max(t["rows"], key=lambda r: abs(r["loss_last"]))
            a, b = table["recipes"]
            return (f"Recipes {a} -> {b}: the largest contributor is {top['choice']} ({top['a']} -> {top['b']}), "
                    f"{top['loss_last']:+.4g} of the {t['gap']['loss_last']:+.4g} gap in the loss at step "
                    f"{t['steps']['last']} ({t['series']}; every row under Recipes in the report)")
    return None


HEADERS = ("choice", "from", "to", "Δloss last", "Δloss middle", "Δtokens/s", "Δpeak RSS MB")


def table_rows(t: dict) -> list[tuple]:
    rows = [(r["choice"], str(r["a"]), str(r["b"]), fmt(r["loss_last"], "+.3e"), fmt(r["loss_middle"], "+.3e"),
             fmt(r["tokens_per_s"], "+,.0f") + (" (noise)" if r.get("tokens_per_s_noise") else ""),
             fmt(r["peak_rss_mb"], "+,.1f")) for r in t["rows"]]
    g = t["gap"]
    return rows + [("whole gap", "", "", fmt(g["loss_last"], "+.3e"), fmt(g["loss_middle"], "+.3e"),
                    fmt(g["tokens_per_s"], "+,.0f"), fmt(g["peak_rss_mb"], "+,.1f"))]


def sum_sentence(table: dict, t: dict) -> str:
    idle = [r["choice"] for r in t["rows"] if r["loss_last"] == 0 and r["loss_middle"] == 0]
    return (f"{t['series']}: the choices taken in this order ({', '.join(table['order'])}), each row against the "
            f"link before; the rows sum to the whole gap within {t['sum_error']:.1e} at steps {t['steps']['middle']} "
            f"(middle) and {t['steps']['last']} (last). An earlier choice changes what a later one does."
            + (f" Exactly 0: {', '.join(idle)}, choices that do not act here (docs/recipes.md)." if idle else ""))


def contribution_blocks(summary: dict) -> list[tuple]:
    table = summary.get("contributions")
    if not table:
        return []
    a, b = table["recipes"]
    blocks: list[tuple] = [("h2", f"Recipes: {a} -> {b}, choice by choice"),
                           ("p", f"The verdict and the runs below are recipe {a}'s; {b}'s own report is "
                                 f"{table.get('b_report', 'in the last folder of links/')}.")]
    for t in table["tables"]:
        if t.get("error"):
            blocks.append(("p", f"{t['series']}: {t['error']}"))
            continue
        blocks += [("p", sum_sentence(table, t)), ("table", HEADERS, table_rows(t))]
    if table.get("plot"):
        blocks.append(("figs", [("Loss along the chain", table["plot"], True)]))
    return blocks


def terminal_lines(summary: dict) -> list[str]:
    from .verdict_table import text_table

    table = summary.get("contributions")
    lines: list[str] = []
    for t in (table or {}).get("tables", []):
        if t.get("rows"):
            lines += ["", sum_sentence(table, t)] + text_table(HEADERS, table_rows(t), right=frozenset({3, 4, 5, 6}))
    return lines
