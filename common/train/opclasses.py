"""The model's op classes: their names, what each holds, the least time each can take, and which one explains
the speed gap between two runs. Framework-neutral; the workloads that time them are {mlx,torch}_impl/opclasses.py,
the timing loop common/train/opprofile.py, the table compare/report/opclass_table.py.

A class holds the forward and the backward of its ops over one optimizer step (every micro-batch), as the
training step runs them:
    matmul        the projections (q, k, v, o), the MLP (gate, up, down) and the output head as the trained
                  model has them: x W^T forward (LoRA: plus its adapters' products), the input's and the trained
                  parameters' gradients backward (a frozen base's weights get none)
    attention     the attention core: q k^T, the causal mask, the softmax over keys and its product with v, and
                  their gradients (torch's scaled_dot_product_attention is one fused kernel, so the softmax
                  inside attention stays here in both frameworks), with v's split into heads and the output's
                  merge back, as the model lays them out
    softmax/cross-entropy   the loss over the vocabulary: max, exp, sum and log of every logit, the target
                  logit, the masked sum, and the gradient of the logits (softmax minus one-hot)
    norms/activations/RoPE  the RMSNorms, the SiLU gate (x / (1 + exp(-x)) times up) and the rotary embedding of
                  q and k (from their split into heads, as the model reads them), forward and backward
    optimizer     the gradient norm, the clip and the AdamW update of every trained parameter
Under LoRA with adapters on the last blocks only (--lora-layers), the blocks below run forward alone, as in the
step. An exp of MLX's own, or any other change to exp, shows in softmax/cross-entropy, norms/activations/RoPE (SiLU)
and attention (its softmax), since their workloads call the model's own functions.

Outside the classes: the embedding lookup and its gradient (a scatter into the vocabulary x dim table), the
residual adds, the casts between the classes, the host's float64 loss sum, and the framework's dispatch
between ops. Timed apart, the classes also lose what the step fuses or overlaps
across their borders (MLX compiles the whole micro-step), so the outside share can be negative.

Lower bounds: matmul and attention at the measured fp32 matmul peak (the MFU denominator), the others at the
measured memory bandwidth: the bytes they must at least read and write once. Working sets that fit in a cache
can beat the memory bound (tiny's do); it is a floor for shapes that do not.
"""
from __future__ import annotations

from common.model.lora import FullModel, Trained
from common.model.spec import ModelSpec

OP_CLASSES = ("matmul", "attention", "softmax/cross-entropy", "norms/activations/RoPE", "optimizer")
# What bounds each class below: "flops" at the matmul peak, "bytes" at memory bandwidth.
BOUND_KIND = {"matmul": "flops", "attention": "flops", "softmax/cross-entropy": "bytes",
              "norms/activations/RoPE": "bytes", "optimizer": "bytes"}
