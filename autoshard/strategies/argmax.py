"""`argmax` / `argmin`: the reduced dim is whole (an index is global), the others keep
their shards; with no dim the flattened tensor is reduced, so nothing is split."""

from __future__ import annotations

from torch.ops import aten

from autoshard.layout import Layout
from autoshard.strategies.base import Context, Strategy, make
from autoshard.strategies.registry import register
from autoshard.tracing.trace import argument


@register(aten.argmax.default, aten.argmin.default)
def argmax(ctx: Context) -> list[Strategy]:
    x = ctx.layout(0)
    nd = len(x.dims)
    dim = argument(ctx.node, "dim")
    if dim is None:
        rep = Layout.replicated
        return [make("follow", [rep(nd)], rep(len(ctx.out_shape)))]
    dim %= nd
    x = Layout(tuple(() if d == dim else axes for d, axes in enumerate(x.dims)))
    out = x if argument(ctx.node, "keepdim") else Layout(x.dims[:dim] + x.dims[dim + 1 :])
    return [make("follow", [x], out)]
