"""Layer norm over sharded features: statistics all-reduced over the feature axes
(ColossalAI's LayerNorm3D), or features gathered first."""

from __future__ import annotations

import math

from torch.ops import aten

from autoshard.layout import Layout, Step
from autoshard.strategies.base import Context, Strategy, make, register
from autoshard.tracing.trace import argument


@register(aten.layer_norm.default)
def layer_norm(ctx: Context) -> list[Strategy]:
    x = ctx.layout(0)
    k = len(argument(ctx.node, "normalized_shape"))
    candidates = []
    itemsize = ctx.inputs[0].meta["val"].element_size()
    for dims in (x.dims, x.dims[:-k] + ((),) * k):
        stat_axes = tuple(a for axes in dims[-k:] for a in axes)
        lay = Layout(dims)
        stat_bytes = math.prod(lay.local_shape(ctx.shape(0), ctx.mesh)[:-k]) * itemsize
        statistics = tuple(  # the sums of x and x², in one buffer
            Step("all_reduce", axis, None, "all_reduce", 2 * stat_bytes, ctx.mesh.size(axis))
            for axis in stat_axes
        )
        affine = [Layout(dims[-k:])] * (len(ctx.inputs) - 1)
        candidates.append(
            make(
                "follow",
                [lay, *affine],
                lay,
                lowering="layer_norm" if stat_axes else None,
                internal=statistics,
                detail=f"statistics all-reduced over {','.join(stat_axes)}" if stat_axes else "",
            )
        )
        if not stat_axes:
            break
    return candidates
