"""Views, permutations, slices and joins: sharded dims are carried through where the
shards stay contiguous, and gathered where they would not.

A reshape maps groups of input dims onto groups of output dims of the same
size. Within a group each axis fixes one digit of the group's flat index;
it stays sharded where an output dim can name that digit, and is gathered
where the local reshape would interleave other ranks' elements
(`reshape_layouts`). Heads split out of a sharded feature dim stay sharded
when the head count divides:

    [B, S, H] S2(c)  --view-->  [B, S, heads, head_dim] S2(c)
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING

from torch import fx
from torch.ops import aten

from autoshard.layout import Layout
from autoshard.mesh import Mesh
from autoshard.runtime import ops
from autoshard.strategies.base import Context, Lowering, Strategy, make
from autoshard.strategies.registry import register
from autoshard.tracing.trace import tensor_inputs

if TYPE_CHECKING:
    from autoshard.planning.plan import NodePlan


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
    """(the input layout the reshape needs, the layout of its output) from `x`.

    Within a group, a dim of size n split over axes (s1, s2, …) reads as the
    digits [s1, s2, …, n / (s1·s2·…)] of its index, and the group's flat index
    is its dims' digits in order: each axis fixes the digit at one place
    value (stride) of that flat index, and every other digit is local. The
    output dims cut the same flat index into their own digits; the local
    reshape is exactly the output's shard when every axis fixes a digit
    that an output dim can name: inside one output dim, as its outermost
    digit or right below the axis placed there before. An axis that cannot
    be placed is gathered first (the axes after it then read as the outer
    ones of their dim). A sharded batch dim behind an unsharded one, as in
    ``x.transpose(0, 1).reshape(T * B, E)``, is such an axis.
    """
    need: list[list[str]] = [[] for _ in in_shape]
    out: list[list[str]] = [[] for _ in out_shape]
    for gi, gj in _groups(in_shape, out_shape):
        in_stride, out_stride = _strides(in_shape, gi), _strides(out_shape, gj)
        lowest: dict[int, int] = {}  # output dim → stride of the last axis placed in it
        for d in gi:
            left = in_shape[d]  # the dim's size over the axes kept so far
            for axis in x.dims[d]:
                size = mesh.size(axis)
                if size == 1:  # splits nothing: it may stay wherever it is
                    need[d].append(axis)
                    continue
                if left % size:
                    continue  # gathered: it does not divide what is left of its dim
                stride = in_stride[d] * left // size
                e = next(e for e in gj if out_stride[e] <= stride < out_stride[e] * out_shape[e])
                top = out_stride[e] * out_shape[e] if e not in lowest else lowest[e]
                if stride % out_stride[e] or stride * size != top:
                    continue  # gathered: its digit is not one the output can name
                need[d].append(axis)
                out[e].append(axis)
                lowest[e] = stride
                left //= size
    return Layout(tuple(tuple(a) for a in need)), Layout(tuple(tuple(a) for a in out))


def _strides(shape, group: list[int]) -> dict[int, int]:
    """The place value of each dim of `group` in the group's flat index."""
    strides, stride = {}, 1
    for d in reversed(group):
        strides[d] = stride
        stride *= shape[d]
    return strides


_TO_LOCAL_SHAPE = (
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.squeeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
)


def _local_shape(node: fx.Node, placed: NodePlan, mesh: Mesh) -> None:
    """Views and expands name their output shape: give them the local one."""
    local = list(placed.strategy.stored.local_shape(placed.shape, mesh))
    if node.target == aten.unflatten.int:
        x, dim, sizes = node.args
        dim %= len(placed.shape) - len(sizes) + 1
        node.args = (x, dim, local[dim : dim + len(sizes)])
    elif node.target in _TO_LOCAL_SHAPE:
        # a shard may not be laid out in memory as the global tensor was: reshape, not
        # view; and a squeeze would also drop a dim that is 1 only on this rank
        node.target = aten.reshape.default
        node.args = (node.args[0], local)
    elif node.target == aten.expand.default:
        node.args = (node.args[0], local, *node.args[2:])


SHAPE = Lowering("shape", _local_shape)


def reshape(ctx: Context) -> list[Strategy]:
    need, out = reshape_layouts(ctx.layout(0), ctx.shape(0), ctx.out_shape, ctx.mesh)
    return [make("follow", [need], out, lowering=SHAPE)]


# Views launch no kernel and move no data (`free`); some of them return a tensor
# that shares its input's storage (`aliases`: also expand, slice and select), which
# the memory model counts once, as that storage.
register(
    aten.view.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    free=True,
    aliases=True,
    lowerings=(SHAPE,),
)(reshape)
register(
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.flatten.using_ints,
    aten.unflatten.int,
    free=True,
    lowerings=(SHAPE,),
)(reshape)
register(aten.squeeze.default, aliases=True, lowerings=(SHAPE,))(reshape)  # priced as a kernel
register(operator.getitem, free=True)()  # one output of split, chunk, topk: the planner's


