"""`roll` (Swin's shifted windows): a rolled dim is whole on every rank, the others
keep their shards; with no dims the flattened tensor rolls, so nothing is split."""

from __future__ import annotations

from torch.ops import aten

from autoshard.layout import Layout
from autoshard.strategies.base import Context, Strategy, make
from autoshard.strategies.registry import register
from autoshard.tracing.trace import argument


@register(aten.roll.default)
def roll(ctx: Context) -> list[Strategy]:
    x = ctx.layout(0)
    nd = len(x.dims)
    dims = argument(ctx.node, "dims")
    rolled = {d % nd for d in dims} if dims else set(range(nd))
    x = Layout(tuple(() if d in rolled else axes for d, axes in enumerate(x.dims)))
    return [make("follow", [x], x)]
