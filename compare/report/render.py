"""Rendering a report's numbers (compare/findings.py) as blocks, then as markdown, HTML and a terminal table.

The markdown and HTML are rendered from one list of blocks, so the two never disagree.
"""
from __future__ import annotations

import base64
import html
from pathlib import Path

from .findings import BREAKDOWN_PHASES, rel_pct
from .parity import all_pairs

PAIR_NAMES = {"cross_framework": "MLX vs torch", "dp_invariance": "N ranks vs 1", "strategy": "strategy vs ddp",
              "precision": "bf16 vs fp32"}


def terminal_table(summary: dict) -> str:
    """Fixed-width table for the end of `dpcompare compare`, then the verdict lines."""
    header = ("run", "N", "status", "final loss", "tokens/s", "scaling", "RSS/rank MB", "parity")
    body = []
    for r in summary["runs"]:
        rss = [m for m in r.get("peak_rss_mb") or [] if m is not None]
        body.append((r["label"], str(r["world_size"]), r["status"], fmt(r.get("final_loss"), ".4f"),
                     fmt(r.get("tokens_per_s"), ",.0f"), pct(r.get("scaling_efficiency"), ".0f"),
                     fmt(max(rss) if rss else None, ",.0f"), r.get("parity", "-")))
    widths = [max(len(row[i]) for row in [header] + body) for i in range(len(header))]
    right = {1, 3, 4, 5, 6}
    lines = ["  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()
             for row in [header] + body]
    lines.insert(1, "  ".join("-" * w for w in widths))
    v = summary["verdicts"]
    lines += ["", f"verdict: {v['headline']}"] + [f"- {line}" for line in v["lines"]]
    lines += [f"! {w}" for w in v.get("warnings", [])]
    return "\n".join(lines)



def fmt(value, spec: str = ".4g", missing: str = "–") -> str:
    return missing if value is None else format(value, spec)


def pct(value, spec: str = ".1f") -> str:
    return "–" if value is None else format(100 * value, spec) + "%"


def grouped(by_label: dict) -> str:
    """{"mlx x1": 1, "torch x1": 1} -> "1 (every run)"; otherwise the runs sharing each value."""
    values = {}
    for label, value in by_label.items():
        values.setdefault(str(value), []).append(label)
    if len(values) == 1:
        return f"{next(iter(values))} (every run)"
    return "; ".join(f"{', '.join(labels)}: {value}" for value, labels in values.items())


def per_rank(values: list) -> str:
    return " / ".join(fmt(v, ",.0f") for v in values) if any(v is not None for v in values) else "–"


