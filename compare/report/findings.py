"""The numbers of a report, computed from run directories: per-run rows, speed, scaling and memory tables,
fairness and environment notes, and the verdict lines. Nothing here renders; compare/report/render.py does.
"""
from __future__ import annotations

import shlex
from dataclasses import fields

from common.config import RunConfig
from common.metrics import throughput_stats
from common.peers import PEERS
from common.train.opclasses import difference_sentence, largest_difference

from ..machine.sharing import MEASURED, polls_on_full_cores
from .mfu import PeakFinder
from .labels import run_parts
from .parity import RunData, run_verdict
from .uneven import rank_lines
from .verdict_table import failure_lines, pair_rows

MB = 1e6
TIMING_NOTE = ("step timers stop only after the framework finished the step's work (mx.eval / .item() on "
               "the loss), so lazy or asynchronous execution is not under-counted")


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
        "fixed_rss_mb": [None if b is None else b / MB for b in s.get("fixed_rss_bytes") or []],
        # The cost model's peak per rank from the shapes and the fixed footprint (compare/plan/predictions.py)
        "memory_prediction": s.get("memory_prediction"),
        "threads_per_rank": s.get("threads_per_rank", cfg.get("threads_per_rank")),
        "blas": s.get("blas"), "tokens_per_step": s.get("tokens_per_step"),
        "dtype": cfg.get("dtype", "float32"), "seq_len": cfg.get("seq_len"), "strategy": run.strategy,
        "precision": s.get("precision"), "device_note": s.get("device_note"),
        # --max-restarts: each restart, what it lost, and the world size it went on at (compare/report/restarts.py)
        "restarts": s.get("restarts") or [], "max_restarts": s.get("max_restarts"),
        # Bytes of parameters, gradients and optimizer state each rank holds (FSDP shards them).
        "state_mb": {k: [None if b is None else b / MB for b in v] for k, v in (s.get("state_bytes") or {}).items()},
        "comm_bytes_per_step": s.get("comm_bytes_per_step"),
        "comm_bytes_per_step_estimate": s.get("comm_bytes_per_step_estimate"),
        # What trains (None: every parameter; LoRA's adapters) and how the loss is normalized; the bytes each rank
        # read at its start (weights, the frozen base included): compare/report/adapters.py
        "adapters": s.get("adapters"), "loss_normalization": s.get("loss_normalization"),
        "base_quantization": s.get("base_quantization"),
        "weights_mb_read": [None if b is None else b / MB for b in s.get("weights_bytes_read") or []],
        "reduce_scatter": s.get("reduce_scatter"),
        "link": s.get("link"),  # the path the ranks talked over, emulated or loopback (docs/links.md)
        "pipeline": s.get("pipeline"),  # pp: schedule, micro-batches, each stage's bubble and layers
        "breakdown": s.get("breakdown"),
        # Each rank's compute and wait, and its sequences of a batch (--rank-shares): compare/report/uneven.py
        "rank_compute_s": s.get("rank_compute_s"), "rank_wait_s": s.get("rank_wait_s"),
        "rank_batch_sizes": s.get("rank_batch_sizes"),
        "op_profile": s.get("op_profile"),  # N=1: ms per step of each op class (common/train/opprofile.py)
        # The cost model's step for this run, from the N=1 run (compare/plan/predictions.py).
        "prediction": s.get("prediction"),
        "trace": [str(run.run_dir / f) for f in s.get("trace") or []],  # --trace timelines (common/train/trace.py)
        "command": s.get("command"), "rerun": rerun_command(cfg, run.framework, run.world_size),
        "parity": run_verdict(parity, run.label) if run.ok else "skipped",
    }
    row.update(peaks.mfu_for(run, row))
    return row


def group_of(row: dict) -> str:
    """"mlx", "mlx fsdp", "torch bf16": the runs of one framework, strategy and dtype."""
    return " ".join(run_parts(row["framework"], row.get("strategy", "ddp"), row.get("dtype", "float32")))


