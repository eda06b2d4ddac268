"""Pooling: ops over the last few dims only (an image's space, a sequence's length).
Those dims are whole on every rank, the leading ones (batch, channels) keep their
shards: each rank pools its own rows as the serial model does, exactly, and the
gradient flows back the same way.

    avg_pool2d(x [8, 16, 8, 8] S0(a) S1(b))   # → [8, 16, 4, 4] S0(a) S1(b)

(Padding would split alike, but it runs replicated on purpose, `strategies/replicated.py`:
a decoder's loss pads its labels, which its readers slice for free.)
"""

from __future__ import annotations

from torch.ops import aten

from autoshard.layout import Layout
from autoshard.strategies.base import Context, Strategy, make
from autoshard.strategies.registry import keeps_input, register

# How many trailing dims each pool reads together.
_AVERAGES = {
    aten.avg_pool1d.default: 1,
    aten.avg_pool2d.default: 2,
    aten.avg_pool3d.default: 3,
    aten.adaptive_avg_pool1d.default: 1,
    aten.adaptive_avg_pool2d.default: 2,
    aten.adaptive_avg_pool3d.default: 3,
}
_MAXIMA = {  # backward routes the gradient to each window's largest input: it keeps it
    aten.max_pool1d.default: 1,
    aten.max_pool2d.default: 2,
    aten.max_pool3d.default: 3,
}


def _trailing_whole(ctx: Context, count: int) -> list[Strategy]:
    """The input as it comes with its last `count` dims whole, the output alike."""
    x = ctx.layout(0)
    first = len(x.dims) - count
    x = Layout(tuple(axes if d < first else () for d, axes in enumerate(x.dims)))
    return [make("follow", [x], x)]


@register(*_AVERAGES)
def average_pool(ctx: Context) -> list[Strategy]:
    return _trailing_whole(ctx, _AVERAGES[ctx.node.target])


@register(*_MAXIMA, saved=keeps_input)
def max_pool(ctx: Context) -> list[Strategy]:
    return _trailing_whole(ctx, _MAXIMA[ctx.node.target])