def report_blocks(s: dict) -> list[tuple]:
    """("h1"|"h2"|"p"|"ul"|"verdict"|"table"|"figs"|"pre", ...) blocks, rendered as markdown and HTML."""
    v = s["verdicts"]
    blocks = [("h1", "dpcompare: MLX vs PyTorch data parallelism"),
              ("p", f"Report created {s['created']} from {len(s['runs'])} run(s)."),
              ("verdict", v["parity"], v["headline"], v["lines"], v["warnings"])]
    blocks += [("h2", "Runs"), ("table", RUN_HEADERS, [run_cells(r) for r in s["runs"]])]
    blocks += parity_blocks(s["parity"])
    blocks += breakdown_blocks(s["runs"])
    blocks += sample_blocks(s.get("samples") or {})
    blocks += memory_blocks(s["runs"])
    blocks += precision_blocks(s["runs"])
    figures = [(title, s["plots"][name], name == "loss") for name, title in (
        ("loss", "Loss curves"), ("eval_loss", "Eval loss"), ("throughput", "Throughput"),
        ("scaling", "Scaling"), ("breakdown", "Where the time goes"), ("memory", "Memory per rank"))
        if name in s["plots"]]
    if figures:
        blocks += [("h2", "Figures"), ("figs", figures)]
    if s["scaling"] and any(len(p) > 1 for p in s["scaling"].values()):
        blocks += [("h2", "Scaling"), ("table", ("framework", "N", "tokens/s", "speedup", "efficiency"),
                    [(fw, p["world_size"], fmt(p["tokens_per_s"], ",.0f"), fmt(p["speedup"], ".2f") + "x"
                      if p["speedup"] else "–", pct(p["efficiency"], ".0f"))
                     for fw, points in s["scaling"].items() for p in points])]
    m = s["mfu"]
    blocks += [("h2", "MFU"), ("p", m["definition"] + "."),
               ("p", "FLOPs per token: " + (m["formula"] or "unknown (no model spec)") + ".")]
    blocks.append(("ul", [f"{r['label']}: MFU {pct(r['mfu'], '.2f')}; peak: {r['peak_source']}" for r in s["runs"]]))
    f = s["fairness"]
    blocks += [("h2", "Fairness"), ("ul", f["notes"] + [
        "threads per rank: " + grouped(f["threads_per_rank"]),
        "warmup steps excluded from throughput: " + grouped(f["warmup_steps"]),
        "tokens per step: " + grouped({k: fmt(v, ",") for k, v in f["tokens_per_step"].items()}),
        "BLAS: " + grouped(f["blas"])] + [f"WARNING: {w}" for w in f["warnings"]])]
    e = s["environment"]
    machine, versions = e.get("machine") or {}, e.get("versions") or {}
    blocks += [("h2", "Environment"), ("ul", [
        f"machine: {machine.get('processor', '?')}, {machine.get('cpus', '?')} CPUs, {machine.get('platform', '?')}"
        f" (host {machine.get('host', '?')})",
        "versions: " + ", ".join(f"{k} {v}" for k, v in versions.items() if v),
        "accelerator: " + str(e.get("accelerator") or "none detected"),
        "backends: " + grouped(e["backends"]),
        "devices: " + grouped(e["devices"]),
        "BLAS: " + "; ".join(f"{k}: {', '.join(v)}" for k, v in e["blas"].items()),
    ] + [f"measured CPU peak, {t} thread(s): " + ", ".join(
        f"{fw} {fmt((p.get('flops') or 0) / 1e9, '.1f')} GFLOP/s ({p.get('error') or p.get('blas') or '?'})"
        for fw, p in peaks.items())
        for t, peaks in e["cpu_peaks"].items()])]
    c = s["commands"]
    reproduce = ([c["compare"]] if c.get("compare") else []) + [
        f"# {r['label']}\n{r['dpcompare']}\n#   launcher: {r['launcher']}" for r in c["runs"]]
    blocks += [("h2", "Reproduce"), ("pre", "\n".join(reproduce))]
    return blocks


RUN_HEADERS = ("run", "N", "backend", "device", "status", "final loss", "eval loss",
               "tokens/s median [p10–p90]", "step ms", "compile s (warmup steps)", "first step s", "MFU",
               "framework peak MB/rank", "peak RSS MB/rank", "parity")


def run_cells(r: dict) -> tuple:
    tps = fmt(r.get("tokens_per_s"), ",.0f")
    if r.get("tokens_per_s_p10") is not None:
        tps += f" [{r['tokens_per_s_p10']:,.0f}–{r['tokens_per_s_p90']:,.0f}]"
    status = r["status"] if r["ok"] else r["problem"]  # the problem starts with the status
    return (r["label"], r["world_size"], r["backend"], r["device"], status, fmt(r.get("final_loss"), ".4f"),
            fmt(r.get("final_eval_loss"), ".4f"), tps, fmt(r.get("step_time_ms"), ".1f"),
            f"{r['compile_s']:.2f} ({r['warmup_steps']})" if r.get("compile_s") is not None else "–",
            fmt(r.get("time_to_first_step_s"), ".1f"), pct(r.get("mfu"), ".2f"),
            per_rank(r["peak_mem_mb"]), per_rank(r["peak_rss_mb"]), r["parity"])


