"""Which parameters a run trains: every one (`FullModel`), or low-rank adapters beside a frozen base (`Adapters`,
LoRA: `--lora-rank R`). One object per choice, asked by the loop, the checkpoints and both frameworks' Trainers
(mlx_impl/lora.py, torch_impl/lora.py attach it), so no Trainer asks "is this LoRA?".

An adapted Linear computes y = x W^T (+ b) + scale * (x A^T) B^T, A of shape (rank, in), B (out, rank), scale =
alpha / rank: peft's layout and scale (`lora_A`, `lora_B`, lora_alpha / r). mlx-lm stores the same two matrices
transposed (`lora_a` (in, rank), `lora_b` (rank, out)) and a `scale`; the exports convert. The initial values are
drawn here in numpy from the run's seed, as peft and mlx-lm draw them: A uniform in +-1/sqrt(in) (peft's
kaiming_uniform(a=sqrt(5)) and mlx-lm's bound are both that), B zeros, so the adapted model starts as the base;
both frameworks load the same bytes. The state a checkpoint holds is the adapters and their AdamW moments; the
frozen base is named by its fingerprint (common/train/loop.py).
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.errors import UserError
from common.model.flops import matmul_parameters
from common.model.spec import ModelSpec
from common.model.weights import parameter_shapes

# HF module names, and where each sits in a block.
TARGET_PATHS = {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
                "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
                "down_proj": "mlp.down_proj"}
DEFAULT_TARGETS = ("q_proj", "v_proj")  # peft's default for Llama; mlx-lm's is every projection of the block
ADAPTER_SEED_OFFSET = 0x10BA  # the adapters' draws never share the base's stream (common/model/weights.py)


@dataclass(frozen=True)
class FullModel:
    """Every parameter trains: the state is the model's (parameter_shapes)."""
    scale = 1.0  # no adapter uses it

    def modules(self, spec: ModelSpec) -> list[str]:
        return []

    def blocks(self, spec: ModelSpec) -> range:
        """The blocks a step's backward runs through: every one."""
        return range(spec.n_layers)

    def matmul_flops_per_token(self, spec: ModelSpec) -> float:
        """6 N (common/model/flops.py): every matrix forward, its input's gradient and its own."""
        return 6.0 * matmul_parameters(spec)

    def state_shapes(self, spec: ModelSpec) -> dict[str, tuple[int, ...]]:
        return parameter_shapes(spec)

    def initial_values(self, spec: ModelSpec, seed: int) -> dict[str, np.ndarray]:
        return {}  # the seed checkpoint holds them all

    def trained_parameters(self, spec: ModelSpec) -> int:
        return sum(math.prod(s) for s in parameter_shapes(spec).values())

    def describe(self) -> dict | None:
        return None

    def comm_bytes_per_step_estimate(self, layout, spec: ModelSpec, micro_batch_size: int, seq_len: int,
                                     grad_accum: int, dtype: str) -> int | None:
        return layout.comm_bytes_per_step_estimate(spec, micro_batch_size, seq_len, grad_accum, dtype)


@dataclass(frozen=True)
class Adapters:
    """LoRA adapters on `targets` of the last `layers` blocks (0: every block), frozen base."""
    rank: int
    alpha: float
    targets: tuple[str, ...] = DEFAULT_TARGETS
    layers: int = 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def blocks(self, spec: ModelSpec) -> range:
        """The adapted blocks, the last ones: also those a step's backward runs through (nothing below trains)."""
        first = 0 if not self.layers else spec.n_layers - min(self.layers, spec.n_layers)
        return range(first, spec.n_layers)

    def modules(self, spec: ModelSpec) -> list[str]:
        """The adapted modules' HF paths ("model.layers.3.self_attn.q_proj"), in the model's order."""
        return [f"model.layers.{i}.{TARGET_PATHS[t]}" for i in self.blocks(spec)
                for t in TARGET_PATHS if t in self.targets]

    def state_shapes(self, spec: ModelSpec) -> dict[str, tuple[int, ...]]:
        """{module.lora_A: (rank, in), module.lora_B: (out, rank)}: what trains, and what a checkpoint holds."""
        base = parameter_shapes(spec)
        shapes: dict[str, tuple[int, ...]] = {}
        for module in self.modules(spec):
            out_features, in_features = base[module + ".weight"]
            shapes[module + ".lora_A"] = (self.rank, in_features)
            shapes[module + ".lora_B"] = (out_features, self.rank)
        return shapes

    def initial_values(self, spec: ModelSpec, seed: int) -> dict[str, np.ndarray]:
        rng = np.random.Generator(np.random.PCG64(seed + ADAPTER_SEED_OFFSET))
        values = {}
        for name, shape in self.state_shapes(spec).items():
            if name.endswith(".lora_A"):
                bound = 1.0 / math.sqrt(shape[1])
                values[name] = rng.uniform(-bound, bound, size=shape).astype(np.float32)
            else:
                values[name] = np.zeros(shape, dtype=np.float32)
        return values

    def trained_parameters(self, spec: ModelSpec) -> int:
        return sum(math.prod(s) for s in self.state_shapes(spec).values())

    def matmul_flops_per_token(self, spec: ModelSpec) -> float:
        """The frozen base forward (2 N), its input gradients from the lowest adapted block up, the output head's
        included (no weight gradient of the base), and the adapters' two products forward and backward, their
        input gradients and their own (6 per adapter parameter)."""
        back = len(self.blocks(spec))
        head = spec.vocab_size * spec.dim
        per_block = (matmul_parameters(spec) - head) / spec.n_layers
        return 2.0 * matmul_parameters(spec) + 2.0 * (back * per_block + head) + 6.0 * self.trained_parameters(spec)

    def describe(self) -> dict:
        """summary.json's `adapters` and the checkpoints' fingerprint of them."""
        return {"rank": self.rank, "alpha": self.alpha, "scale": self.scale, "targets": list(self.targets),
                "layers": self.layers}

    def comm_bytes_per_step_estimate(self, layout, spec: ModelSpec, micro_batch_size: int, seq_len: int,
                                     grad_accum: int, dtype: str) -> int | None:
        """ddp all-reduces the adapters' float32 gradients once per step, nothing of the frozen base (zero1, zero2:
        their reduction and gather of the adapters' rows: layout.trained_payload_bytes)."""
        return 0 if layout.ranks < 2 else layout.trained_payload_bytes(self.state_shapes(spec), dtype)

    def check(self, spec: ModelSpec) -> None:
        """A rank no larger than any adapted matrix's smaller side (else the product is not low-rank)."""
        base = parameter_shapes(spec)
        for module in self.modules(spec):
            smallest = min(base[module + ".weight"])
            if self.rank > smallest:
                raise UserError(f"--lora-rank {self.rank} is larger than {module}'s smaller dimension ({smallest}); "
                                f"use a rank of at most {smallest}")


