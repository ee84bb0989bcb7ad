"""The comparison report: summary.json, report.md, a self-contained report.html and plots/*.png.

It opens with the answers (do the curves agree, which framework is faster, how DP scales), then the
evidence: per-run table, parity numbers, MFU with its formula, fairness settings, environment and the
commands that reproduce every run. The markdown and HTML are rendered from one list of blocks, so the
two never disagree.
"""
from __future__ import annotations

import base64
import html
import shlex
import time
from dataclasses import asdict, fields
from pathlib import Path

from common.config import RunConfig
from common.errors import UserError
from common.flops import flops_formula, flops_per_token, known_peak_flops, mfu
from common.metrics import throughput_stats, write_json
from common.spec import ModelSpec

from .parity import RunData, Tolerances, judge, load_run, run_verdict
from .plots import make_plots

MB = 1e6
NOISE_NOTE = "the p10–p90 ranges overlap: within step-to-step noise"
TIMING_NOTE = ("step timers stop only after the framework finished the step's work (mx.eval / .item() on "
               "the loss), so lazy or asynchronous execution is not under-counted")


# ---- the numbers ---------------------------------------------------------------------------------

def write_report(run_dirs: list[Path], out_dir: Path, tol: Tolerances, context: dict | None = None) -> dict:
    """Judge, measure and render; returns what summary.json holds.

    context: "command" (the dpcompare command line), "peaks" (measured_peaks()-style CPU peaks, used for
    every thread count; when absent they are measured, on the runs' own machine only), "accelerator"
    (GPU name for the known-peak table; detected locally when absent).
    """
    context = context or {}
    out_dir = Path(out_dir)
    if (out_dir / "run_config.json").exists():
        raise UserError(f"{out_dir} is a run directory: the report's summary.json would replace the run's; "
                        "pass --out DIR")
    runs = [load_run(Path(d)) for d in run_dirs]
    if not runs:
        raise UserError("no run directories to report on")
    parity = judge(runs, tol)
    peaks = PeakFinder(runs, context)
    rows = [run_row(run, parity, peaks) for run in runs]
    scaling = scaling_table(rows)
    speed = speed_table(rows)
    fairness = fairness_info(runs, rows, context)
    summary = {
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        "verdicts": verdicts(parity, speed, scaling, rows, fairness),
        "runs": rows,
        "parity": parity,
        "speed": speed,
        "scaling": scaling,
        "mfu": peaks.describe(runs),
        "tolerances": asdict(tol),
        "fairness": fairness,
        "environment": environment_info(runs, rows, peaks),
        "commands": {"compare": context.get("command"),
                     "runs": [{"label": r["label"], "launcher": r["command"], "dpcompare": r["rerun"]}
                              for r in rows]},
    }
    summary["plots"] = {name: f"plots/{file}" for name, file in
                        make_plots(runs, parity, rows, scaling, out_dir / "plots").items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "summary.json", summary)
    blocks = report_blocks(summary)
    (out_dir / "report.md").write_text(to_markdown(blocks))
    (out_dir / "report.html").write_text(to_html(blocks, out_dir))
    return summary


def run_row(run: RunData, parity: dict, peaks: "PeakFinder") -> dict:
    s, cfg = run.summary, run.config
    stats = {k: s.get(k) for k in ("tokens_per_s", "tokens_per_s_p10", "tokens_per_s_p90", "step_time_s",
                                   "timed_steps")}
    if stats["tokens_per_s"] is None and run.train:  # no summary: derive from the metrics written so far
        stats.update(throughput_stats(run.train, s.get("warmup_steps", cfg.get("timing_warmup_steps", 0))))
    losses, evals = run.losses(), run.eval_losses()
    row = {
        "label": run.label, "run_dir": str(run.run_dir), "framework": run.framework,
        "world_size": run.world_size, "backend": s.get("backend", run.run_config.get("backend")),
        "device": str(s.get("device", cfg.get("device", "?"))), "status": run.status, "ok": run.ok,
        "problem": run.problem or None, "error": s.get("error"), "failed_rank": s.get("failed_rank"),
        "steps": s.get("steps", max(losses) if losses else 0), "planned_steps": cfg.get("steps"),
        "final_loss": s.get("final_loss", losses[max(losses)] if losses else None),
        "final_eval_loss": s.get("final_eval_loss", evals[max(evals)] if evals else None),
        **stats,
        "step_time_ms": stats["step_time_s"] * 1e3 if stats.get("step_time_s") else None,
        "compile_s": s.get("compile_s"), "warmup_steps": s.get("warmup_steps", cfg.get("timing_warmup_steps")),
        "time_to_first_step_s": s.get("time_to_first_step_s"), "wall_s": s.get("wall_s"),
        "peak_mem_mb": [None if b is None else b / MB for b in s.get("peak_mem_bytes") or []],
        "peak_rss_mb": [None if b is None else b / MB for b in s.get("peak_rss_bytes") or []],
        "threads_per_rank": s.get("threads_per_rank", cfg.get("threads_per_rank")),
        "blas": s.get("blas"), "tokens_per_step": s.get("tokens_per_step"),
        "dtype": cfg.get("dtype", "float32"), "seq_len": cfg.get("seq_len"),
        "command": s.get("command"), "rerun": rerun_command(cfg, run.framework, run.world_size),
        "parity": run_verdict(parity, run.label) if run.ok else "skipped",
    }
    row.update(peaks.mfu_for(run, row))
    return row


