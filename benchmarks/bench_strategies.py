"""What each rank holds and how fast it trains, per parallelism strategy: `dpcompare run --strategy S`.

    python benchmarks/bench_strategies.py [--strategies ddp,fsdp,tp,pp] [--link 1gbit] [--out runs/bench/strategies.json]

For every framework and strategy at N ranks, one run of the `base` preset (12 layers, dim 768, the
preset's 50,000-token vocabulary kept with `model.vocab_size` so the embedding and head are the size
they would be with a real tokenizer; the builtin corpus supplies the tokens). Reported per rank, from
summary.json: the bytes of parameters, gradients and optimizer state the rank holds (Trainer.state_bytes,
computed from its arrays), the peak RSS, and the median tokens/s; then each strategy's state bytes and
tokens/s against the first strategy's (ddp), and the bytes each rank sends per step: counted where the run
counts them (ddp, tp: `comm_bytes_per_step`; pp: each stage's activations and gradients), else the estimate
from the shapes (fsdp: `comm_bytes_per_step_estimate`, marked ~). `--link RATE` runs every rank in its own
network namespace behind a link shaped to RATE (issue 24's emulated links: root and `ip` needed).

`base` is large for a 2-core CPU (about 180M parameters, 2.9 GB of training state per DDP rank), so the
defaults are few steps, short sequences and a small batch: enough for the memory figures, which do not
depend on them, and a rough tokens/s. A strategy is one more name in --strategies (tp, once it exists).
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import benchlib

PARTS = ("params", "grads", "optimizer")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench/strategies.json"))
    parser.add_argument("--strategies", default="ddp,fsdp", help="the first is the baseline of the ratios")
    parser.add_argument("--frameworks", default="mlx,torch")
    parser.add_argument("--preset", default="base")
    parser.add_argument("--vocab-size", type=int, default=50000, help="model.vocab_size (base's own)")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=1, help="runs per (framework, strategy), alternated")
    parser.add_argument("--layers", type=int, default=0, help="model.n_layers (0: the preset's)")
    parser.add_argument("--kv-heads", type=int, default=6, help="model.n_kv_heads: base's 3 do not split over 2 tp "
                        "ranks, so every strategy gets the same 6 and trains the same model")
    parser.add_argument("--checkpoint-format", default="sharded", help="hf gathers the whole state on one rank "
                        "at the end, which would set fsdp's and tp's peak RSS; sharded writes each rank's own")
    parser.add_argument("--profile-steps", type=int, default=0, help="breakdown rounds (not needed for this table)")
    parser.add_argument("--link", default="", help="a shaped link between the ranks, e.g. 1gbit (default: loopback)")
    parser.add_argument("--quick", action="store_true", help="accepted for run_all.py; one run is the default")
    a = parser.parse_args()
    strategies = a.strategies.split(",")

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_strategies_") as work:
        for framework in a.frameworks.split(","):
            runs = {s: [] for s in strategies}
            for _ in range(a.repeats):
                for strategy in strategies:  # alternated, so load from other jobs hits all alike
                    benchlib.wait_for_quiet()
                    runs[strategy].append(benchlib.dpcompare_run(
                        Path(work) / f"{framework}-{strategy}", framework, a.nproc, a.preset, a.steps, a.seq_len,
                        a.batch, extra=["--strategy", strategy, "--set", f"model.vocab_size={a.vocab_size}",
                                        "--set", f"model.n_kv_heads={a.kv_heads}",
                                        *(["--set", f"model.n_layers={a.layers}"] if a.layers else []),
                                        "--profile-steps", str(a.profile_steps),
                                        "--checkpoint-format", a.checkpoint_format,
                                        *(["--link", a.link] if a.link else [])]))
            base = None
            for strategy in strategies:
                row = summarize(framework, strategy, runs[strategy], spec_of(a))
                base = base or row
                row["state_vs_first"] = row["state_MiB"] / base["state_MiB"]
                row["tokens_per_s_vs_first"] = row["tokens_per_s"] / base["tokens_per_s"]
                rows.append(row)
    benchlib.print_table(rows, [
        ("framework", "framework", ""), ("strategy", "strategy", ""), ("params_MiB", "params MiB", ".0f"),
        ("grads_MiB", "grads MiB", ".0f"), ("optimizer_MiB", "optim MiB", ".0f"), ("state_MiB", "state MiB", ".0f"),
        ("state_vs_first", f"vs {strategies[0]}", ".2f"), ("peak_rss_MiB", "peak RSS MiB/rank", ""),
        ("tokens_per_s", "tok/s", ".0f"), ("tokens_per_s_vs_first", f"vs {strategies[0]}", ".2f"),
        ("comm_MiB", "sent MiB/step", ""), ("peak_predicted", "predicted peak err", ""), ("reduce_scatter", "reduce-scatter", "")],
        title=f"strategies, {a.preset} (vocab {a.vocab_size}), N={a.nproc}, seq {a.seq_len}, global batch "
              f"{a.batch}, {a.steps} steps, {a.link or 'loopback'}; bytes per rank (the largest rank)")
    benchlib.write_result(a.out, "strategies", {**vars(a), "out": str(a.out)}, rows)


def spec_of(a):
    from common.model.spec import preset
    spec = preset(a.preset).with_(vocab_size=a.vocab_size, n_kv_heads=a.kv_heads)
    return spec.with_(n_layers=a.layers) if getattr(a, "layers", 0) else spec


def summarize(framework: str, strategy: str, summaries: list[dict], spec) -> dict:
    """Memory from the last run (it does not vary between runs), tokens/s as the median over runs."""
    s = summaries[-1]
    per_rank = {part: max(s["state_bytes"][part]) for part in PARTS}
    return {
        "framework": framework, "strategy": strategy, "reduce_scatter": s.get("reduce_scatter") or "-",
        **{f"{part}_MiB": per_rank[part] / 2**20 for part in PARTS},
        "state_MiB": sum(per_rank.values()) / 2**20, "state_bytes": s["state_bytes"],
        "peak_rss_MiB": " / ".join(f"{v / 2**20:.0f}" for v in s["peak_rss_bytes"]),
        "tokens_per_s": benchlib.median(r["tokens_per_s"] for r in summaries),
        "tokens_per_s_runs": [r["tokens_per_s"] for r in summaries],
        "comm_MiB": comm_mib(s, spec),
        # the cost model's predicted peak per rank against the measured one (compare/plan/predictions.py memory_record)
        "peak_predicted": " / ".join("-" if e is None else f"{e:+.0%}"
                                     for e in ((s.get("memory_prediction") or {}).get("error") or [])) or "-",
    }


def comm_mib(s: dict, spec) -> str:
    """Bytes a rank sends per step, as text: counted, or estimated from the shapes (~; fsdp: the cost model's
    collectives, common/parallel/fsdp.py)."""
    stages = [b for b in ((s.get("pipeline") or {}).get("comm_bytes_per_step") or []) if b is not None]
    if stages:
        return f"{max(stages) / 2**20:.1f}"
    if s.get("comm_bytes_per_step") is not None and s.get("strategy") != "fsdp":  # MLX fsdp counts only its
        # replicated gradients' all-reduce, torch fsdp nothing: its gathers run inside FSDP
        return f"{s['comm_bytes_per_step'] / 2**20:.1f}"
    estimate = s.get("comm_bytes_per_step_estimate")
    if estimate is None and s.get("strategy") == "fsdp":
        from common.costmodel.workload import Workload
        from common.parallel import collectives
        from common.parallel.fsdp import reduce_scatter_traffic
        cfg = s.get("config") or {}
        w = Workload(spec, int(cfg["seq_len"]), int(cfg["global_batch_size"]), int(cfg.get("grad_accum", 1)),
                     s.get("dtype", "float32"), s["framework"])
        n = int(s["world_size"])
        estimate = sum(c.wire_bytes(n) for c in collectives("fsdp", w, n, reduce_scatter_traffic(s["framework"], s["backend"])))
    return f"~{estimate / 2**20:.1f}" if estimate is not None else "-"


if __name__ == "__main__":
    main()
