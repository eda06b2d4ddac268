"""Pooling and resizing: ops over the last few dims only (an image's space, a sequence's
length).
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
from autoshard.strategies.base import Context, Saved, Strategy, make
from autoshard.strategies.registry import INDEX_BYTES, keeps_input, numel, register

# How many trailing dims each pool reads together.
_AVERAGES = {  # backward reads the input's sizes through the tensor: it keeps it
    aten.avg_pool1d.default: 1,
    aten.avg_pool2d.default: 2,
    aten.avg_pool3d.default: 3,
}
_ADAPTIVE_AVERAGES = {
    aten.adaptive_avg_pool1d.default: 1,
    aten.adaptive_avg_pool2d.default: 2,
    aten.adaptive_avg_pool3d.default: 3,
}
_MAXIMA = {  # run as max_poolNd_with_indices where the input needs a gradient
    aten.max_pool1d.default: 1,
    aten.max_pool2d.default: 2,
    aten.max_pool3d.default: 3,
}
_ADAPTIVE_MAXIMA = {  # the index of each maximum is a second result, laid out alike
    aten.adaptive_max_pool1d.default: 1,
    aten.adaptive_max_pool2d.default: 2,
    aten.adaptive_max_pool3d.default: 3,
}
_RESIZES = {  # F.interpolate: backward needs only the sizes
    aten.upsample_nearest1d.vec: 1,
    aten.upsample_nearest2d.vec: 2,
    aten.upsample_nearest3d.vec: 3,
    aten._upsample_nearest_exact1d.vec: 1,
    aten._upsample_nearest_exact2d.vec: 2,
    aten._upsample_nearest_exact3d.vec: 3,
    aten.upsample_linear1d.vec: 1,
    aten.upsample_bilinear2d.vec: 2,
    aten._upsample_bilinear2d_aa.vec: 2,
    aten.upsample_bicubic2d.vec: 2,
    aten._upsample_bicubic2d_aa.vec: 2,
    aten.upsample_trilinear3d.vec: 3,
}
_TRAILING = {**_AVERAGES, **_ADAPTIVE_AVERAGES, **_MAXIMA, **_ADAPTIVE_MAXIMA, **_RESIZES}


def trailing_whole(ctx: Context) -> list[Strategy]:
    """The input as it comes with the dims the op reads together whole, the output
    (each output) alike."""
    x = ctx.layout(0)
    first = len(x.dims) - _TRAILING[ctx.node.target]
    x = Layout(tuple(axes if d < first else () for d, axes in enumerate(x.dims)))
    return [make("follow", [x], x, outputs=(x,) * len(ctx.result_shapes))]


def _keeps_input_unless_mean(node, in_shapes, out_shape, needs_grad, mask_itemsize) -> Saved:
    """An adaptive average pool keeps its input, as the others do, except to one value
    per row (every output size 1): torch computes that as a mean, which keeps nothing."""
    if all(size == 1 for size in out_shape[-_TRAILING[node.target] :]):
        return Saved()
    return Saved((0,))


def _keeps_input_and_indices(node, in_shapes, out_shape, needs_grad, mask_itemsize) -> Saved:
    """A max pool keeps its input and the int64 index of each window's maximum, where
    backward routes the gradient."""
    return Saved((0,), extra_bytes=numel(out_shape) * INDEX_BYTES)


register(*_RESIZES)(trailing_whole)
register(*_AVERAGES, saved=keeps_input)(trailing_whole)
register(*_ADAPTIVE_AVERAGES, saved=_keeps_input_unless_mean)(trailing_whole)
register(*_MAXIMA, *_ADAPTIVE_MAXIMA, saved=_keeps_input_and_indices)(trailing_whole)