def scaling_table(rows: list[dict]) -> dict:
    """{framework: [{world_size, tokens_per_s, speedup, efficiency}]} over runs that finished."""
    table = {}
    for framework in dict.fromkeys(r["framework"] for r in rows):
        done = sorted((r for r in rows if r["framework"] == framework and r["ok"] and r.get("tokens_per_s")),
                      key=lambda r: r["world_size"])
        base = next((r for r in done if r["world_size"] == 1), None)
        table[framework] = [{
            "label": r["label"], "world_size": r["world_size"], "tokens_per_s": r["tokens_per_s"],
            "speedup": r["tokens_per_s"] / base["tokens_per_s"] if base else None,
            "efficiency": r["tokens_per_s"] / (r["world_size"] * base["tokens_per_s"]) if base else None,
        } for r in done]
    for row in rows:
        point = next((p for p in table.get(row["framework"], []) if p["label"] == row["label"]), None)
        row["scaling_efficiency"] = point["efficiency"] if point else None
    return table


def speed_table(rows: list[dict]) -> list[dict]:
    """Framework against framework at each world size: ratio of median tokens/s."""
    done = [r for r in rows if r["ok"] and r.get("tokens_per_s")]
    table = []
    for n in sorted({r["world_size"] for r in done}):
        at_n = {}
        for r in done:
            if r["world_size"] == n:
                at_n.setdefault(r["framework"], r)
        frameworks = sorted(at_n, key=lambda f: (f != "mlx", f))
        for i, fa in enumerate(frameworks):
            for fb in frameworks[i + 1:]:
                a, b = at_n[fa], at_n[fb]
                fast, slow = (a, b) if a["tokens_per_s"] >= b["tokens_per_s"] else (b, a)
                # Overlapping p10-p90 ranges: the gap is within the step-to-step spread.
                overlap = (fast.get("tokens_per_s_p10") or fast["tokens_per_s"]) <= \
                          (slow.get("tokens_per_s_p90") or slow["tokens_per_s"])
                table.append({"world_size": n, "a": a["label"], "b": b["label"],
                              "a_tokens_per_s": a["tokens_per_s"], "b_tokens_per_s": b["tokens_per_s"],
                              "ratio_a_over_b": a["tokens_per_s"] / b["tokens_per_s"],
                              "faster": fast["framework"], "slower": slow["framework"],
                              "faster_tokens_per_s": fast["tokens_per_s"], "slower_tokens_per_s": slow["tokens_per_s"],
                              "speedup": fast["tokens_per_s"] / slow["tokens_per_s"], "within_noise": bool(overlap)})
    return table


