"""Command-line flags shared by `run`, `compare` and `report`, and the RunConfig they build.

Its own module so that cli.py (the parsers) and matrix.py (the comparison) both import it, and neither
imports the other.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from common.config import RunConfig
from common.config_sources import check_preset_matches_folder, read_toml
from common.errors import UserError
from common.paths import CONFIG_PATHS, resolve

# Flags shared by `run` and `compare`, each mapped onto the RunConfig field of the same name.
RUN_FLAGS = [
    ("--preset", str, "model preset: tiny, small (MLX blog), base (PyTorch DDP article)"),
    ("--steps", int, "total optimizer steps of the run"),
    ("--global-batch-size", int, "sequences per optimizer step, over all ranks"),
    ("--seq-len", int, "tokens per sequence"),
    ("--grad-accum", int, "micro-steps per optimizer step"),
    ("--rank-shares", str, "ddp: each rank's weight of every global batch, W1,W2,... in whole sequences (3,1: rank 0 "
                           "takes 3/4), or auto (one even step timed per rank first; docs/uneven.md)"),
    ("--rank-speed", str, "emulate slow ranks, RANK:FACTOR,... (1:0.5: rank 1 computes at half speed, paused by "
                          "the launcher's SIGSTOP/SIGCONT duty cycle; docs/uneven.md)"),
    ("--lr", float, "peak learning rate (AdamW)"),
    ("--warmup-steps", int, "linear LR warmup steps"),
    ("--lr-decay-steps", int, "cosine horizon (default: --steps)"),
    ("--seed", int, "seed of the initial weights and the data order"),
    ("--dataset", str, "builtin, a local .txt/.jsonl/.parquet/save_to_disk dir, or a HF hub name"),
    ("--dataset-split", str, "split of a hub or save_to_disk dataset"),
    ("--text-field", str, "column holding the text"),
    ("--mask-prompt", None, "instruction data (.jsonl of prompt/completion or messages records): the loss on the "
                            "completion's tokens only, as mlx-lm's --mask-prompt"),
    ("--tokenizer", str, "builtin, a tokenizer dir or hub name (gpt2), or a tokenizer.json"),
    ("--sequence", str, "packing (default) or padding"),
    ("--loss-normalization", str, "global-tokens (default: the summed token losses over the global count, what "
                                  "one rank computes) or per-rank (each rank's own mean, then averaged: mlx-lm's)"),
    ("--recipe", str, "a tool's whole set of training choices: dpcompare (default), mlx-lm, peft, trl; each flag "
                      "below overrides it (docs/recipes.md)"),
    ("--data-order", str, "dpcompare (default: one seeded stream, each rank a contiguous slice) or mlx-lm "
                          "(length-sorted batches in a seeded order, rank r takes r, r + N, ...)"),
    ("--mask-convention", str, "padded rows: exact (default: the real targets) or mlx-lm (one padding target more "
                               "a row, as mlx-lm's default_loss)"),
    ("--padding-rule", str, "padded rows' width: seq-len (default), longest (the micro-batch's longest row: "
                            "transformers, trl) or mlx-lm (1 + 32 ceil(max / 32))"),
    ("--optimizer", str, "adamw (default) or adam (no weight decay: mlx-lm's)"),
    ("--bias-correction", "switch", "Adam's moments divided by 1 - beta^t (default, torch's; --no-bias-correction: "
                                    "MLX's and mlx-lm's default)"),
    ("--lr-schedule", str, "cosine (default: warmup, cosine to --set min_lr_ratio), linear (transformers': warmup, "
                           "then to 0) or constant (mlx-lm's)"),
    ("--grad-clip", float, "clip the global gradient norm to this (0: off, mlx-lm's)"),
    ("--weight-decay", float, "AdamW's decoupled weight decay"),
    ("--beta1", float, "Adam's beta1"),
    ("--beta2", float, "Adam's beta2"),
    ("--adam-eps", float, "Adam's eps"),
    ("--lora-scale-convention", str, "how --lora-alpha is read: alpha-over-rank (default, peft's: scale = alpha / "
                                     "rank) or direct (mlx-lm's: --lora-alpha is the scale)"),
    ("--lora-rank", int, "train LoRA adapters of this rank beside a frozen base (0, the default: every parameter "
                         "trains); ddp only for now (docs/strategies.md)"),
    ("--lora-alpha", float, "LoRA scale = alpha / rank, as peft's (default: 2 x rank)"),
    ("--lora-targets", str, "LoRA's modules, HF names: q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj "
                            "(default q_proj,v_proj)"),
    ("--lora-layers", int, "LoRA on the last K blocks only (default 0: every block)"),
    ("--quantize-base", int, "QLoRA: hold the frozen base in 4 or 8 bits, MLX's affine quantization (default 0: "
                             "float32; needs --lora-rank; docs/finetuning.md)"),
    ("--quantize-group-size", int, "weights sharing one scale and bias in a quantized base: 32, 64 (default) or 128"),
    ("--strategy", str, "ddp (replicated), zero1 or zero2 (ddp with sharded optimizer state, zero2: and gradients), "
                       "fsdp (sharded), tp (tensor parallel), pp (pipeline) or cp (sequence: context parallel)"),
    ("--mesh", str, "strategies composed over named axes, AXIS=SIZE,... with axes dp, fsdp, tp, pp, cp (dp=2,tp=2; their "
                    "product is the rank count); laid out pp outermost, tp innermost (docs/strategies.md)"),
    ("--pp-microbatches", int, "pp: micro-batches each micro-step's batch is cut into (default: the largest count "
                               "up to 4 that divides it, at least one per stage for torch)"),
    ("--pp-schedule", str, "pp: gpipe or 1f1b (default)"),
    ("--cp-attention", str, "cp: ulysses (default: all-to-alls over heads around attention) or ring (K/V blocks "
                            "passed around the cp ranks, zig-zag split; docs/strategies.md)"),
    ("--backend", str, "distributed backend: auto, ring, mpi, nccl (mlx); auto, gloo, nccl (torch)"),
    ("--device", str, "auto, cpu, cuda, mps, gpu"),
    ("--dtype", str, "float32, or bfloat16: mixed precision, the same policy in both frameworks on every "
                     "device (docs/precision.md)"),
    ("--threads-per-rank", int, "CPU threads per rank, the same for both frameworks"),
    ("--mlx-blas", str, "auto (the fastest that works here, measured), wheel (the OpenBLAS wheel), system (a system OpenBLAS), bundled (MLX's reference BLAS)"),
    ("--mlx-cpu-jit", str, "auto, native (MLX's fused CPU kernels built with -march=native), baseline"),
    ("--mlx-exp", str, "auto (on a Linux CPU the faster of the two, timed here at the run's shapes and cached), "
                       "native (MLX's exp), fused (range reduction and a polynomial that mx.compile vectorises)"),
    ("--mlx-bf16-matmul", str, "bf16 matmuls on a CPU: auto (the faster, timed here and cached), native (MLX's "
                               "bf16 kernel), fp32 (exact upcast, the BLAS's sgemm, rounded once)"),
    ("--all-reduce-size-mb", float, "MLX average_gradients bucket size"),
    ("--bucket-cap-mb", float, "torch DDP bucket size"),
    ("--hostfile", str, "MLX hostfile (JSON for ring, text for mpi); with --nnodes: every node's ring address"),
    ("--nnodes", int, "nodes of a job started node by node (torch: torchrun; MLX: ring, without ssh)"),
    ("--node-rank", int, "this node's rank with --nnodes (node 0 writes metrics.jsonl)"),
    ("--rdzv-endpoint", str, "torch: rendezvous HOST:PORT for several nodes"),
    ("--link", str, "emulate a link of this rate between the local ranks: 200mbit, 1gbit, 10gbit (root, Linux; "
                    "each rank in a network namespace, tc-shaped both ways); with --link-inner: between groups"),
    ("--link-inner", str, "two-level link: the rate inside each group of --group-size ranks (one machine of a "
                          "cluster), --link the rate between the groups (docs/links.md)"),
    ("--group-size", int, "two-level link: ranks per group (consecutive ranks; must divide --nproc)"),
    ("--link-probe", "switch", "time the job's own all-reduce before training, the cost model's link (default; "
                               "--no-link-probe: skip it, 0.2-0.9 s on loopback, up to 15 s over a slow link)"),
    ("--launcher", str, "auto (srun inside a Slurm allocation, else this machine's launchers), local, or slurm "
                       "(docs/clusters.md)"),
    ("--collective-timeout-s", float, "seconds without progress before a job is declared hung"),
    ("--max-restarts", int, "restart the job from its latest checkpoint after a rank dies, hangs or fails, at most "
                            "this many times (default 0; docs/faults.md)"),
    ("--min-nproc", int, "with --max-restarts: go on with fewer ranks, down to this many, at the same global "
                         "batch when the job cannot get --nproc back"),
    ("--eval-every", int, "steps between eval losses (0: only at the end)"),
    ("--checkpoint-every", int, "steps between checkpoints (0: only at the end)"),
    ("--checkpoint-format", str, "hf (default: whole HF files, written by rank 0) or sharded (every rank writes "
                                 "its own shards plus an index; resume and export read both)"),
    ("--profile-steps", int, "rounds of extra steps after the run for the time breakdown (0: none)"),
    ("--op-profile", "switch", "at N=1, time the model's op classes after the run (default; --no-op-profile: "
                               "skip it): the report's op-class table (docs/profiling.md)"),
    ("--trace", None, "then trace 2 more steps per rank: RUN_DIR/trace/rank{R}.json for ui.perfetto.dev "
                      "(torch.profiler; MLX: phase spans, plus an Xcode .gputrace on Metal)"),
    ("--pin-ranks", "switch", "where one machine's ranks outnumber its cores, pin them as their framework does best "
                             "(MLX: one core each, round-robin; torch: the kernel's choice) (default; "
                             "--no-pin-ranks: the kernel places every rank) (docs/running.md)"),
    ("--tune-malloc", None, "glibc malloc that keeps freed memory: faster CPU steps, higher peak RSS (torch fsdp "
                            "then skips its heap releases)"),
    ("--init-from", str, "start from this HF-format Llama dir (its config.json sets the model, its tokenizer "
                         "the tokenizer unless --tokenizer names one) instead of the seeded init"),
    ("--cache-dir", str, "where token caches and seed checkpoints live"),
    ("--report-to", str, "tensorboard, wandb, trackio (comma list): each run's metrics, written after the run"),
]



# The path-valued flags of `run`, `compare` and `diagnose`: dest -> (flag, kind of path, common/paths.py).
RUN_PATHS = {"config": ("--config", "config"), "out": ("--out", "out_dir"),
             **{key: ("--" + key.replace("_", "-"), kind) for key, kind in CONFIG_PATHS.items() if key != "out"}}
BASELINE_PATHS = {"against": ("--against", "file"), "save_baseline": ("--save-baseline", "out_file")}
# Configs that ship inside the package: `--config demo` from any directory, installed or not.
BUILTIN_CONFIGS = Path(__file__).resolve().parent / "configs"


def resolve_paths(args: argparse.Namespace, start_dir: Path) -> None:
    """Every path the command was given, made absolute against `start_dir` (where dpcompare was started)
    and checked, in place: the command's `paths` ({dest: (flag, kind)}, set on its parser) and the path
    fields of --set. Defaults the commands choose later resolve against `args.start_dir`."""
    args.start_dir = start_dir
    for dest, (flag, kind) in getattr(args, "paths", {}).items():
        value = getattr(args, dest, None)
        if value is None:
            continue
        if kind == "config":
            setattr(args, dest, resolve_config_file(value, start_dir))
        elif isinstance(value, list):  # positional run directories
            setattr(args, dest, [resolve(v, start_dir, kind, flag) for v in value])
        else:
            setattr(args, dest, resolve(value, start_dir, kind, flag))
    for i, item in enumerate(getattr(args, "set", None) or []):
        key, sep, value = item.partition("=")
        if sep and key in CONFIG_PATHS:
            args.set[i] = f"{key}={resolve(value, start_dir, CONFIG_PATHS[key], f'--set {key}')}"


def resolve_config_file(typed: str, start_dir: Path) -> str:
    """--config FILE.toml, or the name of a config that ships with dpcompare (`--config demo`)."""
    builtin = BUILTIN_CONFIGS / f"{typed}.toml"
    if not Path(start_dir, typed).exists() and "/" not in typed and not typed.endswith(".toml") \
            and builtin.is_file():
        return str(builtin)
    try:
        return resolve(typed, start_dir, "file", "--config")
    except UserError as err:
        names = ", ".join(sorted(p.stem for p in BUILTIN_CONFIGS.glob("*.toml")))
        raise UserError(f"{err}; built-in configs: {names or 'none'}") from None


def add_run_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML config file (flags override it; its paths are relative to it), "
                                         "or a built-in one: demo")
    for flag, kind, text in RUN_FLAGS:
        if kind is None:  # an on/off switch
            parser.add_argument(flag, action="store_true", default=None, help=text)
        elif kind == "switch":  # on by default: --no-X turns it off
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=text)
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


def add_baseline_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--save-baseline", metavar="FILE.json",
                        help="keep every run's per-step losses, grad norms, eval losses and config fingerprint")
    parser.add_argument("--against", metavar="FILE.json",
                        help="judge each run against the baseline run of its framework, strategy and world "
                             "size (--strict: exit 3 when one departs)")


def config_from_args(args, base: dict | None = None, **fixed) -> RunConfig:
    """Defaults (or `base`, a config dict) < --config TOML < flags < `fixed`."""
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
    # --init-from takes the model from its folder: a preset named too (flag or TOML) must agree with it.
    toml = read_toml(args.config) if getattr(args, "config", None) else {}
    named_preset = overrides.get("preset") or toml.get("preset")
    init_from = overrides.get("init_from") or toml.get("init_from") or (base or {}).get("init_from")
    if named_preset and init_from:
        check_preset_matches_folder(named_preset, init_from)
    if base is not None:
        values = {**base, **toml, **overrides}
        values["model"] = {**base.get("model", {}), **toml.get("model", {}), **overrides.get("model", {})}
        return RunConfig.from_dict(values)
    return RunConfig.from_sources(getattr(args, "config", None), overrides)


def _parse_scalar(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)
