"""`dpcompare plan --from RUN --model M`: the model M (an HF folder's config.json, a config.json, a preset), what
trains (LoRA, a quantized base), its workload, and the block probe run in the calibration run's framework and
environment (common/costmodel/probed.py says how its figures become a step). model_plan.py predicts and prints.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from common.config import RunConfig
from common.costmodel.probed import RESULT_PREFIX, ProbeRequest, base_storage
from common.costmodel.workload import Workload
from common.errors import UserError
from common.model.lora import Trained, trained_parameters_of
from common.model.spec import PRESETS, ModelSpec

PROBE_TIMEOUT_S = 900


def add_model_flags(plan) -> None:
    """`plan`'s flags for a model the run did not train (compare/cli.py calls this on the plan parser)."""
    plan.add_argument("--rank-speed", metavar="R:F,...", help="ddp over ranks of unequal speed (1:0.5: rank 1 at half "
                      "speed): the step with even and with the best shares, and without the slowest rank")
    plan.add_argument("--model", metavar="M", help="predict this model instead of the run's: an HF Llama folder (only "
                      "its config.json is read), a config.json, or a preset name (docs/plan-model.md)")
    plan.add_argument("--frameworks", help="with --model: the frameworks to predict, each needing a --from run of its "
                                           "own (default: those of the --from runs)")
    plan.add_argument("--seq-len", type=int, help="with --model: tokens per sequence (default: the run's)")
    plan.add_argument("--global-batch-size", type=int, help="with --model: sequences per step (default: the run's)")
    plan.add_argument("--grad-accum", type=int, help="with --model: micro-steps per step (default: the run's)")
    plan.add_argument("--lora-rank", type=int, default=0, help="with --model: train LoRA adapters of this rank")
    plan.add_argument("--lora-alpha", type=float, default=0.0, help="LoRA's alpha (default 2 x rank)")
    plan.add_argument("--lora-targets", default="", help="LoRA's modules (default q_proj,v_proj)")
    plan.add_argument("--lora-layers", type=int, default=0, help="LoRA on the last K blocks only (default: every block)")
    plan.add_argument("--quantize-base", type=int, default=0, help="with --lora-rank: the frozen base in 4 or 8 bits")
    plan.add_argument("--quantize-group-size", type=int, default=64, help="a quantized base's group size (default 64)")


def resolve_model(text: str, start_dir: Path | None = None) -> tuple[ModelSpec, str, object]:
    """(spec, name, the storage a quantized folder brings or None) of --model: a preset name, an HF folder or a
    config.json; a one-line UserError for a folder without config.json or a field the project refuses (the
    refusals of --init-from: common/model/hfconfig.py)."""
    from common.model.hfconfig import from_hf_config

    if text in PRESETS:
        return PRESETS[text], text, None
    path = Path(start_dir or ".", text)  # a path resolves against where dpcompare started, as every path does
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise UserError(f"--model {text}: {path} not found: expected an HF-format Llama folder (only its "
                            "config.json is read) or a preset: " + ", ".join(PRESETS))
    elif not path.is_file():
        raise UserError(f"--model {text}: no such preset, folder or config.json (presets: {', '.join(PRESETS)})")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise UserError(f"{path} is not valid JSON: {err}") from None
    except OSError as err:
        raise UserError(f"--model {text}: cannot read {path}: {err.strerror}") from None
    if not isinstance(config, dict):
        raise UserError(f"{path} is not a config.json (a JSON object of model fields)")
    spec = from_hf_config(config)
    storage = None
    if config.get("quantization"):
        from common.model.quantize import folder_quantization

        storage = folder_quantization(path.parent)
    return spec, text, storage


def trained_of(args) -> Trained:
    rank = args.lora_rank or 0
    if rank < 0:
        raise UserError(f"--lora-rank must be 0 or positive, got {rank}")
    return trained_parameters_of(rank, args.lora_alpha or 0.0, args.lora_targets or "", args.lora_layers or 0)


def storage_of(args, from_folder):
    """The base's storage: --quantize-base, else what a quantized folder brings, else float32 (None)."""
    if args.quantize_base:
        if not args.lora_rank:
            raise UserError("a quantized base is frozen: --quantize-base needs --lora-rank R (QLoRA)")
        return base_storage(args.quantize_base, args.quantize_group_size)
    if from_folder is not None and not args.lora_rank:
        raise UserError("--model names a quantized folder, whose base is frozen: pass --lora-rank R (QLoRA)")
    return from_folder


def workload_for(args, spec: ModelSpec, run: Workload) -> Workload:
    """The model's workload: the run's sequence length, batch, accumulation, dtype and buckets unless given."""
    seq = args.seq_len or run.seq_len
    batch = args.global_batch_size or run.global_batch_size
    accum = args.grad_accum or run.grad_accum
    for name, value in (("seq-len", seq), ("global-batch-size", batch), ("grad-accum", accum)):
        if value < 1:
            raise UserError(f"--{name} must be positive, got {value}")
    if batch % accum:
        raise UserError(f"--global-batch-size {batch} does not divide into --grad-accum {accum} micro-steps")
    if seq > spec.max_seq_len:
        raise UserError(f"--seq-len {seq} is longer than the model's max_position_embeddings ({spec.max_seq_len})")
    return Workload(spec, seq, batch, accum, run.dtype, run.framework, run.bucket_bytes, None, run.pp_microbatches,
                    run.pp_schedule)


