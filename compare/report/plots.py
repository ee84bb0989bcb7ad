"""The report's figures as PNGs (matplotlib, Agg: no display needed). A figure without data is skipped.

Colours name the framework, line styles the world size, so one legend reads across every figure.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # the backend must be chosen first
except ImportError:  # a declared dependency, but a minimal environment (the lent GPU machines have none) still
    plt = None  # gets its report, without figures: report.md says so

COLORS = {"mlx": "#1f77b4", "torch": "#ee4c2c"}  # MLX blue, PyTorch's orange-red
OTHER_COLORS = ["#2ca02c", "#9467bd", "#8c564b", "#17becf"]
STYLES = ["-", "--", ":", "-."]
DIFF_FLOOR = 1e-9  # identical losses have zero difference; a log axis shows them at this floor
DPI = 110


def color(framework: str) -> str:
    return COLORS.get(framework, OTHER_COLORS[sum(map(ord, framework)) % len(OTHER_COLORS)])


def style(world_size: int, sizes: list[int]) -> str:
    return STYLES[sizes.index(world_size) % len(STYLES)] if world_size in sizes else "-"


def make_plots(runs: list, parity: dict, rows: list[dict], scaling: dict, out_dir: Path) -> dict[str, str] | None:
    """Write every figure that has data into out_dir; {name: file name}. None without matplotlib."""
    if plt is None:
        return None
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sizes = sorted({r.world_size for r in runs})
    made = {}
    for name, draw in (("loss", lambda: loss_figure(runs, parity, sizes)),
                       ("eval_loss", lambda: eval_figure(runs, sizes)),
                       ("throughput", lambda: throughput_figure(rows)),
                       ("scaling", lambda: scaling_figure(scaling)),
                       ("breakdown", lambda: breakdown_figure(rows)),
                       ("memory", lambda: memory_figure(rows))):
        fig = draw()
        if fig is None:
            continue
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=DPI, bbox_inches="tight")
        plt.close(fig)
        made[name] = path.name
    return made


def loss_figure(runs: list, parity: dict, sizes: list[int]):
    with_loss = [r for r in runs if r.losses()]
    if not with_loss:
        return None
    pairs = [p for p in parity["cross_framework"] + parity["dp_invariance"] if p.get("diff_series")]
    if pairs:
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7.5), sharex=True,
                                          gridspec_kw={"height_ratios": [3, 2]})
    else:
        fig, top = plt.subplots(figsize=(9, 4.8))
        bottom = None
    for i, run in enumerate(with_loss):
        losses = run.losses()
        steps = sorted(losses)
        # Each later curve is drawn thinner on top: curves that agree stay visible as nested lines.
        top.plot(steps, [losses[s] for s in steps], style(run.world_size, sizes), color=color(run.framework),
                 lw=max(0.8, 3.2 - 0.7 * i), alpha=0.9 if run.ok else 0.5,
                 label=run.label + ("" if run.ok else " (skipped: " + run.status + ")"))
    top.set_ylabel("training loss")
    top.set_title("Training loss (same initial weights, same batches; agreeing curves overlap)")
    top.grid(alpha=0.3)
    top.legend(fontsize=8)
    if bottom is None:
        top.set_xlabel("step")
        return fig
    tolerance = parity["tolerances"]
    for i, pair in enumerate(pairs):
        series = pair["diff_series"]
        diff = np.maximum(np.array(series["abs_diff"]), DIFF_FLOOR)
        kind = "vs" if pair["kind"] == "cross_framework" else "vs (DP)"
        bottom.plot(series["steps"], diff, STYLES[i % len(STYLES)], lw=1.2,
                    color=OTHER_COLORS[i % len(OTHER_COLORS)] if pair["kind"] == "dp_invariance" else
                    ["#444444", "#7f7f7f", "#bcbd22"][i % 3],
                    label=f"|{pair['a']} {kind} {pair['b']}|")
    bottom.axhline(tolerance["loss_atol"], color="#d62728", lw=1, ls="--",
                   label=f"per-step tolerance {tolerance['loss_atol']:g}")
    bottom.axvspan(0.5, tolerance["parity_steps"] + 0.5, color="#d62728", alpha=0.06,
                   label=f"steps checked one by one (first {tolerance['parity_steps']})")
    bottom.set_yscale("log")
    bottom.set_ylim(bottom=DIFF_FLOOR / 2)
    bottom.set_ylabel(f"|Δ loss| (0 drawn at {DIFF_FLOOR:g})")
    bottom.set_xlabel("step")
    bottom.grid(alpha=0.3, which="major")
    bottom.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=2, frameon=False)
    return fig


def eval_figure(runs: list, sizes: list[int]):
    with_eval = [r for r in runs if r.eval_losses()]
    if not with_eval:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for run in with_eval:
        evals = run.eval_losses()
        steps = sorted(evals)
        ax.plot(steps, [evals[s] for s in steps], style(run.world_size, sizes), marker="o", ms=4,
                color=color(run.framework), label=run.label)
    ax.set_xlabel("step")
    ax.set_ylabel("eval loss")
    ax.set_title("Validation loss (the same samples for every run)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def throughput_figure(rows: list[dict]):
    measured = [r for r in rows if r.get("tokens_per_s")]
    if not measured:
        return None
    sizes = sorted({r["world_size"] for r in measured})
    frameworks = list(dict.fromkeys(r["framework"] for r in measured))
    fig, ax = plt.subplots(figsize=(max(6.4, 1.4 * len(measured) + 1), 4.2))
    width = 0.8 / max(1, max(sum(1 for r in measured if r["world_size"] == n) for n in sizes))
    for x, n in enumerate(sizes):
        group = [r for r in measured if r["world_size"] == n]
        group.sort(key=lambda r: frameworks.index(r["framework"]))
        for j, row in enumerate(group):
            pos = x + (j - (len(group) - 1) / 2) * width
            tps = row["tokens_per_s"]
            low, high = row.get("tokens_per_s_p10") or tps, row.get("tokens_per_s_p90") or tps
            ax.bar(pos, tps, width * 0.9, color=color(row["framework"]), alpha=0.85 if row["ok"] else 0.35,
                   yerr=[[max(0.0, tps - low)], [max(0.0, high - tps)]], capsize=4, ecolor="#333333")
            ax.text(pos, tps / 2, f"{tps:,.0f}" + ("" if row["ok"] else f"\n({row['status']})"), ha="center",
                    va="center", fontsize=8, color="white" if row["ok"] else "#333333",
                    rotation=90 if width < 0.3 else 0)
    ax.set_xticks(range(len(sizes)), [f"N = {n}" for n in sizes])
    ax.set_ylabel("tokens / s (median, bars: p10–p90)")
    ax.set_title("Training throughput, all ranks together")
    handles = [plt.Rectangle((0, 0), 1, 1, color=color(f)) for f in frameworks]
    ax.legend(handles, frameworks, fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    return fig


def scaling_figure(scaling: dict):
    lines = {fw: [p for p in points if p.get("efficiency") is not None] for fw, points in scaling.items()}
    if not any(len(points) > 1 for points in lines.values()):
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    sizes = sorted({p["world_size"] for points in lines.values() for p in points})
    for framework, points in lines.items():
        if len(points) < 2:
            continue
        ax.plot([p["world_size"] for p in points], [100 * p["efficiency"] for p in points], marker="o",
                color=color(framework), label=framework)
        for p in points[1:]:  # the baseline is 100 % by definition
            ax.annotate(f"{100 * p['efficiency']:.0f}%", (p["world_size"], 100 * p["efficiency"]),
                        textcoords="offset points", xytext=(8, 0), va="center", fontsize=8,
                        color=color(framework))
    ax.axhline(100, color="#777777", ls="--", lw=1, label="ideal")
    ax.set_xticks(sizes)
    ax.margins(x=0.12)
    ax.set_xlabel("ranks N")
    ax.set_ylabel("scaling efficiency %")
    ax.set_title("Data-parallel scaling: tokens/s(N) / (N · tokens/s(1))", fontsize=11)
    ax.set_ylim(0, max(110, max(100 * p["efficiency"] for points in lines.values() for p in points) + 10))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def memory_figure(rows: list[dict]):
    bars = []
    for row in rows:
        for rank, (mem, rss) in enumerate(zip(row.get("peak_mem_mb") or [], row.get("peak_rss_mb") or [])):
            if mem is not None or rss is not None:
                bars.append((f"{row['label']}\nrank {rank}", row["framework"], mem, rss))
    if not bars:
        return None
    states = [(row["label"], row["framework"], row["state_mb"]) for row in rows
              if row.get("state_mb") and all(row["state_mb"].get(k) for k in STATE_PARTS)]
    width = max(6.4, 0.9 * len(bars) + 2)
    if states:
        fig, (ax, ax_state) = plt.subplots(1, 2, figsize=(width + 0.9 * len(states) + 2, 4.2),
                                           gridspec_kw={"width_ratios": [len(bars) + 1, len(states) + 1]})
    else:
        fig, ax = plt.subplots(figsize=(width, 4.2))
    x = np.arange(len(bars))
    ax.bar(x - 0.2, [b[2] or 0 for b in bars], 0.4, color=[color(b[1]) for b in bars])
    ax.bar(x + 0.2, [b[3] or 0 for b in bars], 0.4, color=[color(b[1]) for b in bars], alpha=0.45,
           hatch="//", edgecolor="white")
    ax.set_xticks(x, [b[0] for b in bars], fontsize=8)
    ax.set_ylabel("MB")
    ax.set_title("Peak memory per rank")
    legend = [plt.Rectangle((0, 0), 1, 1, color="#777777"),
              plt.Rectangle((0, 0), 1, 1, facecolor="#777777", alpha=0.45, hatch="//", edgecolor="white")]
    ax.legend(legend, ["framework peak", "process peak RSS"], fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    if states:
        state_figure(ax_state, states)
    return fig


STATE_PARTS = ("params", "grads", "optimizer")


def state_figure(ax, states: list[tuple]) -> None:
    """Stacked parameter, gradient and optimizer MB that the largest rank of each run holds: what
    sharding saves, next to the peaks."""
    x = np.arange(len(states))
    bottom = np.zeros(len(states))
    for part, alpha in zip(STATE_PARTS, (1.0, 0.6, 0.3)):
        values = np.array([max(v or 0 for v in state[part]) for _, _, state in states])
        ax.bar(x, values, 0.6, bottom=bottom, color=[color(fw) for _, fw, _ in states], alpha=alpha,
               edgecolor="white", label=part)
        bottom += values
    ax.set_xticks(x, [label for label, _, _ in states], fontsize=8)
    ax.set_ylabel("MB")
    ax.set_title("Training state per rank")
    handles = [plt.Rectangle((0, 0), 1, 1, color="#777777", alpha=a) for a in (1.0, 0.6, 0.3)]
    ax.legend(handles, ["parameters", "gradients", "optimizer state"], fontsize=8)
    ax.grid(alpha=0.3, axis="y")


PHASE_COLORS = {"data": "#8c8c8c", "forward": "#4c72b0", "backward": "#55a868", "communication": "#c44e52",
                "optimizer": "#dd8452", "other": "#cccccc"}


def breakdown_figure(rows: list[dict]):
    """One stacked bar per run: milliseconds per step in each phase, with the uninstrumented step as a tick."""
    have = [r for r in rows if r.get("breakdown")]
    if not have:
        return None
    fig, ax = plt.subplots(figsize=(max(6.4, 1.1 * len(have) + 2.5), 4.2))
    x = np.arange(len(have))
    bottom = np.zeros(len(have))
    for phase, shade in PHASE_COLORS.items():
        values = np.array([(r["breakdown"].get(phase) or 0) * 1e3 for r in have])
        ax.bar(x, values, 0.6, bottom=bottom, color=shade, label=phase, edgecolor="white", linewidth=0.5)
        bottom += values
    steps = [r["breakdown"]["step_s"] * 1e3 for r in have]
    ax.scatter(x, steps, marker="_", s=900, color="black", zorder=3, label="step (uninstrumented)")
    ax.set_xticks(x, [r["label"] for r in have], fontsize=8)
    ax.set_ylabel("ms per step")
    ax.set_title("Where the time goes")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(alpha=0.3, axis="y")
    return fig
