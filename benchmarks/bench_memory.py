"""Peak memory per rank under ddp, fsdp and tp: does a sharded strategy really hold less (issue 25)?

    python benchmarks/bench_memory.py [--frameworks mlx,torch] [--strategies ddp,fsdp,tp] [--layers 12,24]

For every model depth, framework and strategy, one `dpcompare run` of `base` at 2 ranks (vocabulary 50,000 as
the preset's, `model.n_kv_heads=4` so that tp can split the kv heads; `--layers 24` is the deeper variant),
a few steps of short sequences: peak RSS is dominated by the training state, not the activations. Reported
per rank, from summary.json:

    state MiB        parameters + gradients + AdamW moments the rank holds (Trainer.state_bytes)
    read MiB         bytes of the seed the rank read (weights_bytes_read; absent before issue 25)
    train RSS        peak RSS before the first checkpoint (start-up and training alone;
                     peak_rss_before_save_bytes, absent before issue 25)
    peak RSS         the process's peak RSS over the whole run, the final checkpoint included (whole HF
                     files unless --checkpoint-format sharded: streamed, one gathered tensor at a time)
    predicted        the cost model's peak per rank (memory_prediction, common/costmodel/memory.py)
    x ddp            the largest rank's figure over ddp's largest rank's, same framework and depth

Run it against an older checkout (its summary.json lacks the newer fields) to get the "before" figures.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import benchlib

MiB = 2**20


def run(work: Path, framework: str, strategy: str, layers: int, a, nproc: int = 2) -> dict:
    return benchlib.dpcompare_run(
        work / f"{framework}-{strategy}-{layers}-{nproc}", framework, nproc, "base", a.steps, a.seq_len, a.batch,
        extra=["--strategy", strategy, "--profile-steps", "0", "--set", "model.vocab_size=50000",
               "--set", "model.n_kv_heads=4", "--set", f"model.n_layers={layers}",
               "--checkpoint-format", a.checkpoint_format])


def row(framework: str, strategy: str, layers: int, s: dict) -> dict:
    n = int(s.get("world_size") or 1)
    state = [sum((s["state_bytes"][part][r] or 0) for part in ("params", "grads", "optimizer")) for r in range(n)]

    def per_rank(key):
        values = s.get(key) or [None] * n
        return [None if v is None else v / MiB for v in values]

    return {"framework": framework, "layers": layers, "strategy": strategy, "nproc": n,
            "state_MiB": [v / MiB for v in state], "read_MiB": per_rank("weights_bytes_read"),
            "train_rss_MiB": per_rank("peak_rss_before_save_bytes"), "peak_rss_MiB": per_rank("peak_rss_bytes"),
            "predicted_MiB": [v / MiB for v in (s.get("memory_prediction") or {}).get("peak_bytes") or []] or None,
            "load_average": benchlib.load_average()}


def ratio(values, base) -> float | None:
    if any(v is None for v in values + base):
        return None
    return max(values) / max(base)


def error(predicted, measured) -> str:
    if not predicted or any(v is None for v in measured):
        return "-"
    return " / ".join(f"{p / m - 1:+.0%}" for p, m in zip(predicted, measured))


def fmt(values) -> str:
    return " / ".join("-" if v is None else f"{v:,.0f}" for v in values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench/memory.json"))
    parser.add_argument("--frameworks", default="mlx,torch")
    parser.add_argument("--strategies", default="ddp,fsdp,tp", help="ddp first: the baseline of the ratios")
    parser.add_argument("--layers", default="12,24", help="model.n_layers of each variant (base: 12)")
    parser.add_argument("--steps", type=int, default=4,
                        help="torch ddp's peak settles from the third step (docs/benchmarks.md): 2 understates it")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--checkpoint-format", default="hf", choices=("hf", "sharded"),
                        help="the final checkpoint's format (hf: whole files, the default of dpcompare)")
    parser.add_argument("--with-one-rank", action="store_true", help="also ddp at 1 rank (the prediction's N=1)")
    parser.add_argument("--quick", action="store_true", help="run_all.py: the 12-layer model only")
    a = parser.parse_args()
    depths = [12] if a.quick else [int(n) for n in a.layers.split(",")]

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_memory_") as work:
        for layers in depths:
            for framework in a.frameworks.split(","):
                base = None
                if a.with_one_rank:  # the prediction at N=1 too (its ratios are not taken: N=2's ddp is the base)
                    one = row(framework, "ddp", layers, run(Path(work), framework, "ddp", layers, a, nproc=1))
                    one.update(train_rss_vs_ddp=None, peak_rss_vs_ddp=None, state_vs_ddp=None)
                    rows.append(one)
                    print(json.dumps(one), flush=True)
                for strategy in a.strategies.split(","):
                    r = row(framework, strategy, layers, run(Path(work), framework, strategy, layers, a))
                    base = base or r
                    r["train_rss_vs_ddp"] = ratio(r["train_rss_MiB"], base["train_rss_MiB"])
                    r["peak_rss_vs_ddp"] = ratio(r["peak_rss_MiB"], base["peak_rss_MiB"])
                    r["state_vs_ddp"] = ratio(r["state_MiB"], base["state_MiB"])
                    rows.append(r)
                    print(json.dumps(r), flush=True)
    print()
    print("| layers | framework | run | state MiB/rank | x ddp | read MiB/rank | train RSS MiB/rank | x ddp "
          "| peak RSS MiB/rank | x ddp | predicted peak MiB/rank | predicted vs measured |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        x = {k: "-" if r[k] is None else f"{r[k]:.2f}" for k in ("state_vs_ddp", "train_rss_vs_ddp", "peak_rss_vs_ddp")}
        print(f"| {r['layers']} | {r['framework']} | {r['strategy']} x{r['nproc']} | {fmt(r['state_MiB'])} | {x['state_vs_ddp']} "
              f"| {fmt(r['read_MiB'])} | {fmt(r['train_rss_MiB'])} | {x['train_rss_vs_ddp']} "
              f"| {fmt(r['peak_rss_MiB'])} | {x['peak_rss_vs_ddp']} | {fmt(r['predicted_MiB'] or [None])} "
              f"| {error(r['predicted_MiB'], r['peak_rss_MiB'])} |")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"machine": benchlib.env.machine(), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