def run_environment(run_dir: Path, summary: dict) -> dict:
    """The environment a rank of the run had (threads, BLAS, MLX's kernels), rebuilt from its config: the probe
    runs in it. Threads alone where the config no longer reads (an older run)."""
    from compare.launch.launchers import rank_environment
    from compare.machine import environment as env

    config = (json.loads((run_dir / "run_config.json").read_text()) if (run_dir / "run_config.json").is_file()
              else {}).get("config") or summary.get("config") or {}
    try:
        extra, _ = rank_environment(RunConfig.from_dict(config))
    except (UserError, TypeError, ValueError, OSError):
        extra = env.thread_env(int(summary.get("threads_per_rank") or 1))
    return env.child_env(extra)


def run_probe(framework: str, req: ProbeRequest, environment: dict) -> dict:
    """The probe's figures (common/costmodel/probed.py), run as `python -m {framework}_impl.block_probe`."""
    from compare.machine.peak import PROJECT_ROOT

    with tempfile.TemporaryDirectory(prefix="dpcompare-probe-") as tmp:
        request = Path(tmp) / "request.json"
        request.write_text(json.dumps(req.to_json()))
        argv = [sys.executable, "-m", f"{framework}_impl.block_probe", str(request)]
        try:
            out = subprocess.run(argv, capture_output=True, text=True, env=environment, cwd=PROJECT_ROOT,
                                 timeout=PROBE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise UserError(f"the {framework} block probe took over {PROBE_TIMEOUT_S} s; try a shorter --seq-len") \
                from None
    lines = [line for line in out.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if out.returncode != 0 or not lines:
        tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"the {framework} block probe failed (exit {out.returncode}): {tail}")
    return json.loads(lines[-1][len(RESULT_PREFIX):])


def exp_of(summary: dict) -> str:
    """The exp MLX's run used (its BLAS line names it), for the probe to use the same."""
    return "fused" if "exp: fused" in str(summary.get("blas") or "") else "native"


def cross_entropy_of(summary: dict) -> str:
    """The cross-entropy shift MLX's run used (its BLAS line: `cross-entropy shift: tree_shift (measured ...)`)."""
    m = re.search(r"cross-entropy shift: (\w+)", str(summary.get("blas") or ""))
    return m.group(1) if m else "native"


def memory_warning(cfg: RunConfig, spec: ModelSpec) -> str | None:
    """`dpcompare run`'s one line before any rank starts, where the predicted peak of the ranks this machine runs
    (common/costmodel/model_memory.py, its framework overhead and the head's logits from constants) exceeds its
    memory; None where it fits, the ranks run elsewhere (a hostfile) or the machine does not say its memory. It
    warns; it does not refuse."""
    from common.costmodel.model_memory import HEAD_LOGITS_UNPROBED, machine_memory_bytes, model_memory, op_profile_bytes
    from common.costmodel.workload import BUCKET_FIELD

    machine = machine_memory_bytes()
    if machine is None or cfg.hostfile or str(cfg.device).startswith(("cuda", "gpu", "mps")):
        return None
    bucket_mb = getattr(cfg, BUCKET_FIELD.get(cfg.framework, "bucket_cap_mb"), None)
    w = Workload(spec, cfg.seq_len, cfg.global_batch_size, cfg.grad_accum, cfg.dtype, cfg.framework,
                 int(bucket_mb * 2**20) if bucket_mb else None, head_held=(HEAD_LOGITS_UNPROBED, 0.0))
    try:
        per_rank = model_memory(cfg.layout, w, cfg.trained, getattr(cfg, "base_storage", None))
    except (UserError, ValueError, KeyError, ZeroDivisionError):
        return None
    here = max(1, cfg.world_size // max(1, cfg.nnodes))
    # a one-rank run's op classes, timed after training, hold a copy of the gradients
    profile = op_profile_bytes(cfg.layout, w, cfg.trained) if cfg.op_profile else 0.0
    if profile:
        per_rank = {**per_rank, "op profile": profile, "total": per_rank["total"] + profile}
    if per_rank["total"] * here <= machine:
        return None
    big = max((k for k in per_rank if k not in ("total",)), key=lambda k: per_rank[k])
    return (f"predicted peak {per_rank['total'] / 1e9:.1f} GB per rank x {here} rank(s) here exceeds the "
            f"{machine / 1e9:.1f} GB this machine has available (largest part: {big} {per_rank[big] / 1e9:.1f} GB"
            + (f"; {profile / 1e9:.1f} GB of it the op profile after training: --no-op-profile leaves it out"
               if profile else "")
            + "); it may fail out of memory: `dpcompare plan --model` names a layout that fits")