class PeakFinder:
    """The MFU denominator of each run: a measured CPU matmul peak, or a GPU's datasheet peak."""

    def __init__(self, runs: list[RunData], context: dict):
        self.context = context
        self.cpu_peaks: dict[int, dict] = {}
        self.notes: list[str] = []
        self._accelerator = context.get("accelerator")
        self._looked_up = "accelerator" in context

    def accelerator(self, run: RunData) -> str | None:
        machine = run.summary.get("machine") or {}
        if machine.get("accelerator"):
            return machine["accelerator"]
        if not self._looked_up and self._same_host(run):
            from .peak import accelerator_name

            self._accelerator, self._looked_up = accelerator_name(), True
        return self._accelerator

    def _same_host(self, run: RunData) -> bool:
        from .peak import this_host

        return (run.summary.get("machine") or {}).get("host") in (None, this_host())

    def cpu_peak(self, run: RunData, threads: int) -> dict | None:
        if threads not in self.cpu_peaks:
            peaks = self.context.get("peaks")
            if peaks is None and self._same_host(run):
                from .peak import measured_peaks

                peaks = measured_peaks(threads=threads)
            self.cpu_peaks[threads] = peaks or {}
        usable = {fw: p for fw, p in self.cpu_peaks[threads].items() if (p.get("flops") or 0) > 0}
        if not usable:
            return None
        best = max(usable, key=lambda fw: usable[fw]["flops"])
        return {"framework": best, **usable[best]}

    def mfu_for(self, run: RunData, row: dict) -> dict:
        empty = {"flops_per_token": None, "peak_flops": None, "peak_source": None, "mfu": None}
        spec_dict, seq_len = run.run_config.get("spec"), row.get("seq_len")
        if not spec_dict or not seq_len:
            return {**empty, "peak_source": "no model spec in run_config.json"}
        try:
            per_token = flops_per_token(ModelSpec.from_dict(spec_dict), seq_len)
        except UserError as err:
            return {**empty, "peak_source": f"model spec unreadable: {err}"}
        peak, source = self.peak_for(run, row)
        if not row.get("tokens_per_s"):
            return {**empty, "flops_per_token": per_token, "peak_source": "no throughput measured"}
        value = mfu(row["tokens_per_s"], per_token, peak) if peak else None
        return {"flops_per_token": per_token, "peak_flops": peak, "peak_source": source, "mfu": value}

    def peak_for(self, run: RunData, row: dict) -> tuple[float | None, str]:
        device, n = row["device"].lower(), row["world_size"]
        platform = ((run.summary.get("machine") or {}).get("platform") or "").lower()
        if device.startswith(("cuda", "gpu", "mps")):
            name = self.accelerator(run)
            found = known_peak_flops(name, row["dtype"]) if name else None
            if not found:
                return None, f"GPU {name or '(name unknown)'} is not in the known-peak table"
            key, per_gpu = found
            apple = "mac" in platform or "darwin" in platform or device == "mps" or key.startswith("Apple")
            # Ranks on one Mac share its GPU; CUDA ranks each drive their own.
            gpus = n if not apple or run.config.get("hostfile") else 1
            return per_gpu * gpus, f"{key} {row['dtype']} datasheet peak {per_gpu / 1e12:g} TFLOPS x {gpus}"
        threads = int(row.get("threads_per_rank") or 1)
        peak = self.cpu_peak(run, threads)
        if peak is None:
            return None, "no measured CPU peak (runs from another machine, or the measurement failed)"
        cpus = int((run.summary.get("machine") or {}).get("cpus") or n * threads)
        # Oversubscribed ranks share cores: the machine cannot exceed its cores' worth of peak.
        share = min(1.0, cpus / (n * threads))
        total = peak["flops"] * n * share
        shared = f" x {share:.2f} ({n * threads} threads on {cpus} CPUs)" if share < 1 else ""
        return total, (f"measured fp32 matmul rate {peak['flops'] / 1e9:.1f} GFLOP/s per rank at {threads} "
                       f"thread(s) ({peak['framework']}, the faster of the two) x {n} rank(s){shared}")

    def describe(self, runs: list[RunData]) -> dict:
        spec = next((r.run_config["spec"] for r in runs if r.run_config.get("spec")), None)
        seq_len = next((r.config.get("seq_len") for r in runs if r.config.get("seq_len")), None)
        return {
            "formula": _formula(spec, seq_len),
            "definition": "MFU = tokens/s x FLOPs per token / peak FLOP/s of all the hardware the run used",
            "cpu_peaks_by_threads": {str(t): p for t, p in self.cpu_peaks.items()},
            "accelerator": self._accelerator,
        }


def _formula(spec: dict | None, seq_len: int | None) -> str | None:
    try:
        return flops_formula(ModelSpec.from_dict(spec), seq_len) if spec and seq_len else None
    except UserError:
        return None


def rerun_command(cfg: dict, framework: str, world_size: int) -> str:
    """A `dpcompare run` line with every setting that differs from the defaults."""
    if not cfg:
        return ""
    defaults = RunConfig().to_dict()
    parts = ["dpcompare", "run", "--framework", framework, "--nproc", str(cfg.get("nproc", world_size))]
    skip = {"framework", "nproc", "out", "resume", "overwrite", "quiet", "model"}
    names = [f.name for f in fields(RunConfig)]
    for key in names:
        if key in skip or key not in cfg or cfg[key] == defaults.get(key):
            continue
        parts += ["--set", f"{key}={cfg[key]}"]
    for key, value in (cfg.get("model") or {}).items():
        parts += ["--set", f"model.{key}={value}"]
    parts += ["--out", cfg.get("out") or f"runs/{framework}-n{world_size}"]
    return shlex.join(parts)


