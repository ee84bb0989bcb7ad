"""Do the loss curves agree? Every pair of runs that should compute the same model, judged.

Pairs (each run is a framework x strategy x dtype x world size):
    cross_framework  MLX vs torch, same strategy, dtype and world size.
    dp_invariance    ddp at N ranks vs ddp at 1 rank, one framework: the same global batch gives the same loss.
    strategy         fsdp at N vs ddp at N, and tp at N vs ddp at 1 (tp ranks all read the whole batch):
                     sharding or splitting the model must not change what it computes.
    precision        bfloat16 vs float32 of one framework, strategy and world size: how far bf16 moves
                     the curve (trend and eval only; per step they part ways at once).
    peer             a peer's own trainer (mlx-lm's, the Trainer with peft: common/peers.py) vs dpcompare's run of
                     its framework at the same world size, on the same batches (`peer_atol`; 4-bit base: 1e-4).

Checks, each with its own tolerance (Tolerances):
    per_step  max |loss_a - loss_b| over the first `parity_steps` steps (relative in bfloat16). In fp32 from
              identical weights and batches the curves start equal up to summation order; this catches a
              wrong gradient, optimizer or data order immediately, before chaotic divergence sets in.
    curve     max relative difference of the moving averages (window `curve_window`) over all common
              steps: after many steps rounding differences grow, so only the trend is compared.
    eval      max relative difference of eval losses at common eval steps.
Runs are paired only when their configs agree on everything that changes the numbers; the rest
(framework, strategy, ranks, backend, threads, output paths) is what the comparison is about. Data, tokenizer
and initial weights compare by their content hashes where both runs carry them (inputs.py), not by path.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from common.metrics import read_json, read_metrics
from common.model.precision import DEFAULT_TOLERANCES
from common.peers import adapted_names, explained

from .inputs import content_hashes, named, tokenizer_fingerprint
from .labels import run_label, strategy_name


BF16 = DEFAULT_TOLERANCES["bfloat16"]
FP32 = DEFAULT_TOLERANCES["float32"]


@dataclass
class Tolerances:
    loss_atol: float = FP32["loss_atol"]        # per-step absolute loss difference, fp32
    parity_steps: int = FP32["parity_steps"]    # steps compared step by step
    curve_rtol: float = FP32["curve_rtol"]      # relative difference of the moving averages
    curve_window: int = FP32["curve_window"]    # moving-average window, steps
    eval_rtol: float = FP32["eval_rtol"]        # relative difference of eval losses
    dp_atol: float = FP32["dp_atol"]            # per-step absolute difference, N ranks vs 1, and strategy vs ddp
    peer_atol: float = 1e-5                     # per step, a peer's trainer vs ours (issue 74's bound)
    peer_quantized_atol: float = 1e-4           # the same over a quantized base (dequantized on our side)
    # bfloat16 rounds at about 4e-3 relative, so its checks are relative and wider; the defaults are
    # common/model/precision.py's, chosen from the measurements in docs/precision.md.
    bf16_loss_rtol: float = BF16["loss_rtol"]              # per step, MLX bf16 vs torch bf16
    bf16_dp_rtol: float = BF16["dp_rtol"]                  # per step, bf16 N ranks vs 1, and strategy vs ddp
    bf16_curve_rtol: float = BF16["curve_rtol"]            # moving averages, across frameworks in bf16
    bf16_eval_rtol: float = BF16["eval_rtol"]              # eval loss, across frameworks in bf16
    precision_curve_rtol: float = BF16["vs_fp32_curve_rtol"]  # moving averages, bf16 vs fp32 of one framework
    precision_eval_rtol: float = BF16["vs_fp32_eval_rtol"]    # eval loss, bf16 vs fp32 of one framework

    def per_step(self, kind: str, dtype: str) -> tuple[float, bool]:
        """(tolerance, relative?) of the per-step check of a pair of this kind and dtype."""
        if dtype == "bfloat16":
            return (self.bf16_loss_rtol if kind == "cross_framework" else self.bf16_dp_rtol), True
        if kind == "peer":
            return self.peer_atol, False
        return (self.loss_atol if kind == "cross_framework" else self.dp_atol), False

    def trend(self, kind: str, dtype: str) -> tuple[float, float]:
        """(curve rtol, eval rtol) of a pair of this kind and dtype."""
        if kind == "precision":
            return self.precision_curve_rtol, self.precision_eval_rtol
        if dtype == "bfloat16":
            return self.bf16_curve_rtol, self.bf16_eval_rtol
        return self.curve_rtol, self.eval_rtol

PAIR_KINDS = ("cross_framework", "dp_invariance", "strategy", "precision", "peer")


# Config keys that may differ between runs that are still compared: how and where a run executes,
# never what it computes. (grad_accum splits the same global batch differently, like nproc does.)
RUN_ONLY_KEYS = frozenset({
    "framework", "strategy", "mesh", "nproc", "nnodes", "node_rank", "rdzv_endpoint", "hostfile", "backend", "device",
    "threads_per_rank", "mlx_blas", "mlx_cpu_jit", "mlx_exp", "mlx_bf16_matmul", "all_reduce_size_mb", "bucket_cap_mb", "torch_compile", "grad_accum",
    "collective_timeout_s", "timing_warmup_steps", "eval_every", "checkpoint_every", "out", "resume",
    "overwrite", "quiet", "cache_dir", "trace", "profile_steps", "op_profile", "tune_malloc", "pin_ranks", "link", "launcher",
    "recipe",  # a name only: its choices are fields of their own (common/recipes.py), compared one by one
    "peer",  # which trainer ran it: a peer pairs with its framework's run (kind peer)
    "peer_adapted",  # the names of the choices the peer ran with its own value (compared below: kind peer)
    "rank_shares", "rank_speed",  # how the batch is cut over the ranks and how fast they run (docs/uneven.md)
})


@dataclass
class RunData:
    run_dir: Path
    summary: dict
    train: list[dict]
    evals: list[dict]
    run_config: dict
    label: str = ""
    problem: str = field(default="")  # why the run is skipped; empty when it can be judged

    @property
    def config(self) -> dict:
        return self.summary.get("config") or self.run_config.get("config") or {}

    @property
    def framework(self) -> str:
        """mlx or torch; or a peer's name (mlx-lm, hf), which runs on one of them (common/peers.py)."""
        return self.config.get("peer") or self.summary.get("framework") or self.config.get("framework", "?")

    @property
    def peer_of(self) -> str:
        """The framework whose dpcompare run a peer's run is judged against ("" for dpcompare's own runs)."""
        return self.config.get("framework", "") if self.config.get("peer") else ""

    @property
    def strategy(self) -> str:
        # a mesh by its axes (labels.py): dp2xtp2 and fsdp2xtp2 are different strategies
        return strategy_name(self.summary.get("strategy") or self.config.get("strategy", "ddp"),
                             self.config.get("mesh", ""))

    @property
    def dtype(self) -> str:
        return self.config.get("dtype", "float32")

    @property
    def world_size(self) -> int:
        return int(self.summary.get("world_size") or self.run_config.get("world_size") or
                   self.config.get("nproc", 1) * self.config.get("nnodes", 1))

    @property
    def status(self) -> str:
        return self.summary.get("status", "incomplete")

    @property
    def ok(self) -> bool:
        return not self.problem

    def losses(self) -> dict[int, float]:
        return {int(r["step"]): float(r["loss"]) for r in self.train if r.get("loss") is not None}

    def eval_losses(self) -> dict[int, float]:
        return {int(r["step"]): float(r["eval_loss"]) for r in self.evals if r.get("eval_loss") is not None}