def parity_blocks(p: dict) -> list[tuple]:
    t = p["tolerances"]
    blocks = [("h2", "Parity"), ("p", f"Per-step check: max |Δloss| over the first {t['parity_steps']} steps "
               f"(tolerance {t['loss_atol']:g} across frameworks, {t['dp_atol']:g} for N ranks vs 1 and for a strategy vs ddp). Curve "
               f"check: max relative difference of {t['curve_window']}-step moving averages over all common "
               f"steps (tolerance {100 * t['curve_rtol']:g}%). Eval check: max relative difference at common "
               f"eval steps (tolerance {100 * t['eval_rtol']:g}%).")]
    if any(t.get(k) is not None for k in ("bf16_loss_rtol", "precision_curve_rtol")) and \
            any(pair.get("dtype") != "float32" for pair in all_pairs(p)):
        blocks.append(("p", f"bfloat16 pairs are judged relative to the loss, since bf16 rounds at about 0.4%: "
                            f"per step {100 * t['bf16_loss_rtol']:g}% across frameworks and "
                            f"{100 * t['bf16_dp_rtol']:g}% for N ranks vs 1 or a strategy vs ddp; curves "
                            f"{100 * t['bf16_curve_rtol']:g}% and eval {100 * t['bf16_eval_rtol']:g}% across "
                            f"frameworks; bf16 against fp32 of the same framework {100 * t['precision_curve_rtol']:g}% "
                            f"(curves) and {100 * t['precision_eval_rtol']:g}% (eval), with no per-step check "
                            "(the two part ways from the first step). The measurements behind these numbers are "
                            "in docs/precision.md."))
    headers = ("pair", "kind", "per-step max Δ (steps)", "at step", "curve max rel. Δ", "eval max rel. Δ",
               "verdict")
    table = []
    for pair in all_pairs(p):
        name, kind = f"{pair['a']} vs {pair['b']}", PAIR_NAMES.get(pair.get("kind"), pair.get("kind", ""))
        if not pair["comparable"]:
            diffs = "; ".join(f"{k}: {va!r} vs {vb!r}" for k, (va, vb) in pair["differences"].items())
            table.append((name, kind, f"not comparable — {diffs}", "", "", "", pair["verdict"]))
            continue
        c = pair["checks"]
        step, curve, ev = c.get("per_step", {}), c.get("curve", {}), c.get("eval", {})
        if step.get("relative"):
            per_step = f"{rel_pct(step.get('max_rel_diff'))} ({step.get('steps_compared', 0)})"
        elif step:
            per_step = f"{fmt(step.get('max_abs_diff'), '.2e')} ({step.get('steps_compared', 0)})"
        else:
            per_step = "–"
        table.append((name, kind, per_step, fmt(step.get("at_step"), "d"), rel_pct(curve.get("max_rel_diff")),
                      rel_pct(ev.get("max_rel_diff")), pair["verdict"]))
    if table:
        blocks.append(("table", headers, table))
    else:
        blocks.append(("p", "No pairs to compare: parity needs both frameworks at one world size, N>1 "
                            "and N=1 of one framework, a strategy and its ddp run, or bf16 and fp32 runs."))
    if p["skipped"]:
        blocks.append(("ul", [f"skipped {r['label']} ({r['run_dir']}): {r['reason']}" for r in p["skipped"]]))
    return blocks


def breakdown_blocks(rows: list[dict]) -> list[tuple]:
    have = [r for r in rows if r.get("breakdown")]
    if not have:  # --profile-steps 0: the traces alone
        traces = trace_blocks(rows)
        return [("h2", "Where the time goes")] + traces if traces else []
    table = []
    for r in have:
        b = r["breakdown"]
        overhead = b.get("instrumentation_overhead")
        limit = f"{1 / r['mfu']:.1f}x" if r.get("mfu") else "–"
        table.append((r["label"], fmt(b["step_s"] * 1e3, ",.1f"),
                      *(fmt(b.get(p, 0) * 1e3, ",.1f") for p in BREAKDOWN_PHASES),
                      fmt(b.get("phases_sum_s", 0) * 1e3, ",.1f"),
                      "–" if overhead is None else f"{100 * overhead:+.0f}%", limit))
    return [("h2", "Where the time goes"),
            ("p", "Milliseconds per optimizer step, from extra steps run after the last checkpoint: forward, "
                  "backward and optimizer from steps that wait for the device after each phase and skip the "
                  "gradient sync; communication is the median step with gradient sync minus the median step "
                  "without it (what overlap does not hide); other is the rest of the instrumented step; data "
                  "is batch assembly on the host, outside the step timer. 'sum vs step' is what the "
                  "instrumentation itself adds to uninstrumented steps taken in alternation with it. 'x limit' is the step time over the "
                  "time its matmul FLOPs take at the peak used for MFU."),
            ("table", ("run", "step ms", *(f"{p} ms" for p in BREAKDOWN_PHASES), "phases ms", "sum vs step",
                       "x limit"), table)] + trace_blocks(rows)


