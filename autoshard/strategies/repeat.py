"""Repeats: a dim repeated element by element (`repeat_interleave`) keeps its shards,
since each rank's run of elements repeats into the matching run of the output; a
dim tiled whole (`repeat`) is gathered first, since tiles of a shard are not a shard
of the tiles. Other dims keep their shards.

    repeat_interleave(x [S, D] S1(c), 2, dim=1)  →  [S, 2D] S1(c)
"""

from __future__ import annotations

from torch.ops import aten

from autoshard.layout import Layout
from autoshard.strategies.base import Context, Strategy, Unclaimed, make
from autoshard.strategies.registry import register
from autoshard.tracing.schema import argument


@register(aten.repeat.default)
def repeat(ctx: Context) -> list[Strategy]:
    x = ctx.layout(0)
    sizes = list(ctx.node.args[1])
    new = len(sizes) - len(x.dims)  # repeat may add leading dims
    need = Layout(tuple(() if sizes[new + d] != 1 else axes for d, axes in enumerate(x.dims)))
    return [make("follow", [need], Layout(((),) * new + need.dims))]


@register(aten.repeat_interleave.self_int)
def repeat_interleave(ctx: Context) -> list[Strategy]:
    dim = argument(ctx.node, "dim")
    if dim is None:
        raise Unclaimed("dim=None (repeats the flattened tensor)")
    x = ctx.layout(0)
    if argument(ctx.node, "output_size") is not None:  # a global size: keep the dim whole
        dim %= len(x.dims)
        x = Layout(tuple(() if d == dim else axes for d, axes in enumerate(x.dims)))
    return [make("follow", [x], x)]
