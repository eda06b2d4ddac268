"""Pointwise ops follow their largest input; broadcast operands are split to match.

An operand that broadcasts along a dim the output shards is replicated there:
its gradient then comes back partial, which the planner reduces.
"""

from __future__ import annotations

from torch.ops import aten

from autoshard.layout import Layout
from autoshard.strategies.base import Context, Strategy, make, register

POINTWISE = (
    aten.add.Tensor,
    aten.sub.Tensor,
    aten.mul.Tensor,
    aten.div.Tensor,
    aten.add.Scalar,
    aten.sub.Scalar,
    aten.mul.Scalar,
    aten.div.Scalar,
    aten.rsub.Scalar,
    aten.pow.Tensor_Scalar,
    aten.neg.default,
    aten.exp.default,
    aten.log.default,
    aten.sqrt.default,
    aten.rsqrt.default,
    aten.abs.default,
    aten.gelu.default,
    aten.relu.default,
    aten.tanh.default,
    aten.sigmoid.default,
    aten.silu.default,
    aten.clone.default,
    aten.contiguous.default,
    aten.alias.default,
    aten.to.dtype,
    aten._to_copy.default,
    aten.where.self,
    aten.masked_fill.Scalar,
    aten.masked_fill.Tensor,
    aten.cos.default,
    aten.sin.default,
    aten.to.dtype_layout,
    aten.to.device,
    aten.detach.default,
    aten.maximum.default,
    aten.minimum.default,
    aten.clamp.default,
    aten.square.default,
    aten.reciprocal.default,
    # comparisons and logical ops: masks, built elementwise from ids and positions
    aten.eq.Tensor,
    aten.eq.Scalar,
    aten.ne.Tensor,
    aten.ne.Scalar,
    aten.le.Tensor,
    aten.le.Scalar,
    aten.lt.Tensor,
    aten.lt.Scalar,
    aten.ge.Tensor,
    aten.ge.Scalar,
    aten.gt.Tensor,
    aten.gt.Scalar,
    aten.__and__.Tensor,
    aten.__or__.Tensor,
    aten.bitwise_and.Tensor,
    aten.bitwise_or.Tensor,
    aten.logical_not.default,
    aten.bitwise_not.default,
)


def aligned(out: Layout, shape, out_shape) -> Layout:
    """`out` as seen by an operand of `shape` broadcast to `out_shape`."""
    offset = len(out_shape) - len(shape)
    return Layout(
        tuple(
            out.dims[d + offset] if shape[d] == out_shape[d + offset] else ()
            for d in range(len(shape))
        )
    )


def follow(ctx: Context, lowering: str | None = None) -> list[Strategy]:
    """The output laid out as the operand of its own shape (else the one of most dims)."""
    shapes = [ctx.shape(i) for i in range(len(ctx.inputs))]
    same = [i for i, shape in enumerate(shapes) if shape == ctx.out_shape]
    primary = same[0] if same else max(range(len(shapes)), key=lambda i: len(shapes[i]))
    out = ctx.layout(primary)
    inputs = [aligned(out, shape, ctx.out_shape) for shape in shapes]
    return [make("follow", inputs, out, lowering=lowering)]


register(*POINTWISE)(follow)


@register(aten.type_as.default)
def type_as(ctx: Context) -> list[Strategy]:
    """`x.type_as(other)` has x's shape: `other` lends only its dtype (no data, no
    gradient), and is read as it is stored."""
    x = ctx.layout(0)
    return [make("follow", [x, *(ctx.layout(i) for i in range(1, len(ctx.inputs)))], x)]


@register(aten.dropout.default)
def dropout(ctx: Context) -> list[Strategy]:
    # The mask is drawn for the global shape and sliced, so a sharded model drops
    # exactly what the serial model drops from the same random state.
    return follow(ctx, lowering="dropout")
