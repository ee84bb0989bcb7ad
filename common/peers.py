"""The peers (`--frameworks mlx-lm,hf`): the users' own trainers run as frameworks of their own, each fed dpcompare's
batches (peers/, docs/peers.md). Framework-free: what the config checks, the launcher starts and the report pairs.

A peer runs on one of the two frameworks (its `framework`: the launcher, backend, BLAS and threads are that
framework's) and is judged against dpcompare's run of that framework on the same config (kind `peer`).

Two kinds of choice a peer's trainer has no setting for:
- `supports`: what changes how it runs or what it is (a strategy, a dtype, full training, a resume): any other
  value exits 2 in one line before anything starts.
- `nearest`: a setting of the update it cannot be told (torch's AdamW always corrects its bias; mlx-lm's train()
  has no clipping and keeps one padding target): the peer runs with the value it has, the run says so in one line
  (`adapted`), its config names the choice (`peer_adapted`), and the peer's verdict row calls the difference that
  choice's, not a bug (compare/report/parity.py). So `compare --recipe mlx-lm --frameworks mlx,torch,mlx-lm,hf`
  runs, and shows what the Trainer's fixed bias correction costs against mlx-lm's recipe.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any, Callable

from common.errors import UserError


@dataclass(frozen=True)
class Nearest:
    """A setting the peer's trainer cannot be told: `ok(cfg)` where it computes what was asked; else it runs with
    `value` (a function of the config, or the value itself), for the reason `why`."""
    ok: Callable[[Any], bool]      # of the run's RunConfig
    value: object
    why: str

    def ran(self, cfg) -> object:
        return self.value(cfg) if callable(self.value) else self.value


@dataclass(frozen=True)
class Peer:
    name: str
    framework: str                 # the framework it runs on, and whose dpcompare run it is judged against
    module: str                    # `python -m MODULE RUN_DIR`, started as `{framework}_impl.launch` is
    libraries: tuple[str, ...]     # imported by the peer: refused by name with the pip line where missing
    trainer: str                   # what runs, in words
    supports: dict[str, Callable[[object], bool]] = field(default_factory=dict)
    nearest: dict[str, Nearest] = field(default_factory=dict)


COMMON = {"strategy": lambda v: v == "ddp", "mesh": lambda v: not v, "dtype": lambda v: v == "float32",
          "lora_rank": lambda v: v > 0, "nnodes": lambda v: v == 1, "grad_accum": lambda v: v == 1,
          # a peer writes no checkpoint of ours: nothing to resume or restart from
          "resume": lambda v: not v, "max_restarts": lambda v: v == 0}

MLX_LM = Peer("mlx-lm", "mlx", "peers.mlx_lm_peer", ("mlx_lm",), "mlx_lm.tuner.trainer.train (mlx-lm's LoRA trainer)", {
    **COMMON,
    "lr_schedule": lambda v: v in ("constant", "cosine"),  # lora.py: a bare learning rate, or an lr_schedule
                                                  # cosine_decay (its warm-up is not dpcompare's: warmup 0 only)
    "warmup_steps": lambda v: v == 0,
}, {  # a quantized base: load_model builds its QuantizedLinear from the folder's scales and biases
    "mask_convention": Nearest(lambda c: c.mask_convention == "mlx-lm", "mlx-lm",
                               "its default_loss keeps one padding target a row"),
    "grad_clip": Nearest(lambda c: c.grad_clip == 0, 0.0, "its train() clips no gradient"),
    # tuner/trainer.py: each rank's token mean, averaged over the ranks (average_gradients); one rank: either
    "loss_normalization": Nearest(lambda c: c.world_size == 1 or c.loss_normalization == "per-rank", "per-rank",
                                  "it averages each rank's own token mean"),
})

HF = Peer("hf", "torch", "peers.hf_peer", ("transformers", "peft"),
          "transformers.Trainer.train on a peft LoRA model (DDP under torchrun's variables for N > 1)", {
    **COMMON,
    "optimizer": lambda v: v in ("adamw", "adam"),  # optim adamw_torch; adam = adamw with weight decay 0
    "lr_schedule": lambda v: v in ("linear", "constant"),  # lr_scheduler_type linear, constant(_with_warmup)
    "quantize_base": lambda v: v == 0,
}, {
    "bias_correction": Nearest(lambda c: c.bias_correction is True, True, "torch's AdamW always corrects its bias"),
    "lr_decay_steps": Nearest(lambda c: c.lr_decay_steps == 0, 0, "its linear schedule ends at max_steps"),
})

PEERS = {p.name: p for p in (MLX_LM, HF)}
ALIASES = {"mlx_lm": "mlx-lm", "trainer": "hf", "transformers": "hf"}
PIP_LINE = "pip install 'dpcompare[peers]'"


def peer_of(name: str) -> Peer | None:
    return PEERS.get(ALIASES.get(name, name))


def check(cfg) -> None:
    """Exit 2 (UserError) naming the first choice `cfg.peer`'s trainer cannot run with (`supports`), or a `nearest`
    choice not yet set to the peer's own value (`adapted` sets them)."""
    peer = PEERS[cfg.peer]
    if cfg.framework != peer.framework:
        raise UserError(f"peer {peer.name} runs on {peer.framework}, not {cfg.framework}")
    if cfg.optimizer == "adam" and cfg.weight_decay and peer.name == "hf":
        raise UserError("--framework hf: the Trainer's optimizers decay weights as AdamW; adam takes weight-decay 0")
    for name, ok in peer.supports.items():
        if not ok(getattr(cfg, name)):
            raise UserError(f"--frameworks {peer.name}: {peer.trainer} cannot take {name.replace('_', '-')} = "
                            f"{getattr(cfg, name)!r} (docs/peers.md)")
    for name, rule in peer.nearest.items():
        if not rule.ok(cfg):
            raise UserError(f"--frameworks {peer.name}: {name.replace('_', '-')} = {getattr(cfg, name)!r} "
                            f"cannot be told ({rule.why}); compare runs it with {rule.ran(cfg)!r} (docs/peers.md)")


