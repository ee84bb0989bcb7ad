"""What torch's AdamW update holds beside the state: the resident pages one update adds, in copies of a parameter
(common/costmodel/model_memory.py's UPDATE_TEMPORARIES, the "update" phase of `plan --model`'s memory).

    python benchmarks/bench_update_rss.py [--mb 10,1049]

Per size: two float32 parameters of that many MB with gradients, one step of torch_impl/adamw.py (the moments now
exist), then a second step measured by what it holds resident at its peak beyond what was resident before it
(common/metrics.py `held_at_peak_rss`: the kernel's high-water mark, each allocation mapped apart). Each size runs in a process of its own, so the first size's freed heap is not the second's.
Linux only (VmHWM). On the AMD EPYC Zen 5 (torch 2.13): 3.00 copies at 10 MB and at 1,049 MB.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def one(elements: int) -> float:
    """Copies of one parameter the second update adds to the resident pages."""
    import torch

    from common.metrics import held_at_peak_rss
    from torch_impl.adamw import AdamW

    params = [torch.nn.Parameter(torch.randn(elements)) for _ in range(2)]
    for p in params:
        p.grad = torch.randn(elements)
    opt = AdamW([{"params": params}], 1e-3, (0.9, 0.95), 1e-8, 0.1)
    opt.step()
    held = held_at_peak_rss(opt.step)
    if held is None:
        raise SystemExit("bench_update_rss.py: this system cannot say what a call holds (Linux and glibc only)")
    return held / (elements * 4)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", default="10,1049", help="parameter sizes in MB, comma-separated")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child: this many elements
    a = parser.parse_args()
    if a.one:
        print(f"{one(a.one):.2f}")
        return 0
    if not Path("/proc/self/clear_refs").exists():
        print("bench_update_rss.py: needs Linux's /proc/self/clear_refs", file=sys.stderr)
        return 2
    print("parameter MB  copies the update adds")
    for mb in (float(x) for x in a.mb.split(",")):
        elements = int(mb * 1e6 / 4)
        out = subprocess.run([sys.executable, __file__, "--one", str(elements)], cwd=REPO, capture_output=True,
                             text=True, check=True, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
        print(f"{mb:>12,.0f}  {out.stdout.strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
