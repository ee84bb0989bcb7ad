"""The parity verdict as a table: one row per judged pair, failures first, and after the table one sentence
for each pair that did not pass; then the speed ratios, scaling and memory, as a table each.

A matrix of frameworks x strategies x dtypes x world sizes judges dozens of pairs; as sentences they hid
the one that failed. The rows are computed once (findings.verdicts puts them into summary.json), and the
terminal (terminal.py), report.md and report.html show the same rows; the terminal leaves out what does not
fit a screen unless asked (--verbose), the report never does.
"""
from __future__ import annotations

from .parity import all_pairs

PAIR_NAMES = {"cross_framework": "MLX vs torch", "dp_invariance": "N vs 1", "strategy": "strategy vs ddp",
              "precision": "bf16 vs fp32", "peer": "peer"}
# Worst first: a failure is what a reader looks for.
# "differs": the pair differs by a stated choice, not a bug (N vs 1 under --loss-normalization per-rank).
VERDICT_ORDER = ("fail", "differs", "not comparable", "no data", "pass")
HEADERS = ("verdict", "kind", "pair", "per-step max |Δloss|", "curve max rel. Δ", "eval max rel. Δ")
COLUMNS = ("verdict", "kind", "pair", "per_step", "curve", "eval")


def pair_rows(parity: dict) -> list[dict]:
    """{"verdict", "kind", "pair", "per_step", "curve", "eval"} per judged pair, failures first (report order
    within a verdict); each check reads "value ≤ tolerance", or "value > tolerance" where it failed."""
    rows = []
    for pair in all_pairs(parity):
        checks = pair.get("checks") or {}
        step = checks.get("per_step") or {}
        rows.append({"verdict": pair["verdict"], "kind": PAIR_NAMES.get(pair.get("kind"), pair.get("kind", "")),
                     "pair": f"{pair['a']} vs {pair['b']}",
                     "per_step": check_cell(step, "max_rel_diff" if step.get("relative") else "max_abs_diff",
                                            relative=bool(step.get("relative"))),
                     "curve": check_cell(checks.get("curve") or {}, "max_rel_diff", relative=True),
                     "eval": check_cell(checks.get("eval") or {}, "max_rel_diff", relative=True)})
    rank = {verdict: i for i, verdict in enumerate(VERDICT_ORDER)}
    return sorted(rows, key=lambda r: rank.get(r["verdict"], len(rank)))  # stable: report order kept


def check_cell(check: dict, key: str, relative: bool) -> str:
    if check.get("verdict") not in ("pass", "fail") or check.get(key) is None:
        return "–"
    show = rel_pct if relative else (lambda x: f"{x:.2e}")
    tolerance = f"{100 * check['tolerance']:g}%" if relative else f"{check['tolerance']:g}"
    if check["verdict"] == "pass":
        return f"{show(check[key])} ≤ {tolerance}"
    where = f" at step {check['at_step']}" if check.get("at_step") is not None else ""
    return f"{show(check[key])} > {tolerance}{where}"


def failure_lines(parity: dict) -> list[str]:
    """The sentence of every pair that did not pass, in the table's order, each followed by its diagnosis."""
    lines = []
    order = {verdict: i for i, verdict in enumerate(VERDICT_ORDER)}
    failed = sorted((p for p in all_pairs(parity) if p["verdict"] != "pass"),
                    key=lambda p: order.get(p["verdict"], len(order)))
    for pair in failed:
        lines.append(f"{pair_topic(pair)}: {pair_sentence(pair)}")
        if pair.get("diagnosis"):
            lines.append(f"Diagnosis, {pair['a']} vs {pair['b']}: {pair['diagnosis']['finding']}")
    return lines


def pair_topic(pair: dict) -> str:
    kind = pair.get("kind")
    if kind == "cross_framework":
        return f"Parity, N={pair['world_size'][0]}"
    if kind == "strategy":
        return f"Strategy, {pair['strategy'][0]}"
    return {"dp_invariance": "DP invariance", "precision": "Precision"}.get(kind, str(kind))


def table_cells(rows: list[dict]) -> tuple[tuple, list[tuple]]:
    """(headers, rows) for a markdown or HTML table."""
    return HEADERS, [tuple(row[c] for c in COLUMNS) for row in rows]


SPEED_NAMES = {"framework": "MLX vs torch", "strategy": "strategy vs ddp", "dtype": "bf16 vs fp32", "peer": "peer vs ours"}
SPEED_HEADERS = ("speed", "runs", "faster", "speedup", "tokens/s median", "p10–p90", "phase that differs most",
                 "op class that differs most")