def trace_blocks(rows: list[dict]) -> list[tuple]:
    """Where each --trace run's timelines are (common/trace.py)."""
    traced = [r for r in rows if r.get("trace")]
    if not traced:
        return []
    return [("p", "Traces of extra steps after the run (--trace): open the .json files in ui.perfetto.dev or "
                  "chrome://tracing, a .gputrace in Xcode."),
            ("ul", [f"{r['label']}: {', '.join(r['trace'])}" for r in traced])]


def sample_blocks(samples: dict) -> list[tuple]:
    by_run = samples.get("by_run") or {}
    if not by_run:
        return []
    same = samples.get("fp32_identical")
    verdict = ("" if same is None else " The float32 runs' texts are identical, as fp32 parity predicts." if same
               else " The float32 runs' texts differ: their final weights differ (or two tokens are near-tied).")
    return [("h2", "Greedy continuations"),
            ("p", f"From each run's final weights, the {len(by_run)} runs continue the prompt "
                  f"\"{samples.get('prompt')}\" greedily, decoded with the run's tokenizer." + verdict),
            ("table", ("run", "continuation"), [(label, s.get("text", f"({s.get('error', 'no sample')})"))
                                                for label, s in by_run.items()])]


def memory_blocks(rows: list[dict]) -> list[tuple]:
    """Per rank: the training state the rank holds (what FSDP shards), then the measured peaks."""
    have = [r for r in rows if r.get("state_mb")]
    if not have:
        return []
    table = []
    for r in have:
        state = r["state_mb"]
        for rank in range(r["world_size"]):
            cell = lambda k: fmt((state.get(k) or [None] * (rank + 1))[rank], ",.1f")  # noqa: E731
            values = [(state.get(k) or [None] * (rank + 1))[rank] for k in ("params", "grads", "optimizer")]
            total = sum(values) if all(v is not None for v in values) else None
            mem = (r.get("peak_mem_mb") or [None] * (rank + 1))[rank] if rank < len(r.get("peak_mem_mb") or []) else None
            rss = (r.get("peak_rss_mb") or [None] * (rank + 1))[rank] if rank < len(r.get("peak_rss_mb") or []) else None
            table.append((r["label"], rank, cell("params"), cell("grads"), cell("optimizer"), fmt(total, ",.1f"),
                          fmt(mem, ",.0f"), fmt(rss, ",.0f")))
    blocks = [("h2", "Memory per rank"),
              ("p", "Parameters, gradients and optimizer state are the bytes of the arrays each rank holds after "
                    "its last step (counted from the arrays themselves); ddp replicates all three, fsdp keeps "
                    "1/N of the sharded ones, tp 1/N of the split layers. The framework peak and the process "
                    "peak RSS add activations, buffers and the runtime."),
              ("table", ("run", "rank", "params MB", "grads MB", "optimizer MB", "state MB", "framework peak MB",
                         "peak RSS MB"), table)]
    comm = [r for r in rows if r.get("comm_bytes_per_step")]
    if comm:
        blocks.append(("ul", [f"{r['label']}: {fmt(r['comm_bytes_per_step'] / 1e6, ',.2f')} MB all-reduced per step "
                              "per rank, measured" + (f"; {fmt(r['comm_bytes_per_step_estimate'] / 1e6, ',.2f')} MB "
                              "estimated from the shapes" if r.get("comm_bytes_per_step_estimate") else "")
                              for r in comm]))
    notes = [f"{r['label']}: reduce-scatter {r['reduce_scatter']}" for r in rows if r.get("reduce_scatter")]
    if notes:
        blocks.append(("ul", notes))
    return blocks


