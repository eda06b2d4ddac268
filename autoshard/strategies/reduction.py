"""Sums and means: a reduction over a sharded dim is a pending sum over its axes,
all-reduced by the node itself so that nothing downstream sees a partial value."""

from __future__ import annotations

from torch.ops import aten

from autoshard.layout import Layout
from autoshard.strategies import Context, Strategy, make, register


@register(aten.sum.default, aten.sum.dim_IntList, aten.mean.default, aten.mean.dim)
def reduction(ctx: Context) -> list[Strategy]:
    x = ctx.layout(0)
    nd = len(ctx.shape(0))
    args = ctx.node.args
    reduced = args[1] if len(args) > 1 and args[1] is not None else list(range(nd))
    reduced = {d % nd for d in reduced} if nd else set()
    keepdim = args[2] if len(args) > 2 else ctx.node.kwargs.get("keepdim", False)
    partial = tuple(a for d in sorted(reduced) for a in x.dims[d])
    dims = tuple(
        () if d in reduced else x.dims[d] for d in range(nd) if keepdim or d not in reduced
    )
    is_mean = ctx.node.target in (aten.mean.default, aten.mean.dim)
    return [
        make(
            "follow",
            [x],
            Layout(dims, partial),
            Layout(dims),
            lowering="mean" if is_mean and partial else None,
        )
    ]
