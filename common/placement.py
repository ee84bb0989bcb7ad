"""Where a run's ranks run, checked across the config's fields before anything starts: several nodes, a
hostfile, an emulated link (one level or two), the Slurm launcher, restarts, and the backends each of them
needs. common/config.py's RunConfig.validate calls check_placement; bad input raises UserError (one line, exit 2).
"""
from __future__ import annotations

from typing import Protocol

from common.costmodel.rates import parse_rate
from common.errors import UserError


class Placed(Protocol):
    """What these checks read of a RunConfig (common/config.py), which imports this module."""
    framework: str
    nproc: int
    nnodes: int
    hostfile: str
    rdzv_endpoint: str
    link: str
    link_inner: str
    group_size: int
    launcher: str
    max_restarts: int
    min_nproc: int

    @property
    def resolved_backend(self) -> str: ...

    @property
    def world_size(self) -> int: ...

LINK_BACKENDS = {"mlx": ("ring", "mpi"), "torch": ("gloo",)}  # the TCP ones, which --link can shape


def check_placement(cfg: Placed) -> None:
    if cfg.nnodes > 1 and cfg.framework == "torch" and not cfg.rdzv_endpoint:
        raise UserError("torch with nnodes > 1 needs --rdzv-endpoint HOST:PORT (node 0's address)")
    if cfg.nnodes > 1 and cfg.framework == "mlx":
        # One host's share of a ring job, started here without ssh (see compare/launch/runner.py).
        if cfg.resolved_backend != "ring":
            raise UserError(f"MLX with nnodes > 1 runs the ring backend, not {cfg.resolved_backend} "
                            "(MPI: --backend mpi --nproc N --hostfile FILE starts every host through mpirun)")
        if not cfg.hostfile:
            raise UserError("MLX with nnodes > 1 needs --hostfile FILE listing every node's ring address")
        if cfg.nproc != 1:
            raise UserError("MLX with nnodes > 1 starts one rank per node: use --nproc 1 (list a host "
                            "twice in the hostfile and start two nodes on it for two ranks there)")
    if cfg.link:
        parse_rate(cfg.link)
        if cfg.hostfile or cfg.nnodes > 1:
            raise UserError(f"--link {cfg.link} emulates a link between the ranks of this machine; it "
                            "cannot be combined with --hostfile or --nnodes (there the link is real)")
        if cfg.resolved_backend not in LINK_BACKENDS[cfg.framework]:
            raise UserError(f"--link {cfg.link}: the {cfg.resolved_backend} backend does not talk over "
                            f"TCP; emulated links work with {', '.join(LINK_BACKENDS[cfg.framework])}")
    check_two_level_link(cfg)
    if cfg.launcher == "slurm" and (cfg.hostfile or cfg.nnodes > 1 or cfg.link):
        raise UserError("--launcher slurm starts the ranks on the allocation's nodes; it cannot be combined with "
                        "--hostfile, --nnodes or --link")
    if cfg.max_restarts < 0:
        raise UserError(f"max_restarts must be >= 0, got {cfg.max_restarts}")
    if not 0 <= cfg.min_nproc <= cfg.nproc:
        raise UserError(f"min_nproc must be in [1, nproc={cfg.nproc}], got {cfg.min_nproc}")
    if cfg.max_restarts and cfg.nnodes > 1:
        raise UserError("--max-restarts restarts a job that one dpcompare starts whole; with --nnodes each node's "
                        "dpcompare would restart alone (restart every node with --resume)")


def check_two_level_link(cfg: Placed) -> None:
    """--link-inner and --group-size go together, with --link, and cut the ranks into 2 or more groups."""
    if not (cfg.link_inner or cfg.group_size):
        return
    if not (cfg.link_inner and cfg.group_size):
        raise UserError("--link-inner and --group-size go together (the link inside a group, and its ranks)")
    if not cfg.link:
        raise UserError(f"--link-inner {cfg.link_inner} needs --link RATE: the link between the groups")
    parse_rate(cfg.link_inner)
    if cfg.world_size > 1 and (cfg.group_size < 2 or cfg.world_size % cfg.group_size or cfg.group_size >= cfg.world_size):
        raise UserError(f"--group-size {cfg.group_size} must be 2 or more and divide --nproc {cfg.world_size} "
                        f"into 2 or more groups (for example --group-size {max(2, cfg.world_size // 2)} "
                        f"with --nproc {2 * max(2, cfg.world_size // 2)})")
