"""Uneven shares against a slow rank (docs/uneven.md): `small` at N=2 with rank 1 at half speed (--rank-speed 1:0.5,
the launcher's SIGSTOP/SIGCONT duty cycle), even shares against --rank-shares 2,1 and auto, both frameworks,
alternating in one sitting; the losses of every variant against the even run's; and `plan --rank-speed 1:0.5
--ranks-per-machine 2` (the two ranks share this machine's cores, as the emulation runs them: compare/plan/uneven.py)
from an unthrottled x2 run of each framework against the measured steps; each rank's compute and wait (ms per step,
from summary.json's rank_compute_s and rank_wait_s) of the first round.

    python benchmarks/bench_uneven.py OUT [--rounds 2] [--quiet-wait S] [-- extra run flags]

--quiet-wait S: before each run wait up to S seconds for a second in which the machine's cores are less than 15 %
busy (other engineers' work, since none of this benchmark's runs is alive then). The last line says, for each run,
the 1-minute load average and (with --quiet-wait) how busy the cores were as it started, and how many cores' worth
of CPU processes other than this benchmark's used while it ran: a run beside others' work reads above 0.

Prints a markdown table (the docs' excerpt, docs/benchmarks.md "Uneven shares").
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN = ["--preset", "small", "--seq-len", "128", "--global-batch-size", "12", "--steps", "12", "--warmup-steps", "2",
       "--eval-every", "0", "--no-op-profile", "--profile-steps", "2", "--nproc", "2", "--quiet", "--overwrite"]
# The calibration's split of its step into compute and communication sets the plan's rest; 2 profiled rounds read
# its communication at 18-96 ms under a neighbour's load (docs/notes/2026-12-uneven-polling.md), so it takes 6.
CALIBRATION = ["--profile-steps", "6"]
VARIANTS = {"even": [], "2,1": ["--rank-shares", "2,1"], "auto": ["--rank-shares", "auto"]}


def dpcompare(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "compare.cli", *args], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)


def read(run: Path) -> tuple[dict, list[float]]:
    summary = json.loads((run / "summary.json").read_text())
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line]
    return summary, losses


def ticks() -> tuple[int, int]:
    """The machine's CPU ticks so far, all and idle (/proc/stat; 0, 0 where absent)."""
    try:
        values = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    except OSError:
        return 0, 0
    return sum(values), values[3] + values[4]  # all, idle + iowait


def others_cores(run) -> tuple[object, float]:
    """run()'s result and the cores' worth of CPU that other processes than run()'s used meanwhile."""
    (all0, idle0), mine0, wall0 = ticks(), os.times(), time.monotonic()
    result = run()
    (all1, idle1), mine1, wall = ticks(), os.times(), time.monotonic() - wall0
    busy_s = ((all1 - all0) - (idle1 - idle0)) / os.sysconf("SC_CLK_TCK")
    mine_s = sum(mine1[:4]) - sum(mine0[:4])  # this process and its waited-for children, the ranks among them
    return result, max(0.0, busy_s - mine_s) / wall


def busy_share() -> float:
    """The share of the machine's CPU time that was not idle over one second."""
    (all0, idle0), _ = ticks(), time.sleep(1.0)
    all1, idle1 = ticks()
    return 1 - (idle1 - idle0) / (all1 - all0) if all1 > all0 else 0.0


def wait_quiet(limit_s: float) -> float:
    start, busy = time.monotonic(), busy_share()
    while busy >= 0.15 and time.monotonic() - start < limit_s:
        busy = busy_share()
    return busy


def ms(seconds: list | None) -> str:
    return ", ".join("?" if s is None else f"{1e3 * s:.0f}" for s in seconds or [])


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    rounds = int(argv[argv.index("--rounds") + 1]) if "--rounds" in argv else 2
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    quiet_s = float(argv[argv.index("--quiet-wait") + 1]) if "--quiet-wait" in argv[:argv.index("--") if "--" in argv else None] else 0.0
    steps: dict[tuple[str, str], list[float]] = {}
    loads: list[str] = []  # the 1-minute load average as each run starts, this benchmark's own ranks included
    for k in range(rounds):
        for fw in ("mlx", "torch"):
            for name, flags in VARIANTS.items():
                run = out / f"{fw}-{name.replace(',', '-')}-{k}"
                busy = wait_quiet(quiet_s) if quiet_s else None
                loads.append(f"{fw} {name} {k}: load {os.getloadavg()[0]:.1f}"
                             + (f", {100 * busy:.0f} % busy" if busy is not None else ""))
                _, others = others_cores(lambda: dpcompare("run", "--framework", fw, *RUN, "--rank-speed", "1:0.5",
                                                           *flags, *extra, "--out", str(run)))
                loads[-1] += f", others {others:.2f} cores during it"
                steps.setdefault((fw, name), []).append(read(run)[0]["step_time_s"])
    rows = ["| framework | shares | sequences per rank | step ms (each round) | speed-up vs even | max abs Δloss vs even "
            "| plan's step ms | compute / wait ms per rank |", "|---|---|---|---|---|---|---|---|"]
    for fw in ("mlx", "torch"):
        calibration = out / f"{fw}-calibration"
        busy = wait_quiet(quiet_s) if quiet_s else None
        loads.append(f"{fw} calibration: load {os.getloadavg()[0]:.1f}"
                     + (f", {100 * busy:.0f} % busy" if busy is not None else ""))
        _, others = others_cores(lambda: dpcompare("run", "--framework", fw, *RUN, *CALIBRATION, *extra,
                                                   "--out", str(calibration)))
        loads[-1] += f", others {others:.2f} cores during it"
        dpcompare("plan", "--from", str(calibration), "--nproc", "2", "--strategies", "ddp", "--rank-speed", "1:0.5",
                  "--ranks-per-machine", "2", "--out", str(out / f"{fw}-plan"))
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
                        + f" | {ms(summary.get('rank_compute_s'))} / {ms(summary.get('rank_wait_s'))} |")
        rows.append(f"| {fw} | plan without rank 1 | {'/'.join(map(str, plan.get('without_sizes', [])))} | – | – | – | "
                    f"{1e3 * plan.get('without_step_s', float('nan')):.0f} (keep: {plan.get('keep_slowest')}) | – |")
    print("\n".join(rows))
    print("\nas each run started: " + "; ".join(loads))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
