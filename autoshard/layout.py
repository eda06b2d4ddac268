"""How a tensor lies on the mesh, and the collectives that move it.

A `Layout` says, for each tensor dimension, which mesh axes split it (outer
axis first: with ``("a", "b")`` on dim 0, rank (i, j) holds chunk
``i * size(b) + j``), and over which axes the value is a pending sum
(``Partial``). Every other axis replicates the tensor. In the vocabulary of
`torch.distributed.tensor`, `Layout.placements` gives one `Shard(dim)`,
`Replicate()` or `Partial()` per mesh axis; the nesting order is the extra
fact a 3D layout needs, since the 3D linear's reduce-scatter nests its axis
inside whichever axis already splits the token dimension.

Gradients follow the forward layout: a shard's gradient is a shard, a
partial sum's gradient is replicated, and a replicated value's gradient is
replicated, except at the input of an op that splits work over the axis,
where it arrives partial (`redistribute`'s ``grad_partial``). `redistribute`
turns one layout into another as a list of `Step`s, each a collective with
the backward that keeps autograd exact:

    >>> mesh = Mesh.from_shape((2, 2, 2))
    >>> src = Layout((("a", "b"), ("c",)))          # tokens over a, b; features over c
    >>> dst = Layout((("a",), ("c",)))               # gathered over b for a matmul
    >>> [str(s) for s in redistribute(src, dst, (8, 16), 4, mesh, frozenset({"b"}))]
    ['all_gather(b, dim=0) ↔ reduce_scatter']
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard  # the one way to nest

from autoshard.mesh import Mesh


@dataclass(frozen=True)
class Layout:
    dims: tuple[tuple[str, ...], ...]
    partial: tuple[str, ...] = ()

    @staticmethod
    def replicated(ndim: int) -> Layout:
        return Layout(((),) * ndim)

    @property
    def ndim(self) -> int:
        return len(self.dims)

    @property
    def sharded_axes(self) -> tuple[str, ...]:
        return tuple(axis for dim in self.dims for axis in dim)

    def dim_of(self, axis: str) -> int | None:
        for d, axes in enumerate(self.dims):
            if axis in axes:
                return d
        return None

    def replicates(self, axis: str) -> bool:
        return axis not in self.partial and self.dim_of(axis) is None

    def normalized(self, mesh: Mesh) -> Layout:
        """The same layout without size-1 axes, which split and sum nothing."""
        keep = [n for n, s in zip(mesh.names, mesh.sizes) if s > 1]
        return Layout(
            tuple(tuple(a for a in axes if a in keep) for axes in self.dims),
            tuple(sorted(a for a in self.partial if a in keep)),  # a sum's order is moot
        )

    def shard_counts(self, mesh: Mesh) -> tuple[int, ...]:
        return tuple(mesh.count(axes) for axes in self.dims)

    def indivisible(self, shape, mesh: Mesh) -> str | None:
        """Why `shape` cannot be split this way, or None when it can."""
        for d, (size, count) in enumerate(zip(shape, self.shard_counts(mesh))):
            if size % count:
                axes = "×".join(f"{a}({mesh.size(a)})" for a in self.dims[d])
                return f"dim {d} of size {size} does not divide over mesh axes {axes}"
        return None

    def local_shape(self, shape, mesh: Mesh) -> tuple[int, ...]:
        return tuple(s // c for s, c in zip(shape, self.shard_counts(mesh)))

    def placements(self, mesh: Mesh) -> tuple:
        """One torch.distributed.tensor placement per mesh axis, exact for any nesting:
        DTensor shards over mesh axes in mesh order, so an axis that nests inside one
        later in the mesh is a `_StridedShard` whose split factor is the product of
        those later, outer axes' sizes.

            >>> Layout((("b", "a"),)).placements(Mesh.from_shape((2, 2, 2)))
            (_StridedShard(dim=0, sf=2), Shard(dim=0), Replicate())
        """
        out = []
        for position, axis in enumerate(mesh.names):
            dim = self.dim_of(axis)
            if dim is None:
                out.append(Partial() if axis in self.partial else Replicate())
                continue
            nest = self.dims[dim]
            later_outer = [a for a in nest[: nest.index(axis)] if mesh.index(a) > position]
            factor = mesh.count(later_outer)
            out.append(Shard(dim) if factor == 1 else _StridedShard(dim, split_factor=factor))
        return tuple(out)

    def shard_slices(self, shape, mesh: Mesh, coord: dict[str, int]) -> list[tuple[int, int]]:
        """Per dim, the [start, stop) of the global tensor the rank at `coord` holds.

        Axes splitting one dim nest outer to inner: with (x, y) the chunk index is
        ``coord[x] * size(y) + coord[y]`` of ``size(x) * size(y)`` equal chunks.

            >>> Layout((("b", "a"),)).shard_slices((8,), Mesh.from_shape((2, 2, 2)),
            ...                                    {"a": 1, "b": 0, "c": 0})
            [(2, 4)]
        """
        out = []
        for size, axes in zip(shape, self.dims):
            index, count = 0, 1
            for axis in axes:
                index = index * mesh.size(axis) + coord[axis]
                count *= mesh.size(axis)
            chunk = size // count
            out.append((index * chunk, (index + 1) * chunk))
        return out

    def __str__(self) -> str:
        parts = [f"S{d}({','.join(axes)})" for d, axes in enumerate(self.dims) if axes]
        if self.partial:
            parts.append(f"P({','.join(self.partial)})")
        return " ".join(parts) or "R"


@dataclass(frozen=True)
class Step:
    """One collective (or a free local split) with the backward that pairs with it.

    ``nbytes`` is the size of the full buffer: an all-gather's gathered output,
    a reduce-scatter's or all-reduce's unreduced input, a split's unsplit
    input. The backward moves a buffer of the same size.
    """

    kind: str  # all_gather | reduce_scatter | all_reduce | split | grad_all_reduce | to_partial
    axis: str
    dim: int | None
    backward: str  # split | reduce_scatter | all_gather | all_reduce | identity
    nbytes: int
    group_size: int

    def ring_bytes(self, collective: str) -> float:
        """Bytes a rank sends on a ring for `collective` of this buffer."""
        n = self.group_size
        return {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2}.get(collective, 0) * (
            (n - 1) / n * self.nbytes
        )

    @property
    def forward_collective(self) -> str:
        return {"split": "none", "grad_all_reduce": "none", "to_partial": "none"}.get(
            self.kind, self.kind
        )

    @property
    def backward_collective(self) -> str:
        return (
            self.backward
            if self.backward in ("all_gather", "reduce_scatter", "all_reduce")
            else "none"
        )

    def __str__(self) -> str:
        where = f", dim={self.dim}" if self.dim is not None else ""
        return f"{self.kind}({self.axis}{where}) ↔ {self.backward}"


def redistribute(
    src: Layout,
    dst: Layout,
    shape,
    itemsize: int,
    mesh: Mesh,
    grad_partial: frozenset[str] = frozenset(),
) -> list[Step]:
    """The steps that turn a value laid out as `src` into `dst`.

    `grad_partial` names the axes over which `dst` is replicated but its
    consumer splits the work, so the gradient comes back partial and each
    such axis's last step reduces it (reduce-scatter or all-reduce, or an
    identity whose backward all-reduces).
    """
    return list(_redistribute(src, dst, tuple(shape), itemsize, mesh, frozenset(grad_partial)))


@functools.lru_cache(maxsize=1 << 16)  # the planner asks the same questions for every block
def _redistribute(src, dst, shape, itemsize, mesh, grad_partial) -> tuple[Step, ...]:
    grad_partial = {a for a in grad_partial if mesh.size(a) > 1}
    dims = [list(axes) for axes in src.dims]
    partial = [a for a in mesh.names if a in src.partial]
    steps: list[tuple[str, str, int | None, int]] = []

    def local_numel() -> int:
        return math.prod(s // mesh.count(axes) for s, axes in zip(shape, dims))

    kept = []  # per dim, how many of its axes (outermost first) stay as they are
    for d, want in enumerate(dst.dims):
        keep = 0
        while keep < min(len(dims[d]), len(want)) and dims[d][keep] == want[keep]:
            keep += 1
        kept.append(keep)
    gathered = [d for d in range(len(dims)) if kept[d] < len(dims[d])]
    # Splits first where they are free (an axis that splits nothing yet and is not
    # partial, onto a dim that gathers nothing): the gathers after them then move 1/n
    # of the bytes, and so do their backwards (heads split before the sequence is
    # gathered).
    held = {axis for axes in dims for axis in axes} | set(partial)
    for d, want in enumerate(dst.dims):
        for axis in want[len(dims[d]) :] if d not in gathered else ():
            if axis in held:
                break
            steps.append(("split", axis, d, local_numel()))
            dims[d].append(axis)
    for d in gathered:
        while len(dims[d]) > kept[d]:
            axis = dims[d].pop()
            steps.append(("all_gather", axis, d, local_numel()))
    for d, want in enumerate(dst.dims):
        for axis in want[len(dims[d]) :]:
            kind = "reduce_scatter" if axis in partial else "split"
            if axis in partial:
                partial.remove(axis)
            steps.append((kind, axis, d, local_numel()))
            dims[d].append(axis)
    for axis in list(partial):
        if axis not in dst.partial:
            steps.append(("all_reduce", axis, None, local_numel()))
            partial.remove(axis)
    for axis in dst.partial:
        if axis not in partial:
            steps.append(("to_partial", axis, None, local_numel()))

    last = {axis: i for i, (_, axis, _, _) in enumerate(steps)}
    out = []
    for i, (kind, axis, dim, numel) in enumerate(steps):
        reduce_grad = axis in grad_partial and last[axis] == i
        backward = {
            "all_gather": "reduce_scatter" if reduce_grad else "split",
            "all_reduce": "all_reduce" if reduce_grad else "identity",
            "reduce_scatter": "all_gather",
            "split": "all_gather",
            "to_partial": "identity",
        }[kind]
        out.append(Step(kind, axis, dim, backward, numel * itemsize, mesh.size(axis)))
    local_bytes = local_numel() * itemsize
    for axis in mesh.names:
        if axis in grad_partial and axis not in last:
            out.append(
                Step("grad_all_reduce", axis, None, "all_reduce", local_bytes, mesh.size(axis))
            )
    return tuple(out)


def steps_ring_bytes(steps: list[Step]) -> float:
    """Forward plus backward bytes a rank sends for these steps."""
    return sum(
        s.ring_bytes(s.forward_collective) + s.ring_bytes(s.backward_collective) for s in steps
    )