def load_run(run_dir: Path) -> RunData:
    """A run directory as written by compare/launch/runner.py; never raises on a broken or unfinished run,
    it gets a `problem` instead, so a report can still list it."""
    run_dir = Path(run_dir)
    summary = read_json(run_dir / "summary.json", None) or {}
    run_config = read_json(run_dir / "run_config.json", None) or {}
    train, evals = read_metrics(run_dir / "metrics.jsonl")
    run = RunData(run_dir, summary, train, evals, run_config)
    run.label = run_label(run.framework, run.world_size, run.strategy, run.dtype)
    if not summary and not run_config:
        run.problem = f"no run files in {run_dir}"
    elif not summary:
        run.problem = "incomplete: no summary.json (still running, or the launcher was killed)"
    elif run.status != "ok":
        run.problem = f"{run.status}: {summary.get('error', 'no error recorded')}"
    elif not train:
        run.problem = "no training steps in metrics.jsonl"
    elif run.config.get("steps") and run.losses() and max(run.losses()) < run.config["steps"]:
        run.problem = f"incomplete: {max(run.losses())} of {run.config['steps']} steps"
    return run


def assign_labels(runs: list[RunData]) -> None:
    """"mlx x2" (or "mlx fsdp bf16 x2") alone when unique; backend, then directory name appended where needed."""
    base = [run_label(r.framework, r.world_size, r.strategy, r.dtype) for r in runs]
    for run, label in zip(runs, base):
        run.label = label
        if base.count(label) > 1 and run.world_size > 1:
            run.label = f"{label} {run.summary.get('backend') or run.run_config.get('backend', '')}".strip()
    labels = [r.label for r in runs]
    for run in runs:
        if labels.count(run.label) > 1:
            run.label = f"{run.label} ({run.run_dir.name})"


