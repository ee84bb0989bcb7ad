"""Restarts after a lost rank (--max-restarts, --min-nproc): the issue's whole matrix, and its overhead.

    python benchmarks/bench_restart.py [--quick] [--out runs/bench/restart.json]

For each framework and strategy (ddp, fsdp) at N=2, `tiny`, 30 steps, a checkpoint every 5, against the
uninterrupted run of the same flags:
- kill: SIGKILL rank 1 before step 13, --max-restarts 1;
- stop: SIGSTOP rank 1 before step 13, --max-restarts 1, --collective-timeout-s 5;
- shrink: rank 1 dies before step 13 at every start at N=2, --max-restarts 2 --min-nproc 1.
Each row: the exit code, the steps in metrics.jsonl, the largest |loss - uninterrupted loss|, the steps lost,
detect_s (fault -> the watchdog's verdict) and restart_s (fault -> the first step after the last restart:
detection, a survivor's checkpoint under ddp, stopping the job, starting every rank, loading, one step).
The faults come from DPCOMPARE_INJECT_FAULT (common/train/faults.py).
keep_ms: what keeping the last step in memory costs a torch ddp rank per step (common/train/rescue.py copy_state:
weights and both moments copied, float32), timed alone for each preset's shapes (builtin vocabulary for tiny,
GPT-2's for small and base), median of 5. Against a whole run's step time it drowned in the noise of a loaded
machine (-33 and +25 ms on tiny steps), so it is timed where it happens.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

import benchlib

STEPS, EVERY, AT = 30, 5, 13
FLAGS = ["--preset", "tiny", "--steps", str(STEPS), "--checkpoint-every", str(EVERY), "--seq-len", "32",
         "--global-batch-size", "8", "--eval-every", "0", "--profile-steps", "0", "--quiet", "--overwrite",
         *benchlib.BUILTIN]
CASES = {"kill": (["--max-restarts", "1"], f"rank=1,step={AT},signal=KILL"),
         "stop": (["--max-restarts", "1", "--collective-timeout-s", "5"], f"rank=1,step={AT},signal=STOP"),
         "shrink": (["--max-restarts", "2", "--min-nproc", "1"], f"rank=1,step={AT},signal=KILL,world=2")}


def run(out: Path, framework: str, strategy: str, extra: list[str], fault: str | None = None) -> tuple[int, dict]:
    env = {**os.environ, **({"DPCOMPARE_INJECT_FAULT": f"framework={framework},{fault}"} if fault else {})}
    argv = benchlib.DPCOMPARE + ["run", "--framework", framework, "--strategy", strategy, "--nproc", "2", *FLAGS,
                                 *extra, "--out", str(out)]
    proc = subprocess.run(argv, cwd=benchlib.REPO, env=env, capture_output=True, text=True)
    path = out / "summary.json"
    return proc.returncode, json.loads(path.read_text()) if path.exists() else {}


def losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench/restart.json"))
    parser.add_argument("--quick", action="store_true", help="kill only, ddp and fsdp; no keep_ms")
    parser.add_argument("--frameworks", default="mlx,torch")
    a = parser.parse_args()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench_restart_") as work:
        for framework in a.frameworks.split(","):
            for strategy in ("ddp", "fsdp"):
                ref_dir = Path(work) / f"{framework}-{strategy}-ref"
                code, ref = run(ref_dir, framework, strategy, [])
                reference = losses(ref_dir)
                for case, (extra, fault) in CASES.items():
                    if a.quick and case != "kill":
                        continue
                    out = Path(work) / f"{framework}-{strategy}-{case}"
                    code, s = run(out, framework, strategy, extra, fault)
                    got = losses(out) if (out / "metrics.jsonl").exists() else {}
                    records = s.get("restarts") or []
                    last = records[-1] if records else {}
                    rows.append({
                        "framework": framework, "strategy": strategy, "case": case, "exit": code,
                        "steps": len(got), "max_dloss": max((abs(got[k] - reference[k]) for k in got), default=None),
                        "restarts": len(records), "steps_lost": sum(r["steps_lost"] for r in records),
                        "how": last.get("how"), "world_size": s.get("world_size"),
                        "detect_s": records[0].get("detect_s") if records else None,
                        "restart_s": (last["seconds"] + (last["failed_at"] - records[0]["failed_at"])
                                      if last.get("seconds") is not None else None)})
    copies = [] if a.quick else [copy_cost(name) for name in ("tiny", "small", "base")]
    benchlib.print_table(rows, [("framework", "framework", "s"), ("strategy", "strategy", "s"), ("case", "case", "s"),
                                ("exit", "exit", "d"), ("steps", "steps", "d"), ("max_dloss", "max |dloss|", ".1e"),
                                ("restarts", "restarts", "d"), ("steps_lost", "lost", "d"), ("how", "resumed from", "s"),
                                ("world_size", "N end", "d"), ("detect_s", "detect s", ".1f"),
                                ("restart_s", "fault->step s", ".1f")],
                         title=f"Restarts (tiny, {STEPS} steps, checkpoint every {EVERY}, fault before step {AT}, N=2)")
    if copies:
        benchlib.print_table(copies, [("preset", "preset", "s"), ("state_mb", "weights+moments MB", ".1f"),
                                      ("keep_ms", "keep ms/step", ".2f")], title="Keeping the last ddp step")
    benchlib.write_result(a.out, "restart", {"steps": STEPS, "checkpoint_every": EVERY, "fault_step": AT}, rows,
                          copies=copies)


def copy_cost(name: str) -> dict:
    """copy_state of a preset's weights and moments, as a ddp rank does after every step with --max-restarts."""
    import time

    import numpy as np

    from common.model.spec import preset
    from common.model.weights import parameter_shapes
    from common.train.rescue import copy_state

    spec = preset(name)
    if name != "tiny":
        spec = spec.__class__(**{**spec.to_dict(), "vocab_size": 50257})
    live = {k: np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
            for k, shape in parameter_shapes(spec).items()}
    times = []
    for _ in range(5):
        start = time.perf_counter()
        copy_state([iter(live.items())] * 3)
        times.append(time.perf_counter() - start)
    return {"preset": name, "state_mb": 3 * sum(v.nbytes for v in live.values()) / 2**20,
            "keep_ms": benchlib.median(times) * 1e3}


if __name__ == "__main__":
    main()
