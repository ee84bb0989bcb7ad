"""The cost model against measured runs: predicted and measured step time of every N=2 run, for ddp, fsdp
and tp in both frameworks, over loopback and over emulated links (`--link`, docs/links.md).

    python benchmarks/bench_links.py [--preset small] [--links none,1gbit,200mbit] [--steps 6] [--out runs/bench/links]

Each link is one `dpcompare compare --frameworks mlx,torch --nproc 1,2 --strategies ddp,fsdp,tp`: the N=1 ddp
run of each framework calibrates the model (its breakdown gives compute per token), and every N=2 run's
summary.json carries `prediction` (common/costmodel.py, made by compare from that N=1 run and the link the
N=2 job measured). The table prints both and their ratio; the model's target is within 15 %.
Needs root and iproute2 for the shaped links (loopback runs anywhere).
"""
from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import benchlib


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--links", default="none,1gbit,200mbit")
    parser.add_argument("--strategies", default="ddp,fsdp,tp")
    parser.add_argument("--frameworks", default="mlx,torch")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch-size", type=int, default=8)
    parser.add_argument("--out", default="runs/bench/links")
    args = parser.parse_args()
    rows = []
    for link in args.links.split(","):
        out = Path(args.out) / f"link-{link}"
        cmd = [*benchlib.DPCOMPARE, "compare", "--frameworks", args.frameworks, "--nproc", "1,2",
               "--strategies", args.strategies, "--preset", args.preset, *benchlib.data_args(args.preset),
               "--steps", str(args.steps), "--seq-len", str(args.seq_len),
               "--global-batch-size", str(args.global_batch_size), "--eval-every", "0", "--quiet",
               "--out", str(out), "--overwrite", *(["--link", link] if link != "none" else [])]
        print("$", " ".join(cmd), flush=True)
        subprocess.run(cmd, cwd=benchlib.REPO, check=False)
        for summary_path in sorted(out.glob("*/summary.json")):
            s = json.loads(summary_path.read_text())
            if s.get("world_size", 1) < 2 or s.get("status") != "ok":
                continue
            predicted = (s.get("prediction") or {}).get("step_s")
            measured = s["step_time_s"]
            allreduce = (s.get("link") or {}).get("allreduce") or {}
            rows.append({"link": link, "framework": s["framework"], "strategy": s["strategy"],
                         "allreduce_MBps": (allreduce.get("bandwidth_Bps") or 0) / 1e6,
                         "measured_s": measured, "predicted_s": predicted,
                         "ratio": predicted / measured if predicted else None,
                         "comm_share": (s.get("breakdown") or {}).get("communication", 0) / measured})
    benchlib.print_table(rows, [("link", "link", "s"), ("framework", "framework", "s"), ("strategy", "strategy", "s"),
                                ("allreduce_MBps", "all-reduce MB/s", ".1f"), ("measured_s", "measured s", ".3f"),
                                ("predicted_s", "predicted s", ".3f"), ("ratio", "predicted/measured", ".2f"),
                                ("comm_share", "exposed comm share", ".0%")],
                         title=f"{args.preset}, seq {args.seq_len}, batch {args.global_batch_size}, N=2")
    benchlib.write_result(Path(args.out) / "links.json", "links", vars(args), rows)


if __name__ == "__main__":
    main()