def adapted(name: str, cfg) -> tuple[object, list[str]]:
    """The config peer `name`'s trainer runs with, from dpcompare's `cfg` of its framework: each `nearest` choice it
    cannot be told set to the value it has, named in `peer_adapted`; and one line for each, to print before it
    starts."""
    peer = PEERS[name]
    changes, lines = {}, []
    for name, rule in peer.nearest.items():
        if not rule.ok(cfg):
            changes[name] = rule.ran(cfg)
            lines.append(f"{peer.name} x{cfg.world_size} cannot be told {name.replace('_', '-')} = "
                         f"{getattr(cfg, name)!r} ({rule.why}): it runs with {changes[name]!r}, and its peer row "
                         "names that as the cause of any difference")
    return cfg.replace(peer=peer.name, **changes, peer_adapted=",".join(changes)), lines


def adapted_names(config: dict) -> tuple[str, ...]:
    """The choices a peer's run config (`config`) ran with the peer's own value (`adapted`)."""
    return tuple(n for n in str(config.get("peer_adapted") or "").split(",") if n)


def explained(config: dict) -> str:
    """The verdict's words for a peer run's adapted choices (its run_config's `config`), "" where none."""
    peer = PEERS.get(config.get("peer") or "")
    names = adapted_names(config)
    if peer is None or not names:
        return ""
    return "; ".join(f"{peer.name} ran {n.replace('_', '-')} = {config.get(n)!r} ({peer.nearest[n].why})"
                     for n in names if n in peer.nearest)


def check_installed(name: str) -> None:
    """Exit 2 with the pip line where a peer's library is not installed (nothing is imported to tell)."""
    peer = PEERS[name]
    missing = [lib for lib in peer.libraries if importlib.util.find_spec(lib) is None]
    if missing:
        raise UserError(f"--frameworks {peer.name} needs {', '.join(missing)}, which is not installed: {PIP_LINE}")
