"""Rank entry point for MLX: `python -m mlx_impl.launch RUN_DIR`.

Started by `mlx.launch` (ring), `mpirun` (mpi) or plain python (one rank: `mlx.launch -n 1` crashes);
the launcher in compare/launch/runner.py builds those command lines. Threads per rank come from the
environment the launcher sets (OMP/OpenBLAS variables), the same for both frameworks.
"""
from __future__ import annotations

import sys

from common.errors import UserError
from common.train.collector import imports_uncollected
from common.train.loop import World, rank_main
from common.train.placement import ROUND_ROBIN, place_rank

# Where one machine's ranks outnumber its cores, one core each, round-robin (common/train/placement.py). Measured on
# the AMD EPYC Zen 5 (2 cores), tiny with 4 layers, 4 ranks, 10 steps, pinned against the kernel's placement, in one
# sitting: pp=2,tp=2 on MPI 0.146-0.149 s a step against 0.146 or 0.217 (the kernel's coin flip: 0.213-0.218 with
# each tp pair pinned to one core); ddp on ring 0.083-0.088 against 0.090-0.122; pp x4 on ring 0.214-0.222 against
# 0.256-0.277; dp=2,tp=2 and dp=2,pp=2 on MPI alike (0.062-0.076 either way).
SHARED_CORES = ROUND_ROBIN

# mlx.launch's backend names that mx.distributed.init does not know: jaccl-ring is jaccl told by
# mlx.launch (MLX_JACCL_RING=1) to connect only neighbours.
INIT_BACKEND = {"jaccl-ring": "jaccl"}


def start_world(cfg) -> World:
    """This rank in the job the run plan's config describes (cfg.world_size ranks, cfg.resolved_backend)."""
    import mlx.core as mx

    device = pick_device(cfg.device, 0, cfg.world_size)
    if cfg.world_size == 1:
        return World(rank=0, size=1, group=None, device=device)
    backend = cfg.resolved_backend
    group = mx.distributed.init(backend=INIT_BACKEND.get(backend, backend), strict=True)
    if group.size() != cfg.world_size:
        raise UserError(f"the {backend} backend started {group.size()} ranks, the run expects "
                        f"{cfg.world_size}")
    from .comm import collectives_of, communication_stream

    world = World(rank=group.rank(), size=group.size(), group=group, device=device,
                  collectives=lambda: collectives_of(group, communication_stream(cfg), device))
    if cfg.mesh:  # a sub-group per mesh axis (mlx_impl/mesh.py)
        from common.parallel.mesh import Mesh

        from .mesh import split_axes
        world.axes = split_axes(world, Mesh.parse(cfg.mesh))
    return world


def pick_device(requested: str, local_rank: int, world_size: int) -> str:
    """MLX has one GPU per process (Metal or CUDA), so the local rank plays no part here."""
    import mlx.core as mx

    if requested in ("gpu", "cuda", "mps"):
        if not mx.is_available(mx.gpu):
            raise UserError(f"--device {requested}: this MLX build has no GPU")
        mx.set_default_device(mx.gpu)
    elif requested == "cpu":
        mx.set_default_device(mx.cpu)
    return "gpu" if mx.default_device() == mx.gpu else "cpu"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with imports_uncollected():  # common/train/collector.py
        place_rank(argv[0], SHARED_CORES)  # before MLX starts its threads, which inherit the cores
        from .step import Trainer

    worlds: list[World] = []

    def started(cfg) -> World:
        worlds.append(start_world(cfg))
        return worlds[-1]

    code = rank_main(argv[0], started, Trainer)
    # Split groups (a mesh's axes, mlx_impl/mesh.py; a pipeline's embedding group, pp.py) must be freed while MPI is
    # up: the trainer that holds them is garbage by now, in reference cycles.
    if worlds and worlds[0].group is not None:
        import gc

        from .mesh import release_axes
        release_axes(worlds[0])
        worlds.clear()
        gc.collect()
    return code


if __name__ == "__main__":
    from common.train.process_exit import exit_now

    exit_now(main())  # no interpreter teardown: 1-1.5 s of a torch process (common/train/process_exit.py)