def scaling_table(rows: list[dict]) -> dict:
    """{group: [{world_size, tokens_per_s, speedup, efficiency}]} over runs that finished; every group is
    measured against the 1-rank ddp run of its framework and dtype."""
    table = {}
    done = [r for r in rows if r["ok"] and r.get("tokens_per_s")]
    for group in dict.fromkeys(group_of(r) for r in rows):
        points = sorted((r for r in done if group_of(r) == group), key=lambda r: r["world_size"])
        if not points:
            table[group] = []
            continue
        one = points[0]
        base = next((r for r in done if r["framework"] == one["framework"] and r["dtype"] == one["dtype"]
                     and r.get("strategy", "ddp") == "ddp" and r["world_size"] == 1), None)
        table[group] = [{
            "label": r["label"], "world_size": r["world_size"], "tokens_per_s": r["tokens_per_s"],
            "against": base["label"] if base else None,
            "speedup": r["tokens_per_s"] / base["tokens_per_s"] if base else None,
            "efficiency": r["tokens_per_s"] / (r["world_size"] * base["tokens_per_s"]) if base else None,
        } for r in points]
    for row in rows:
        point = next((p for p in table.get(group_of(row), []) if p["label"] == row["label"]), None)
        row["scaling_efficiency"] = point["efficiency"] if point else None
    return table


def speed_table(rows: list[dict]) -> list[dict]:
    """Median tokens/s ratios: framework against framework (same strategy, dtype and world size), and
    within a framework, each strategy against ddp and bf16 against fp32 (kind: framework, strategy, dtype)."""
    done = [r for r in rows if r["ok"] and r.get("tokens_per_s")]
    table = []

    def add(kind: str, a: dict, b: dict) -> None:
        fast, slow = (a, b) if a["tokens_per_s"] >= b["tokens_per_s"] else (b, a)
        # Overlapping p10-p90 ranges: the gap is within the step-to-step spread.
        overlap = (fast.get("tokens_per_s_p10") or fast["tokens_per_s"]) <= \
                  (slow.get("tokens_per_s_p90") or slow["tokens_per_s"])
        setting = " ".join(run_parts("", a.get("strategy", "ddp"), a["dtype"])[1:]) if kind == "framework" else ""
        table.append({"kind": kind, "setting": setting, "world_size": a["world_size"], "a": a["label"], "b": b["label"],
                      "a_tokens_per_s": a["tokens_per_s"], "b_tokens_per_s": b["tokens_per_s"],
                      "ratio_a_over_b": a["tokens_per_s"] / b["tokens_per_s"],
                      "faster": fast["framework"] if kind == "framework" else fast["label"],
                      "slower": slow["framework"] if kind == "framework" else slow["label"],
                      "faster_label": fast["label"], "slower_label": slow["label"],
                      "faster_tokens_per_s": fast["tokens_per_s"], "slower_tokens_per_s": slow["tokens_per_s"],
                      "speedup": fast["tokens_per_s"] / slow["tokens_per_s"], "within_noise": bool(overlap)})

    def first(**want):
        return next((r for r in done if all(r.get(k) == v for k, v in want.items())), None)

    for n in sorted({r["world_size"] for r in done}):
        for strategy in ("ddp", "fsdp", "tp", "pp"):
            for dtype in dict.fromkeys(r["dtype"] for r in done):
                at = {}
                for r in done:
                    if (r["world_size"], r.get("strategy", "ddp"), r["dtype"]) == (n, strategy, dtype):
                        at.setdefault(r["framework"], r)
                frameworks = sorted((f for f in at if f not in PEERS), key=lambda f: (f != "mlx", f))
                for i, fa in enumerate(frameworks):
                    for fb in frameworks[i + 1:]:
                        add("framework", at[fa], at[fb])
                for name in (f for f in at if f in PEERS and PEERS[f].framework in at):  # a peer vs ours
                    add("peer", at[name], at[PEERS[name].framework])
                    table[-1]["peer_figures"] = {key: [at[name].get(key), at[PEERS[name].framework].get(key)]
                                                 for key in ("peak_rss_mb", "time_to_first_step_s")}
    for r in done:
        if r.get("strategy", "ddp") != "ddp":
            ref = first(framework=r["framework"], strategy="ddp", dtype=r["dtype"], world_size=r["world_size"])
            if ref:
                add("strategy", r, ref)
        if r["dtype"] != "float32":
            ref = first(framework=r["framework"], strategy=r.get("strategy", "ddp"), dtype="float32",
                        world_size=r["world_size"])
            if ref:
                add("dtype", r, ref)
    by_label = {r["label"]: r for r in done}
    for entry in table:
        fast, slow = by_label[entry["faster_label"]], by_label[entry["slower_label"]]
        entry["phase_gap"], entry["phase"] = phase_gap(fast, slow), phase_difference(fast, slow)
        # The op class that accounts for most of the gap (1-rank runs: common/train/opclasses.py)
        entry["op_class"] = largest_difference(fast.get("op_profile"), slow.get("op_profile"))
        entry["op_class_gap"] = difference_sentence(entry["op_class"], entry["faster"], entry["slower"])
    return table