def speed_cells(speed: list[dict]) -> tuple[tuple, list[tuple]]:
    """The speed ratios (findings.speed_table) as a table of their own: one row per pair of runs, its
    figures in the order faster vs slower; at one rank the op class that accounts for most of the gap, with
    both runs' cost (common/train/opclasses.py). A pair that measures the machine (environment_bound.py) names
    no faster framework: "environment-bound", its figures and ratio in the order of its runs, a over b."""
    rows = []
    for s in speed:
        bound = bool(s.get("environment_bound"))
        # Without a faster framework named, "faster vs slower" could not be read: such a row keeps the runs' order.
        order = (lambda x, y: (y, x)) if bound and s["a"] != s["faster_label"] else (lambda x, y: (x, y))
        d = s.get("phase")
        phase = "–" if not d else ("{}: {:,.1f} vs {:,.1f} ms/step".format(d["phase"], *order(d["fast_ms"], d["slow_ms"]))
                                   + {None: "", True: ", spreads apart", False: ", within spread"}[d["spreads_apart"]])
        if s.get("peer_figures"):  # a peer beside ours: its memory and start-up, in the runs' order
            phase = peer_cell(s["peer_figures"])
        rows.append((SPEED_NAMES.get(s.get("kind", "framework"), s.get("kind")), f"{s['a']} vs {s['b']}",
                     "environment-bound" if bound else s["faster"],
                     f"{s['ratio_a_over_b'] if bound else s['speedup']:.2f}x",
                     "{:,.0f} vs {:,.0f}".format(*order(s["faster_tokens_per_s"], s["slower_tokens_per_s"])),
                     "overlap: noise" if s["within_noise"] else "apart", phase, s.get("op_class_gap") or "–"))
    return SPEED_HEADERS, rows


def peer_cell(figures: dict) -> str:
    """"peak RSS 310 vs 69 MB/rank, first step 15.0 vs 17.9 s": a peer's figures, then ours."""
    rss = ["/".join(f"{m:,.0f}" for m in mbs if m) or "?" for mbs in (v or [] for v in figures["peak_rss_mb"])]
    first = ["?" if t is None else f"{t:.1f}" for t in figures["time_to_first_step_s"]]
    return f"peak RSS {rss[0]} vs {rss[1]} MB/rank, first step {first[0]} vs {first[1]} s"


def asked_speed(speed: list[dict]) -> list[dict]:
    """The speed ratios a comparison asks about: MLX vs torch at each configuration, where both ran; all of
    them (each strategy vs ddp, bf16 vs fp32) where only one framework did."""
    return [s for s in speed if s.get("kind", "framework") in ("framework", "peer")] or speed


def scaling_cells(scaling: dict) -> tuple[tuple, list[tuple]] | None:
    """Scaling (findings.scaling_table) as a table, one row per run group: at each world size above 1 the
    speedup over the 1-rank ddp run of its framework and dtype ("against"), and the efficiency."""
    scaled = {group: {p["world_size"]: p for p in points if p["world_size"] > 1 and p["efficiency"] is not None}
              for group, points in scaling.items()}
    sizes = sorted({n for at in scaled.values() for n in at})
    if not sizes:
        return None
    rows = [(group, next(iter(at.values())).get("against") or "–", *(scaling_cell(at.get(n)) for n in sizes))
            for group, at in scaled.items() if at]
    return ("scaling", "against", *(f"x{n} speedup (efficiency)" for n in sizes)), rows


def scaling_cell(point: dict | None) -> str:
    if point is None:
        return "–"
    slower = ", slower than 1 rank" if point["speedup"] < 1 else ""
    return f"{point['speedup']:.2f}x ({100 * point['efficiency']:.0f}%{slower})"


def memory_cells(memory: list[dict]) -> tuple[tuple, list[tuple]] | None:
    """What sharding saves (findings.memory_table) as a table, one row per run group: at each world size, the
    parameters, gradients and optimizer state one rank holds against its ddp run's."""
    if not memory:
        return None
    sizes = sorted({m["world_size"] for m in memory})
    at = {(m["group"], m["world_size"]): m for m in memory}
    rows = [(group, *(memory_cell(at.get((group, n))) for n in sizes)) for group in dict.fromkeys(m["group"] for m in memory)]
    return ("memory", *(f"x{n} state MB/rank vs ddp" for n in sizes)), rows


def memory_cell(entry: dict | None) -> str:
    if entry is None:
        return "–"
    return f"{entry['state_mb']:,.1f} vs {entry['ddp_state_mb']:,.1f} ({entry['ratio']:.2f}x)"


