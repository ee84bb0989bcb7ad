"""The parity verdict as a table: one row per judged pair, failures first, and after the table one sentence
for each pair that did not pass; then the speed ratios as a table of their own.

A matrix of frameworks x strategies x dtypes x world sizes judges dozens of pairs; as sentences they hid
the one that failed. The rows are computed once (findings.verdicts puts them into summary.json), and the
terminal, report.md and report.html show the same rows.
"""
from __future__ import annotations

from .parity import all_pairs

PAIR_NAMES = {"cross_framework": "MLX vs torch", "dp_invariance": "N vs 1", "strategy": "strategy vs ddp",
              "precision": "bf16 vs fp32"}
# Worst first: a failure is what a reader looks for.
VERDICT_ORDER = ("fail", "not comparable", "no data", "pass")
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


SPEED_NAMES = {"framework": "MLX vs torch", "strategy": "strategy vs ddp", "dtype": "bf16 vs fp32"}
SPEED_HEADERS = ("speed", "runs", "faster", "speedup", "tokens/s median", "p10–p90", "phase that differs most",
                 "op class that differs most")


def speed_cells(speed: list[dict]) -> tuple[tuple, list[tuple]]:
    """The speed ratios (findings.speed_table) as a table of their own: one row per pair of runs, its
    figures in the order faster vs slower; at one rank the op class that accounts for most of the gap, with
    both runs' cost (common/train/opclasses.py)."""
    rows = []
    for s in speed:
        d = s.get("phase")
        phase = "–" if not d else (f"{d['phase']}: {d['fast_ms']:,.1f} vs {d['slow_ms']:,.1f} ms/step"
                                   + {None: "", True: ", spreads apart", False: ", within spread"}[d["spreads_apart"]])
        rows.append((SPEED_NAMES.get(s.get("kind", "framework"), s.get("kind")), f"{s['a']} vs {s['b']}",
                     s["faster"], f"{s['speedup']:.2f}x",
                     f"{s['faster_tokens_per_s']:,.0f} vs {s['slower_tokens_per_s']:,.0f}",
                     "overlap: noise" if s["within_noise"] else "apart", phase, s.get("op_class_gap") or "–"))
    return SPEED_HEADERS, rows


def verdict_tables(summary: dict) -> list[tuple[tuple, list[tuple]]]:
    """The verdict's tables, (headers, rows) each: the judged pairs, then the speed ratios."""
    v = summary["verdicts"]
    return ([table_cells(v["pairs"])] if v.get("pairs") else []) + \
        ([speed_cells(summary["speed"])] if summary.get("speed") else [])


def text_table(headers: tuple, body: list[tuple], right: frozenset = frozenset()) -> list[str]:
    """Fixed-width lines: a header, a rule, one line per row (columns in `right` aligned right)."""
    widths = [max(len(str(row[i])) for row in [headers] + body) for i in range(len(headers))]
    lines = ["  ".join(str(c).rjust(w) if i in right else str(c).ljust(w)
                       for i, (c, w) in enumerate(zip(row, widths))).rstrip() for row in [headers] + body]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def terminal_verdict(summary: dict) -> list[str]:
    """The headline, the pairs' table (verdicts in capitals), the failures' sentences, the speed table, then
    the other lines and the warnings."""
    verdicts = summary["verdicts"]
    lines = [f"verdict: {verdicts['headline']}"]
    if verdicts.get("pairs"):
        headers, body = table_cells(verdicts["pairs"])
        lines += [""] + text_table(headers, [(row[0].upper(), *row[1:]) for row in body])
    if verdicts.get("failures"):
        lines += [""] + [f"! {line}" for line in verdicts["failures"]]
    if summary.get("speed"):
        lines += [""] + text_table(*speed_cells(summary["speed"]))
    if verdicts.get("lines"):
        lines += [""] + [f"- {line}" for line in verdicts["lines"]]
    return lines + [f"! {w}" for w in verdicts.get("warnings", [])]


def pair_sentence(pair: dict) -> str:
    a, b = pair["a"], pair["b"]
    if pair["verdict"] == "not comparable":
        diffs = ", ".join(f"{k} ({va!r} vs {vb!r})" for k, (va, vb) in list(pair["differences"].items())[:4])
        return f"{a} and {b} are not comparable: their configs differ in {diffs}"
    if pair["verdict"] == "no data":
        return f"{a} vs {b}: no common steps to compare"
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
