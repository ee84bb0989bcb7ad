"""Run every benchmark, one after the other, each writing its JSON under --out (`make bench`).

    python benchmarks/run_all.py [--quick] [--out runs/bench] [--only overhead,blas]

--quick passes --quick to each (one run per measurement instead of several: ~15 min instead of ~60 min on
a 2-core machine). A benchmark that fails is reported and the others still run; the exit code says
whether all passed. Results and the commands behind docs/benchmarks.md: see that file.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHMARKS = ["data", "overhead", "blas", "collectives", "startup", "mfu", "malloc", "precision", "strategies", "tp", "ops", "gap",
              "pp_bubble", "plan", "rss_timeline", "restart", "recipes"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", default=",".join(BENCHMARKS), help="comma list of " + ", ".join(BENCHMARKS))
    args = parser.parse_args()

    failed = []
    for name in args.only.split(","):
        argv = [sys.executable, str(HERE / f"bench_{name}.py"), "--out", str(args.out / f"{name}.json")]
        if args.quick and name != "data":  # bench_data.py has no quick mode; it takes about a minute
            argv.append("--quick")
        print(f"\n=== {name}: {' '.join(argv[1:])}", flush=True)
        start = time.time()
        code = subprocess.run(argv).returncode
        print(f"=== {name}: {'ok' if code == 0 else f'FAILED (exit {code})'} in {time.time() - start:.0f} s", flush=True)
        if code:
            failed.append(name)
    print(f"\n{len(args.only.split(',')) - len(failed)} benchmark(s) ok" + (f", failed: {', '.join(failed)}" if failed else "")
          + f"; JSON under {args.out}/")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
