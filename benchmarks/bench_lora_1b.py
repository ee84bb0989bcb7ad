"""LoRA and QLoRA at a real size: a folder of Llama-3.2-1B's full published shape (16 layers, 2048 wide, the 128256
vocabulary, tied embeddings, llama3 rope; seeded random weights, since nothing can be downloaded here), fine-tuned
with LoRA in both frameworks at N=1 and N=2, on a float32 base and on a 4-bit base. Prints, per run, seconds per
step (median of the timed steps), peak RSS per rank and the frozen base each rank holds, and the parity figures
(MLX vs torch, N=2 vs N=1). A benchmark, not a test: the 1B runs take minutes and ~15 GB at N=2.

    .venv/bin/python benchmarks/bench_lora_1b.py --out runs/bench-lora-1b [--steps 5] [--quantize 0,4]

The folder is written once into OUT (5 GB) and reused; each base is one `dpcompare compare` of four runs into
OUT/q{bits}, whose report.md holds the full tables. docs/benchmarks.md has the figures and their machine.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
SHARED = ROOT.parent / "shared" / "data"


def write_folder(folder: Path) -> Path:
    """config.json with Llama-3.2-1B's published values and model.safetensors from the project's seeded init."""
    from common.model.hfconfig import from_hf_config
    from common.model.weights import init_weights, save_pretrained
    from pretrained_folder import REAL_CONFIGS

    if (folder / "model.safetensors").is_file():
        return folder
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **REAL_CONFIGS["llama-3.2-1b"]}
    spec = from_hf_config(config)
    print(f"writing {folder} (Llama-3.2-1B's shape, seeded random weights)", flush=True)
    save_pretrained(folder, spec, init_weights(spec, 0))
    return folder


def compare(folder: Path, out: Path, bits: int, steps: int, nproc: str) -> None:
    if (out / "summary.json").is_file():
        return
    cmd = [str(ROOT / ".venv" / "bin" / "dpcompare"), "compare", "--init-from", str(folder),
           "--dataset", str(SHARED / "tinystories" / "train.txt"), "--tokenizer", str(SHARED / "gpt2"),
           "--lora-rank", "8", "--lora-targets", "q_proj,v_proj", "--seq-len", "128", "--global-batch-size", "4",
           "--steps", str(steps), "--warmup-steps", "1", "--eval-every", "0",
           "--profile-steps", "0", "--no-op-profile", "--no-samples", "--collective-timeout-s", "900", "--frameworks", "mlx,torch",
           "--nproc", nproc, "--out", str(out), "--overwrite", *(("--quantize-base", str(bits)) if bits else ())]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=False)  # a failed run is in the table too (its log says why)


def table(out: Path, bits: int) -> list[str]:
    rows = []
    verdicts = json.loads((out / "summary.json").read_text())["verdicts"]["pairs"]
    for run in sorted(p for p in out.iterdir() if (p / "summary.json").is_file()):
        s = json.loads((run / "summary.json").read_text())
        if s.get("status") != "ok":
            rows.append(f"| {'4-bit' if bits else 'fp32'} | {run.name} | {s.get('status')}: see its log.txt | | | |")
            continue
        times = [json.loads(line)["step_time_s"] for line in (run / "metrics.jsonl").read_text().splitlines()
                 if '"step_time_s"' in line][1:]  # the first step compiles
        base = [(w - s["state_bytes"]["params"][0]) / 2**20 for w in s["weights_bytes_read"] if w is not None]
        rss = " / ".join(f"{m / 2**20:,.0f}" for m in s.get("peak_rss_bytes") or [] if m) or "–"
        rows.append(f"| {'4-bit' if bits else 'fp32'} | {run.name} | {statistics.median(times):.2f} | {rss} | "
                    f"{base[0]:,.0f} | {s['final_loss']:.4f} |")
    for p in verdicts:
        rows.append(f"| {'4-bit' if bits else 'fp32'} | {p['pair']} | per-step max Δloss {p['per_step']} | "
                    f"{p['verdict']} | | |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-lora-1b")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--nproc", default="1,2")
    parser.add_argument("--quantize", default="0,4", help="base bits to run: 0 (float32), 4, 8")
    args = parser.parse_args()
    folder = write_folder(args.out / "llama-3.2-1b-shape")
    lines = ["| base | run | s/step (median) | peak RSS MB/rank | base MB/rank | final loss |", "|---|---|---|---|---|---|"]
    for bits in (int(b) for b in args.quantize.split(",")):
        compare(folder, args.out / f"q{bits}", bits, args.steps, args.nproc)
        lines += table(args.out / f"q{bits}", bits)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
