"""Training FLOPs per token and model FLOPs utilisation (MFU), framework-neutral.

The count is PaLM's (Chowdhery et al. 2022, appendix B), the one nanoGPT and torchtitan report:

    flops_per_token = 6 * N  +  12 * n_layers * seq_len * dim

    6 * N        forward (2 FLOPs per multiply-add) plus backward (twice the forward) through every
                 weight matrix a token is multiplied with. N counts q/k/v/o, gate/up/down and the
                 output projection (lm_head, or the tied embedding acting as one); the input embedding
                 is a table lookup and RMSNorm gains are elementwise, so neither is counted.
    12 * L*T*d   attention scores (Q K^T) and the weighted sum (A V): 2 matmuls of T x d per query
                 token and layer, times 2 FLOPs, times 3 for forward + backward. Like PaLM it ignores
                 the causal mask (no halving), so MFU stays comparable with published numbers.
"""
from __future__ import annotations

import re

from common.model.spec import ModelSpec

T = 1e12  # peaks below are quoted in TFLOPS

# Dense (no 2:4 sparsity) peaks in FLOP/s. "fp32" is plain FP32 on CUDA cores (torch's default for
# float32 matmuls: TF32 is off unless allowed); "bf16" is tensor-core BF16 with FP32 accumulation.
# None: the chip has no such mode.
KNOWN_PEAK_FLOPS: dict[str, dict[str, float | None]] = {
    # NVIDIA datasheets; they quote sparse tensor rates, the dense rate is half of those.
    "NVIDIA H100 SXM": {"fp32": 67 * T, "bf16": 989.4 * T},     # H100 datasheet (1979 sparse)
    "NVIDIA H100 PCIe": {"fp32": 51.2 * T, "bf16": 756 * T},    # H100 datasheet (1513 sparse)
    "NVIDIA H100 NVL": {"fp32": 60 * T, "bf16": 835 * T},       # H100 NVL datasheet (1671 sparse)
    "NVIDIA H200 SXM": {"fp32": 67 * T, "bf16": 989.4 * T},     # H200 datasheet (1979 sparse)
    "NVIDIA H200 NVL": {"fp32": 60 * T, "bf16": 835 * T},       # H200 datasheet (1671 sparse)
    "NVIDIA A100": {"fp32": 19.5 * T, "bf16": 312 * T},         # A100 datasheet, SXM and PCIe (624 sparse)
    "NVIDIA A10": {"fp32": 31.2 * T, "bf16": 125 * T},          # A10 datasheet (250 sparse)
    "NVIDIA L4": {"fp32": 30.3 * T, "bf16": 121 * T},           # L4 datasheet (242 sparse)
    "NVIDIA L40S": {"fp32": 91.6 * T, "bf16": 362.05 * T},      # L40S datasheet (733 sparse)
    "NVIDIA L40": {"fp32": 90.5 * T, "bf16": 181 * T},          # L40 datasheet (362 sparse)
    "NVIDIA RTX A6000": {"fp32": 38.7 * T, "bf16": 154.8 * T},  # RTX A6000 datasheet (309.7 sparse)
    # GeForce: FP32-accumulate tensor rate is half the FP16-accumulate one (Ada / Ampere whitepapers).
    "NVIDIA GeForce RTX 4090": {"fp32": 82.6 * T, "bf16": 165.2 * T},  # Ada whitepaper, appendix A
    "NVIDIA GeForce RTX 3090": {"fp32": 35.6 * T, "bf16": 71 * T},     # Ampere GA102 whitepaper
    "NVIDIA V100": {"fp32": 15.7 * T, "bf16": None},             # V100 datasheet (SXM2)
    "NVIDIA T4": {"fp32": 8.1 * T, "bf16": None},                # T4 datasheet
    # Apple GPUs: FP32 = cores x 128 ALUs x 2 FLOPs x clock. M1 and M2 figures are Apple's own (keynotes,
    # press releases: M1 Max 10.4, M1 Ultra 21, M2 Max 13.6 TFLOPS); Apple quotes none for M3/M4, so
    # those use the clocks reported by Notebookcheck / Wikipedia (~1.6 GHz M3, ~1.68 GHz M4): estimates.
    # The GPU has no faster bf16 matmul path, so bf16 = fp32.
    **{f"Apple {chip} ({cores}-core GPU)": {"fp32": tflops * T, "bf16": tflops * T}
       for chip, cores, tflops in [
           ("M1", 7, 2.29), ("M1", 8, 2.6), ("M1 Pro", 14, 4.5), ("M1 Pro", 16, 5.2),
           ("M1 Max", 24, 7.8), ("M1 Max", 32, 10.4), ("M1 Ultra", 48, 15.9), ("M1 Ultra", 64, 21.0),
           ("M2", 8, 2.9), ("M2", 10, 3.6), ("M2 Pro", 16, 5.7), ("M2 Pro", 19, 6.8),
           ("M2 Max", 30, 10.7), ("M2 Max", 38, 13.6), ("M2 Ultra", 60, 21.5), ("M2 Ultra", 76, 27.2),
           ("M3", 8, 3.3), ("M3", 10, 4.1), ("M3 Pro", 14, 5.7), ("M3 Pro", 18, 7.4),
           ("M3 Max", 30, 12.3), ("M3 Max", 40, 16.4), ("M3 Ultra", 60, 24.6), ("M3 Ultra", 80, 32.8),
           ("M4", 8, 3.4), ("M4", 10, 4.3), ("M4 Pro", 16, 6.9), ("M4 Pro", 20, 8.6),
           ("M4 Max", 32, 13.7), ("M4 Max", 40, 17.2),
       ]},
}

