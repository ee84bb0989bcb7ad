"""The cost model against a folder of finished `dpcompare run`s: each run at N > 2 predicted as `compare` predicts it,
from the N=1 run of its framework in the folder, over the link the job measured, fitted on the folder's N=2 runs of
its axes' strategies (the run's own backend first: compare/plan/predictions.py `fit_runs`), with its measured
figures beside.

    python benchmarks/predict_runs.py DIR [DIR ...]

Each DIR holds runs named as compare names them (FRAMEWORK-n1 beside FRAMEWORK-STRATEGY-n2; the N > 2 runs may be
named freely); a DIR/ring subfolder may hold MLX's ring N=2 runs beside its MPI ones. `benchmarks/mesh_table.sh`
trains such a folder for issue 37's table. Prints one markdown row per run: step time measured and predicted
(unfitted, fitted), tokens/s, state and peak RSS per rank, and the bytes rank 0 counted against the estimate.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from compare.plan import fit_runs, predicted_record  # noqa: E402


def summaries(folder: Path) -> dict[Path, dict]:
    return {d: json.loads((d / "summary.json").read_text()) for d in sorted(folder.iterdir())
            if d.is_dir() and (d / "summary.json").is_file()}


def mb(x) -> str:
    return f"{x / 1e6:,.1f} MB" if isinstance(x, (int, float)) else "not counted"


def rows(folder: Path) -> list[str]:
    runs = summaries(folder)
    fits = {d: s for base in (runs, summaries(folder / "ring") if (folder / "ring").is_dir() else {})
            for d, s in base.items() if s.get("status") == "ok" and s.get("world_size") == 2}
    out = []
    for d, s in runs.items():
        if s.get("status") != "ok" or (s.get("world_size") or 1) < 3:
            continue
        source = folder / f"{s['framework']}-n1"
        if not (source / "summary.json").is_file():
            out.append(f"| {d.name} | no {source.name} beside it to predict from |")
            continue
        strategy = s.get("strategy", "ddp")
        bare = predicted_record(source, s, strategy)
        chosen = fit_runs(s, fits)
        fitted = predicted_record(source, s, strategy, chosen)
        on = ", ".join(f"{o.get('strategy', 'ddp')} ({o.get('backend')})" for _, o, *_ in chosen) or "none"
        state = s.get("state_bytes") or {}
        per_rank = max(map(sum, zip(*state.values()))) if state else None
        rss = max(s.get("peak_rss_bytes") or [0]) or None
        out.append(f"| {d.name} | {s.get('backend')} | {s['step_time_s']:.2f} | {100 * bare['step_error']:+.1f} % | "
                   f"{fitted['step_s']:.2f} ({100 * fitted['step_error']:+.1f} %) | {on} | {s['tokens_per_s']:,.0f} | "
                   f"{mb(per_rank)} | {mb(rss)} | {mb(s.get('comm_bytes_per_step'))} / "
                   f"{mb(s.get('comm_bytes_per_step_estimate'))} |")
    return out


def main(argv: list[str]) -> int:
    if not argv or any(not Path(a).is_dir() for a in argv):
        bad = next((a for a in argv if not Path(a).is_dir()), None)
        print(f"predict_runs.py: {'no folder ' + repr(bad) if bad else 'usage: predict_runs.py DIR [DIR ...]'}",
              file=sys.stderr)
        return 2
    print("| run | backend | step s | unfitted | fitted s (error) | fitted on | tokens/s | state per rank | "
          "peak RSS per rank | bytes per step, counted / estimate |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for folder in map(Path, argv):
        print("\n".join(rows(folder)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