def comparable(a: RunData, b: RunData, ignore: tuple = ()) -> dict:
    """{key: [a's value, b's value]} for every difference that changes the numbers; empty = comparable.

    Inputs named by a path (dataset, tokenizer, init_from) compare by their content hashes where both runs
    carry them (inputs.py), so the same data at two paths pairs; by the paths where either lacks one.
    `ignore`: keys that differ on purpose in this kind of pair (dtype, for bf16 vs fp32)."""
    diffs = {}
    ca, cb = a.config, b.config
    ha, hb = (content_hashes(r.run_config, r.summary) for r in (a, b))
    for key in sorted(set(ca) | set(cb)):
        if key in RUN_ONLY_KEYS or key in ignore:
            continue
        if key in ha and key in hb:
            if ha[key] != hb[key]:
                diffs[key] = [named(ca.get(key), ha[key]), named(cb.get(key), hb[key])]
        elif ca.get(key) != cb.get(key):
            diffs[key] = [ca.get(key), cb.get(key)]
    for section in ("spec", "data"):
        sa, sb = a.run_config.get(section) or {}, b.run_config.get(section) or {}
        for key in sorted(set(sa) | set(sb)):
            va, vb = sa.get(key), sb.get(key)
            if key == "tokenizer" and tokenizer_fingerprint(sa) and tokenizer_fingerprint(sb):
                va, vb = tokenizer_fingerprint(sa), tokenizer_fingerprint(sb)  # its name may be a path
            if va != vb:
                diffs[f"{section}.{key}"] = [va, vb]
    return diffs