def verdict_tables(summary: dict, every_ratio: bool = True) -> list[tuple]:
    """The verdict's tables, (headers, rows) each: the judged pairs, the speed ratios (every one, or only
    those asked_speed keeps) led by the lines that say which of them measure the machine (headers, rows,
    lines), then scaling and memory by run group."""
    v = summary["verdicts"]
    speed = summary.get("speed") or []
    tables: list[tuple] = [table_cells(v["pairs"])] if v.get("pairs") else []
    tables += [(*speed_cells(speed if every_ratio else asked_speed(speed)), v.get("speed_environment") or [])] \
        if speed else []
    return tables + [t for t in (scaling_cells(summary.get("scaling") or {}),
                                 memory_cells(summary.get("memory") or [])) if t]


def text_table(headers: tuple, body: list[tuple], right: frozenset = frozenset()) -> list[str]:
    """Fixed-width lines: a header, a rule, one line per row (columns in `right` aligned right)."""
    widths = [max(len(str(row[i])) for row in [headers] + body) for i in range(len(headers))]
    lines = ["  ".join(str(c).rjust(w) if i in right else str(c).ljust(w)
                       for i, (c, w) in enumerate(zip(row, widths))).rstrip() for row in [headers] + body]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def pair_sentence(pair: dict) -> str:
    a, b = pair["a"], pair["b"]
    if pair["verdict"] == "not comparable":
        diffs = ", ".join(f"{k} ({va!r} vs {vb!r})" for k, (va, vb) in list(pair["differences"].items())[:4])
        return f"{a} and {b} are not comparable: their configs differ in {diffs}"
    if pair["verdict"] == "no data":
        return f"{a} vs {b}: no common steps to compare"
    if pair["verdict"] == "differs" and pair.get("kind") == "peer":
        step = pair["checks"].get("per_step") or {}
        return (f"{a} differs from {b} by {step.get('max_abs_diff', float('nan')):.2e} per step, as its trainer "
                f"cannot be told what ours ran (not a bug): {pair['explained_by']} (docs/peers.md)")
    if pair["verdict"] == "differs":
        step = pair["checks"].get("per_step") or {}
        return (f"{a} differs from {b} by {step.get('max_abs_diff', float('nan')):.2e} per step, as its "
                f"--loss-normalization {pair['explained_by']} makes it (not a bug): each rank divides its loss by "
                "its own count of targets (mlx-lm's choice), so where the ranks hold unequal counts (padding, masked "
                "prompts, uneven --rank-shares) a token weighs more on a rank with few; global-tokens computes what one rank computes "
                "(docs/parity.md, \"Loss normalization\")")
    checks = pair["checks"]
    step = checks.get("per_step", {"verdict": "no data"})
    verb = {"pass": "matches", "fail": "does NOT match"}[pair["verdict"]]
    if pair.get("kind") == "precision":
        verb = {"pass": "stays close to", "fail": "departs from"}[pair["verdict"]]
    text = f"{a} {verb} {b}"
    if step["verdict"] == "no data" and "curve" in checks:
        text += ":"
    elif step.get("relative"):
        text += (f": max relative |Δloss| {rel_pct(step['max_rel_diff'])} over the first {step['steps_compared']} "
                 f"steps (tolerance {100 * step['tolerance']:g}%{', FAIL' if step['verdict'] == 'fail' else ''})")
    elif step["verdict"] != "no data":
        text += (f": max |Δloss| {step['max_abs_diff']:.2e} over the first {step['steps_compared']} steps "
                 f"(tolerance {step['tolerance']:g}{', FAIL' if step['verdict'] == 'fail' else ''})")
    if "curve" in checks:
        c = checks["curve"]
        text += (f"{';' if not text.endswith(':') else ''} moving averages within {rel_pct(c['max_rel_diff'])} "
                 f"over {c['steps_compared']} steps "
                 f"(tolerance {100 * c['tolerance']:g}%{', FAIL' if c['verdict'] == 'fail' else ''})")
    if checks.get("eval", {}).get("verdict") in ("pass", "fail"):
        e = checks["eval"]
        text += (f"; eval loss within {rel_pct(e['max_rel_diff'])} "
                 f"(tolerance {100 * e['tolerance']:g}%{', FAIL' if e['verdict'] == 'fail' else ''})")
    return text


def rel_pct(value) -> str:
    """Relative differences as percentages, readable from exact zero up to whole percent."""
    if value is None:
        return "–"
    if value == 0:
        return "0%"
    return "<0.001%" if value < 1e-5 else f"{100 * value:.3g}%"
