"""Link rates as users write them (`--link 1gbit`), framework-neutral: the config validates them, the
launcher shapes them (compare/launch/netns.py), the cost model reads them (common/costmodel/links.py).

The units are tc's: kbit, mbit, gbit (powers of ten, bits per second), so the rate a user names is the
rate the kernel's token bucket is given.
"""
from __future__ import annotations

import re

from common.errors import UserError

UNITS_BPS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
# This kernel has the HTB and TBF qdiscs but no netem: bandwidth can be shaped, delay cannot.
NO_DELAY_NOTE = ("bandwidth shaped with tc tbf in each direction; delay cannot be shaped on this kernel (no "
                 "netem), so latency is the emulated path's own, as measured")


def parse_rate(text: str) -> float:
    """'1gbit' -> 1e9 bits/s; a one-line error for anything else."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]bit)\s*", str(text).lower())
    if not match or float(match.group(1)) <= 0:
        raise UserError(f"--link {text}: give a rate such as 200mbit, 1gbit or 10gbit (units: "
                        f"{', '.join(UNITS_BPS)})")
    return float(match.group(1)) * UNITS_BPS[match.group(2)]


def describe_rate(bits_per_s: float) -> str:
    for unit, scale in reversed(UNITS_BPS.items()):
        if bits_per_s >= scale:
            return f"{bits_per_s / scale:g} {unit[0].upper()}bit/s"
    return f"{bits_per_s:g} bit/s"
