"""What an emulated link (`--link`, compare/launch/netns.py) does to a run beyond its collectives, said in one line
before it starts, so that a slow step the user did not ask to measure is not a surprise."""
from __future__ import annotations

from common.config import RunConfig
from common.costmodel.rates import describe_rate, parse_rate
from common.model.spec import ModelSpec
from common.parallel.layout import total_parameters

# An hf checkpoint holds the float32 weights and AdamW's two moments (common/checkpoint/store.py).
HF_BYTES_PER_PARAMETER = 12
NOTE_FROM_S = 5.0  # a gather shorter than this is not worth a line


def hf_gather_note(cfg: RunConfig, spec: ModelSpec) -> str | None:
    """One line where an hf checkpoint makes rank 0 gather the other ranks' state across the emulated link: a
    pipeline's or a sharded strategy's ranks hold parts; ddp's rank 0 holds it all. The line rate's time is said
    as a floor: `base` under dp2 x pp2 over 100mbit between two machines of 1gbit wrote 1.25 GB in 220 s, three
    times its training (docs/strategies.md), where this counts 1.08 GB and 86 s."""
    if not cfg.link or cfg.checkpoint_format != "hf" or cfg.world_size < 2:
        return None
    total = total_parameters(spec)
    others = HF_BYTES_PER_PARAMETER * max(0.0, total - cfg.layout.local_parameters(spec, cfg.framework))
    # With two levels, what rank 0 lacks lies across the slow link too: the mesh puts pp outermost, tp innermost.
    seconds = others * 8 / parse_rate(cfg.link)
    if seconds < NOTE_FROM_S:
        return None
    when = "each checkpoint and the final one" if cfg.checkpoint_every else "the final checkpoint"
    return (f"{cfg.framework} {cfg.strategy if cfg.strategy != 'mesh' else cfg.mesh} x{cfg.world_size}: {when} "
            f"(--checkpoint-format hf) gathers about {size(others)} of the other ranks' state to rank 0 over "
            f"the {describe_rate(parse_rate(cfg.link))} link, {seconds:.0f} s or more each; --checkpoint-format "
            "sharded writes each rank's own part")


def size(nbytes: float) -> str:
    return f"{nbytes / 1e9:.3g} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.3g} MB"
