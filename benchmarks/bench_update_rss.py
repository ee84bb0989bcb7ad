"""What torch's AdamW update holds beside the state: the resident pages one update adds, in copies of a parameter
(common/costmodel/model_memory.py's UPDATE_TEMPORARIES, the "update" phase of `plan --model`'s memory).

    python benchmarks/bench_update_rss.py [--mb 10,1049]

Per size: two float32 parameters of that many MB with gradients, one step of torch_impl/adamw.py (the moments now
exist), then the kernel's high-water mark is cleared (/proc/self/clear_refs) and a second step is timed by what it
adds to the resident set. Each size runs in a process of its own, so the first size's freed heap is not the second's.
Linux only (VmHWM). On the AMD EPYC Zen 5 (torch 2.13): 3.00 copies at 10 MB and at 1,049 MB.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _status_kb(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def one(elements: int) -> float:
    """Copies of one parameter the second update adds to the resident pages."""
    import torch

    from torch_impl.adamw import AdamW

    params = [torch.nn.Parameter(torch.randn(elements)) for _ in range(2)]
    for p in params:
        p.grad = torch.randn(elements)
    opt = AdamW([{"params": params}], 1e-3, (0.9, 0.95), 1e-8, 0.1)
    opt.step()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM back to VmRSS
    before = _status_kb("VmRSS")
    opt.step()
    return (_status_kb("VmHWM") - before) * 1024 / (elements * 4)


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
