"""The ranks of a job arranged on named axes, outermost first, as torch's DeviceMesh names them.

Every run today has one axis, named after its strategy (`Mesh.one_axis("fsdp", 4)`); a strategy object
(common/parallel/layout.py) reads its own axis by name, so a mesh of several axes (fsdp over one, tp over
another) needs no change to the objects' signatures, only to the objects' formulas.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


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

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.axes)

    @property
    def size(self) -> int:
        """Ranks in the whole mesh: the product of the axes' sizes."""
        return math.prod(size for _, size in self.axes)

    def axis(self, name: str) -> int:
        """The size of axis `name`."""
        for axis_name, size in self.axes:
            if axis_name == name:
                return size
        raise KeyError(f"the mesh has no axis {name!r}; it has {', '.join(self.names)}")

    def coordinate(self, rank: int, name: str) -> int:
        """Rank `rank`'s index along axis `name`."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is not in a mesh of {self.size} ranks")
        size = self.axis(name)
        inner = math.prod(axis_size for _, axis_size in self.axes[self.names.index(name) + 1:])
        return rank // inner % size
