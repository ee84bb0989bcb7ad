"""`dpcompare plan --from RUN [--from RUN2] --model M`: the step time, tokens/s, scaling and memory per rank of a
model nobody trained here, per strategy (or mesh), world size and link, in the framework of each run given.

Per framework: the run is calibrated as `plan` calibrates it (compare/plan/command.py), the block probe times the
run's own model and M in the run's environment (compare/plan/model.py), common/costmodel/probed.py turns the
figures into M's phases, and the same predict() gives each row; the memory per rank is
common/costmodel/model_memory.py's (weights, gradients, optimizer, activations, ... and the framework's overhead
measured on the run), judged against --device-memory-gb (default: this machine's memory), with the cheapest change
that makes a layout fit where it does not.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from common.costmodel.calibrate import calibrate
from common.costmodel.fit import carried_to, fit_host_costs
from common.costmodel.model_memory import (machine_memory_bytes, model_memory, op_profile_bytes, overhead_from_run,
                                          peak_phase)
from common.costmodel.probed import calibration_for, head_held, phases, request_for, split_of_runs, transfer
from common.errors import UserError
from common.metrics import write_json
from common.model.lora import Adapters, FullModel, trained_parameters_of
from common.parallel import STRATEGIES, layout
from compare.plan.links import choose_links, describe_links, links_json, predicted_backend
from compare.plan.meshes import mesh_plan, mesh_table
from compare.plan.model import cross_entropy_of, exp_of, resolve_model, run_environment, run_probe, storage_of, trained_of, workload_for
from compare.plan.runs import cores_shared_by, n1_beside, read_run
from compare.plan.table import make_plan, rank_share, table

LORA_FOR_FIT = Adapters(rank=8, alpha=16.0)
TIGHT = 0.10  # a fit with less than this share of the memory to spare is marked `tight` (the RSS target of issue 56)


def run_trained(summary: dict):
    c = summary.get("config") or {}
    return trained_parameters_of(int(c.get("lora_rank") or 0), float(c.get("lora_alpha") or 0.0),
                                 str(c.get("lora_targets") or ""), int(c.get("lora_layers") or 0))


def run_quantize(summary: dict) -> tuple[int, int]:
    c = summary.get("config") or {}
    return int(c.get("quantize_base") or 0), int(c.get("quantize_group_size") or 64)


def frameworks_asked(args, runs: dict) -> list[str]:
    asked = [f.strip() for f in (args.frameworks or "").split(",") if f.strip()] or list(runs)
    for fw in asked:
        if fw not in runs:
            have = ", ".join(f"{f} ({d})" for f, (d, _, _) in runs.items())
            raise UserError(f"--model: no {fw} run to calibrate on (given: {have}); the probe times the model in "
                            f"the run's framework: pass --from a finished {fw} run too")
    return asked


def model_plan(args, from_runs: list[str], world_sizes: list[int], strategies: list[str]) -> int:
    runs: dict = {}
    for d in from_runs:
        summary, spec = read_run(Path(d))
        fw = summary.get("framework", "torch")
        if fw in runs:
            raise UserError(f"two --from runs of {fw} ({runs[fw][0]}, {d}): give one run per framework")
        runs[fw] = (Path(d), summary, spec)
    frameworks = frameworks_asked(args, runs)
    spec, name, folder_storage = resolve_model(args.model, getattr(args, "start_dir", None))
    trained, storage = trained_of(args), storage_of(args, folder_storage)
    if isinstance(trained, Adapters):
        trained.check(spec)
    gb = args.device_memory_gb or (machine_memory_bytes() or 0) / 1e9 or None
    sharing = getattr(args, "ranks_per_machine", None) or 1
    limit = gb * 1e9 if gb else None  # a machine's; a rank's share of it: rank_share
    meshes = getattr(args, "meshes", False)
    notes = []
    adapter_strategies = [s for s in strategies if STRATEGIES[s].trains_adapters]  # ddp, zero1, zero2
    if isinstance(trained, Adapters) and (meshes or strategies != adapter_strategies):
        notes.append("LoRA trains under ddp, zero1 and zero2 only (the strategies that split the model do not split "
                     "adapters yet): their rows only")
        strategies, meshes = adapter_strategies or ["ddp"], False
    rows, report = [], {}
    for fw in frameworks:
        run_dir, summary, run_spec = runs[fw]
        cal = calibrate(summary, run_spec, source=str(run_dir))
        fit_on = [(d, s, cores_shared_by(s), n1_beside(Path(d), s)) for d in getattr(args, "fit", None) or []
                  for s in [read_run(Path(d))[0]] if s.get("framework") == fw]
        if fit_on:
            cal = fit_host_costs(cal, fit_on)
        w_run = cal.workload
        w = workload_for(args, spec, w_run)
        if isinstance(trained, Adapters):  # ddp reduces the adapters' gradients only
            w = replace(w, trained_elements=int(trained.trained_parameters(spec)))
        environment, exp = run_environment(run_dir, summary), exp_of(summary)
        quantize = (getattr(storage, "bits", 0) if storage is not None else 0, getattr(storage, "group_size", 64))
        ce = cross_entropy_of(summary)
        own_req = request_for(w_run, run_trained(summary), run_quantize(summary), exp, ce)
        req = request_for(w, trained, quantize, exp, ce)
        own, figures = probe(fw, own_req, environment), probe(fw, req, environment)
        moved = transfer(cal, phases(own, own_req, w_run))
        target = calibration_for(cal, w, moved.apply(phases(figures, req, w)), f"{args.model} probed, from {run_dir}")
        target = carried_to(target, w_run, predicted_backend(summary))  # the fits' host work, per call
        on_gpu = str(summary.get("device", "")).startswith(("cuda", "gpu", "mps"))
        peaks = summary.get("peak_mem_bytes" if on_gpu else "peak_rss_bytes") or []
        run_lay = layout(summary.get("strategy", "ddp"), cal.world_size, (summary.get("config") or {}).get("mesh") or "")
        overhead = overhead_from_run(run_lay, replace(w_run, head_held=head_held(own, own_req)),
                                     max((p for p in peaks if p), default=None), run_trained(summary), None)
        w = replace(w, head_held=head_held(figures, req))  # the head phase of this model's peak (model_memory)
        backend = predicted_backend(summary)
        fits = tuple((d, s) for d, s, *_ in fit_on)  # their loopback, where the run measured none
        link, link_how = choose_links(args, summary, backend, fits)

        def runs_on(mesh_text: str, summary=summary, fits=fits) -> tuple:
            mine = predicted_backend(summary, mesh_text)
            return mine, choose_links(args, summary, mine, fits)[0]
        mine = (mesh_plan(target, link, world_sizes, None, runs_on)["rows"] if meshes
                else make_plan(target, link, strategies, world_sizes, None, backend))
        for r in mine:
            r["framework"] = fw
            if "impossible" not in r:
                judge(r, w, trained, storage, overhead, rank_share(limit, sharing, r["world_size"]))
        for r in mine:
            if r.get("fits") is False:
                r["to_fit"] = cheapest_change(r, mine, w, trained, storage, overhead,
                                              rank_share(limit, sharing, r["world_size"]))
        rows += mine
        report[fw] = {"from": str(run_dir), "link": links_json(link, link_how), "link_text": describe_links(link, link_how),
                      "probe": {"model": figures, "run_model": own, "request": req.to_json(),
                                "run_request": own_req.to_json()},
                      "transfer": moved.to_dict(), "overhead_bytes": overhead,
                      "phases": {"forward_s": target.forward_s, "backward_s": target.backward_s,
                                 "optimizer_s": target.optimizer_s, "other_s": target.other_s}}
    what = describe_model(name, spec, trained, storage, w)
    out = Path(args.out) if args.out else Path(from_runs[0]) / "plan"
    try:
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "plan.json", {
            "from": [str(runs[fw][0]) for fw in frameworks], "model": {
                "name": name, "spec": spec.to_dict(), "trained": trained.describe(),
                "quantize": storage.describe() if storage is not None else None, "seq_len": w.seq_len,
                "global_batch_size": w.global_batch_size, "grad_accum": w.grad_accum, "dtype": w.dtype},
            "device_memory_bytes": limit, "ranks_per_machine": sharing, "frameworks": report, "predictions": rows, "notes": notes})
    except OSError as err:
        raise UserError(f"cannot write the plan into {out}: {err.strerror}") from None
    print(f"plan for {what}")
    if limit:
        print(f"fits: against {gb:.3g} GB a machine" + ("" if args.device_memory_gb else " (this one's available now)") + (f", shared by up to {sharing} ranks" if sharing > 1
                                                         else ", one rank each"))
    for fw in frameworks:
        print(f"\n{fw}: calibrated on {report[fw]['from']}; link {report[fw]['link_text']}")
        mine = [r for r in rows if r["framework"] == fw]
        print(mesh_table({"rows": mine, **best_of(mine)}, gb) if meshes else table(mine, gb))
        for r in mine:
            if r.get("to_fit"):
                print(f"  {r.get('label') or r['strategy']} x{r['world_size']} does not fit: {r['to_fit']}")
            elif r.get("tight"):
                print(f"  {r.get('label') or r['strategy']} x{r['world_size']} fits with under {TIGHT:.0%} to spare, "
                      "within the memory prediction's error: it may not")
    for note in notes:
        print(f"note: {note}")
    print(f"\nplan: {out / 'plan.json'}; how the model is probed and what it cannot know: docs/plan-model.md")
    return 0


def probe(fw: str, req, environment: dict) -> dict:
    """The probe's figures at its rows and at twice them, each call's part apart from the rows' (split_per_call): each
    size run twice, alternately (rows, twice the rows, rows, twice), split as the faster runs split (split_of_runs)."""
    doubled = replace(req, rows=2 * req.rows)
    runs = [run_probe(fw, r, environment) for r in (req, doubled, req, doubled)]
    return split_of_runs(runs[0::2], runs[1::2], req.rows, req.seq_len * req.vocab_rows)


def describe_model(name: str, spec, trained, storage, w) -> str:
    what = f"{name} ({spec.n_layers} layers, dim {spec.dim}, vocab {spec.vocab_size})"
    what += ", LoRA rank %d" % trained.rank if isinstance(trained, Adapters) else ", full fine-tune"
    if storage is not None:
        what += f" on a {storage.bits}-bit base"
    return what + f"; seq {w.seq_len}, global batch {w.global_batch_size}, grad accum {w.grad_accum}, {w.dtype}"


def best_of(rows: list[dict]) -> dict:
    best = {}
    for n in sorted({r["world_size"] for r in rows}):
        mine = [r for r in rows if r["world_size"] == n]
        fastest = min(mine, key=lambda r: r["step_s"], default=None)
        fitting = min((r for r in mine if r["fits"] is not False), key=lambda r: r["step_s"], default=None)
        best[n] = {"fastest": fastest and fastest["label"], "fastest_fitting": fitting and fitting["label"]}
    return {"best": best, "refused": {}}


def row_layout(r: dict):
    return layout(r["strategy"], r["world_size"], r.get("mesh") or "")


def memory_of(r: dict, w, trained, storage, overhead) -> dict:
    return model_memory(row_layout(r), w, trained, storage, overhead)


def judge(r: dict, w, trained, storage, overhead, limit) -> None:
    """The row's memory as model_memory predicts it, whether it fits `limit`, and the bottleneck if it does not."""
    lay = row_layout(r)
    r["memory_peak_at"], memory = peak_phase(lay, w, trained, storage, overhead)  # "head", "backward" or "update", its parts
    r["memory_bytes"] = memory
    # a one-rank run times its op classes after training, holding a copy of the gradients (op_profile_bytes):
    # the row fits where that fits too, and --no-op-profile is then the cheapest change (cheapest_change)
    r["op_profile_bytes"] = op_profile_bytes(lay, w, trained)
    r["fits"] = None if limit is None else memory["total"] + r["op_profile_bytes"] <= limit
    # within TIGHT of the limit the prediction's own error decides: torch's 1B full fine-tune, predicted at 22.7 GB
    # (the summed phase) against 24.3 available, trained 3 steps at 21 GB and was killed at 24.9 GB in its profiled
    # steps (issue 56), which op_profile_bytes now counts
    r["tight"] = bool(r["fits"]) and memory["total"] + r["op_profile_bytes"] > (1 - TIGHT) * limit
    if r["fits"] is False and memory["total"] <= limit:
        r["bottleneck"] = (f"memory: {memory['total'] / 1e9:.2f} GB per rank, and {r['op_profile_bytes'] / 1e9:.2f} GB "
                           f"more while the op classes are timed after training, does not fit in {limit / 1e9:.3g} GB")
    elif r["fits"] is False:
        big = sorted(((k, v) for k, v in memory.items() if k != "total"), key=lambda kv: -kv[1])[:3]
        r["bottleneck"] = (f"memory: {memory['total'] / 1e9:.2f} GB per rank does not fit in {limit / 1e9:.3g} GB ("
                           + ", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in big) + ")")


