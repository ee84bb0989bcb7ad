"""What the report says, as blocks (headings, paragraphs, tables, images) built from its numbers
(compare/report/findings.py). markup.py writes the blocks as markdown and HTML; terminal.py prints the end
of `dpcompare compare`.
"""
from __future__ import annotations

from common.costmodel.links import hop_bandwidth_Bps

from .adapters import adapter_blocks
from .contributions import contribution_blocks
from .findings import BREAKDOWN_PHASES, MB
from .opclass_table import opclass_blocks
from .parity import all_pairs
from .restarts import restart_blocks
from .verdict_table import verdict_tables


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
    blocks = [("h1", "dpcompare: MLX vs PyTorch distributed training"),
              ("p", f"Report created {s['created']} from {len(s['runs'])} run(s)."
                    + "".join(f" Started from the checkpoint {c['path']} (model.safetensors sha256 "
                              f"{c['weights_sha256'][:16]}...)." for c in s.get("init_from") or [])),
              ("verdict", v["parity"], v["headline"], verdict_tables(s), v.get("failures", []), v.get("notes", v["lines"]),
               v["warnings"])]
    blocks += contribution_blocks(s)  # compare --recipes A,B
    blocks += [("h2", "Runs"), ("table", RUN_HEADERS, [run_cells(r) for r in s["runs"]])]
    blocks += parity_blocks(s["parity"])
    blocks += restart_blocks(s["runs"])
    blocks += breakdown_blocks(s["runs"])
    blocks += opclass_blocks(s["runs"])
    blocks += prediction_blocks(s["runs"])
    blocks += sample_blocks(s.get("samples") or {})
    blocks += memory_blocks(s["runs"])
    blocks += adapter_blocks(s["runs"])
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
    backend = r["backend"]
    if (r.get("link") or {}).get("requested"):  # --link: the backend over an emulated link of this rate
        backend += f" @ {r['link']['requested']}"
    return (r["label"], r["world_size"], backend, r["device"], status, fmt(r.get("final_loss"), ".4f"),
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
        blocks.append(("p", f"What a bf16 pass can and cannot tell. The per-step check across frameworks "
                            f"({100 * t['bf16_loss_rtol']:g}% relative) catches a mismatch that moves the loss by a "
                            "percent or more: a missing cast, a matmul left in float32 on one side, a wrong scale. "
                            "It cannot tell a subtle policy mismatch from rounding: one framework keeping its "
                            "residual stream or its softmax in float32 moves the loss about as much as bf16 does "
                            "against float32 (2-5e-4 relative per step, measured at 256 tokens per step), 4-10x "
                            "below the tolerance, and at 256 tokens per step MLX and torch bf16 already differ "
                            "by up to 3.7e-4 from rounding alone. A bf16 pass therefore says both frameworks "
                            "train in bf16 and neither is broken; that both round at the same points is checked "
                            "module by module by tests/unit/test_bf16.py (bf16 logits within one bf16 ulp), not "
                            "by this verdict (docs/precision.md)."))
    if all_pairs(p):
        blocks.append(("p", "Every judged pair, with its numbers, is in the verdict table at the top."))
    else:
        blocks.append(("p", "No pairs to compare: parity needs both frameworks at one world size, N>1 "
                            "and N=1 of one framework, a strategy and its ddp run, or bf16 and fp32 runs."))
    if p["skipped"]:
        blocks.append(("ul", [f"skipped {r['label']} ({r['run_dir']}): {r['reason']}" for r in p["skipped"]]))
    return blocks


def prediction_blocks(rows: list[dict]) -> list[tuple]:
    """The cost model's step time next to the measured one (docs/scaling.md)."""
    have = [r for r in rows if (r.get("prediction") or {}).get("step_s")]
    if not have:
        return []
    table = [(r["label"], r["prediction"]["from"], r["prediction"].get("link", "–"),
              fmt(r["prediction"]["step_s"] * 1e3, ",.1f"), fmt(r.get("step_time_ms"), ",.1f"),
              (f"{100 * (r['prediction']['step_s'] * 1e3 / r['step_time_ms'] - 1):+.0f}%" if r.get("step_time_ms")
               else "–"), fmt(r["prediction"]["tokens_per_s"], ",.0f"), fmt(r.get("tokens_per_s"), ",.0f"))
             for r in have]
    notes = [f"{r['label']}: {r['prediction']['note']}" for r in rows if (r.get("prediction") or {}).get("note")]
    notes += [f"{r['label']}: host work fitted on " + ", ".join(f"{run} ({axis} {fitted_cost(r['prediction'], axis)})"
                                                            for axis, run in r["prediction"]["fitted_on"].items())
              for r in have if r["prediction"].get("fitted_on")]
    notes += [f"{r['label']}: {r['prediction']['caveat']}" for r in have if r["prediction"].get("caveat")]
    notes += [f"{r['label']}: {r['prediction']['fit_note']}" for r in have if r["prediction"].get("fit_note")]
    return [("h2", "Predicted and measured"),
            ("p", "The cost model (common/costmodel/, docs/scaling.md) predicts each multi-rank run from the "
                  "1-rank run of its framework and dtype and the link the job measured: compute scaled by the "
                  "work each rank does, plus the ring collectives' time at that link. A run at more than 2 ranks "
                  "also pays the host work per byte moved (per call on torch's tp) that the 2-rank run of each of its axes' "
                  "strategies measured, where the comparison has one."),
            ("table", ("run", "predicted from", "link", "predicted step ms", "measured step ms", "difference",
                       "predicted tokens/s", "measured tokens/s"), table)] + ([("ul", notes)] if notes else [])


def fitted_cost(prediction: dict, axis: str) -> str:
    """An axis's fitted host work as the report says it, in its strategy's unit (Layout.host_unit): per MB moved,
    or per collective call (torch's tp; before stop 47 every axis was stored per call, and a report rebuilt from
    those runs says so)."""
    if axis in (prediction.get("host_s_per_byte") or {}):
        return f"{1e9 * prediction['host_s_per_byte'][axis]:.3g} ms per MB"
    return f"{1e3 * (prediction.get('host_s_per_call') or {}).get(axis, 0.0):.3g} ms per call"


def breakdown_blocks(rows: list[dict]) -> list[tuple]:
    have = [r for r in rows if r.get("breakdown")]
    if not have:  # --profile-steps 0: the traces alone
        traces = trace_blocks(rows)
        return [("h2", "Where the time goes")] + traces if traces else []
    table, misses = [], []
    for r in have:
        b = r["breakdown"]
        spread = b.get("spread") or {}
        overhead = b.get("instrumentation_overhead")
        limit = f"{1 / r['mfu']:.1f}x" if r.get("mfu") else "–"
        table.append((r["label"], fmt(b["step_s"] * 1e3, ",.1f"),
                      ms_spread(b.get("reference_step_s"), spread.get("reference_step_s")),
                      *(ms_spread(b.get(p, 0), spread.get(p)) for p in BREAKDOWN_PHASES),
                      fmt(b.get("phases_sum_s", 0) * 1e3, ",.1f"),
                      "–" if overhead is None else f"{100 * overhead:+.0f}%", limit))
        if b.get("within_tolerance") is False:
            misses.append(f"{r['label']}: its phases add up to {fmt(b['phases_sum_s'] * 1e3, ',.1f')} ms against "
                          f"{fmt(b['reference_step_s'] * 1e3, ',.1f')} ms for the uninstrumented steps beside them "
                          f"({100 * overhead:+.0f}%, beyond the {100 * b.get('tolerance', 0.15):.0f}% the breakdown is "
                          f"held to) over {b.get('profile_steps')} rounds: the step could not be split reliably under "
                          "this load; read its phases as rough shares, and measure it again on a quieter machine or "
                          "with more --profile-steps")
    blocks = [("h2", "Where the time goes"),
              ("p", "Milliseconds per optimizer step, from extra rounds of steps run after the last checkpoint: the "
                    "median over the rounds, and in brackets the 10th to 90th percentile of the rounds (a "
                    "difference inside these spreads is not a real one). forward, backward and optimizer come from "
                    "steps that wait for the device after each phase and skip the gradient sync; communication is "
                    "each round's step with gradient sync minus its step without it (what overlap does not hide); "
                    "other is the rest of the median round (host overhead, casts, syncs, and what slow phases added to it); data is batch assembly on "
                    "the host, outside the step timer. 'ref step ms' are the uninstrumented steps taken in "
                    "alternation with the instrumented ones, 'step ms' the run's own median step; 'sum vs ref' is "
                    "how far the phases are from the reference (what the instrumentation and the noise add; the "
                    "breakdown is held to 15%). 'x limit' is the step time over the time its matmul FLOPs take at "
                    "the peak used for MFU."),
              ("table", ("run", "step ms", "ref step ms", *(f"{p} ms" for p in BREAKDOWN_PHASES), "phases ms",
                         "sum vs ref", "x limit"), table)]
    if misses:
        blocks.append(("ul", misses))
    return blocks + trace_blocks(rows)


def ms_spread(value, spread) -> str:
    """'12.3 [11.0–14.1]': a median and its p10–p90 in ms (no brackets without a spread, or for a constant)."""
    if value is None:
        return "–"
    if not spread or spread[0] == spread[1]:
        return fmt(value * 1e3, ",.1f")
    return f"{value * 1e3:,.1f} [{spread[0] * 1e3:,.1f}–{spread[1] * 1e3:,.1f}]"


def trace_blocks(rows: list[dict]) -> list[tuple]:
    """Where each --trace run's timelines are (common/train/trace.py)."""
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


def _at(values, rank: int):
    values = values or []
    return values[rank] if rank < len(values) else None


def memory_blocks(rows: list[dict]) -> list[tuple]:
    """Per rank: the training state the rank holds (what FSDP shards), the activations estimated from the
    shapes, the fixed footprint measured at its start, the predicted peak and the measured peaks."""
    have = [r for r in rows if r.get("state_mb")]
    if not have:
        return []
    table = []
    for r in have:
        state, pred = r["state_mb"], r.get("memory_prediction") or {}
        for rank in range(r["world_size"]):
            values = [_at(state.get(k), rank) for k in ("params", "grads", "optimizer")]
            total = sum(values) if all(v is not None for v in values) else None
            held = pred.get("parts") or {}  # the strategy's formula for the three (its layout's state_elements)
            formula = sum(held[k] for k in ("params", "grads", "optimizer")) / MB if "params" in held else None
            predicted, error = _at(pred.get("peak_bytes"), rank), _at(pred.get("error"), rank)
            saving = " (saving)" if _at(pred.get("peak_at"), rank) == "checkpoint" else ""
            table.append((r["label"], rank, *(fmt(v, ",.1f") for v in values), fmt(total, ",.1f"), fmt(formula, ",.1f"),
                          fmt((pred.get("parts") or {}).get("activations", 0) / MB or None, ",.0f"),
                          fmt(_at(r.get("fixed_rss_mb"), rank), ",.0f"),
                          fmt(predicted / MB if predicted else None, ",.0f") + saving,
                          fmt(_at(r.get("peak_mem_mb"), rank), ",.0f"),
                          fmt(_at(r.get("peak_rss_mb"), rank), ",.0f"),
                          f"{100 * error:+.0f}%" if error is not None else "–"))
    blocks = [("h2", "Memory per rank"),
              ("p", "Parameters, gradients and optimizer state are the bytes of the arrays each rank holds after "
                    "its last step (counted from the arrays themselves); ddp replicates all three, fsdp keeps "
                    "1/N of the sharded ones, tp 1/N of the split layers, pp its stage's layers, zero1 whole "
                    "parameters and gradients beside its rows of the moments, zero2 its rows of the gradients too; "
                    "\"formula\" is the strategy's own count of the three from the shapes (fp32 Adam: 16Ψ at ddp, "
                    "8Ψ + 8Ψ/N at zero1, 4Ψ + 12Ψ/N at zero2, 16Ψ/N at fsdp, each with its shards' zero padding; "
                    "docs/strategies.md). Activations are "
                    "one micro-batch's saved tensors estimated from the shapes and dtype; fixed is the process's "
                    "RSS at its start, before the model exists (the interpreter, the framework, its distributed "
                    "state). The predicted peak (common/costmodel/memory.py's predicted_peak, docs/scaling.md) adds "
                    "these, fsdp's gathered parameters, AdamW's update copies and a measured workspace (less the "
                    "pages torch's small gradients reuse), or, where it is larger, what the update holds after "
                    "the backward or what saving a checkpoint holds (marked \"saving\": the hf format gathers the "
                    "whole state on rank 0 under fsdp, on every rank under tp and pp; --checkpoint-format sharded "
                    "does not); the last column is its difference from the measured peak (peak RSS on a CPU, the "
                    "framework peak on a GPU). It predicts what a rank holds: where every rank still builds the "
                    "whole model first (fsdp, tp), the measured peak can be higher."),
              ("table", ("run", "rank", "params MB", "grads MB", "optimizer MB", "state MB", "formula MB", "activations MB (est.)",
                         "fixed MB", "predicted peak MB", "framework peak MB", "peak RSS MB", "predicted vs peak"),
               table)]
    notes = [f"{r['label']}: {r['memory_prediction']['note']}" for r in have
             if (r.get("memory_prediction") or {}).get("note")]
    if notes:
        blocks.append(("ul", notes))
    comm = [r for r in rows if r.get("comm_bytes_per_step")]
    if comm:
        blocks.append(("ul", [f"{r['label']}: {fmt(r['comm_bytes_per_step'] / 1e6, ',.2f')} MB "
                              + ("sent to the next or previous stage" if r.get("pipeline") else "all-reduced")
                              + " per step per rank, measured"
                              + (f"; {fmt(r['comm_bytes_per_step_estimate'] / 1e6, ',.2f')} MB "
                                 "estimated from the shapes" if r.get("comm_bytes_per_step_estimate") else "")
                              for r in comm]))
    pipes = [r for r in rows if r.get("pipeline")]
    if pipes:
        blocks.append(("ul", [
            f"{r['label']}: {r['pipeline']['schedule']}, {r['pipeline']['microbatches']} micro-batches; pipeline "
            "bubble (each stage's idle fraction of a step) "
            + ", ".join(f"stage {s} (layers {lay[0]}-{lay[1] - 1}) {fmt(100 * b, '.0f')}%" if b is not None and lay
                        else f"stage {s} -" for s, (b, lay) in enumerate(zip(r["pipeline"]["bubble"],
                                                                             r["pipeline"]["layers"])))
            + f" measured; {fmt(100 * r['pipeline']['bubble_analytic'], '.0f')}% analytic, (p - 1) / (M + p - 1)"
            + _idle_split(r["pipeline"].get("idle"))
            for r in pipes]))
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
    items += [link_line(r) for r in rows if (r.get("link") or {}).get("emulated")]
    return [("h2", "Precision"), ("ul", items)]


def link_line(r: dict) -> str:
    """An emulated link as the run measured it (docs/links.md): with two levels, between groups, then inside one."""
    link = r["link"]
    line = f"{r['label']}: {link['note']}; measured {level_figures(link)}"
    if link.get("inner"):
        line += f"; inside a group {level_figures(link['inner'])}"
    across = link.get("allreduce_across") or {}
    if across.get("bandwidth_Bps"):  # one rank per machine in each group, every group at once (levels.py)
        line += (f"; across machines, {across.get('concurrent')} groups at once, "
                 f"{level_figures({'allreduce': across})}")
        last = across.get("last_rank") or {}
        if last.get("bandwidth_Bps"):  # what a mesh's collectives across the hop wait for (levels.py)
            line += f", {last['bandwidth_Bps'] / 1e6:,.1f} MB/s by each call's slowest rank"
    return line


def level_figures(level: dict) -> str:
    """One level's TCP figures and the ranks' own all-reduce, with the per-hop rate the ring formula gives it
    (common/costmodel/links.py), which is what compares with the shaped rate at any number of ranks."""
    allreduce = level.get("allreduce") or {}
    hop = hop_bandwidth_Bps(allreduce)
    measured = [f"TCP {level['tcp_bandwidth_Bps'] * 8e-6:,.0f} Mbit/s" if level.get("tcp_bandwidth_Bps") else None,
                f"{level['tcp_latency_s'] * 1e6:,.0f} µs one way" if level.get("tcp_latency_s") else None,
                f"a 64 KB message after idling {level['tcp_message_Bps'] * 8e-6:,.0f} Mbit/s"
                if level.get("tcp_message_Bps") else None,
                f"its all-reduce {allreduce['bandwidth_Bps'] / 1e6:,.1f} MB/s over {allreduce.get('world_size')} ranks"
                f" ({hop * 8e-6:,.0f} Mbit/s per hop)" if hop else None]
    return ", ".join(m for m in measured if m) or "nothing"


def _idle_split(idle: dict | None) -> str:
    """The bubble is the busiest stage's idle time; the others' extra idle is waiting on it (common/parallel/pipeline.py)."""
    if not idle:
        return ""
    others = [f"stage {s} {100 * x:.0f} points" for s, x in enumerate(idle["imbalance"])
              if x is not None and s != idle["busiest_stage"]]
    return (f". The busiest stage ({idle['busiest_stage']}) sets the pace: its {100 * idle['bubble']:.0f}% is the "
            "bubble; the others idle longer waiting for it" + (f" ({', '.join(others)})" if others else ""))
