"""The cost model's predictions on paper, for docs/scaling.md: fabrics Mac users have and an 8-GPU node.

    python benchmarks/plan_on_paper.py > /tmp/paper.md

Nothing is measured: compute comes from common/model/flops.py's FLOPs per token at an assumed fraction of a
published peak, links from the figures below. Every number's source or assumption is in docs/scaling.md,
and here next to it.
"""
from __future__ import annotations

from common.costmodel.calibrate import calibration_from_flops
from common.costmodel.links import Link
from common.costmodel.predict import predict
from common.costmodel.workload import Workload
from common.errors import UserError
from common.model.flops import KNOWN_PEAK_FLOPS
from common.model.spec import preset

GB = 1e9
# (name, Gbit/s each way, µs per hop, where the figures come from)
MAC_LINKS = [
    ("1 GbE", 0.94, 150, "line rate less TCP/IP headers at MTU 1500; latency: Geerling's ~300 µs TCP at N=2"),
    ("10 GbE", 9.4, 150, "the same for 10 GbE"),
    ("TB4 over IP", 16.4, 150, "iperf3 Mac to PC over a USB4 20/20 link (jiribrejcha.net, 2024); latency as TCP"),
    ("TB5 over IP", 32.8, 150, "ASSUMED 2x TB4's measured figure (no measured one found); latency as TCP"),
    ("TB5 RDMA (jaccl)", 80, 25, "ASSUMED the 80 Gb/s line rate; latency: Geerling's < 50 µs at N=2"),
]
GPU_LINKS = [
    ("NVLink 4 (H100 SXM)", 450 * 8, 5, "900 GB/s total per GPU, H100 datasheet; latency ASSUMED"),
    ("PCIe 5.0 x16", 64 * 8, 10, "PCIe 5.0 x16 spec, 64 GB/s each way; latency ASSUMED"),
]
MAC = ("Apple M2 Ultra (76-core GPU)", "fp32", 0.30)   # MFU ASSUMED
GPU = ("NVIDIA H100 SXM", "bf16", 0.40)                # MFU ASSUMED
WORKLOADS = {"small": (512, 32), "base": (1024, 64)}   # seq_len, global batch (sequences): ASSUMED


def table(device, links, preset_name: str, sizes: list[int], dtype: str) -> str:
    name, mode, mfu = device
    seq_len, batch = WORKLOADS[preset_name]
    w = Workload(preset(preset_name), seq_len, batch, dtype=dtype, framework="mlx" if "Apple" in name else "torch")
    achieved = KNOWN_PEAK_FLOPS[name][mode] * mfu
    cal = calibration_from_flops(w, achieved, f"{name} at {mfu:.0%} of its {mode} peak")
    base = predict(cal, "ddp", 1, None)
    lines = [f"**{preset_name}** ({w.tokens_per_step:,} tokens per step, {dtype}) on {name} at {mfu:.0%} of its "
             f"{mode} peak: one rank {base.step_s * 1e3:,.1f} ms per step, {base.tokens_per_s:,.0f} tokens/s.", "",
             "| link | strategy | " + " | ".join(f"N={n}" for n in sizes) + f" | bottleneck at N={sizes[-1]} |",
             "|---|---|" + "---|" * len(sizes) + "---|"]
    for link_name, gbit, hop_us, _ in links:
        link = Link.wire(gbit, hop_us, name=link_name)
        for strategy in ("ddp", "fsdp", "tp"):
            cells, last = [], None
            for n in sizes:
                try:
                    p = predict(cal, strategy, n, link, backend="ring" if w.framework == "mlx" else "nccl")
                    cells.append(f"{p.tokens_per_s / 1e3:,.0f}k ({100 * p.efficiency:.0f}%)")
                    last = p
                except UserError as err:
                    cells.append("–")
                    last = last or err
            why = last.bottleneck if hasattr(last, "bottleneck") else f"not possible: {str(last).split('; ')[0].split(': run on')[0]}"
            lines.append(f"| {link_name} | {strategy} | " + " | ".join(cells) + f" | {why} |")
    return "\n".join(lines)


def main() -> None:
    print("Cells: predicted tokens/s of the whole job (scaling efficiency against one rank).\n")
    for preset_name in WORKLOADS:
        print(table(MAC, MAC_LINKS, preset_name, [2, 4, 8], "float32") + "\n")
    for preset_name in WORKLOADS:
        print(table(GPU, GPU_LINKS, preset_name, [2, 4, 8], "bfloat16") + "\n")


if __name__ == "__main__":
    main()