def moving_average(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean; the first window-1 points average what exists so far (no padding artefacts)."""
    sums = np.cumsum(np.insert(values, 0, 0.0))
    idx = np.arange(1, len(values) + 1)
    lo = np.maximum(idx - window, 0)
    return (sums[idx] - sums[lo]) / (idx - lo)


def compare_pair(a: RunData, b: RunData, kind: str, tol: Tolerances) -> dict:
    result = {"kind": kind, "a": a.label, "b": b.label, "a_dir": str(a.run_dir), "b_dir": str(b.run_dir),
              "world_size": [a.world_size, b.world_size], "dtype": a.dtype if a.dtype == b.dtype else
              f"{a.dtype} vs {b.dtype}", "strategy": [a.strategy, b.strategy]}
    # At one rank both loss normalizations compute the same loss: an N=1 reference serves either.
    one_rank = ("loss_normalization",) if 1 in (a.world_size, b.world_size) else ()
    # A peer ran a choice it cannot be told with its own value (common/peers.py adapted): that key differs on purpose.
    by_peer = tuple(n for r in (a, b) for n in adapted_names(r.config)) if kind == "peer" else ()
    diffs = comparable(a, b, ignore=(("dtype",) if kind == "precision" else ()) + one_rank + by_peer)
    if diffs:
        return {**result, "comparable": False, "differences": diffs, "verdict": "not comparable",
                "checks": {}}
    la, lb = a.losses(), b.losses()
    steps = sorted(set(la) & set(lb))
    if not steps:
        return {**result, "comparable": True, "differences": {}, "verdict": "no data", "checks": {}}
    ya, yb = np.array([la[s] for s in steps]), np.array([lb[s] for s in steps])
    abs_diff = np.abs(ya - yb)
    first = [i for i, s in enumerate(steps) if s <= tol.parity_steps]
    checks = {}
    if kind != "precision":  # bf16 and fp32 part ways from the first step: only their trends compare
        limit, relative = tol.per_step(kind, a.dtype)
        if kind == "peer" and (a.summary.get("base_quantization") or b.summary.get("base_quantization")):
            limit = tol.peer_quantized_atol
        diff = abs_diff / np.maximum(np.abs(yb), 1e-12) if relative else abs_diff
        checks["per_step"] = per_step_check(steps, diff, first, limit, tol.parity_steps, relative)
    if kind in ("cross_framework", "precision"):
        curve_rtol, eval_rtol = tol.trend(kind, a.dtype)
        checks["curve"] = curve_check(ya, yb, curve_rtol, tol.curve_window)
        checks["eval"] = eval_check(a.eval_losses(), b.eval_losses(), eval_rtol)
    verdicts = [c["verdict"] for c in checks.values() if c["verdict"] in ("pass", "fail")]
    verdict = "fail" if "fail" in verdicts else ("pass" if verdicts else "no data")
    if verdict == "fail" and kind == "dp_invariance" and PER_RANK in (normalization(a), normalization(b)):
        # mlx-lm's normalization does not compute what one rank computes where the ranks hold unequal counts of
        # targets (common/train/normalization.py): the difference is the choice's, not a bug's.
        verdict, result["explained_by"] = "differs", PER_RANK
    if verdict == "fail" and by_peer:  # the peer's trainer could not be told what ours computed: named, not a bug
        verdict, result["explained_by"] = "differs", explained(a.config if a.peer_of else b.config)
    return {**result, "comparable": True, "differences": {}, "verdict": verdict, "checks": checks,
            "common_steps": len(steps),
            "diff_series": {"steps": steps, "abs_diff": [float(x) for x in abs_diff]}}


PER_RANK = "per-rank"


def normalization(run: RunData) -> str:
    return run.config.get("loss_normalization") or "global-tokens"


def per_step_check(steps: list[int], diff: np.ndarray, first: list[int], limit: float, k: int,
                   relative: bool = False) -> dict:
    """`diff` holds |Δloss| per step, or |Δloss| / |loss_b| when `relative` (bfloat16)."""
    if not first:
        return {"verdict": "no data", "steps_compared": 0, "tolerance": limit, "parity_steps": k,
                "relative": relative}
    worst = max(first, key=lambda i: diff[i])
    value = float(diff[worst])
    key = "max_rel_diff" if relative else "max_abs_diff"
    return {"verdict": "pass" if value <= limit else "fail", key: value, "at_step": steps[worst],
            "steps_compared": len(first), "tolerance": limit, "parity_steps": k, "relative": relative,
            "mean_rel_diff" if relative else "mean_abs_diff": float(np.mean(diff[first]))}


def curve_check(ya: np.ndarray, yb: np.ndarray, rtol: float, window: int) -> dict:
    ma, mb = moving_average(ya, window), moving_average(yb, window)
    rel = np.abs(ma - mb) / np.maximum(np.abs(mb), 1e-12)
    value = float(rel.max())
    return {"verdict": "pass" if value <= rtol else "fail", "max_rel_diff": value,
            "at_index": int(rel.argmax()), "window": window, "steps_compared": len(ya),
            "tolerance": rtol, "final_rel_diff": float(rel[-1])}


def eval_check(ea: dict[int, float], eb: dict[int, float], rtol: float) -> dict:
    steps = sorted(set(ea) & set(eb))
    if not steps:
        return {"verdict": "no data", "steps_compared": 0, "tolerance": rtol}
    rel = [abs(ea[s] - eb[s]) / max(abs(eb[s]), 1e-12) for s in steps]
    worst = int(np.argmax(rel))
    return {"verdict": "pass" if rel[worst] <= rtol else "fail", "max_rel_diff": float(rel[worst]),
            "at_step": steps[worst], "steps_compared": len(steps), "tolerance": rtol,
            "a": [ea[s] for s in steps], "b": [eb[s] for s in steps], "steps": steps}


def judge(runs: list[RunData], tol: Tolerances) -> dict:
    """Every verdict and the numbers behind it, JSON-able. Verdicts: pass, fail, not comparable, no data."""
    assign_labels(runs)
    usable = [r for r in runs if r.ok]
    skipped = [{"label": r.label, "run_dir": str(r.run_dir), "status": r.status, "reason": r.problem}
               for r in runs if not r.ok]
    order = {"mlx": 0, "torch": 1}
    usable.sort(key=lambda r: (r.world_size, STRATEGY_ORDER.get(r.strategy, 9), r.dtype != "float32",
                               order.get(r.framework, 9), r.framework))
    pairs = {kind: [compare_pair(a, b, kind, tol) for a, b in find_pairs(usable, kind)] for kind in PAIR_KINDS}
    verdicts = [p["verdict"] for kind in PAIR_KINDS for p in pairs[kind]]
    if "fail" in verdicts:
        overall = "fail"
    elif "pass" in verdicts:
        overall = "pass"
    elif "not comparable" in verdicts:
        overall = "not comparable"
    elif "differs" in verdicts:
        overall = "pass"  # every difference has its stated cause
    else:
        overall = "no data"
    return {"tolerances": asdict(tol), "overall": overall, "all_pass": "fail" not in verdicts,
            "runs": [{"label": r.label, "run_dir": str(r.run_dir), "framework": r.framework,
                      "strategy": r.strategy, "dtype": r.dtype, "world_size": r.world_size, "status": r.status,
                      "judged": r.ok} for r in runs],
            "skipped": skipped, **pairs}


STRATEGY_ORDER = {"ddp": 0, "zero1": 1, "zero2": 2, "fsdp": 3, "tp": 4, "pp": 5}


def find_pairs(runs: list[RunData], kind: str) -> list[tuple[RunData, RunData]]:
    """The (a, b) pairs of one kind among finished runs, in report order; b is the reference."""
    def first(**want):
        return next((r for r in runs if all(getattr(r, k) == v for k, v in want.items())), None)

    found = []
    for a in runs:
        if kind == "cross_framework":
            found += [(a, b) for b in runs[runs.index(a) + 1:]
                      if (b.strategy, b.dtype, b.world_size) == (a.strategy, a.dtype, a.world_size)
                      and b.framework != a.framework and not a.peer_of and not b.peer_of]
        elif kind == "peer" and a.peer_of:  # a peer's trainer vs dpcompare's on its framework, same N
            ref = next((r for r in runs if not r.peer_of and (r.framework, r.strategy, r.dtype, r.world_size) ==
                        (a.peer_of, a.strategy, a.dtype, a.world_size)), None)
            found += [(a, ref)] if ref else []
        elif kind == "dp_invariance" and a.strategy == "ddp" and a.world_size > 1:
            ref = first(framework=a.framework, strategy="ddp", dtype=a.dtype, world_size=1)
            found += [(a, ref)] if ref else []
        elif kind == "strategy" and a.strategy == "fsdp":
            ref = first(framework=a.framework, strategy="ddp", dtype=a.dtype, world_size=a.world_size)
            found += [(a, ref)] if ref else []
        elif kind == "strategy" and a.strategy not in ("ddp", "fsdp"):
            # A tp or pp job is one model replica, and any mesh computes the global batch: it must compute what
            # one ddp rank computes.
            ref = (first(framework=a.framework, strategy="ddp", dtype=a.dtype, world_size=1) or
                   first(framework=a.framework, strategy="ddp", dtype=a.dtype, world_size=a.world_size))
            found += [(a, ref)] if ref else []
        elif kind == "precision" and a.dtype != "float32":
            ref = first(framework=a.framework, strategy=a.strategy, dtype="float32", world_size=a.world_size)
            found += [(a, ref)] if ref else []
    return found


def all_pairs(parity: dict) -> list[dict]:
    return [p for kind in PAIR_KINDS for p in parity.get(kind, [])]


def run_verdict(parity: dict, label: str) -> str:
    """The worst verdict among the pairs a run takes part in ("-" when it is in none)."""
    verdicts = [p["verdict"] for p in all_pairs(parity) if label in (p["a"], p["b"])]
    for worst in ("fail", "differs", "not comparable", "no data", "pass"):
        if worst in verdicts:
            return worst
    return "-"
