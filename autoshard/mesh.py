"""The device mesh as the planner sees it: named axes with sizes.

autoshard always plans on three axes. A mesh given with fewer gets size-1
axes appended, which shard nothing and never communicate, so a 2×4 mesh is
planned as 2×4×1 and a single device as 1×1×1.

    >>> Mesh.from_shape((2, 4))
    Mesh(names=('a', 'b', 'c'), sizes=(2, 4, 1))
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autoshard.errors import MeshError

DEFAULT_AXIS_NAMES = ("a", "b", "c")


@dataclass(frozen=True)
class Mesh:
    names: tuple[str, ...]
    sizes: tuple[int, ...]

    @classmethod
    def from_shape(cls, shape, names=None) -> Mesh:
        shape = tuple(int(s) for s in shape)
        if not 1 <= len(shape) <= 3 or any(s < 1 for s in shape):
            raise MeshError(
                f"mesh shape {shape} is not supported: give 1 to 3 axes of positive sizes, "
                "e.g. (2, 2, 2)"
            )
        names = tuple(names) if names else DEFAULT_AXIS_NAMES[: len(shape)]
        if len(names) != len(shape) or len(set(names)) != len(names):
            raise MeshError(f"mesh axis names {names} do not name the {len(shape)} axes once each")
        spare = [n for n in DEFAULT_AXIS_NAMES + ("_x", "_y", "_z") if n not in names]
        pad = 3 - len(shape)
        return cls(names + tuple(spare[:pad]), shape + (1,) * pad)

    @classmethod
    def from_device_mesh(cls, device_mesh) -> Mesh:
        return cls.from_shape(tuple(device_mesh.mesh.shape), device_mesh.mesh_dim_names)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.sizes

    @property
    def world_size(self) -> int:
        return math.prod(self.sizes)

    def size(self, axis: str) -> int:
        return self.sizes[self.names.index(axis)]

    def count(self, axes) -> int:
        """How many parts `axes` split a dim into together."""
        return math.prod(self.size(a) for a in axes)

    def index(self, axis: str) -> int:
        return self.names.index(axis)

    def relabeled(self, order) -> Mesh:
        """The same axes listed in `order` (each name with its size)."""
        return Mesh(tuple(order), tuple(self.size(a) for a in order))

    def __str__(self) -> str:
        return "×".join(map(str, self.sizes)) + " (" + ", ".join(self.names) + ")"
