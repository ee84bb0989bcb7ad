"""Rank entry point for PyTorch: `python -m torch_impl.launch RUN_DIR`.

Started by `compare.launch.spawn --torch` on one machine or `torchrun` across hosts (either sets RANK,
WORLD_SIZE, LOCAL_RANK and the env:// rendezvous), or plain python for one rank; compare/launch/launchers.py
builds those command lines. torchrun forces OMP_NUM_THREADS=1, so threads per rank are set here from
the config, as for MLX.
"""
from __future__ import annotations

import datetime
import os
import sys
from pathlib import Path

from common.errors import UserError
from common.train.collector import imports_uncollected
from common.train.forkranks import fork_ranks
from common.train.loop import World, rank_main
from common.train.placement import KERNEL, place_rank

# Where one machine's ranks outnumber its cores, the kernel places them (common/train/placement.py). Measured on the
# AMD EPYC Zen 5 (2 cores), tiny with 4 layers, pp=2,tp=2 on 4 ranks, 10 steps, in one sitting: 0.20-0.21 s a step
# by the kernel's placement, 0.30-0.32 with one core each, round-robin (gloo's threads then wait behind the rank's
# compute on its one core).
SHARED_CORES = KERNEL


def start_world(cfg) -> World:
    """This rank in the job the run plan's config describes (cfg.world_size ranks, cfg.resolved_backend)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(cfg.threads_per_rank)
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    device = pick_device(cfg.device, local_rank, world_size)
    if world_size == 1:
        return World(rank=0, size=1, group=None, device=device)
    if world_size != cfg.world_size:
        raise UserError(f"the launcher started {world_size} ranks, the run expects {cfg.world_size}")
    # A finite timeout turns a dead or hung peer into an error instead of an endless wait.
    dist.init_process_group(backend=cfg.resolved_backend, timeout=datetime.timedelta(seconds=cfg.collective_timeout_s),
                            device_id=torch.device(device) if device.startswith("cuda") else None)
    from .comm import collectives_of

    world = World(rank=rank, size=world_size, group=None, device=device,
                  collectives=lambda: collectives_of(None, None, device))
    if cfg.mesh:  # a process group per mesh axis (torch_impl/mesh.py)
        from common.parallel.mesh import Mesh

        from .mesh import split_axes
        world.axes = split_axes(world, Mesh.parse(cfg.mesh))
    return world


def pick_device(requested: str, local_rank: int, world_size: int) -> str:
    import torch

    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested in ("cuda", "gpu"):
        if not torch.cuda.is_available():
            raise UserError("--device cuda: torch sees no CUDA device")
        torch.cuda.set_device(local_rank)
        return f"cuda:{local_rank}"
    if requested == "mps":
        if not torch.backends.mps.is_available():
            raise UserError("--device mps: torch sees no MPS device")
        # gloo has no MPS support upstream, so DDP cannot all-reduce MPS tensors: several ranks run on
        # the CPU with gloo, and summary.json's device_note says so (compare/launch/launchers.py).
        return "mps" if world_size == 1 else "cpu"
    return "cpu"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with imports_uncollected():  # common/train/collector.py: 0.5 CPU-s of torch's import
        fork_ranks(lambda: _preload(argv[0]))  # under `spawn --fork`: from here on, one of the ranks
        place_rank(argv[0], SHARED_CORES)
        from .step import Trainer

    code = rank_main(argv[0], start_world, Trainer)
    import torch.distributed as dist

    # After a failure a peer may be gone: tearing the group down could block on it, so just exit.
    if code == 0 and dist.is_initialized():
        dist.destroy_process_group()
    return code


def _preload(run_dir: str) -> None:
    """What every rank of a CPU job imports before its first step (common/train/forkranks.py): torch, the
    step, the strategy's module (DTensor, pipelining), and torch._dynamo, which DDP's constructor imports."""
    import torch._dynamo  # noqa: F401

    from common.metrics import read_json
    from common.runplan import PLAN_FILE

    from .step import STRATEGIES
    strategy = (read_json(Path(run_dir) / PLAN_FILE, None) or {}).get("config", {}).get("strategy")
    if strategy in STRATEGIES:  # an unreadable plan is each rank's error to report, as without --fork
        STRATEGIES[strategy]()


if __name__ == "__main__":
    from common.train.process_exit import exit_now

    exit_now(main())  # no interpreter teardown: 1-1.5 s of a torch process (common/train/process_exit.py)