def fairness_info(runs: list[RunData], rows: list[dict], context: dict) -> dict:
    done = [r for r in rows if r["ok"]]
    threads = {r["label"]: r["threads_per_rank"] for r in rows}
    tokens = {r["label"]: r["tokens_per_step"] for r in rows}
    warnings = []
    if len({r["threads_per_rank"] for r in done}) > 1:
        warnings.append("threads per rank differ between runs: speed is not compared like for like")
    if len({r["tokens_per_step"] for r in done}) > 1:
        warnings.append("tokens per step differ between runs: tokens/s still compares, loss parity cannot")
    for run, row in zip(runs, rows):
        cpus = (run.summary.get("machine") or {}).get("cpus")
        if row["ok"] and row["device"] == "cpu" and cpus and row["world_size"] * (row["threads_per_rank"] or 1) > cpus:
            warnings.append(f"{row['label']}: {row['world_size']} ranks x {row['threads_per_rank']} thread(s) on "
                            f"{cpus} CPUs: ranks share cores, so its speed measures oversubscription")
    hosts = {(r.summary.get("machine") or {}).get("host") for r in runs if r.summary.get("machine")}
    if len(hosts) > 1:
        warnings.append(f"runs come from different machines ({', '.join(sorted(map(str, hosts)))}): "
                        "speeds are not comparable")
    notes = [TIMING_NOTE,
             "throughput is the median over steps after each run's warmup steps; p10/p90 show the spread",
             "runs are paired for parity only when their configs agree on everything that changes the numbers "
             "(seed, data, tokenizer, model, batch, schedule): such runs read the same global batches and start "
             "from the same seed checkpoint"]
    if str(context.get("command") or "").startswith("dpcompare compare"):
        notes.append("dpcompare compare ran the runs one after another, never concurrently, so they did not "
                     "compete for cores")
    if any(r["framework"] == "torch" and r["device"] == "cpu" for r in rows):
        notes.append("torch on CPU keeps no allocator statistics: its framework peak memory is the process "
                     "peak RSS; MLX reports mx.get_peak_memory(), its allocator's peak")
    return {"threads_per_rank": threads, "warmup_steps": {r["label"]: r["warmup_steps"] for r in rows},
            "tokens_per_step": tokens, "blas": {r["label"]: r["blas"] for r in rows},
            "same_threads": len({r["threads_per_rank"] for r in done}) <= 1,
            "same_tokens_per_step": len({r["tokens_per_step"] for r in done}) <= 1,
            "notes": notes, "warnings": warnings}


def environment_info(runs: list[RunData], rows: list[dict], peaks: PeakFinder) -> dict:
    first = next((r.summary for r in runs if r.summary.get("machine")), {})
    return {"machine": first.get("machine"), "versions": first.get("versions"),
            "blas": {fw: sorted({str(r["blas"]) for r in rows if r["framework"] == fw})
                     for fw in dict.fromkeys(r["framework"] for r in rows)},
            "backends": {r["label"]: r["backend"] for r in rows},
            "devices": {r["label"]: r["device"] for r in rows},
            "threads_per_rank": {r["label"]: r["threads_per_rank"] for r in rows},
            "cpu_peaks": {str(t): p for t, p in peaks.cpu_peaks.items()},
            "accelerator": peaks._accelerator}


# ---- the verdict ---------------------------------------------------------------------------------

def verdicts(parity: dict, speed: list[dict], scaling: dict, rows: list[dict], fairness: dict) -> dict:
    lines = []
    frameworks = {r["framework"] for r in rows}
    if len(frameworks) > 1 and not parity["cross_framework"]:
        lines.append("Parity, " + " vs ".join(sorted(frameworks)) + ": not judged, no world size has a finished "
                     "run of more than one framework")
    for pair in parity["cross_framework"]:
        lines.append(f"Parity, N={pair['world_size'][0]}: " + pair_sentence(pair))
    for pair in parity["dp_invariance"]:
        lines.append("DP invariance: " + pair_sentence(pair))
    for s in speed:
        lines.append(f"Speed, N={s['world_size']}: {s['faster']} is {s['speedup']:.2f}x faster than {s['slower']} "
                     f"({s['faster_tokens_per_s']:,.0f} vs {s['slower_tokens_per_s']:,.0f} tokens/s median)"
                     + (f"; {NOISE_NOTE}" if s["within_noise"] else ""))
    for framework, points in scaling.items():
        scaled = [p for p in points if p["world_size"] > 1 and p["efficiency"] is not None]
        if scaled:
            lines.append(f"Scaling, {framework}: " + ", ".join(
                f"{p['world_size']} ranks {p['speedup']:.2f}x ({100 * p['efficiency']:.0f}% efficiency"
                + (", slower than 1 rank)" if p["speedup"] < 1 else ")") for p in scaled))
    for row in rows:
        if not row["ok"]:
            lines.append(f"Skipped, {row['label']}: {row['problem']}")
    if not lines:
        lines.append("Nothing to compare: no run finished")
    skipped = len(parity["skipped"])
    headline = f"parity {parity['overall'].upper()}" + (f" ({skipped} run(s) skipped)" if skipped else "")
    return {"all_pass": parity["all_pass"], "parity": parity["overall"], "headline": headline, "lines": lines,
            "warnings": fairness["warnings"]}