Trained = FullModel | Adapters


def initial_adapters_file(trained: Trained, spec: ModelSpec, seed: int, cache_dir: Path) -> Path | None:
    """The adapters' initial values as a safetensors file (HF module names, `.lora_A` / `.lora_B`), written once per
    (spec, adapters, seed) beside the seed checkpoints, so that both frameworks, and another tool, start from the
    same file; None when every parameter trains (the seed checkpoint holds them all)."""
    if not isinstance(trained, Adapters):
        return None
    key = hashlib.sha256(json.dumps([spec.to_dict(), trained.describe(), seed], sort_keys=True).encode())
    path = Path(cache_dir) / "seeds" / f"adapters-{key.hexdigest()[:16]}.safetensors"
    if not path.is_file():
        from safetensors.numpy import save_file

        from common.fsutil import atomic_path

        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:
            save_file(trained.initial_values(spec, seed), str(tmp), metadata={"format": "pt"})
    return path


# How `--lora-alpha` is read (`--lora-scale-convention`), as the alpha each Adapters holds: peft's alpha / rank, or
# mlx-lm's scale used directly (its lora_parameters.scale: y + scale * x A B), which is alpha = scale x rank. Either
# way a value of 0 means a scale of 2. The adapters themselves (and so both Trainers and the exports) see one alpha.
SCALE_CONVENTIONS = {"alpha-over-rank": lambda value, rank: value or 2.0 * rank,
                     "direct": lambda value, rank: (value or 2.0) * rank}


def trained_parameters_of(lora_rank: int, lora_alpha: float, lora_targets: str, lora_layers: int,
                          scale_convention: str = "alpha-over-rank") -> Trained:
    """The RunConfig's choice as its object (RunConfig.trained): FullModel at rank 0."""
    if scale_convention not in SCALE_CONVENTIONS:
        raise UserError(f"unknown lora_scale_convention {scale_convention!r}; allowed: "
                        f"{', '.join(SCALE_CONVENTIONS)}")
    if not lora_rank:
        given = [flag for flag, value in (("--lora-targets", lora_targets), ("--lora-alpha", lora_alpha),
                                          ("--lora-layers", lora_layers)) if value]
        if given:  # a rank of 0 trains every parameter: adapter settings beside it are a mistake, not a choice
            raise UserError(f"{given[0]} sets up LoRA adapters, but the rank is 0 (every parameter trains); "
                            "give --lora-rank R > 0")
        return FullModel()
    targets = tuple(t.strip() for t in lora_targets.split(",") if t.strip()) if lora_targets else DEFAULT_TARGETS
    unknown = [t for t in targets if t not in TARGET_PATHS]
    if unknown:
        raise UserError(f"--lora-targets: unknown module {unknown[0]!r}; allowed: {', '.join(TARGET_PATHS)}")
    if not targets:
        raise UserError("--lora-targets names no module")
    return Adapters(rank=lora_rank, alpha=SCALE_CONVENTIONS[scale_convention](lora_alpha, lora_rank),
                    targets=tuple(dict.fromkeys(targets)), layers=lora_layers)
