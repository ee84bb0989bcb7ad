"""The link `dpcompare plan` predicts over: one link, or two levels (a fast one inside each machine of
--group-size ranks, a slow one between machines: common/costmodel/levels.py). Each level comes from a `doctor
--fabric --out` file (--fabric, --fabric-inner), from the wire by hand (--link-gbps and --latency-us, and their
-inner twins), or else from the run's own `link` record (summary.json: a two-level run records both levels), or,
for a run of one rank (which measured no link), this machine's loopback as the `--fit` runs of the same framework and
backend measured it at their start (fit_loopback), else the backend's loopback figures (docs/benchmarks.md).
The `doctor --fabric --out` file is written here too (write_fabric), beside the code that reads it.
"""
from __future__ import annotations

import math
import time
from pathlib import Path

from common.costmodel.levels import Links, TwoLevelLink, links_from_record
from common.config import MLX_SPLIT_BACKENDS, default_backend
from common.costmodel.links import Link, loopback_link
from common.costmodel.probe import fastest_fit
from common.errors import UserError
from common.metrics import read_json, write_json

FABRIC_KIND = "dpcompare doctor --fabric"


def fabric_record(rows, where: str, link: dict | None = None) -> dict:
    """What `doctor --fabric --out FILE` writes: one entry per backend measured (compare/machine/fabric.py's
    Measured rows), in the units the cost model reads."""
    keys = ("framework", "backend", "ranks", "device", "latency_s", "bandwidth_Bps", "large_bytes", "error")
    return {"kind": FABRIC_KIND, "created": time.strftime("%Y-%m-%d %H:%M:%S"), "where": where, "link": link,
            "backends": [{k: getattr(r, k) for k in keys} for r in rows]}


def write_fabric(path: str, rows, where: str, link: dict | None = None) -> None:
    try:
        write_json(Path(path), fabric_record(rows, where, link))
    except OSError as err:
        raise UserError(f"cannot write {path}: {err.strerror}") from None


def link_from_fabric(path: str, framework: str, backend: str) -> Link:
    """The entry of `framework` in a `doctor --fabric --out` file (its `backend` preferred)."""
    data = read_json(Path(path))
    if not isinstance(data, dict) or not isinstance(data.get("backends"), list):
        raise UserError(f"--fabric {path}: not a file written by `dpcompare doctor --fabric --out FILE`")
    usable = [b for b in data["backends"] if isinstance(b, dict) and b.get("framework") == framework
              and b.get("latency_s") is not None and b.get("bandwidth_Bps")]
    if not usable:
        listed = [f"{b.get('framework')} {b.get('backend')}" + (f" (failed: {b['error']})" if b.get("error") else "")
                  for b in data["backends"] if isinstance(b, dict)]
        raise UserError(f"--fabric {path} has no measured {framework} backend; it holds: {', '.join(listed) or 'none'}")
    entry = next((b for b in usable if b.get("backend") == backend), usable[0])
    shaped = (data.get("link") or {}).get("requested") if isinstance(data.get("link"), dict) else None
    name = (f"{entry['framework']} {entry['backend']}" + (f" over {data['where']}" if data.get("where") else "")
            + (f", shaped to {shaped}" if shaped else ""))
    return Link.from_allreduce(name, float(entry["latency_s"]), float(entry["bandwidth_Bps"]), int(entry.get("ranks") or 2),
                               f"doctor --fabric ({path}, {data.get('created', 'undated')})")


def given_link(fabric: str | None, gbps: float | None, latency_us: float | None, framework: str, backend: str,
               suffix: str = "") -> tuple[Link, str] | None:
    """(link, how) from --fabric{suffix} or --link-gbps{suffix}/--latency-us{suffix}, None when neither is given."""
    if fabric and (gbps is not None or latency_us is not None):
        raise UserError(f"give either --fabric{suffix} FILE or --link-gbps{suffix}/--latency-us{suffix}, not both")
    if fabric:
        return link_from_fabric(fabric, framework, backend), f"--fabric{suffix}"
    if gbps is not None or latency_us is not None:
        if gbps is None or latency_us is None:
            raise UserError(f"--link-gbps{suffix} and --latency-us{suffix} go together (the link's bandwidth and "
                            "its latency)")
        if not (math.isfinite(gbps) and gbps > 0):
            raise UserError(f"--link-gbps{suffix} must be a positive number, got {gbps}")
        if not (math.isfinite(latency_us) and latency_us >= 0):
            raise UserError(f"--latency-us{suffix} must be 0 or more, got {latency_us}")
        return Link.wire(gbps, latency_us), f"--link-gbps{suffix}/--latency-us{suffix}"
    return None


def predicted_backend(summary: dict, mesh: str = "") -> str:
    """The backend a predicted layout runs on (`mesh`: "dp=2,tp=2", or "" for one strategy): the measured run's,
    where it can run that layout; else the one a run of it gets without --backend (common/config.py
    default_backend). An N=1 run ran on none, and MLX's ring cannot split its group for a mesh."""
    framework, measured = summary.get("framework", ""), summary.get("backend") or "none"
    if measured == "none" or (framework == "mlx" and mesh and measured not in MLX_SPLIT_BACKENDS):
        return default_backend(framework, summary.get("device") or "cpu", mesh)
    return measured


