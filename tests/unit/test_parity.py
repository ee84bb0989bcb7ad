"""The parity judge: when MLX and torch curves agree, when they do not, and when they cannot be compared.

Run directories are synthetic but written with the real schema (run_config.json, metrics.jsonl,
summary.json as compare/launch/runner.py writes them), so the judge reads exactly what a real run leaves.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from common.config import RunConfig
from common.metrics import write_json
from common.model.spec import preset
from compare.report.parity import RunData, Tolerances, compare_pair, judge, load_run, moving_average

STEPS = 40


def reference_losses(steps: int = STEPS) -> list[float]:
    rng = np.random.default_rng(0)
    return [float(2.5 + 5.1 * math.exp(-s / 12) + 0.05 * rng.standard_normal()) for s in range(1, steps + 1)]


def make_run(root: Path, framework: str, nproc: int, losses: list[float] | None = None, *,
             evals: dict[int, float] | None = None, status: str = "ok", config: dict | None = None,
             tokens_per_s: float = 10_000.0, name: str | None = None, write_summary: bool = True) -> Path:
    """A run directory as compare/launch/runner.py leaves it, with the given loss curve."""
    losses = reference_losses() if losses is None else losses
    cfg = RunConfig().to_dict()
    cfg.update(framework=framework, nproc=nproc, steps=len(losses), eval_every=20,
               backend="auto" if nproc == 1 else ("ring" if framework == "mlx" else "gloo"))
    cfg.update(config or {})
    run_dir = root / (name or f"{framework}-n{nproc}")
    run_dir.mkdir(parents=True)
    spec = preset(cfg["preset"]).to_dict()
    tokens = cfg["global_batch_size"] * cfg["seq_len"]
    write_json(run_dir / "run_config.json", {
        "config": cfg, "spec": spec, "token_cache": "/cache/tokens", "seed_checkpoint": "/cache/seeds/x",
        "world_size": nproc, "backend": "none" if nproc == 1 else cfg["backend"],
        "data": {"num_documents": 100, "num_tokens": 50_000, "vocab_size": 2048, "tokenizer": "builtin"}})
    rng = np.random.default_rng(nproc)
    lines = []
    for step, loss in enumerate(losses, start=1):
        rate = tokens_per_s * (1 + 0.03 * rng.standard_normal())
        lines.append({"step": step, "loss": loss, "lr": 3e-4, "grad_norm": 1.0, "tokens": tokens,
                      "step_time_s": tokens / rate, "tokens_per_s": rate, "epoch": 0})
        if evals and step in evals:
            lines.append({"step": step, "eval_loss": evals[step]})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    if write_summary:
        rates = [line["tokens_per_s"] for line in lines if "tokens_per_s" in line]
        tps = np.array(rates[3:] or rates)  # after 3 warmup steps, as the runner does
        summary = {
            "framework": framework, "world_size": nproc, "backend": "none" if nproc == 1 else cfg["backend"],
            "device": "cpu", "status": status, "steps": len(losses),
            "tokens_per_s": float(np.median(tps)), "tokens_per_s_p10": float(np.percentile(tps, 10)),
            "tokens_per_s_p90": float(np.percentile(tps, 90)), "step_time_s": tokens / float(np.median(tps)),
            "timed_steps": len(tps), "warmup_steps": 3, "compile_s": 0.4, "time_to_first_step_s": 2.5,
            "wall_s": 12.0, "peak_mem_bytes": [150e6 + 1e6 * r for r in range(nproc)],
            "peak_rss_bytes": [400e6 + 2e6 * r for r in range(nproc)],
            "blas": "openblas (preloaded)" if framework == "mlx" else "framework default",
            "threads_per_rank": cfg["threads_per_rank"],
            "versions": {"python": "3.12.0", "numpy": "2.0", "mlx": "0.32.4", "torch": "2.13.0"},
            "machine": {"host": "testhost", "platform": "Linux-test", "machine": "x86_64",
                        "processor": "Test CPU", "cpus": 2},
            "final_loss": losses[-1], "final_eval_loss": evals[max(evals)] if evals else None,
            "tokens_per_step": tokens, "command": f"python -m {framework}_impl.launch {run_dir}", "config": cfg,
        }
        if status != "ok":
            summary.update(error="rank 1 died at step 7 without reporting an error", failed_rank=1)
        write_json(run_dir / "summary.json", summary)
    return run_dir


def judged(*run_dirs: Path, tol: Tolerances | None = None) -> dict:
    return judge([load_run(d) for d in run_dirs], tol or Tolerances())


def test_identical_curves_pass_every_check(tmp_path):
    evals = {20: 3.1, 40: 2.9}
    result = judged(make_run(tmp_path, "mlx", 1, evals=evals), make_run(tmp_path, "torch", 1, evals=evals))
    (pair,) = result["cross_framework"]
    assert pair["verdict"] == "pass" and result["overall"] == "pass" and result["all_pass"]
    assert pair["checks"]["per_step"]["max_abs_diff"] == 0.0
    assert pair["checks"]["per_step"]["steps_compared"] == 20
    assert pair["checks"]["curve"]["steps_compared"] == STEPS
    assert pair["checks"]["eval"]["steps_compared"] == 2 and pair["checks"]["eval"]["verdict"] == "pass"


def test_a_1e3_offset_fails_the_per_step_check_but_not_the_curve_check(tmp_path):
    shifted = [x + 1e-3 for x in reference_losses()]
    result = judged(make_run(tmp_path, "mlx", 1), make_run(tmp_path, "torch", 1, shifted))
    (pair,) = result["cross_framework"]
    assert pair["checks"]["per_step"]["verdict"] == "fail"
    assert abs(pair["checks"]["per_step"]["max_abs_diff"] - 1e-3) < 1e-9
    assert pair["checks"]["curve"]["verdict"] == "pass"  # 1e-3 on a loss of ~3 is far below 2 %
    assert pair["verdict"] == "fail" and result["overall"] == "fail" and not result["all_pass"]


def test_a_drift_after_the_first_steps_fails_the_curve_check(tmp_path):
    drifted = [x * (1.0 if s <= 20 else 1.1) for s, x in enumerate(reference_losses(), start=1)]
    (pair,) = judged(make_run(tmp_path, "mlx", 1), make_run(tmp_path, "torch", 1, drifted))["cross_framework"]
    assert pair["checks"]["per_step"]["verdict"] == "pass"
    assert pair["checks"]["curve"]["verdict"] == "fail" and pair["checks"]["curve"]["max_rel_diff"] > 0.05


def test_eval_losses_are_compared_at_common_steps(tmp_path):
    a = make_run(tmp_path, "mlx", 1, evals={20: 3.0, 40: 2.9})
    b = make_run(tmp_path, "torch", 1, evals={20: 3.0, 40: 3.2})
    (pair,) = judged(a, b)["cross_framework"]
    assert pair["checks"]["eval"]["verdict"] == "fail" and pair["checks"]["eval"]["at_step"] == 40


def test_pairs_are_made_per_world_size_and_dp_runs_are_checked_against_one_rank(tmp_path):
    dirs = [make_run(tmp_path, fw, n) for fw in ("mlx", "torch") for n in (1, 2)]
    result = judged(*dirs)
    assert [(p["a"], p["b"]) for p in result["cross_framework"]] == [("mlx x1", "torch x1"),
                                                                     ("mlx x2", "torch x2")]
    assert [(p["a"], p["b"]) for p in result["dp_invariance"]] == [("mlx x2", "mlx x1"), ("torch x2", "torch x1")]
    assert all(p["verdict"] == "pass" for p in result["dp_invariance"])


def test_dp_invariance_uses_its_own_tolerance(tmp_path):
    off = [x + 5e-4 for x in reference_losses()]
    result = judged(make_run(tmp_path, "mlx", 1), make_run(tmp_path, "mlx", 2, off),
                    tol=Tolerances(dp_atol=1e-3, loss_atol=1e-6))
    (pair,) = result["dp_invariance"]
    assert pair["verdict"] == "pass" and pair["checks"]["per_step"]["tolerance"] == 1e-3


def test_incomparable_configs_are_reported_as_such_not_as_failures(tmp_path):
    a = make_run(tmp_path, "mlx", 1, config={"seed": 0})
    b = make_run(tmp_path, "torch", 1, [x + 1.0 for x in reference_losses()], config={"seed": 1, "lr": 1e-3})
    result = judged(a, b)
    (pair,) = result["cross_framework"]
    assert pair["verdict"] == "not comparable" and not pair["comparable"]
    assert pair["differences"] == {"lr": [3e-4, 1e-3], "seed": [0, 1]}
    assert result["overall"] == "not comparable" and result["all_pass"]


def test_how_a_run_executes_does_not_make_it_incomparable(tmp_path):
    a = make_run(tmp_path, "mlx", 2, config={"threads_per_rank": 1, "all_reduce_size_mb": 8.0})
    b = make_run(tmp_path, "torch", 2, config={"threads_per_rank": 2, "out": "/elsewhere", "grad_accum": 2})
    (pair,) = judged(a, b)["cross_framework"]
    assert pair["comparable"] and pair["verdict"] == "pass"


def test_failed_and_unfinished_runs_are_listed_and_skipped(tmp_path):
    ok = [make_run(tmp_path, "mlx", 1), make_run(tmp_path, "torch", 1)]
    failed = make_run(tmp_path, "torch", 2, reference_losses()[:7], status="failed")
    unfinished = make_run(tmp_path, "mlx", 2, write_summary=False)
    empty = tmp_path / "never-started"
    empty.mkdir()
    result = judged(*ok, failed, unfinished, empty)
    skipped = {s["run_dir"]: s for s in result["skipped"]}
    assert set(skipped) == {str(failed), str(unfinished), str(empty)}
    assert "rank 1 died" in skipped[str(failed)]["reason"]
    assert "incomplete" in skipped[str(unfinished)]["reason"]
    assert result["dp_invariance"] == [] and len(result["cross_framework"]) == 1
    assert result["overall"] == "pass"


def test_the_judgement_is_json_serialisable(tmp_path):
    result = judged(make_run(tmp_path, "mlx", 1, evals={20: 3.0}), make_run(tmp_path, "torch", 1, evals={20: 3.0}),
                    make_run(tmp_path, "torch", 2, status="failed"))
    assert json.loads(json.dumps(result)) == result


def test_duplicate_framework_and_world_size_get_distinct_labels(tmp_path):
    runs = [make_run(tmp_path, "mlx", 2, name="ring", config={"backend": "ring"}),
            make_run(tmp_path, "mlx", 2, name="mpi", config={"backend": "mpi"})]
    labels = [r["label"] for r in judged(*runs)["runs"]]
    assert len(set(labels)) == 2


def test_moving_average_is_a_trailing_mean():
    assert np.allclose(moving_average(np.array([1.0, 3.0, 5.0, 7.0]), 2), [1.0, 2.0, 4.0, 6.0])


def in_memory_run(label: str, losses: list[float]) -> RunData:
    rows = [{"step": s, "loss": x} for s, x in enumerate(losses, start=1)]
    return RunData(Path(label), {"framework": label, "world_size": 1, "status": "ok", "config": {"seed": 0}},
                   rows, [], {}, label=label)


@settings(max_examples=40, deadline=None)
@given(offset=st.floats(min_value=0.0, max_value=1e-3), at=st.integers(min_value=1, max_value=STEPS))
def test_the_per_step_check_fails_exactly_when_one_step_exceeds_the_tolerance(offset, at):
    base = reference_losses()
    other = [x + (offset if s == at else 0.0) for s, x in enumerate(base, start=1)]
    tol = Tolerances()
    check = compare_pair(in_memory_run("mlx", base), in_memory_run("torch", other), "cross_framework",
                         tol)["checks"]["per_step"]
    exceeded = at <= tol.parity_steps and abs((base[at - 1] + offset) - base[at - 1]) > tol.loss_atol
    assert (check["verdict"] == "fail") == exceeded
