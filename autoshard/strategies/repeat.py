"""Repeats: a dim repeated element by element (`repeat_interleave`) keeps its shards,
since each rank's run of elements repeats into the matching run of the output; a
dim tiled whole (`repeat`) is gathered first, since tiles of a shard are not a shard
of the tiles. Other dims keep their shards.

    repeat_interleave(x [S, D] S1(c), 2, dim=1)  →  [S, 2D] S1(c)
"""

from __future__ import annotations

import warnings

from torch.ops import aten

from autoshard.layout import Layout
from autoshard.strategies import Context, Strategy, make, register, replicated_fallback


@register(aten.repeat.default)
def repeat(ctx: Context) -> list[Strategy]:
    x = ctx.layout(0)
    sizes = list(ctx.node.args[1])
    new = len(sizes) - len(x.dims)  # repeat may add leading dims
    need = Layout(tuple(() if sizes[new + d] != 1 else axes for d, axes in enumerate(x.dims)))
    return [make("follow", [need], Layout(((),) * new + need.dims))]


@register(aten.repeat_interleave.self_int)
def repeat_interleave(ctx: Context) -> list[Strategy]:
    args = dict(zip(("self", "repeats", "dim", "output_size"), ctx.node.args))
    args.update(ctx.node.kwargs)
    if args.get("dim") is None:  # repeats the flattened tensor
        warnings.warn(
            f"{ctx.node.target} ({ctx.node.name}) without dim: it runs replicated", stacklevel=2
        )
        return replicated_fallback(ctx)
    x = ctx.layout(0)
    if args.get("output_size") is not None:  # a global size: keep the dim whole
        dim = args["dim"] % len(x.dims)
        x = Layout(tuple(() if d == dim else axes for d, axes in enumerate(x.dims)))
    return [make("follow", [x], x)]