BREAKDOWN_PHASES = ("data", "forward", "backward", "communication", "optimizer", "other")


def phase_difference(fast: dict, slow: dict) -> dict | None:
    """The phase of the step breakdown whose time differs most between two runs: {phase, fast_ms, slow_ms,
    spreads_apart}, the last None without spreads, else whether their p10-p90 over the profile rounds
    (common/train/breakdown.py) do not overlap."""
    a, b = fast.get("breakdown"), slow.get("breakdown")
    if not a or not b:
        return None
    phase = max(BREAKDOWN_PHASES, key=lambda p: abs((b.get(p) or 0) - (a.get(p) or 0)))
    sa, sb = (a.get("spread") or {}).get(phase), (b.get("spread") or {}).get(phase)
    return {"phase": phase, "fast_ms": (a.get(phase) or 0) * 1e3, "slow_ms": (b.get(phase) or 0) * 1e3,
            "spreads_apart": (sa[1] < sb[0] or sb[1] < sa[0]) if sa and sb else None}


def phase_gap(fast: dict, slow: dict) -> str | None:
    """phase_difference as a sentence."""
    d = phase_difference(fast, slow)
    if d is None:
        return None
    real = {None: "", True: "; their p10–p90 spreads do not overlap",
            False: "; within the spread of the profile rounds, so not a clear difference"}[d["spreads_apart"]]
    return (f"the phase that differs most is {d['phase']} ({d['slow_ms']:,.1f} ms in {slow['label']} vs "
            f"{d['fast_ms']:,.1f} ms in {fast['label']} per step{real})")


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
    of_runs = []  # (label, warning): the same warning for several runs is said once, naming them
    for run, row in zip(runs, rows):
        cpus = (run.summary.get("machine") or {}).get("cpus")
        if row["ok"] and row["device"] == "cpu" and cpus and row["world_size"] * (row["threads_per_rank"] or 1) > cpus:
            pinned = all(run.summary.get("pinned_cores") or [None])  # every rank pinned (common/train/placement.py)
            of_runs.append((row["label"], f"{row['world_size']} ranks x {row['threads_per_rank']} thread(s) on "
                                          f"{cpus} CPUs: ranks share cores"
                                          f"{' (pinned one core each, round-robin)' if pinned else ''}, so the speed "
                                          f"measures oversubscription"))
        if row["ok"] and row["device"] == "cpu" and cpus and polls_on_full_cores(
                row["framework"], row["backend"], row["world_size"], row["threads_per_rank"] or 1, cpus,
                local=not run.config.get("hostfile") and (run.config.get("nnodes") or 1) == 1):
            of_runs.append((row["label"], f"MLX's ring polls its sockets while a rank waits, and these ranks' "
                                          f"threads fill the {cpus} CPUs, so a waiting rank takes a core from one "
                                          f"that computes ({MEASURED}; docs/cpu-performance.md)"))
    warnings += naming_runs(of_runs)
    hosts = {(r.summary.get("machine") or {}).get("host") for r in runs if r.summary.get("machine")}
    if len(hosts) > 1:
        warnings.append(f"runs come from different machines ({', '.join(sorted(map(str, hosts)))}): "
                        "speeds are not comparable")
    notes = [TIMING_NOTE,
             "throughput is the median over steps after each run's warmup steps; p10/p90 show the spread",
             "runs are paired for parity only when their configs agree on everything that changes the numbers "
             "(seed, data, tokenizer, model, batch, schedule): such runs read the same global batches and start "
             "from the same seed checkpoint; data, tokenizer and initial weights compare by their content hashes "
             "where both runs record them, so the same files under two paths pair"]
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


def naming_runs(found: list[tuple[str, str]]) -> list[str]:
    """(run label, text) pairs as one line per distinct text, which names every run it applies to, in order."""
    labels: dict[str, list[str]] = {}
    for label, text in found:
        labels.setdefault(text, []).append(label)
    return [f"{', '.join(names)}: {text}" for text, names in labels.items()]


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



