"""The mixed-precision policy, framework-neutral: what each dtype means, written once for both frameworks.

`--dtype float32` computes everything in float32. `--dtype bfloat16` is mixed precision, the same in MLX
and torch on every device (CPU included), written as explicit casts in mlx_impl/model.py and
torch_impl/model.py, line for line (torch autocast's per-op lists cannot be mirrored in MLX):

    float32   master weights, AdamW moments, checkpoints (the parameters never change dtype)
    bfloat16  every parameter as used by the forward (cast at use, `w.astype(x.dtype)`: the gradient of
              the cast lands in float32 on the master weight), matmul inputs and outputs, the embedding
              output and so the residual stream, attention q/k/v and output, the MLP, the logits
    float32   RMSNorm statistics (normalized in float32, rounded once, then times the bf16 weight, as
              HF Llama does), SiLU (evaluated in float32, rounded once), softmax accumulation inside
              the attention kernels, the logits cast up before the loss, the loss, the gradients and
              their all-reduce (the loss rides along)

Sharded strategies apply the same policy: `compute_dtype` is MLX `fully_shard(compute_dtype=...)` and
torch FSDP2 `MixedPrecisionPolicy(param_dtype=...)` (the gathered parameters are cast to it, which is what
the cast at use does, so the model's casts become no-ops), `reduce_dtype` the dtype of the gradient
reduce-scatter. The measurements behind DEFAULT_TOLERANCES are in docs/precision.md.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Policy:
    dtype: str                      # the --dtype value
    compute_dtype: str              # parameters as used, matmul inputs, activations, logits
    master_dtype: str = "float32"   # parameters, AdamW moments, checkpoints
    norm_dtype: str = "float32"     # RMSNorm statistics
    softmax_dtype: str = "float32"  # attention softmax accumulation (inside the fused kernels)
    loss_dtype: str = "float32"     # logits are cast to it before the cross-entropy
    reduce_dtype: str = "float32"   # gradients and their all-reduce / reduce-scatter, the loss with them


POLICIES = {
    "float32": Policy(dtype="float32", compute_dtype="float32"),
    "bfloat16": Policy(dtype="bfloat16", compute_dtype="bfloat16"),
}


def policy(dtype: str) -> Policy:
    return POLICIES[dtype]


def describe(dtype: str) -> dict:
    """What summary.json records as `precision`: the policy's dtypes and one line for the report."""
    p = policy(dtype)
    if p.compute_dtype == p.master_dtype:
        text = f"{p.dtype} throughout"
    else:
        text = (f"mixed: {p.compute_dtype} matmuls and activations (parameters cast at use); {p.master_dtype} "
                f"master weights and AdamW state, RMSNorm statistics, softmax accumulation, loss, gradient "
                f"all-reduce")
    return {**asdict(p), "policy": text}


# Default verdict tolerances per dtype, read by compare/report/parity.py. float32's are parity.Tolerances' own.
# bfloat16's come from docs/precision.md ("Measurements"): the largest value over 5 seeds of `tiny`
# (demo config, 200 steps; test config, 20 steps) and 2 seeds of `small` (TinyStories, 10 steps), times
# about 3-6, rounded up. Per-step differences shrink with more tokens per step (the loss averages the
# rounding): the 256-token test config gives the largest ones.
#   loss_atol / loss_rtol  per step over the first `parity_steps` steps, MLX vs torch (absolute / relative)
#   curve_rtol             moving averages (window `curve_window`) over all steps, MLX vs torch
#   eval_rtol              eval losses, MLX vs torch
#   dp_atol / dp_rtol      per step over the first `parity_steps` steps, N ranks vs 1 of the same framework
#   vs_fp32_curve_rtol     moving averages, a bf16 run vs the float32 run of the same framework, seed and data
#   vs_fp32_eval_rtol      eval losses, the same pair
DEFAULT_TOLERANCES = {
    "float32": {"loss_atol": 1e-4, "parity_steps": 20, "curve_rtol": 0.02, "curve_window": 10,
                "eval_rtol": 0.02, "dp_atol": 1e-4},
    "bfloat16": {
        "loss_rtol": 2e-3,            # measured max 3.7e-4 (test config, N=2)
        "parity_steps": 20,
        "curve_rtol": 5e-3,           # measured max 8.4e-4 (tiny demo config, N=2, 200 steps)
        "curve_window": 10,
        "eval_rtol": 5e-3,            # measured max 7.9e-4 (tiny demo config)
        "dp_rtol": 1e-3,              # measured max 1.6e-4 (test config, MLX)
        "vs_fp32_curve_rtol": 5e-3,   # measured max 1.3e-3 (tiny demo config, torch)
        "vs_fp32_eval_rtol": 5e-3,    # measured max 1.2e-3 (tiny demo config, torch)
    },
}


def default_tolerances(dtype: str) -> dict:
    return dict(DEFAULT_TOLERANCES[dtype])
