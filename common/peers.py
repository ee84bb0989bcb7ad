"""The peers (`--frameworks mlx-lm,hf`): the users' own trainers run as frameworks of their own, each fed dpcompare's
batches (peers/, docs/peers.md). Framework-free: what the config checks, the launcher starts and the report pairs.

A peer runs on one of the two frameworks (its `framework`: the launcher, backend, BLAS and threads are that
framework's) and is judged against dpcompare's run of that framework on the same config (kind `peer`). `supports`
is every choice the peer's trainer can be told; any other exits 2 in one line before anything starts.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Callable

from common.errors import UserError


@dataclass(frozen=True)
class Peer:
    name: str
    framework: str                 # the framework it runs on, and whose dpcompare run it is judged against
    module: str                    # `python -m MODULE RUN_DIR`, started as `{framework}_impl.launch` is
    libraries: tuple[str, ...]     # imported by the peer: refused by name with the pip line where missing
    trainer: str                   # what runs, in words
    supports: dict[str, Callable[[object], bool]] = field(default_factory=dict)
    per_rank_only: bool = False    # its loss normalization is per rank at N > 1, whatever it is told


COMMON = {"strategy": lambda v: v == "ddp", "mesh": lambda v: not v, "dtype": lambda v: v == "float32",
          "lora_rank": lambda v: v > 0, "nnodes": lambda v: v == 1, "grad_accum": lambda v: v == 1,
          # a peer writes no checkpoint of ours: nothing to resume or restart from
          "resume": lambda v: not v, "max_restarts": lambda v: v == 0}

MLX_LM = Peer("mlx-lm", "mlx", "peers.mlx_lm_peer", ("mlx_lm",), "mlx_lm.tuner.trainer.train (mlx-lm's LoRA trainer)", {
    **COMMON,
    "mask_convention": lambda v: v == "mlx-lm",   # default_loss keeps one padding target a row
    "lr_schedule": lambda v: v in ("constant", "cosine"),  # lora.py: a bare learning rate, or an lr_schedule
                                                  # cosine_decay (its warm-up is not dpcompare's: warmup 0 only)
    "warmup_steps": lambda v: v == 0,
    "grad_clip": lambda v: v == 0,                # train() has no clip
}, per_rank_only=True)  # a quantized base: load_model builds its QuantizedLinear from the folder's scales and biases

HF = Peer("hf", "torch", "peers.hf_peer", ("transformers", "peft"),
          "transformers.Trainer.train on a peft LoRA model (DDP under torchrun's variables for N > 1)", {
    **COMMON,
    "bias_correction": lambda v: v is True,       # torch's AdamW always corrects
    "optimizer": lambda v: v in ("adamw", "adam"),  # optim adamw_torch; adam = adamw with weight decay 0
    "lr_schedule": lambda v: v in ("linear", "constant"),  # lr_scheduler_type linear, constant(_with_warmup)
    "lr_decay_steps": lambda v: v == 0,           # its linear schedule ends at max_steps
    "quantize_base": lambda v: v == 0,
})

PEERS = {p.name: p for p in (MLX_LM, HF)}
ALIASES = {"mlx_lm": "mlx-lm", "trainer": "hf", "transformers": "hf"}
PIP_LINE = "pip install 'dpcompare[peers]'"


def peer_of(name: str) -> Peer | None:
    return PEERS.get(ALIASES.get(name, name))


def check(cfg) -> None:
    """Exit 2 (UserError) naming the first choice `cfg.peer`'s trainer cannot express."""
    peer = PEERS[cfg.peer]
    if cfg.framework != peer.framework:
        raise UserError(f"peer {peer.name} runs on {peer.framework}, not {cfg.framework}")
    if cfg.optimizer == "adam" and cfg.weight_decay and peer.name == "hf":
        raise UserError("--framework hf: the Trainer's optimizers decay weights as AdamW; adam takes weight-decay 0")
    for name, ok in peer.supports.items():
        if not ok(getattr(cfg, name)):
            raise UserError(f"--frameworks {peer.name}: {peer.trainer} cannot take {name.replace('_', '-')} = "
                            f"{getattr(cfg, name)!r} (docs/peers.md)")
    if peer.per_rank_only and cfg.world_size > 1 and cfg.loss_normalization != "per-rank":
        raise UserError(f"--frameworks {peer.name}: its trainer averages per-rank token means at "
                        f"{cfg.world_size} ranks; give --loss-normalization per-rank (or its --recipe)")


def check_installed(name: str) -> None:
    """Exit 2 with the pip line where a peer's library is not installed (nothing is imported to tell)."""
    peer = PEERS[name]
    missing = [lib for lib in peer.libraries if importlib.util.find_spec(lib) is None]
    if missing:
        raise UserError(f"--frameworks {peer.name} needs {', '.join(missing)}, which is not installed: {PIP_LINE}")
