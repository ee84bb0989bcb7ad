"""How ranks share the work: one object per strategy (its layout and its cost), meshes, and pipeline schedules.

STRATEGIES is the one registry of strategy names in common/: everything framework-neutral that depends on the
strategy asks its object (common/parallel/layout.py says what each answers), never its name. A new strategy is
one Layout subclass here plus one class per framework (mlx_impl/, torch_impl/ step.py's STRATEGIES).

    ddp.py    replicated data parallelism
    fsdp.py   sharded data parallelism (ZeRO-3 / FSDP2), the fsdp row split, reduce_scatter_kind
    tp.py     tensor parallelism (Megatron), the tp split
    pp.py     pipeline parallelism's cost and checks; pipeline.py its stages and schedules
    zero.py   ZeRO-1 and ZeRO-2 (zero1, zero2): ddp with the optimizer state (and zero2's gradients) sharded
    cp.py     context parallelism, the sequence axis (Ulysses's all-to-alls around attention)
    mesh.py   the ranks on named axes (--mesh dp=2,tp=2), which ranks share each axis
    composed.py  several strategies over the axes of one mesh (`MeshLayout`, --strategy mesh)

The functions below are shortcuts by name for callers that hold a strategy name and a world size.
"""
from __future__ import annotations

from common.costmodel.links import Collective
from common.costmodel.workload import Workload
from common.errors import UserError
from common.model.spec import ModelSpec
from common.parallel.composed import MeshLayout
from common.parallel.cp import CpLayout
from common.parallel.ddp import DdpLayout
from common.parallel.fsdp import FsdpLayout
from common.parallel.layout import Layout
from common.parallel.mesh import STRATEGY_AXIS, Mesh
from common.parallel.pp import PpLayout
from common.parallel.tp import TpLayout
from common.parallel.zero import Zero1Layout, Zero2Layout

STRATEGIES: dict[str, type[Layout]] = {cls.name: cls for cls in (DdpLayout, FsdpLayout, TpLayout, PpLayout,
                                                                 Zero1Layout, Zero2Layout, CpLayout)}
MESH_STRATEGY = MeshLayout.name  # --strategy mesh: the strategies of RunConfig.mesh's axes, composed
AXIS_STRATEGY = {axis: strategy for strategy, axis in STRATEGY_AXIS.items()}


def layout(strategy: str, world_size: int, mesh: str = "") -> Layout:
    """`strategy`'s object over a mesh of one axis of `world_size` ranks, or (strategy "mesh") the composition
    of the axes of `mesh` ("dp=2,tp=2"), which must hold `world_size` ranks."""
    if strategy == MESH_STRATEGY:
        if not mesh:
            raise UserError("--strategy mesh needs --mesh AXIS=SIZE,... (for example --mesh dp=2,tp=2)")
        grid = Mesh.parse(mesh)
        if grid.size != world_size:
            sizes = " x ".join(str(size) for _, size in grid.axes)
            raise UserError(f"--mesh {grid.text} holds {sizes} = {grid.size} ranks, but the run has "
                            f"{world_size} (--nproc x --nnodes): make them equal")
        return MeshLayout(grid)
    if strategy not in STRATEGIES:
        raise UserError(f"unknown strategy {strategy!r}; allowed: {', '.join(STRATEGIES)}")
    if mesh:
        raise UserError(f"--mesh {mesh} and --strategy {strategy}: a mesh names its own strategies; leave one out")
    return STRATEGIES[strategy](Mesh.one_axis(STRATEGY_AXIS.get(strategy, strategy), world_size))


def mesh_fields(values: dict) -> dict:
    """Config values with `mesh` made canonical: a mesh of one axis is that axis's strategy (`--mesh tp=2` is
    `--strategy tp`), a mesh of several is strategy "mesh"; a strategy named beside a mesh must be that one."""
    text = values.get("mesh")
    if not text:
        return values
    grid = Mesh.parse(text)
    strategy = AXIS_STRATEGY[grid.names[0]] if len(grid.axes) == 1 else MESH_STRATEGY
    named = values.get("strategy")
    if named not in (None, strategy):
        raise UserError(f"--mesh {grid.text} and --strategy {named}: a mesh names its own strategies; leave "
                        "--strategy out")
    return {**values, "strategy": strategy, "mesh": grid.text if strategy == MESH_STRATEGY else ""}


def describe_mesh(mesh: str) -> list[str]:
    """Which ranks share each axis of `mesh`, one line per axis (the launcher logs it; docs/strategies.md)."""
    return Mesh.parse(mesh).describe()


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
