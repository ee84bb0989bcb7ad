"""How ranks share the work: one object per strategy (its layout and its cost), meshes, and pipeline schedules.

STRATEGIES is the one registry of strategy names in common/: everything framework-neutral that depends on the
strategy asks its object (common/parallel/layout.py says what each answers), never its name. A new strategy is
one Layout subclass here plus one class per framework (mlx_impl/, torch_impl/ step.py's STRATEGIES).

    ddp.py    replicated data parallelism
    fsdp.py   sharded data parallelism (ZeRO-3 / FSDP2), the fsdp row split, reduce_scatter_kind
    tp.py     tensor parallelism (Megatron), the tp split
    pp.py     pipeline parallelism's cost and checks; pipeline.py its stages and schedules
    mesh.py   the ranks on named axes

The functions below are shortcuts by name for callers that hold a strategy name and a world size.
"""
from __future__ import annotations

from common.costmodel.links import Collective
from common.costmodel.workload import Workload
from common.errors import UserError
from common.model.spec import ModelSpec
from common.parallel.ddp import DdpLayout
from common.parallel.fsdp import FsdpLayout
from common.parallel.layout import Layout
from common.parallel.mesh import Mesh
from common.parallel.pp import PpLayout
from common.parallel.tp import TpLayout

STRATEGIES: dict[str, type[Layout]] = {cls.name: cls for cls in (DdpLayout, FsdpLayout, TpLayout, PpLayout)}


def layout(strategy: str, world_size: int, mesh: str = "") -> Layout:
    """`strategy`'s object over a mesh of one axis of `world_size` ranks. (`mesh`, the axes of a composed mesh,
    arrives with the mesh layer: until then it is refused.)"""
    if mesh:
        raise UserError(f"mesh {mesh}: composed meshes are not in this build")
    if strategy not in STRATEGIES:
        raise UserError(f"unknown strategy {strategy!r}; allowed: {', '.join(STRATEGIES)}")
    return STRATEGIES[strategy](Mesh.one_axis(strategy, world_size))


def check_strategy(strategy: str, spec: ModelSpec, world_size: int) -> None:
    layout(strategy, world_size).check(spec)


def data_parallel(strategy: str, rank: int, world_size: int) -> tuple[int, int]:
    return layout(strategy, world_size).data_parallel(rank)


def comm_bytes_per_step_estimate(strategy: str, spec: ModelSpec, world_size: int, micro_batch_size: int,
                                 seq_len: int, grad_accum: int, dtype: str = "float32") -> int | None:
    return layout(strategy, world_size).comm_bytes_per_step_estimate(spec, micro_batch_size, seq_len, grad_accum,
                                                                     dtype)


def local_parameters(strategy: str, spec: ModelSpec, n: int, framework: str = "torch") -> float:
    return layout(strategy, n).local_parameters(spec, framework)


def work_fraction(strategy: str, w: Workload, n: int) -> float:
    return layout(strategy, n).work_fraction(w)


def state_fraction(strategy: str, w: Workload, n: int) -> float:
    return layout(strategy, n).state_fraction(w)


def collectives(strategy: str, w: Workload, n: int, reduce_scatter: str = "native") -> list[Collective]:
    return layout(strategy, n).collectives(w, reduce_scatter)
