"""`stack`: every operand has one shape, so all take the first one's layout, and the
new dim is whole (GPT-J's rotary tables stack sin and cos)."""

from __future__ import annotations

from torch.ops import aten

from autoshard.layout import Layout
from autoshard.strategies.base import Context, Strategy, make
from autoshard.strategies.registry import register
from autoshard.tracing.schema import argument


@register(aten.stack.default)
def stack(ctx: Context) -> list[Strategy]:
    nd = len(ctx.shape(0))
    dim = argument(ctx.node, "dim") % (nd + 1)
    x = ctx.layout(0)
    out = Layout(x.dims[:dim] + ((),) + x.dims[dim:])
    return [make("follow", [x] * len(ctx.inputs), out)]