def precision_blocks(rows: list[dict]) -> list[tuple]:
    """The dtype and mixed-precision policy each run computed with, and device notes."""
    policies = {}
    for r in rows:
        policy = r.get("precision")
        text = (policy.get("policy") or ", ".join(f"{k}: {v}" for k, v in policy.items())
                if isinstance(policy, dict) else str(policy) if policy else f"{r['dtype']} throughout")
        policies.setdefault(text, []).append(r["label"])
    items = [f"{', '.join(labels)}: {text}" for text, labels in policies.items()]
    items += [f"{r['label']}: {r['device_note']}" for r in rows if r.get("device_note")]
    return [("h2", "Precision"), ("ul", items)]


def to_markdown(blocks: list[tuple]) -> str:
    out = []
    for block in blocks:
        kind = block[0]
        if kind == "h1":
            out.append(f"# {block[1]}")
        elif kind == "h2":
            out.append(f"## {block[1]}")
        elif kind == "p":
            out.append(block[1])
        elif kind == "verdict":
            out.append(f"## Verdict: {block[2]}")
            out.append("\n".join("- **{}:**{}".format(*line.split(":", 1)) for line in block[3]) +
                       "".join(f"\n- **Warning:** {w}" for w in block[4]))
        elif kind == "ul":
            out.append("\n".join(f"- {item}" for item in block[1]))
        elif kind == "table":
            cell = lambda x: str(x).replace("|", "\\|").replace("\n", " ")  # noqa: E731
            rows = [" | ".join(cell(c) for c in block[1]), " | ".join("---" for _ in block[1])]
            rows += [" | ".join(cell(c) for c in row) for row in block[2]]
            out.append("\n".join(f"| {r} |" for r in rows))
        elif kind == "figs":
            out += [f"### {title}\n\n![{title}]({path})" for title, path, _ in block[1]]
        elif kind == "pre":
            out.append(f"```sh\n{block[1]}\n```")
    return "\n\n".join(out) + "\n"


CSS = """
body { font: 15px/1.5 -apple-system, "Segoe UI", Roboto, Helvetica, Arial, sans-serif; color: #1d1d1f;
       max-width: 1200px; margin: 2em auto; padding: 0 1.2em; background: #fff; }
h1 { font-size: 1.6em; margin-bottom: .2em; } h2 { border-bottom: 1px solid #ddd; padding-bottom: .2em; margin-top: 1.8em; }
h3 { margin: 1.2em 0 .4em; font-size: 1.05em; color: #444; }
.meta { color: #666; margin-top: 0; }
.verdict { border-radius: 8px; padding: .8em 1.2em; margin: 1em 0; border: 1px solid; }
.verdict.pass { background: #eef8f0; border-color: #5cb270; } .verdict.fail { background: #fdeeee; border-color: #d9534f; }
.verdict.other { background: #f4f4f6; border-color: #aaa; }
.verdict h2 { border: none; margin: 0 0 .3em; } .verdict ul { margin: .2em 0; padding-left: 1.2em; }
.warn { color: #8a5a00; }
.scroll { overflow-x: auto; }
table { border-collapse: collapse; font-size: 13px; margin: .6em 0; }
th, td { border: 1px solid #ddd; padding: 4px 8px; text-align: left; vertical-align: top; }
th { background: #f4f4f6; } tr:nth-child(even) td { background: #fafafa; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
.badge { display: inline-block; padding: 0 .5em; border-radius: 4px; font-weight: 600; font-size: 12px; }
.b-pass { background: #d4edda; color: #1e6b2f; } .b-fail { background: #f8d7da; color: #8b1c24; }
.b-other { background: #e9e9ec; color: #444; }
.figs { display: grid; grid-template-columns: repeat(auto-fit, minmax(460px, 1fr)); gap: 1em 1.5em; }
figure { margin: 0; } figure.wide { grid-column: 1 / -1; text-align: center; }
figure img { max-width: 100%; height: auto; border: 1px solid #eee; }
td:first-child { white-space: nowrap; font-weight: 600; }
pre { background: #f6f8fa; padding: .8em 1em; border-radius: 6px; overflow-x: auto; font-size: 12.5px; }
"""