OUTSIDE = ("embedding lookup and its gradient, residual adds, casts between the classes, the host's loss sum, "
           "framework dispatch; negative where the classes timed apart lose the fusion the compiled step has")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def class_work(spec: ModelSpec, micro_batch: int, seq_len: int, grad_accum: int, dtype: str,
               trained: Trained = FullModel()) -> dict[str, dict]:
    """{class: {"flops": FLOPs per step, "bytes": bytes it must move per step}} at a step's shapes, for what the
    step trains (`trained`, common/model/lora.py: every parameter, or LoRA's adapters).

    matmul: the trained object's count (6 N per token under full training, common/model/flops.py; under LoRA the
    frozen base gets no weight gradient). attention: 6 L T d per token, the causal half of flops.py's 12 L T d (a
    kernel that skips masked blocks does no more): 2 forward, 4 backward in each block the backward runs through
    (LoRA's lowest adapted one and up). The rest are the bytes read and written once: the float32 logits read
    and their gradient written (cross-entropy); per layer two norms (x, y forward; x, dy, dx backward), RoPE of q
    and k (x, y; dy, dx), the SiLU gate (gate, up, y; gate, up, dy, d gate, d up), in the compute dtype; AdamW
    reads each trained parameter, its gradient twice (the norm, then the update) and both moments, and writes
    the parameter and both moments, all float32."""
    tokens = micro_batch * seq_len * grad_accum
    size = DTYPE_BYTES.get(dtype, 4)
    d, f, L = spec.dim, spec.ffn_dim, spec.n_layers
    back = len(trained.blocks(spec))
    qk = (spec.n_heads + spec.n_kv_heads) * spec.head_dim
    forward, backward = 2 * 2 * d + 2 * qk + 3 * f, 2 * 3 * d + 2 * qk + 5 * f  # per layer
    return {
        "matmul": {"flops": trained.matmul_flops_per_token(spec) * tokens, "bytes": None},
        "attention": {"flops": (2.0 * L + 4.0 * back) * seq_len * spec.n_heads * spec.head_dim * tokens,
                      "bytes": None},
        "softmax/cross-entropy": {"flops": None, "bytes": 2.0 * 4 * spec.vocab_size * tokens},
        "norms/activations/RoPE": {"flops": None,
                                   "bytes": float(size * tokens * (L * forward + back * backward + 5 * d))},
        "optimizer": {"flops": None, "bytes": 8.0 * 4 * trained.trained_parameters(spec)},
    }


def lower_bound_s(work: dict, peak_flops: float | None, bandwidth_Bps: float | None) -> float | None:
    """A class's least time: its FLOPs at the matmul peak or its bytes at the memory bandwidth (None when that
    rate is unknown)."""
    if work.get("flops") is not None:
        return work["flops"] / peak_flops if peak_flops else None
    if work.get("bytes") is not None:
        return work["bytes"] / bandwidth_Bps if bandwidth_Bps else None
    return None


def largest_difference(fast: dict, slow: dict) -> dict | None:
    """The op class that accounts for most of the gap between two runs' op profiles (opprofile.py's records): the
    one the slower run spends most time on beyond the faster one (a class the faster run is slower at explains
    nothing of the gap, however large), with both times and its share of the gap between their steps:
    {class, fast_s, slow_s, gap_s, share}. share is the class's difference over the difference of the two
    reference steps (None when the slower run's step is not longer); it can pass 100 % where other classes go
    the other way. None without both profiles."""
    if not fast or not slow:
        return None
    a, b = fast.get("classes") or {}, slow.get("classes") or {}
    common = [c for c in OP_CLASSES if c in a and c in b]
    if not common:
        return None
    name = max(common, key=lambda c: b[c]["s"] - a[c]["s"])
    gap = (slow.get("reference_step_s") or 0.0) - (fast.get("reference_step_s") or 0.0)
    diff = b[name]["s"] - a[name]["s"]
    return {"class": name, "fast_s": a[name]["s"], "slow_s": b[name]["s"], "gap_s": gap,
            "share": diff / gap if gap > 0 else None}


def difference_sentence(d: dict | None, fast: str, slow: str) -> str | None:
    """largest_difference as the speed verdict says it: "softmax/cross-entropy: 1,950 ms in mlx vs 360 ms in
    torch, 76% of the gap"."""
    if d is None:
        return None
    share = f", {100 * d['share']:.0f}% of the gap" if d.get("share") is not None else ""
    return f"{d['class']}: {ms(d['slow_s'])} ms in {slow} vs {ms(d['fast_s'])} ms in {fast}{share}"


def ms(seconds: float) -> str:
    """Milliseconds with the digits that matter: 1,950 / 36.0 / 0.42."""
    value = 1e3 * seconds
    size = abs(round(value, 1))  # 99.99 prints as 100, not 100.0
    return f"{value:,.0f}" if size >= 100 else f"{value:.1f}" if size >= 1 else f"{value:.2f}"
