"""Views, permutations, slices and joins: sharded dims are carried through where the
shards stay contiguous, and gathered where they would not.

A reshape maps groups of input dims onto groups of output dims of the same
size. Within a group the shards form one nested list of axes (outer dims
first); it survives onto the output dims as long as each axis divides what
is left of the dim it lands on. Heads split out of a sharded feature dim
stay sharded when the head count divides:

    [B, S, H] S2(c)  --view-->  [B, S, heads, head_dim] S2(c)
"""

from __future__ import annotations

import math

from torch.ops import aten

from autoshard.layout import Layout
from autoshard.mesh import Mesh
from autoshard.strategies import Context, Strategy, make, register


def _groups(in_shape, out_shape) -> list[tuple[list[int], list[int]]]:
    """Pair runs of input and output dims whose sizes multiply to the same number.
    Size-1 dims belong to no run: they hold no shards."""
    ins = [d for d, size in enumerate(in_shape) if size != 1]
    outs = [d for d, size in enumerate(out_shape) if size != 1]
    groups, i, j = [], 0, 0
    while i < len(ins) and j < len(outs):
        gi, gj = [ins[i]], [outs[j]]
        pi, pj = in_shape[ins[i]], out_shape[outs[j]]
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj:
                gi.append(ins[i])
                pi *= in_shape[ins[i]]
                i += 1
            else:
                gj.append(outs[j])
                pj *= out_shape[outs[j]]
                j += 1
        groups.append((gi, gj))
    return groups


def reshape_layouts(x: Layout, in_shape, out_shape, mesh: Mesh) -> tuple[Layout, Layout]:
    """(the input layout the reshape needs, the layout of its output) from `x`."""
    need = [list(axes) if in_shape[d] != 1 else [] for d, axes in enumerate(x.dims)]
    out: list[list[str]] = [[] for _ in out_shape]
    for gi, gj in _groups(in_shape, out_shape):
        # The shards of a group read as one nested list while every dim before a
        # sharded one is split down to a single element.
        axes = []
        for d in gi:
            outer = gi[: gi.index(d)]
            if axes and math.prod(in_shape[e] // mesh.count(need[e]) for e in outer) != 1:
                need[d] = []
            axes.extend(need[d])
        placed = 0
        remaining = {d: out_shape[d] for d in gj}
        k = 0
        for axis in axes:
            while k < len(gj) and remaining[gj[k]] == 1:
                k += 1
            if k == len(gj) or remaining[gj[k]] % mesh.size(axis):
                break
            remaining[gj[k]] //= mesh.size(axis)
            out[gj[k]].append(axis)
            placed += 1
        dropped = set(axes[placed:])
        for d in gi:
            need[d] = [a for a in need[d] if a not in dropped]
    return Layout(tuple(tuple(a) for a in need)), Layout(tuple(tuple(a) for a in out))


@register(
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.squeeze.default,
    aten.flatten.using_ints,
    aten.unflatten.int,
)
def reshape(ctx: Context) -> list[Strategy]:
    need, out = reshape_layouts(ctx.layout(0), ctx.shape(0), ctx.out_shape, ctx.mesh)
    return [make("follow", [need], out, lowering="shape")]


@register(aten.transpose.int, aten.t.default, aten.permute.default)
def permute(ctx: Context) -> list[Strategy]:
    x = ctx.layout(0)
    nd = len(ctx.shape(0))
    if ctx.node.target == aten.permute.default:
        order = [d % nd for d in ctx.node.args[1]]
    else:
        d0, d1 = (ctx.node.args[1], ctx.node.args[2]) if len(ctx.node.args) > 2 else (0, 1)
        order = list(range(nd))
        order[d0 % nd], order[d1 % nd] = order[d1 % nd], order[d0 % nd]
    return [make("follow", [x], Layout(tuple(x.dims[d] for d in order)))]


@register(aten.expand.default)
def expand(ctx: Context) -> list[Strategy]:
    x = ctx.layout(0)
    in_shape, out_shape = ctx.shape(0), ctx.out_shape
    offset = len(out_shape) - len(in_shape)
    dims = [()] * offset + [
        x.dims[d] if in_shape[d] == out_shape[d + offset] else () for d in range(len(in_shape))
    ]
    need = Layout(tuple(dims[offset:]))
    return [make("follow", [need], Layout(tuple(dims)), lowering="shape")]


def _dim_arg(ctx: Context, position: int, default: int = 0) -> int:
    args = ctx.node.args
    dim = args[position] if len(args) > position else ctx.node.kwargs.get("dim", default)
    return dim % len(ctx.shape(0))


def _unshard(layout: Layout, dim: int) -> Layout:
    return Layout(tuple(() if d == dim else axes for d, axes in enumerate(layout.dims)))


@register(aten.slice.Tensor, aten.narrow.default)
def slice_(ctx: Context) -> list[Strategy]:
    x = _unshard(ctx.layout(0), _dim_arg(ctx, 1))
    return [make("follow", [x], x)]


@register(aten.select.int)
def select(ctx: Context) -> list[Strategy]:
    dim = _dim_arg(ctx, 1)
    x = _unshard(ctx.layout(0), dim)
    return [make("follow", [x], Layout(x.dims[:dim] + x.dims[dim + 1 :]))]


@register(aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int)
def split(ctx: Context) -> list[Strategy]:
    dim = _dim_arg(ctx, 2 if ctx.node.target != aten.unbind.int else 1)
    x = _unshard(ctx.layout(0), dim)
    pieces = len(ctx.node.meta["val"])
    if ctx.node.target == aten.unbind.int:
        piece = Layout(x.dims[:dim] + x.dims[dim + 1 :])
    else:
        piece = x
    return [make("follow", [x], piece, outputs=(piece,) * pieces)]


@register(aten.cat.default)
def cat(ctx: Context) -> list[Strategy]:
    dim = _dim_arg(ctx, 1)
    ndims = [len(ctx.shape(i)) for i in range(len(ctx.inputs))]
    primary = ndims.index(max(ndims))
    x = _unshard(ctx.layout(primary), dim)
    # a 1-D empty operand (an empty cache, torch.tensor([])) joins anything and holds nothing
    inputs = [x if n == len(x.dims) else Layout.replicated(n) for n in ndims]
    return [make("follow", inputs, x)]