def pair_sentence(pair: dict) -> str:
    a, b = pair["a"], pair["b"]
    if pair["verdict"] == "not comparable":
        diffs = ", ".join(f"{k} ({va!r} vs {vb!r})" for k, (va, vb) in list(pair["differences"].items())[:4])
        return f"{a} and {b} are not comparable: their configs differ in {diffs}"
    if pair["verdict"] == "no data":
        return f"{a} vs {b}: no common steps to compare"
    checks = pair["checks"]
    step = checks["per_step"]
    verb = {"pass": "matches", "fail": "does NOT match"}[pair["verdict"]]
    text = f"{a} {verb} {b}"
    if step["verdict"] != "no data":
        text += (f": max |Δloss| {step['max_abs_diff']:.2e} over the first {step['steps_compared']} steps "
                 f"(tolerance {step['tolerance']:g}{', FAIL' if step['verdict'] == 'fail' else ''})")
    if "curve" in checks:
        c = checks["curve"]
        text += (f"; moving averages within {rel_pct(c['max_rel_diff'])} over {c['steps_compared']} steps "
                 f"(tolerance {100 * c['tolerance']:g}%{', FAIL' if c['verdict'] == 'fail' else ''})")
    if checks.get("eval", {}).get("verdict") in ("pass", "fail"):
        e = checks["eval"]
        text += (f"; eval loss within {rel_pct(e['max_rel_diff'])} "
                 f"(tolerance {100 * e['tolerance']:g}%{', FAIL' if e['verdict'] == 'fail' else ''})")
    return text


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


# ---- rendering -----------------------------------------------------------------------------------

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


def rel_pct(value) -> str:
    """Relative differences as percentages, readable from exact zero up to whole percent."""
    if value is None:
        return "–"
    if value == 0:
        return "0%"
    return "<0.001%" if value < 1e-5 else f"{100 * value:.3g}%"


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
    figures = [(title, s["plots"][name], name == "loss") for name, title in (
        ("loss", "Loss curves"), ("eval_loss", "Eval loss"), ("throughput", "Throughput"),
        ("scaling", "Scaling"), ("memory", "Memory per rank")) if name in s["plots"]]
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
               f"(tolerance {t['loss_atol']:g} across frameworks, {t['dp_atol']:g} for N ranks vs 1). Curve "
               f"check: max relative difference of {t['curve_window']}-step moving averages over all common "
               f"steps (tolerance {100 * t['curve_rtol']:g}%). Eval check: max relative difference at common "
               f"eval steps (tolerance {100 * t['eval_rtol']:g}%).")]
    headers = ("pair", "per-step max |Δ| (steps)", "at step", "curve max rel. Δ", "eval max rel. Δ", "verdict")
    table = []
    for pair in p["cross_framework"] + p["dp_invariance"]:
        name = f"{pair['a']} vs {pair['b']}"
        if not pair["comparable"]:
            diffs = "; ".join(f"{k}: {va!r} vs {vb!r}" for k, (va, vb) in pair["differences"].items())
            table.append((name, f"not comparable — {diffs}", "", "", "", pair["verdict"]))
            continue
        c = pair["checks"]
        step, curve, ev = c.get("per_step", {}), c.get("curve", {}), c.get("eval", {})
        table.append((name, f"{fmt(step.get('max_abs_diff'), '.2e')} ({step.get('steps_compared', 0)})",
                      fmt(step.get("at_step"), "d"), rel_pct(curve.get("max_rel_diff")),
                      rel_pct(ev.get("max_rel_diff")), pair["verdict"]))
    if table:
        blocks.append(("table", headers, table))
    else:
        blocks.append(("p", "No pairs to compare: parity needs both frameworks at one world size, or N>1 "
                            "and N=1 of one framework."))
    if p["skipped"]:
        blocks.append(("ul", [f"skipped {r['label']} ({r['run_dir']}): {r['reason']}" for r in p["skipped"]]))
    return blocks


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