# Device names as drivers report them ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB") -> table key.
# Order matters: the first match wins, so the more specific patterns come first.
_NVIDIA_PATTERNS = [
    (r"h100.*nvl", "NVIDIA H100 NVL"), (r"h100.*pcie", "NVIDIA H100 PCIe"), (r"h100", "NVIDIA H100 SXM"),
    (r"h200.*nvl", "NVIDIA H200 NVL"), (r"h200", "NVIDIA H200 SXM"), (r"a100", "NVIDIA A100"),
    (r"\ba10\b", "NVIDIA A10"), (r"\bl40s\b", "NVIDIA L40S"), (r"\bl40\b", "NVIDIA L40"),
    (r"\bl4\b", "NVIDIA L4"), (r"rtx a6000", "NVIDIA RTX A6000"), (r"rtx 4090", "NVIDIA GeForce RTX 4090"),
    (r"rtx 3090", "NVIDIA GeForce RTX 3090"), (r"v100", "NVIDIA V100"), (r"\bt4\b", "NVIDIA T4"),
]


def matmul_parameters(spec: ModelSpec) -> int:
    """N of the 6N term: weights a token is multiplied with (attention, MLP, output projection)."""
    d, q, kv = spec.dim, spec.n_heads * spec.head_dim, spec.n_kv_heads * spec.head_dim  # q == d but for an
    per_layer = q * d + 2 * kv * d + d * q + 3 * d * spec.ffn_dim  # explicit head_dim; q, k + v, o, MLP
    return spec.n_layers * per_layer + spec.vocab_size * d  # lm_head or the tied embedding used as one


def attention_flops_per_token(spec: ModelSpec, seq_len: int) -> float:
    return 12.0 * spec.n_layers * seq_len * spec.n_heads * spec.head_dim  # d, but for an explicit head_dim


def flops_per_token(spec: ModelSpec, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token: 6 N + 12 L T d (see the module docstring)."""
    return 6.0 * matmul_parameters(spec) + attention_flops_per_token(spec, seq_len)


def flops_formula(spec: ModelSpec, seq_len: int) -> str:
    n = matmul_parameters(spec)
    return (f"6·N + 12·L·T·d = 6·{n:,} + 12·{spec.n_layers}·{seq_len}·{spec.dim} = "
            f"{flops_per_token(spec, seq_len):,.0f} FLOPs/token (N: matmul weights incl. the output "
            f"projection, excl. the input embedding; PaLM appendix B, causal mask not discounted)")


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float) -> float:
    """Achieved model FLOP/s over the hardware peak, as a fraction (0.42 = 42 %)."""
    if not peak_flops or peak_flops <= 0:
        raise ValueError(f"peak_flops must be positive, got {peak_flops!r}")
    return tokens_per_s * flops_per_token / peak_flops


def known_peak_flops(device_name: str, dtype: str = "float32") -> tuple[str, float] | None:
    """(table key, peak FLOP/s) for a device name such as "NVIDIA H100 80GB HBM3" or
    "Apple M2 Max (38-core GPU)"; None when the device or its dtype is not in the table."""
    key = _table_key(device_name or "")
    if key is None:
        return None
    peak = KNOWN_PEAK_FLOPS[key]["bf16" if dtype in ("bfloat16", "bf16") else "fp32"]
    return (key, peak) if peak else None


def _table_key(name: str) -> str | None:
    lowered = name.lower()
    apple = re.search(r"apple (m\d)(?: (pro|max|ultra))?.*?(\d+)[- ]core gpu", lowered)
    if apple:
        chip = apple.group(1).upper() + (f" {apple.group(2).title()}" if apple.group(2) else "")
        key = f"Apple {chip} ({apple.group(3)}-core GPU)"
        return key if key in KNOWN_PEAK_FLOPS else None
    for pattern, key in _NVIDIA_PATTERNS:
        if re.search(pattern, lowered):
            return key
    return None
