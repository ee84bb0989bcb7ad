"""The ranks of a job arranged on named axes, outermost first, as torch's DeviceMesh names them.

A one-strategy run has one axis, named after its strategy (`Mesh.one_axis("fsdp", 4)`); `--mesh dp=2,tp=2`
(`Mesh.parse`) has several. Whatever order the user writes them in, the axes are laid out in one canonical
order, torchtitan's: pp outermost, then the data axis (dp or fsdp), then tp innermost. Rank r's coordinates
are r in mixed radix, the last axis varying fastest, so the ranks of the inner axis are neighbours: tp, whose
all-reduces sit on the critical path of every layer, talks between ranks r and r+1 (one machine, the fast
link); pp, which sends one activation per piece and boundary, spans the farthest ranks (the slow link).

`groups(axis)` says which ranks share an axis (each group talks on that axis alone, a sub-communicator in
the frameworks: mlx_impl/mesh.py, torch_impl/mesh.py); `describe()` writes it for people (docs/strategies.md,
the launcher's log line).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from common.errors import UserError

# Outermost first (the module docstring says why). dp and fsdp are the data axes: one of them at most.
AXIS_ORDER = ("pp", "dp", "fsdp", "cp", "tp")  # cp: all-to-alls every layer, next to tp (cp.py)
DATA_AXES = ("dp", "fsdp")
# The axis of a one-strategy run is named after the strategy; ddp's data axis is `dp` in a mesh.
STRATEGY_AXIS = {"ddp": "dp", "fsdp": "fsdp", "tp": "tp", "pp": "pp", "cp": "cp"}


@dataclass(frozen=True)
class Mesh:
    """Named axes and their sizes, outermost first: rank r's coordinates are r in mixed radix, the last
    axis varying fastest (the ranks of an inner axis are neighbours)."""
    axes: tuple[tuple[str, int], ...]

    def __post_init__(self):
        names = [name for name, _ in self.axes]
        if not self.axes or len(set(names)) != len(names) or any(size < 1 for _, size in self.axes):
            raise ValueError(f"a mesh needs at least one axis, distinct names and sizes >= 1, got {self.axes!r}")

    @classmethod
    def one_axis(cls, name: str, size: int) -> Mesh:
        return cls(((name, int(size)),))

    @classmethod
    def parse(cls, text: str) -> Mesh:
        """`--mesh dp=2,tp=2` -> the mesh in canonical order (AXIS_ORDER), or a one-line UserError."""
        sizes: dict[str, int] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            name, sep, value = item.partition("=")
            name = name.strip()
            if not sep or name not in AXIS_ORDER:
                raise UserError(f"--mesh {text}: {item!r} is not AXIS=SIZE with AXIS one of {', '.join(AXIS_ORDER)}")
            if name in sizes:
                raise UserError(f"--mesh {text}: axis {name} is given twice")
            try:
                sizes[name] = int(value)
            except ValueError:
                raise UserError(f"--mesh {text}: the size of {name}, {value.strip()!r}, is not a whole number") from None
            if sizes[name] < 1:
                raise UserError(f"--mesh {text}: axis {name}={sizes[name]} must be at least 1")
        if not sizes:
            raise UserError(f"--mesh {text!r} names no axis: write AXIS=SIZE,... (for example dp=2,tp=2)")
        if len([a for a in sizes if a in DATA_AXES]) > 1:
            raise UserError(f"--mesh {text}: dp and fsdp are both data axes; use one of them")
        return cls(tuple((name, sizes[name]) for name in AXIS_ORDER if name in sizes))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.axes)

    @property
    def size(self) -> int:
        """Ranks in the whole mesh: the product of the axes' sizes."""
        return math.prod(size for _, size in self.axes)

    @property
    def text(self) -> str:
        """The mesh as --mesh takes it, in canonical order: "dp=2,tp=2"."""
        return ",".join(f"{name}={size}" for name, size in self.axes)

    def has(self, name: str) -> bool:
        return name in self.names

    def axis(self, name: str) -> int:
        """The size of axis `name`."""
        for axis_name, size in self.axes:
            if axis_name == name:
                return size
        raise KeyError(f"the mesh has no axis {name!r}; it has {', '.join(self.names)}")

    @property
    def tp_stages(self) -> bool:
        """pp x tp (with dp beside it or not): each pipeline stage's blocks split over a tp group."""
        return self.has("pp") and self.has("tp")

    @property
    def model_axis(self) -> str | None:
        """The outermost axis that splits the model (pp, else tp), None where every rank holds it whole."""
        return next((name for name in self.names if name in ("pp", "tp")), None)

    @property
    def data_axis(self) -> str | None:
        """The axis whose ranks read different samples (dp or fsdp), None where every rank reads the whole batch."""
        return next((name for name in self.names if name in DATA_AXES), None)

    @property
    def data_size(self) -> int:
        """Ranks that read different samples: the data axis's size, 1 without one."""
        return self.axis(self.data_axis) if self.data_axis else 1

    def resized(self, world_size: int) -> Mesh | None:
        """The mesh at `world_size` ranks with every model axis kept (tp, pp: the model's split is the
        checkpoint's) and the data axis alone grown or shrunk: a restart on fewer ranks. None where the model
        axes do not divide `world_size`, or where there is no data axis to change."""
        model = self.size // self.data_size
        if world_size % model or (self.data_axis is None and world_size != self.size):
            return None
        data = world_size // model
        axis = self.data_axis or "dp"
        kept = [(name, size) for name, size in self.axes if name != axis]
        return Mesh.parse(",".join(f"{name}={size}" for name, size in kept + ([(axis, data)] if data > 1 else [])))

    def _stride(self, name: str) -> int:
        return math.prod(axis_size for _, axis_size in self.axes[self.names.index(name) + 1:])

    def coordinate(self, rank: int, name: str) -> int:
        """Rank `rank`'s index along axis `name`."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is not in a mesh of {self.size} ranks")
        return rank // self._stride(name) % self.axis(name)

    def coordinates(self, rank: int) -> dict[str, int]:
        return {name: self.coordinate(rank, name) for name in self.names}

    def group(self, rank: int, name: str) -> tuple[int, ...]:
        """The ranks that share every coordinate with `rank` but the one on `name`, in the order of that
        coordinate: the group `rank` talks to on axis `name`."""
        base = rank - self.coordinate(rank, name) * self._stride(name)
        return tuple(base + i * self._stride(name) for i in range(self.axis(name)))

    def groups(self, name: str) -> list[tuple[int, ...]]:
        """Every group of axis `name`, by their first rank: each is one sub-communicator."""
        return sorted({self.group(rank, name) for rank in range(self.size)})

    def describe(self) -> list[str]:
        """One line per axis, outermost first: which ranks talk to each other on it."""
        return [f"{name}={size}: " + " ".join("[" + ",".join(map(str, g)) + "]" for g in self.groups(name))
                for name, size in self.axes]
