"""`dpcompare`: one CLI for preparing data, running one backend, comparing both, and reporting.

User mistakes (common.errors.UserError) become one line on stderr and exit code 2; a failed run exits 1;
a failed parity verdict under --strict exits 3.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from common.config import RunConfig
from common.errors import ParityError, UserError

# Flags shared by `run` and `compare`, each mapped onto the RunConfig field of the same name.
RUN_FLAGS = [
    ("--preset", str, "model preset: tiny, small (MLX blog), base (PyTorch DDP article)"),
    ("--steps", int, "total optimizer steps of the run"),
    ("--global-batch-size", int, "sequences per optimizer step, over all ranks"),
    ("--seq-len", int, "tokens per sequence"),
    ("--grad-accum", int, "micro-steps per optimizer step"),
    ("--lr", float, "peak learning rate (AdamW)"),
    ("--warmup-steps", int, "linear LR warmup steps"),
    ("--lr-decay-steps", int, "cosine horizon (default: --steps)"),
    ("--seed", int, "seed of the initial weights and the data order"),
    ("--dataset", str, "builtin, a local .txt/.jsonl/.parquet/save_to_disk dir, or a HF hub name"),
    ("--dataset-split", str, "split of a hub or save_to_disk dataset"),
    ("--text-field", str, "column holding the text"),
    ("--tokenizer", str, "builtin, a tokenizer dir or hub name (gpt2), or a tokenizer.json"),
    ("--sequence", str, "packing (default) or padding"),
    ("--strategy", str, "ddp (replicated, default), fsdp (sharded parameters, gradients, optimizer state)"),
    ("--backend", str, "distributed backend: auto, ring, mpi, nccl (mlx); auto, gloo, nccl (torch)"),
    ("--device", str, "auto, cpu, cuda, mps, gpu"),
    ("--dtype", str, "float32 (parity) or bfloat16 (torch autocast on CUDA)"),
    ("--threads-per-rank", int, "CPU threads per rank, the same for both frameworks"),
    ("--mlx-blas", str, "auto, system (preload OpenBLAS), bundled"),
    ("--all-reduce-size-mb", float, "MLX average_gradients bucket size"),
    ("--bucket-cap-mb", float, "torch DDP bucket size"),
    ("--hostfile", str, "MLX hostfile (JSON for ring, text for mpi); with --nnodes: every node's ring address"),
    ("--nnodes", int, "nodes of a job started node by node (torch: torchrun; MLX: ring, without ssh)"),
    ("--node-rank", int, "this node's rank with --nnodes (node 0 writes metrics.jsonl)"),
    ("--rdzv-endpoint", str, "torch: rendezvous HOST:PORT for several nodes"),
    ("--collective-timeout-s", float, "seconds without progress before a job is declared hung"),
    ("--eval-every", int, "steps between eval losses (0: only at the end)"),
    ("--checkpoint-every", int, "steps between checkpoints (0: only at the end)"),
    ("--tune-malloc", None, "glibc malloc that keeps freed memory: faster CPU steps, higher peak RSS"),
    ("--init-from", str, "start from this HF-format Llama dir instead of the seeded init"),
    ("--cache-dir", str, "where token caches and seed checkpoints live"),
]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except (UserError, ParityError) as err:
        print(f"dpcompare: error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("dpcompare: interrupted", file=sys.stderr)
        return 130


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own exit code is 2 too; keep its message to one line
        self.exit(2, f"dpcompare: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="dpcompare", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    doctor = sub.add_parser("doctor", help="what this machine can run: frameworks, devices, backends, BLAS")
    doctor.add_argument("--peak", action="store_true", help="also measure each framework's matmul peak")
    doctor.set_defaults(handler=cmd_doctor)

    prepare = sub.add_parser("prepare", help="tokenize a dataset into the shared token cache")
    prepare.add_argument("--dataset", default="builtin")
    prepare.add_argument("--tokenizer", default="builtin")
    prepare.add_argument("--dataset-split", default=None)
    prepare.add_argument("--text-field", default=None)
    prepare.add_argument("--config", help="TOML config file")
    prepare.add_argument("--out", dest="cache_dir", help="cache directory (default: the user cache)")
    prepare.add_argument("--quiet", action="store_true", default=None)
    prepare.set_defaults(handler=cmd_prepare)

    run = sub.add_parser("run", help="train one framework at one world size")
    run.add_argument("--framework", help="mlx or torch")
    run.add_argument("--nproc", type=int, help="ranks on this machine")
    add_run_flags(run)
    run.add_argument("--resume", action="store_true", default=None, help="continue from the latest checkpoint")
    run.set_defaults(handler=cmd_run)

    compare = sub.add_parser("compare", help="run both frameworks at several world sizes and report")
    compare.add_argument("--frameworks", default="mlx,torch", help="comma list, e.g. mlx,torch")
    compare.add_argument("--nproc", default="1,2", help="comma list of world sizes, e.g. 1,2")
    compare.add_argument("--strict", action="store_true", help="exit 3 when a parity verdict fails")
    add_tolerance_flags(compare)
    add_run_flags(compare)
    compare.set_defaults(handler=cmd_compare)

    report = sub.add_parser("report", help="rebuild the report from existing run directories")
    report.add_argument("runs", nargs="+", help="run directories, or a compare directory")
    report.add_argument("--out", help="where to write the report (default: the first argument)")
    report.add_argument("--strict", action="store_true")
    add_tolerance_flags(report)
    report.set_defaults(handler=cmd_report)

    export = sub.add_parser("export", help="export a run's latest checkpoint as an HF Llama directory")
    export.add_argument("run_dir")
    export.add_argument("--out", required=True)
    export.set_defaults(handler=cmd_export)
    return parser


def add_run_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML config file (flags override it)")
    for flag, kind, text in RUN_FLAGS:
        if kind is None:  # an on/off switch
            parser.add_argument(flag, action="store_true", default=None, help=text)
        else:
            parser.add_argument(flag, type=kind, help=text)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="any config field, e.g. --set model.n_layers=2 --set weight_decay=0")
    parser.add_argument("--out", help="output directory")
    parser.add_argument("--overwrite", action="store_true", default=None,
                        help="replace dpcompare's files in an output directory that holds a run")
    parser.add_argument("--quiet", action="store_true", default=None, help="no progress bars")


def add_tolerance_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--loss-atol", type=float, default=None, help="per-step loss tolerance (fp32)")
    parser.add_argument("--parity-steps", type=int, default=None, help="steps compared step by step")
    parser.add_argument("--curve-rtol", type=float, default=None, help="relative tolerance of whole curves")


def config_from_args(args, **fixed) -> RunConfig:
    overrides: dict = {}
    for flag, _, _ in RUN_FLAGS + [("--nproc", 0, 0), ("--out", 0, 0), ("--quiet", 0, 0), ("--overwrite", 0, 0),
                                   ("--resume", 0, 0), ("--framework", 0, 0)]:
        name = flag.lstrip("-").replace("-", "_")
        value = getattr(args, name, None)
        if value is not None and not (name == "nproc" and isinstance(value, str)):  # compare: a list
            overrides[name] = value
    for item in getattr(args, "set", []) or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise UserError(f"--set expects KEY=VALUE, got {item!r}")
        if key.startswith("model."):
            overrides.setdefault("model", {})[key[len("model."):]] = _parse_scalar(value)
        else:
            overrides[key] = value
    overrides.update({k: v for k, v in fixed.items() if v is not None})
    return RunConfig.from_sources(getattr(args, "config", None), overrides)


def _parse_scalar(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def cmd_doctor(args) -> int:
    from .doctor import doctor

    print(doctor(measure_peak=args.peak))
    return 0


def cmd_prepare(args) -> int:
    from common.tokencache import describe

    from .runner import prepare_inputs

    cfg = config_from_args(args)
    inputs = prepare_inputs(cfg)
    from common.tokencache import TokenCache

    print(describe(TokenCache.open(inputs.token_cache)))
    print(f"model spec for this tokenizer ({cfg.preset}): vocab_size={inputs.spec.vocab_size}")
    return 0


def cmd_run(args) -> int:
    from .runner import launch, prepare_inputs

    cfg = config_from_args(args)
    run_dir = Path(cfg.out or default_out(cfg))
    from common.strategy import check_strategy

    from .runner import check_hostfile, check_run_dir

    check_run_dir(run_dir, cfg.resume, cfg.overwrite)
    check_hostfile(cfg)
    check_strategy(cfg.strategy, cfg.model_spec(), cfg.world_size)  # before the tokenizer runs
    inputs = prepare_inputs(cfg)
    summary = launch(cfg, inputs, run_dir)
    return print_run_result(summary, run_dir)


def print_run_result(summary: dict, run_dir: Path) -> int:
    if summary["status"] != "ok":
        print(f"dpcompare: error: {summary['framework']} x{summary['world_size']}: {summary.get('error')} "
              f"(log: {run_dir / 'log.txt'})", file=sys.stderr)
        return 1
    tps = summary.get("tokens_per_s")
    rate = f"{tps:,.0f} tokens/s (median)" if tps is not None else "tokens/s: see node 0's metrics"
    loss = f"{summary['final_loss']:.4f}" if summary.get("final_loss") is not None else "n/a"
    print(f"{summary['framework']} x{summary['world_size']}: {summary['steps']} steps, final loss "
          f"{loss}, {rate}, wall {summary['wall_s']:.1f} s -> {run_dir}")
    return 0


def default_out(cfg: RunConfig) -> str:
    import time

    return f"runs/{cfg.framework}-n{cfg.world_size}-{time.strftime('%Y%m%d-%H%M%S')}"


def cmd_compare(args) -> int:
    from .matrix import run_matrix

    return run_matrix(args)


def cmd_report(args) -> int:
    from .matrix import rebuild_report

    return rebuild_report(args)


def cmd_export(args) -> int:
    import shutil

    from common.checkpoint import latest_checkpoint

    ckpt = latest_checkpoint(Path(args.run_dir))
    if ckpt is None:
        raise UserError(f"{args.run_dir} holds no checkpoint to export")
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise UserError(f"{out} exists and is not empty; choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy2(ckpt / name, out / name)
    print(f"exported {ckpt} -> {out} (loads with transformers.LlamaForCausalLM.from_pretrained)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
