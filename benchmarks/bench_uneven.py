"""Uneven shares against a slow rank (docs/uneven.md): `small` at N=2 with rank 1 at half speed (--rank-speed 1:0.5,
the launcher's SIGSTOP/SIGCONT duty cycle), even shares against --rank-shares 2,1 and auto, both frameworks,
alternating in one sitting; the losses of every variant against the even run's; and `plan --rank-speed 1:0.5` from
an unthrottled x2 run of each framework against the measured steps.

    python benchmarks/bench_uneven.py OUT [--rounds 2] [-- extra run flags]

Prints a markdown table (the docs' excerpt, docs/benchmarks.md "Uneven shares").
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN = ["--preset", "small", "--seq-len", "128", "--global-batch-size", "12", "--steps", "12", "--warmup-steps", "2",
       "--eval-every", "0", "--no-op-profile", "--profile-steps", "2", "--nproc", "2", "--quiet", "--overwrite"]
VARIANTS = {"even": [], "2,1": ["--rank-shares", "2,1"], "auto": ["--rank-shares", "auto"]}


def dpcompare(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "compare.cli", *args], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)


def read(run: Path) -> tuple[dict, list[float]]:
    summary = json.loads((run / "summary.json").read_text())
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line]
    return summary, losses


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    rounds = int(argv[argv.index("--rounds") + 1]) if "--rounds" in argv else 2
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    steps: dict[tuple[str, str], list[float]] = {}
    for k in range(rounds):
        for fw in ("mlx", "torch"):
            for name, flags in VARIANTS.items():
                run = out / f"{fw}-{name.replace(',', '-')}-{k}"
                dpcompare("run", "--framework", fw, *RUN, "--rank-speed", "1:0.5", *flags, *extra, "--out", str(run))
                steps.setdefault((fw, name), []).append(read(run)[0]["step_time_s"])
    rows = ["| framework | shares | sequences per rank | step ms (each round) | speed-up vs even | max abs Δloss vs even "
            "| plan's step ms |", "|---|---|---|---|---|---|---|"]
    for fw in ("mlx", "torch"):
        calibration = out / f"{fw}-calibration"
        dpcompare("run", "--framework", fw, *RUN, *extra, "--out", str(calibration))
        dpcompare("plan", "--from", str(calibration), "--nproc", "2", "--strategies", "ddp", "--rank-speed", "1:0.5",
                  "--out", str(out / f"{fw}-plan"))
        plan = json.loads((out / f"{fw}-plan" / "plan.json").read_text())["uneven"]
        even_losses = read(out / f"{fw}-even-0")[1]
        for name in VARIANTS:
            summary, losses = read(out / f"{fw}-{name.replace(',', '-')}-0")
            median = statistics.median(steps[(fw, name)])
            speedup = statistics.median(steps[(fw, "even")]) / median
            delta = max(abs(a - b) for a, b in zip(losses, even_losses))
            predicted = {"even": plan["even_step_s"], "2,1": plan["best_step_s"]}.get(name)
            rows.append(f"| {fw} | {name} | {'/'.join(map(str, summary['rank_batch_sizes']))} | "
                        + ", ".join(f"{1e3 * s:.0f}" for s in steps[(fw, name)]) + f" | {speedup:.2f}x | {delta:.1e} | "
                        + (f"{1e3 * predicted:.0f} ({100 * (predicted / median - 1):+.0f}%)" if predicted else "–")
                        + " |")
        rows.append(f"| {fw} | plan without rank 1 | {'/'.join(map(str, plan.get('without_sizes', [])))} | – | – | – | "
                    f"{1e3 * plan.get('without_step_s', float('nan')):.0f} (keep: {plan.get('keep_slowest')}) |")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
