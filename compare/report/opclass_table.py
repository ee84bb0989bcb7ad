"""The report's op-class table: milliseconds per step of each op class in every 1-rank run, beside the class's
lower bound, and where the classes fall short of the step (common/train/opclasses.py, common/train/opprofile.py).
"""
from __future__ import annotations

from common.train.opclasses import BOUND_KIND, OP_CLASSES, OUTSIDE, lower_bound_s, ms


def opclass_blocks(rows: list[dict]) -> list[tuple]:
    """("h2" | "p" | "table" | "ul", ...) blocks: one table per dtype, a column per run with an op profile."""
    have = [r for r in rows if (r.get("op_profile") or {}).get("classes")]
    failed = [f"{r['label']}: the op profile failed ({r['op_profile']['error']})" for r in rows
              if (r.get("op_profile") or {}).get("error")]
    if not have:
        return [("h2", "Op classes"), ("ul", failed)] if failed else []
    blocks: list[tuple] = [
        ("h2", "Op classes"),
        ("p", "Milliseconds per optimizer step of each op class of the model, timed one class at a time after "
              "training, at the run's own shapes, in every 1-rank run (both frameworks the same way): the forward "
              "and the backward of the class's ops for every layer and micro-batch, the optimizer update once; "
              "the median over the reps, beside uninstrumented training steps ('measured step'). 'lower bound' "
              "is the least time the class can take: matmul and attention at the measured fp32 matmul peak "
              "(the MFU denominator), the others their bytes at the measured memory bandwidth (a working set "
              "that fits in a cache can beat that bound). 'sum of classes' is the median over the reps of each "
              "rep's sum, so it can differ from the sum of the rows above; 'outside the classes' is the median "
              "of each rep's step minus its own classes (they ran back to back, under the same load): "
              f"{OUTSIDE}. docs/profiling.md says how to read it.")]
    misses = list(failed)
    for dtype in dict.fromkeys(r.get("dtype", "float32") for r in have):
        runs = [r for r in have if r.get("dtype", "float32") == dtype]
        bounds = class_bounds(runs)
        body = []
        for name in OP_CLASSES:
            body.append((name, _ms(bounds.get(name)),
                         *(_ms(((r["op_profile"].get("classes") or {}).get(name) or {}).get("s")) for r in runs)))
        body.append(("sum of classes", "", *(_ms(r["op_profile"].get("class_sum_s")) for r in runs)))
        body.append(("measured step", "", *(_ms(r["op_profile"].get("reference_step_s")) for r in runs)))
        body.append(("outside the classes", "", *(outside_cell(r["op_profile"]) for r in runs)))
        title = f"{dtype}, {shape_text(runs[0]['op_profile'].get('shapes') or {})}"
        blocks += [("p", title),
                   ("table", ("op class", "lower bound ms", *(f"{r['label']} ms" for r in runs)), body)]
        for r in runs:
            p = r["op_profile"]
            if p.get("within_tolerance") is False:
                misses.append(f"{r['label']}: the classes add up to {ms(p['class_sum_s'])} ms against a "
                              f"{ms(p['reference_step_s'])} ms step ({100 * p['outside_share']:+.0f}% outside, beyond "
                              f"the {100 * p.get('tolerance', 0.15):.0f}% the profile is held to): read them as "
                              "rough shares, or measure again on a quieter machine")
    if misses:
        blocks.append(("ul", misses))
    return blocks


def class_bounds(runs: list[dict]) -> dict[str, float | None]:
    """Each class's lower bound in seconds for runs of one dtype and shape: the best matmul peak and memory
    bandwidth measured among them (None where neither is known)."""
    peak = max((r.get("peak_flops") or 0.0 for r in runs if r.get("world_size", 1) == 1), default=0.0) or None
    bandwidth = max((r["op_profile"].get("memory_bandwidth_Bps") or 0.0 for r in runs), default=0.0) or None
    classes = runs[0]["op_profile"].get("classes") or {}
    return {name: lower_bound_s(classes[name], peak, bandwidth) for name in OP_CLASSES
            if name in classes and BOUND_KIND.get(name)}


def outside_cell(profile: dict) -> str:
    if profile.get("outside_s") is None:
        return "–"
    share = profile.get("outside_share")
    return ms(profile["outside_s"]) + (f" ({100 * share:+.0f}%)" if share is not None else "")


def shape_text(shapes: dict) -> str:
    if not shapes:
        return "shapes unknown"
    accum = f" x {shapes['grad_accum']} micro-batches" if shapes.get("grad_accum", 1) > 1 else ""
    return f"micro-batch {shapes.get('micro_batch')} x seq {shapes.get('seq_len')}{accum}"


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else ms(seconds)
