"""Speed ratios that measure the machine, not the frameworks: a framework whose matmuls ran on a reference BLAS
(MLX's Linux wheel bundles one: about 5 GFLOP/s, where an optimized BLAS gives 80), or two runs given different
threads or tokens per step. Such a pair is "environment-bound": its row names no faster framework, and the speed
section opens with why, the matmul GFLOP/s of both frameworks at the run's shapes, and the fix (issue 72). A
newcomer read "MLX 7.96x slower" where the cause was a missing library.
"""
from __future__ import annotations

from common.model.spec import ModelSpec
from common.train.opclasses import class_work

from .parity import RunData

REFERENCE_FIX = "pip install ngsolve-openblas (then --mlx-blas auto picks it), or apt install libopenblas0-pthread"
NAMES = {"mlx": "MLX"}


def blas_of(summary: dict) -> dict:
    """{"kind", "chosen", "fix"} of a run: summary.json's blas_kind ("reference", "openblas", "accelerate"),
    blas_chosen and blas_fix (compare/launch/runner.py). Summaries written before those fields hold only the
    description, which starts with "bundled" for the mlx wheel's reference BLAS (compare/machine/environment.py)."""
    kind = summary.get("blas_kind")
    if kind is None and str(summary.get("blas") or "").startswith("bundled"):
        kind = "reference"
    return {"kind": kind, "chosen": summary.get("blas_chosen"), "fix": summary.get("blas_fix") or REFERENCE_FIX}


def on_reference_blas(run: RunData) -> bool:
    # A GPU's matmuls do not go through the BLAS, whatever library the process loaded.
    return str(run.summary.get("device", "cpu")).lower().startswith("cpu") and blas_of(run.summary)["kind"] == "reference"


def matmul_flops_per_s(run: RunData) -> float | None:
    """The matmul class's FLOPs per step over its seconds per step in the run's op profile (1-rank runs record
    one); a profile without its FLOPs gets the model's at the profiled shapes, as the lower bounds count them."""
    profile = run.summary.get("op_profile") or {}
    matmul = (profile.get("classes") or {}).get("matmul") or {}
    if not matmul.get("s"):
        return None
    flops, shapes, spec = matmul.get("flops"), profile.get("shapes") or {}, run.run_config.get("spec")
    if flops is None and shapes and spec:
        flops = class_work(ModelSpec.from_dict(spec), shapes["micro_batch"], shapes["seq_len"],
                           shapes.get("grad_accum", 1), shapes.get("dtype", "float32"))["matmul"]["flops"]
    return flops / matmul["s"] if flops else None


def profiled(run: RunData, runs: list[RunData]) -> float | None:
    """A run's matmul rate, or, for a run with no op profile (N>1), its framework's 1-rank run's at that dtype."""
    same = [run] + [r for r in runs if r.ok and r.world_size == 1 and (r.framework, r.dtype) == (run.framework, run.dtype)]
    return next((rate for r in same if (rate := matmul_flops_per_s(r)) is not None), None)


def gflops(rate: float | None) -> str:
    return "not measured (no 1-rank op profile)" if rate is None else f"{rate / 1e9:.3g} GFLOP/s"


def blas_reason(a: RunData, b: RunData, kind: str, runs: list[RunData]) -> str | None:
    """Why a pair's ratio measures a reference BLAS: across frameworks whenever either side ran on it; within one
    framework (strategy, dtype) only where the two ran on different BLAS."""
    slow = [r for r in (a, b) if on_reference_blas(r)]
    if not slow or (kind != "framework" and len(slow) == 2):
        return None
    names = " and ".join(dict.fromkeys(NAMES.get(r.framework, r.framework) for r in slow))
    other = next((r for r in (a, b) if r not in slow), None)
    against = f" against {gflops(profiled(other, runs))} for {other.framework}" if other else ""
    return (f"{names} ran on its reference BLAS, matmul at {gflops(profiled(slow[0], runs))}{against} at the run's "
            f"shapes, so the ratio below measures the BLAS, not the framework. Fix: {blas_of(slow[0].summary)['fix']}")


def mismatch_reason(a: str, b: str, fairness: dict) -> str | None:
    """Threads or tokens per step the two runs were given differently (findings.fairness_info's per-run figures)."""
    given = [(what, fairness[key].get(a), fairness[key].get(b)) for what, key, same in (
        ("threads per rank", "threads_per_rank", "same_threads"), ("tokens per step", "tokens_per_step",
                                                                   "same_tokens_per_step"))
        if not fairness[same] and fairness[key].get(a) != fairness[key].get(b)]
    if not given:
        return None
    # Values in the pair's order and no labels, so that pairs given alike share one line.
    return ("the two runs were given different " + ", ".join(f"{what} ({x} vs {y})" for what, x, y in given)
            + ", so the ratio below measures what each was given, not the framework. Fix: run both with the same "
              "--threads-per-rank, --global-batch-size and --seq-len")


def environment_lines(speed: list[dict], runs: list[RunData], fairness: dict) -> list[str]:
    """Marks each speed entry (findings.speed_table) with "environment_bound", the reasons or None, and returns the
    lines that open the speed section: one per reason, naming the pairs it applies to, reference BLAS first."""
    by_label = {r.label: r for r in runs}
    found: dict[str, list[str]] = {}
    for entry in speed:
        a, b = by_label[entry["a"]], by_label[entry["b"]]
        reasons = [r for r in (blas_reason(a, b, entry["kind"], runs), mismatch_reason(a.label, b.label, fairness)) if r]
        entry["environment_bound"] = reasons or None
        for reason in reasons:
            found.setdefault(reason, []).append(f"{entry['a']} vs {entry['b']}")
    ordered = sorted(found.items(), key=lambda item: "reference BLAS" not in item[0])  # stable: BLAS first
    return [f"Speed is environment-bound ({', '.join(pairs)}): {reason}" for reason, pairs in ordered]