def verdicts(parity: dict, speed: list[dict], scaling: dict, memory: list[dict], rows: list[dict], fairness: dict,
             baseline: list[dict] | None = None) -> dict:
    """The headline; the judged pairs as table rows and a sentence for each that did not pass
    (compare/report/verdict_table.py, where the speed ratios, scaling and memory are tables of their own);
    then "notes": what no table shows (frameworks not paired, baseline, skipped runs). "lines" holds every
    finding as a sentence, scaling and memory included, for readers of summary.json."""
    notes = []
    frameworks = {r["framework"] for r in rows if r["framework"] not in PEERS}  # a peer pairs with its own (peer)
    if len(frameworks) > 1 and not parity["cross_framework"]:
        notes.append("Parity, " + " vs ".join(sorted(frameworks)) + ": not judged, no world size has a finished "
                     "run of more than one framework")
    for v in baseline or []:
        notes.append(f"Baseline, {v['label']}: {v['verdict']}: {v['message']}")
    for row in rows:
        if not row["ok"]:
            notes.append(f"Skipped, {row['label']}: {row['problem']}")
    notes += rank_lines(rows)  # each rank's compute and wait; the slow rank and its balancing shares
    pairs = pair_rows(parity)
    figures = scaling_lines(scaling) + memory_lines(memory)
    if not notes and not figures and not pairs:
        notes.append("Nothing to compare: " + ("one run, no pair to judge" if any(r["ok"] for r in rows)
                                               else "no run finished"))
    # A pair that cannot be compared is no failure (--strict passes), but a PASS must not hide it.
    unjudged = [f"{len(parity['skipped'])} run(s) skipped"] if parity["skipped"] else []
    unjudged += [f"{n} pair(s) not comparable"] if (n := sum(r["verdict"] == "not comparable" for r in pairs)) else []
    headline = f"parity {parity['overall'].upper()}" + (f" ({'; '.join(unjudged)})" if unjudged else "")
    if any(v["verdict"] == "fail" for v in baseline or []):
        headline += ", BASELINE FAIL"
    return {"all_pass": parity["all_pass"], "parity": parity["overall"], "headline": headline, "pairs": pairs,
            "failures": failure_lines(parity), "notes": notes, "lines": notes + figures,
            "warnings": fairness["warnings"]}


def scaling_lines(scaling: dict) -> list[str]:
    lines = []
    for group, points in scaling.items():
        scaled = [p for p in points if p["world_size"] > 1 and p["efficiency"] is not None]
        if scaled:
            lines.append(f"Scaling, {group}: " + ", ".join(
                f"{p['world_size']} ranks {p['speedup']:.2f}x ({100 * p['efficiency']:.0f}% efficiency"
                + (", slower than 1 rank)" if p["speedup"] < 1 else ")") for p in scaled))
    return lines


def state_total_mb(row: dict) -> float | None:
    """The most parameter + gradient + optimizer MB any rank of the run holds."""
    parts = [row.get("state_mb", {}).get(k) or [] for k in ("params", "grads", "optimizer")]
    if not all(parts) or any(v is None for p in parts for v in p):
        return None
    return max(sum(values) for values in zip(*parts))


def memory_table(rows: list[dict]) -> list[dict]:
    """What sharding saves: each non-ddp run's per-rank state against its ddp run at the same world size,
    {label, group, world_size, state_mb, ddp_label, ddp_state_mb, ratio}; each row gets its state_total_mb
    and, where it has such a ddp run, its state_vs_ddp."""
    table = []
    for row in rows:
        row["state_total_mb"], row["state_vs_ddp"] = state_total_mb(row) if row["ok"] else None, None
    for row in rows:
        if row["state_total_mb"] is None or row.get("strategy", "ddp") == "ddp":
            continue
        ref = next((r for r in rows if r["ok"] and r["framework"] == row["framework"] and r["dtype"] == row["dtype"]
                    and r.get("strategy", "ddp") == "ddp" and r["world_size"] == row["world_size"]), None)
        if ref is None or not ref["state_total_mb"]:
            continue
        row["state_vs_ddp"] = row["state_total_mb"] / ref["state_total_mb"]
        table.append({"label": row["label"], "group": group_of(row), "world_size": row["world_size"],
                      "state_mb": row["state_total_mb"], "ddp_label": ref["label"],
                      "ddp_state_mb": ref["state_total_mb"], "ratio": row["state_vs_ddp"]})
    return table


def memory_lines(memory: list[dict]) -> list[str]:
    return [f"Memory, {m['label']}: parameters + gradients + optimizer state {m['state_mb']:,.1f} MB per rank, "
            f"{m['ratio']:.2f}x {m['ddp_label']}'s {m['ddp_state_mb']:,.1f} MB" for m in memory]
