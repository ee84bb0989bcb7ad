"""`dpcompare compare --recipes A,B`: recipe A, recipe B, and the chain of recipes between them, one choice changed
per link, then the gap between A's and B's curves explained choice by choice (compare/report/contributions.py).

The choices that differ are taken in common/recipes.py's CHOICES order (the data's, the normalization, what
trains, the optimizer, the schedule, clipping). Link 0 is A; link k is A with its first k differing choices set to
B's; the last link is B. Every link runs in each framework and world size named, so a link's row is measured in
each. A choice fixed by a flag (`--recipes mlx-lm,trl --lr 1e-4`) is the same on both sides and is no link.

Runs go under OUT/links/KK-NAME/; the report in OUT judges recipe A's runs as any compare does and holds the
contributions table, and OUT/links/'s last folder holds B's own report.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from common.config import RunConfig
from common.errors import UserError
from common.recipes import CHOICES, recipe

from .flags import config_from_args


def parse_recipes(text: str, args: argparse.Namespace) -> tuple[str, str]:
    names = [n.strip() for n in str(text).split(",") if n.strip()]
    if len(names) != 2:
        raise UserError(f"--recipes takes two recipe names, A,B (the chain runs from A to B); got {text!r}")
    for name in names:
        recipe(name)  # an unknown one exits 2 here
    if names[0] == names[1]:
        raise UserError(f"--recipes {text}: the two recipes are the same, there is no gap to explain")
    if getattr(args, "recipe", None):
        raise UserError("--recipe and --recipes together: --recipes names both recipes; drop --recipe")
    return names[0], names[1]


def chain_links(args: argparse.Namespace, names: tuple[str, str], **fixed) -> tuple[list[dict], list[RunConfig]]:
    """([{"choice", "a", "b"}] per differing choice, in order; [RunConfig of link 0 (A), link 1, ..., B]): each
    validated now, so a chain that cannot run exits 2 before anything trains."""
    a_cfg = config_from_args(args, **fixed, recipe=names[0])
    b_cfg = config_from_args(args, **fixed, recipe=names[1])
    links = [{"choice": c, "a": getattr(a_cfg, c), "b": getattr(b_cfg, c)} for c in CHOICES
             if _meant(a_cfg, c) != _meant(b_cfg, c)]
    if not links:
        raise UserError(f"--recipes {','.join(names)}: with the flags given, the two recipes make the same choices")
    configs = [a_cfg]
    values = a_cfg.to_dict()
    for k, link in enumerate(links, start=1):
        values = {**values, link["choice"]: link["b"], "recipe": names[1] if k == len(links) else names[0]}
        try:
            configs.append(RunConfig.from_dict(values))
        except UserError as err:
            raise UserError(f"--recipes {','.join(names)}: the link that sets {link['choice']} = {link['b']!r} "
                            f"cannot run ({err}); fix that choice on both sides with its flag") from None
    return links, configs


def _meant(cfg: RunConfig, choice: str):
    """A choice's value as it acts: --lora-targets "" is q_proj,v_proj (common/model/lora.py DEFAULT_TARGETS)."""
    if choice == "lora_targets" and cfg.lora_rank:
        return ",".join(getattr(cfg.trained, "targets", ()))
    return getattr(cfg, choice)


def short(name: str) -> str:
    """A recipe's name in folder names and labels: a recipe file's stem (`--recipe-from` writes a-mlx-lm.json)."""
    return Path(name).stem if str(name).endswith(".json") else name


def link_dirname(k: int, links: list[dict], names: tuple[str, str]) -> str:
    names = (short(names[0]), short(names[1]))
    if k == 0:
        return f"00-{names[0]}"
    return f"{k:02d}-{links[k - 1]['choice'].replace('_', '-')}" + (f"-{names[1]}" if k == len(links) else "")


def link_label(k: int, links: list[dict], names: tuple[str, str]) -> str:
    names = (short(names[0]), short(names[1]))
    return names[0] if k == 0 else f"+{links[k - 1]['choice']}" + (f" = {names[1]}" if k == len(links) else "")


def describe(links: list[dict], names: tuple[str, str]) -> str:
    names = (short(names[0]), short(names[1]))
    steps = ", ".join(f"{link['choice']} {link['a']} -> {link['b']}" for link in links)
    return f"recipes {names[0]} -> {names[1]}: {len(links)} choices differ, taken in this order: {steps}"


def out_of(base: RunConfig, args) -> Path:
    return Path(base.out or args.start_dir / "runs/compare")