# Records, once the page has loaded, whether every embedded figure decoded (headless tests read it).
IMAGE_CHECK = """
window.addEventListener("load", function () {
  var images = Array.prototype.slice.call(document.images);
  var ok = images.filter(function (img) { return img.complete && img.naturalWidth > 0; }).length;
  document.body.setAttribute("data-images-loaded", ok + "/" + images.length);
});
"""


def badge(text: str) -> str:
    cls = {"pass": "b-pass", "ok": "b-pass", "fail": "b-fail", "failed": "b-fail"}.get(text.lower(), "b-other")
    return f'<span class="badge {cls}">{html.escape(text)}</span>'


def to_html(blocks: list[tuple], out_dir: Path) -> str:
    body = []
    for block in blocks:
        kind = block[0]
        if kind == "h1":
            body.append(f"<h1>{html.escape(block[1])}</h1>")
        elif kind == "h2":
            body.append(f"<h2>{html.escape(block[1])}</h2>")
        elif kind == "p":
            body.append(f'<p class="{"meta" if block[1].startswith("Report created") else ""}">'
                        f"{html.escape(block[1])}</p>")
        elif kind == "verdict":
            cls = block[1] if block[1] in ("pass", "fail") else "other"
            items = "".join("<li><b>{}:</b>{}</li>".format(*map(html.escape, line.split(":", 1)))
                            for line in block[3])
            items += "".join(f'<li class="warn"><b>Warning:</b> {html.escape(w)}</li>' for w in block[4])
            headline = html.escape(block[2]).replace(block[1].upper(), badge(block[1].upper()), 1)
            body.append(f'<div class="verdict {cls}"><h2>Verdict: {headline}</h2><ul>{items}</ul></div>')
        elif kind == "ul":
            body.append("<ul>" + "".join(f"<li>{html.escape(item)}</li>" for item in block[1]) + "</ul>")
        elif kind == "table":
            head = "".join(f"<th>{html.escape(str(h))}</th>" for h in block[1])
            rows = "".join("<tr>" + "".join(html_cell(c) for c in row) + "</tr>" for row in block[2])
            body.append(f'<div class="scroll"><table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody>'
                        "</table></div>")
        elif kind == "figs":
            figures = []
            for title, path, wide in block[1]:
                data = base64.b64encode((out_dir / path).read_bytes()).decode()
                figures.append(f'<figure class="{"wide" if wide else ""}"><h3>{html.escape(title)}</h3>'
                               f'<img alt="{html.escape(title)}" src="data:image/png;base64,{data}"></figure>')
            body.append('<div class="figs">' + "".join(figures) + "</div>")
        elif kind == "pre":
            body.append(f"<pre>{html.escape(block[1])}</pre>")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>dpcompare report</title><style>{CSS}</style></head>\n<body>\n"
            + "\n".join(body) + f"\n<script>{IMAGE_CHECK}</script>\n</body></html>\n")


VERDICT_WORDS = ("ok", "failed", "pass", "fail", "skipped", "not comparable", "no data", "incomplete")


def html_cell(value) -> str:
    text = str(value)
    if text in VERDICT_WORDS:
        return f"<td>{badge(text)}</td>"
    # Numbers (with separators, units, ranges) align right; prose stays left.
    numeric = bool(text) and all(ch.isdigit() or ch in ",.–-%[]()/<ex+ " for ch in text) and any(ch.isdigit() for ch in text)
    return f'<td class="num">{html.escape(text)}</td>' if numeric else f"<td>{html.escape(text)}</td>"