def choose_links(args, summary: dict, backend: str, fits: tuple = ()) -> tuple[Links, str]:
    """(one link or two levels, how they were chosen) for a layout on `backend` (predicted_backend): the outer
    (or only) level from choose_link; with --group-size, the inner one from its flags, else from the run's
    record."""
    framework = summary.get("framework", "")
    inner_flags = (getattr(args, "fabric_inner", None), getattr(args, "link_gbps_inner", None),
                   getattr(args, "latency_us_inner", None))
    group_size = getattr(args, "group_size", None)
    inner = given_link(*inner_flags, framework, backend, suffix="-inner")
    if inner is None and group_size is None:
        return choose_link(args, summary, backend, fits)
    if group_size is None or group_size < 1:
        raise UserError("a two-level link needs --group-size N (ranks per machine, 1 or more)" if group_size is None
                        else f"--group-size must be 1 or more, got {group_size}")
    outer, how = choose_link(args, summary, backend, fits)
    if isinstance(outer, TwoLevelLink):  # the run's own record had two levels: its inner one, unless given
        outer = outer.outer
    if inner is None:
        recorded = links_from_record(summary.get("link"), framework, summary.get("backend") or backend)
        if not isinstance(recorded, TwoLevelLink):
            raise UserError("--group-size needs the link inside a machine: --link-gbps-inner and "
                            "--latency-us-inner, or --fabric-inner FILE (or a run over a two-level --link)")
        inner = recorded.inner, "the run's link record (inside a group)"
    return TwoLevelLink(inner[0], outer, group_size), f"inside a machine: {inner[1]}; between machines: {how}"


def choose_link(args, summary: dict, backend: str, fits: tuple = ()) -> tuple[Links, str]:
    """(link, how it was chosen) from the flags (a --fabric file's entry of `backend`), else from the run (two
    levels where it ran over two), else this machine's loopback as the fit runs measured it (fit_loopback: `fits`
    holds (its folder, its summary.json)), else that backend's assumed loopback figures."""
    framework = summary.get("framework", "")
    given = given_link(args.fabric, args.link_gbps, args.latency_us, framework, backend)
    if given is not None:
        return given
    own = links_from_record(summary.get("link"), framework, summary.get("backend") or backend)  # measured on its own
    if own:
        return own, "the run's link record"
    measured = fit_loopback(fits, framework, backend)
    if measured is not None:
        return measured
    return loopback_link(backend), "pass --fabric or --link-gbps for another link"


def fit_loopback(fits, framework: str, backend: str) -> tuple[Link, str] | None:
    """This machine's loopback as the --fit runs of `framework` on `backend` measured it at their start (their
    unshaped `link` records), for a calibration run of one rank, which measured none: (link, how), or None where no
    fit run of them recorded its calls. Each collective from its sizes' fastest calls over every such run
    (common/costmodel/probe.py fastest_fit); an all-gather no fsdp run measured is priced from the all-reduce.

    The assumed figures (docs/benchmarks.md's loopback, another machine's) price the all-gather as half a ring
    all-reduce, and gloo's all_gather is CPU-bound: a tiny fsdp run measured it at 0.71-0.84 GB/s on the Zen 5, where
    half the assumed all-reduce is 3.7, and torch's fsdp rows of `small` and `base` came out 19-21 % short (issue 56).
    Their all-reduce is another machine's too: on the AMD EPYC Zen 3 the fit runs' 32 MiB all-reduces took 56-90 ms
    over MLX's ring (0.86 GB/s assumed: 39 ms) and 27-48 ms over gloo (18 ms assumed), and `small`'s ddp and fsdp
    rows at N=2 came out 9-19 % short over the assumed figures (issue 72). The runs' own fitted figures are not
    taken: their median 4 KB call is a scheduler tick or not (0.3 or 3.7 ms from one run to the next on the Zen 5),
    and over them MLX's `small` fsdp x2 was predicted 13-17 % long (docs/notes/2026-11-plan-model.md); their fastest
    calls are what the path gives."""
    reduces, gathers, sources = [], [], []
    for source, s in fits:
        record = s.get("link") or {}
        if (s.get("framework"), s.get("backend")) != (framework, backend) or record.get("requested") \
                or record.get("emulated") or record.get("inner"):
            continue  # another framework's, another backend's, or a shaped link: not this machine's loopback
        reduces.append(record.get("allreduce") or {})
        gathers.append(record.get("allgather") or {})
        sources.append(str(source))
    reduce, gather = fastest_fit(reduces), fastest_fit(gathers)
    if reduce is None or not reduce.get("bandwidth_Bps"):
        return None
    ranks = next((r.get("world_size") for r in reduces if r.get("world_size")), 2)
    link = Link.from_allreduce(f"loopback ({backend}, measured by the fit runs)", reduce["latency_s"],
                               reduce["bandwidth_Bps"], ranks,
                               f"the fastest calls of {', '.join(sources)}'s all-reduce, measured at their start")
    if gather is not None and gather.get("bandwidth_Bps"):
        link = link.with_allgather(gather["latency_s"], gather["bandwidth_Bps"], ranks)
    return link, "the calibration ran on one rank; pass --fabric or --link-gbps for another link"


def describe_links(links: Links, how: str) -> str:
    """The link line(s) the plan prints."""
    if isinstance(links, TwoLevelLink):
        return (f"inside machines of {links.group_size} ranks {describe_links(links.inner, '')}\n"
                f"     between machines {describe_links(links.outer, '')}" + (f"\n     ({how})" if how else ""))
    return (f"{links.name}: {links.hop_latency_s * 1e6:,.1f} µs per hop, {links.bandwidth_Bps / 1e9:.3g} GB/s each "
            f"way ({links.source}" + (f"; {how})" if how else ")"))


def links_json(links: Links, how: str) -> dict:
    """plan.json's `link`: one link's fields, or each level's and the machine size."""
    if isinstance(links, TwoLevelLink):
        return {"inner": vars(links.inner), "outer": vars(links.outer), "group_size": links.group_size,
                "name": links.name, "chosen_by": how}
    return {**vars(links), "chosen_by": how}