@register(aten.transpose.int, aten.t.default, aten.permute.default, free=True, aliases=True)
def permute(ctx: Context) -> list[Strategy]:
    x = Layout(ctx.layout(0).dims)  # a pending sum is reduced first, as by every view
    nd = len(ctx.shape(0))
    if ctx.node.target == aten.permute.default:
        order = [d % nd for d in ctx.node.args[1]]
    else:
        d0, d1 = (ctx.node.args[1], ctx.node.args[2]) if len(ctx.node.args) > 2 else (0, 1)
        order = list(range(nd))
        order[d0 % nd], order[d1 % nd] = order[d1 % nd], order[d0 % nd]
    return [make("follow", [x], Layout(tuple(x.dims[d] for d in order)))]


@register(aten.expand.default, free=True, aliases=True, lowerings=(SHAPE,))
def expand(ctx: Context) -> list[Strategy]:
    x = ctx.layout(0)
    in_shape, out_shape = ctx.shape(0), ctx.out_shape
    offset = len(out_shape) - len(in_shape)
    dims = [()] * offset + [
        x.dims[d] if in_shape[d] == out_shape[d + offset] else () for d in range(len(in_shape))
    ]
    need = Layout(tuple(dims[offset:]))
    return [make("follow", [need], Layout(tuple(dims)), lowering=SHAPE)]


def _dim_arg(ctx: Context, position: int, default: int = 0) -> int:
    return _dim_of(ctx.node, position, default)


def _dim_of(node: fx.Node, position: int, default: int = 0) -> int:
    """The dim argument at `position` (or keyword `dim`) of `node`, non-negative."""
    args = node.args
    dim = args[position] if len(args) > position else node.kwargs.get("dim", default)
    return dim % tensor_inputs(node)[0].meta["val"].ndim


def _unshard(layout: Layout, dim: int) -> Layout:
    return Layout(tuple(() if d == dim else axes for d, axes in enumerate(layout.dims)))


def slice_(ctx: Context) -> list[Strategy]:
    x = _unshard(ctx.layout(0), _dim_arg(ctx, 1))
    return [make("follow", [x], x)]


register(aten.slice.Tensor, free=True, aliases=True)(slice_)
register(aten.narrow.default)(slice_)  # priced as a kernel


@register(aten.select.int, free=True, aliases=True)
def select(ctx: Context) -> list[Strategy]:
    dim = _dim_arg(ctx, 1)
    x = _unshard(ctx.layout(0), dim)
    return [make("follow", [x], Layout(x.dims[:dim] + x.dims[dim + 1 :]))]


def _split_pieces_to_shards(node: fx.Node, placed: NodePlan, mesh: Mesh) -> None:
    dim = _split_dim(node)
    axes = tuple(piece.dims[dim] for piece in placed.strategy.outputs)
    node.args = (str(node.target), *node.args)
    node.kwargs = {**node.kwargs, "split_dim": dim, "axes": axes}
    node.target = ops.split_to_shards


SPLIT_TO_SHARDS = Lowering("shards", _split_pieces_to_shards)


def _split_dim(node: fx.Node) -> int:
    return _dim_of(node, 1 if node.target == aten.unbind.int else 2)


def split(ctx: Context) -> list[Strategy]:
    """A split of a sharded dim gathers it; each piece that divides over the axes
    gathered is cut to its shard at once, so that the work after the split (a fused
    q/k/v projection's heads) stays split instead of running whole on every rank of
    those axes. Its backward then reduce-scatters the gathered input's gradient
    instead of slicing it; a piece that does not divide (multi-query attention's one
    key head) stays whole, its gradient passed on one rank of those axes."""
    dim = _split_dim(ctx.node)
    x = _unshard(ctx.layout(0), dim)
    pieces = len(ctx.result_shapes)
    if ctx.node.target == aten.unbind.int:
        piece = Layout(x.dims[:dim] + x.dims[dim + 1 :])
        return [make("follow", [x], piece, outputs=(piece,) * pieces)]
    gathered = ctx.layout(0).dims[dim]
    count = ctx.mesh.count(gathered)
    cut = Layout(x.dims[:dim] + (gathered,) + x.dims[dim + 1 :])
    outputs = tuple(cut if shape[dim] % count == 0 else x for shape in ctx.result_shapes)
    if count > 1 and cut in outputs:
        return [make("follow", [x], cut, outputs=outputs, lowering=SPLIT_TO_SHARDS)]
    return [make("follow", [x], x, outputs=(x,) * pieces)]


# Their outputs view the input's storage (`aliases`): a getitem of one is that storage.
register(
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.tensor_split.indices,
    aten.tensor_split.sections,
    free=True,
    aliases=True,
    lowerings=(SPLIT_TO_SHARDS,),
)(split)
register(aten.chunk.default, aliases=True, lowerings=(SPLIT_TO_SHARDS,))(split)  # as kernels
register(aten.unbind.int, aliases=True)(split)


@register(aten.cat.default)
def cat(ctx: Context) -> list[Strategy]:
    dim = _dim_arg(ctx, 1)
    ndims = [len(ctx.shape(i)) for i in range(len(ctx.inputs))]
    primary = ndims.index(max(ndims))
    x = _unshard(ctx.layout(primary), dim)
    # a 1-D empty operand (an empty cache, torch.tensor([])) joins anything and holds nothing
    inputs = [x if n == len(x.dims) else Layout.replicated(n) for n in ndims]
    return [make("follow", inputs, x)]