def cheapest_change(r: dict, rows: list[dict], w, trained, storage, overhead, limit) -> str:
    """The smallest change that makes row `r`'s layout fit, in this order: no op profile after a one-rank run's
    training (the training fits), another strategy or mesh at the same N (the same training, the fastest that
    fits), a smaller micro-batch (more accumulation), LoRA, a 4-bit base."""
    if r.get("op_profile_bytes") and r["memory_bytes"]["total"] <= limit:
        return (f"--no-op-profile (the op classes a one-rank run times after training hold "
                f"{r['op_profile_bytes'] / 1e9:.2f} GB of gradients more) fits: {r['memory_bytes']['total'] / 1e9:.2f} "
                "GB per rank")
    same_n = [o for o in rows if o["world_size"] == r["world_size"] and o.get("fits") and o is not r]
    if same_n:
        o = min(same_n, key=lambda o: o["step_s"])
        return (f"{o.get('label') or o['strategy']} x{o['world_size']} fits ({o['memory_bytes']['total'] / 1e9:.2f} "
                f"GB per rank, {o['step_s']:.3g} s per step)")
    rows_per_rank = w.micro_rows(1) / max(1, row_layout(r).dp_size)
    accum = w.grad_accum
    while rows_per_rank / (accum / w.grad_accum) > 1 and w.global_batch_size % (accum * 2) == 0:
        accum *= 2
        smaller = replace(w, grad_accum=accum)
        total = memory_of(r, smaller, trained, storage, overhead)["total"]
        if total <= limit:
            return f"--grad-accum {accum} (a smaller micro-batch) fits: {total / 1e9:.2f} GB per rank"
    if isinstance(trained, FullModel):
        total = memory_of({**r, "strategy": "ddp", "mesh": ""}, w, LORA_FOR_FIT, None, overhead)["total"]
        if total <= limit:
            return f"LoRA (--lora-rank 8) under ddp fits: {total / 1e9:.2f} GB per rank"
    if storage is None or getattr(storage, "bits", 32) > 4:
        from common.costmodel.probed import base_storage

        try:
            four = base_storage(4, 64)
        except UserError:
            four = None
        lora = trained if isinstance(trained, Adapters) else LORA_FOR_FIT
        if four is not None:
            total = memory_of({**r, "strategy": "ddp", "mesh": ""}, w, lora, four, overhead)["total"]
            if total <= limit:
                return (f"LoRA on a 4-bit base (--lora-rank {lora.rank} --quantize-base 4) fits: "
                        f"{total / 1e9:.2f} GB per rank")
    return "no change tried fits (another strategy or mesh, a smaller micro-batch, LoRA, a 4-bit base): more ranks"
