"""Layer norm over sharded features: each rank's statistics combined over the feature
axes, one collective per axis each way (`autoshard.runtime.ops.layer_norm`), or
features gathered first. Batch norm per channel, channels split as they come: from
running statistics, nothing to combine; from the batch's, each rank's statistics
combined over the axes that split the batch and space (`ops.batch_norm`), or those
gathered first. RMS norm over its features gathered; group and instance norms
within each sample, the batch split."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from torch import fx
from torch.ops import aten

from autoshard.layout import Layout, Step
from autoshard.mesh import Mesh
from autoshard.runtime import ops
from autoshard.strategies.base import (
    Context,
    Lowering,
    Saved,
    Strategy,
    Unclaimed,
    make,
    whole_operands,
)
from autoshard.strategies.registry import (
    STATISTIC_BYTES,
    itemsize,
    keeps_input,
    normalizing_flops,
    numel,
    register,
)
from autoshard.tracing.trace import argument, tensor_inputs

if TYPE_CHECKING:
    from autoshard.planning.plan import NodePlan


def _native_saved(node, in_shapes, out_shape, needs_grad, mask_itemsize) -> Saved:
    """The native kernels keep the input and fp32 statistics per row: mean and rstd
    (layer_norm), rstd (rms_norm)."""
    rows = numel(in_shapes[0][: -len(node.args[1])])
    statistics = 2 if node.target == aten.layer_norm.default else 1
    return Saved((0,), extra_bytes=rows * statistics * STATISTIC_BYTES)


def _sharded_features(node: fx.Node, placed: NodePlan, mesh: Mesh) -> None:
    x = node.args[0]
    weight, bias, eps = (argument(node, name) for name in ("weight", "bias", "eps"))
    k = len(argument(node, "normalized_shape"))
    axes = tuple(a for dim in placed.strategy.inputs[0].dims[-k:] for a in dim)
    node.target = ops.layer_norm
    node.args = (x, weight, bias, eps)
    node.kwargs = {"normalized_ndim": k, "axes": axes, "node": node.name}


def _keeps_normalized(node, in_shapes, needs_grad, statistics: int) -> Saved:
    """`autoshard.runtime.ops`' sharded norms keep the normalized input (for either
    gradient), and for the input's, rstd per statistic (in the input's dtype) and the
    weight."""
    x, item = numel(in_shapes[0]), itemsize(tensor_inputs(node)[0])
    has_weight = argument(node, "weight") is not None  # else input 1 is the bias, if any
    needs_x, needs_weight = needs_grad[0], has_weight and needs_grad[1]
    weight = (1,) if has_weight and needs_x else ()
    kept = (x if needs_x or needs_weight else 0) + (statistics if needs_x else 0)
    return Saved(weight, extra_bytes=kept * item)


def _sharded_features_saved(node, in_shapes, out_shape, needs_grad, mask_itemsize) -> Saved:
    """One statistic per row."""
    rows = numel(in_shapes[0][: -len(node.args[1])])
    return _keeps_normalized(node, in_shapes, needs_grad, rows)


# over features split across mesh axes: statistics combined over them
LAYER_NORM = Lowering("layer_norm", _sharded_features, saved=_sharded_features_saved)


def _normalizing(
    ctx: Context, lay: Layout, stat_axes: tuple, count: int, affine: Layout, lowering: Lowering
) -> Strategy:
    """The input in `lay` and the output alike, the affine operands in `affine`; where
    `stat_axes` split what is normalized, `lowering` combines every rank's `count`
    statistics (a mean and an M2 each, gathered over each axis) in forward and
    all-reduces two sums per statistic in backward."""
    itemsize = max(ctx.inputs[0].meta["val"].element_size(), STATISTIC_BYTES)  # fp32 at least
    grad_itemsize = ctx.node.meta["val"].element_size()  # the output's, with the weight's
    statistics = []
    for axis in stat_axes:
        n = ctx.mesh.size(axis)
        statistics += [
            Step("all_gather", axis, 0, "identity", 2 * count * itemsize * n, n),
            Step("grad_all_reduce", axis, None, "all_reduce", 2 * count * grad_itemsize, n),
        ]
    return make(
        "follow",
        [lay] + [affine] * (len(ctx.inputs) - 1),
        lay,
        lowering=lowering if stat_axes else None,
        internal=tuple(statistics),
        detail=f"statistics combined over {','.join(stat_axes)}" if stat_axes else "",
    )


def _sharded_batch(node: fx.Node, placed: NodePlan, mesh: Mesh) -> None:
    dims = placed.strategy.inputs[0].dims
    names = ("input", "weight", "bias", "running_mean", "running_var", "momentum", "eps")
    node.args = tuple(argument(node, name) for name in names)
    node.kwargs = {
        "axes": tuple(a for axes in dims[:1] + dims[2:] for a in axes),
        "node": node.name,
    }
    node.target = ops.batch_norm


def _sharded_batch_saved(node, in_shapes, out_shape, needs_grad, mask_itemsize) -> Saved:
    """One statistic per channel."""
    return _keeps_normalized(node, in_shapes, needs_grad, in_shapes[0][1])


def _batch_norm_saved(node, in_shapes, out_shape, needs_grad, mask_itemsize) -> Saved:
    """The native kernel keeps the input and fp32 statistics per channel."""
    return Saved((0,), extra_bytes=2 * in_shapes[0][1] * STATISTIC_BYTES)


# from the batch's statistics, the batch or space split across mesh axes
BATCH_NORM = Lowering("batch_norm", _sharded_batch, saved=_sharded_batch_saved)


@register(
    aten.batch_norm.default,
    flops=normalizing_flops,
    saved=_batch_norm_saved,
    lowerings=(BATCH_NORM,),
)
def batch_norm(ctx: Context) -> list[Strategy]:
    """Per channel: the weight, bias and running statistics split as the channels are
    (each rank updates its own channels' running statistics in place, as stored).
    From running statistics (eval) it is pointwise; from the batch's, the batch and
    space keep their shards and the statistics are combined over their axes, or are
    gathered first."""
    x = ctx.layout(0)
    from_batch = argument(ctx.node, "training")
    candidates = []
    for dims in (x.dims, ((),) + x.dims[1:2] + ((),) * (len(x.dims) - 2)):
        stat_axes = tuple(a for axes in dims[:1] + dims[2:] for a in axes) if from_batch else ()
        lay = Layout(dims)
        channels = lay.local_shape(ctx.shape(0), ctx.mesh)[1]
        candidates.append(
            _normalizing(ctx, lay, stat_axes, channels, Layout(dims[1:2]), BATCH_NORM)
        )
        if not stat_axes:
            break
    return candidates


@register(aten.rms_norm.default, flops=normalizing_flops, saved=_native_saved)
def rms_norm(ctx: Context) -> list[Strategy]:
    """Over its normalized (last) dims gathered; the rows keep their shards."""
    x = ctx.layout(0)
    k = len(argument(ctx.node, "normalized_shape"))
    whole = Layout(x.dims[:-k] + ((),) * k)
    return [make("follow", [whole, *whole_operands(ctx, 1)], whole)]


@register(aten.group_norm.default, flops=normalizing_flops, saved=keeps_input)
@register(aten.instance_norm.default, flops=normalizing_flops, saved=keeps_input)
def per_sample_norm(ctx: Context) -> list[Strategy]:
    """Group and instance norms compute their statistics within each sample: the batch
    keeps its shards, channels and space are gathered. An instance norm that updates
    running statistics from the batch (training with ``track_running_stats``) is not
    claimed: each rank would average its own samples."""
    if ctx.node.target == aten.instance_norm.default:
        tracked = argument(ctx.node, "running_mean") is not None
        if tracked and argument(ctx.node, "use_input_stats"):
            raise Unclaimed("running statistics updated from the batch")
    x = ctx.layout(0)
    whole = Layout(x.dims[:1] + ((),) * (len(x.dims) - 1))
    return [make("follow", [whole, *whole_operands(ctx, 1)], whole)]


@register(
    aten.layer_norm.default,
    flops=normalizing_flops,
    saved=_native_saved,
    lowerings=(LAYER_NORM,),
)
def layer_norm(ctx: Context) -> list[Strategy]:
    x = ctx.layout(0)
    k = len(argument(ctx.node, "normalized_shape"))
    candidates = []
    for dims in (x.dims, x.dims[:-k] + ((),) * k):
        stat_axes = tuple(a for axes in dims[-k:] for a in axes)
        lay = Layout(dims)
        rows = math.prod(lay.local_shape(ctx.shape(0), ctx.mesh)[:-k])
        candidates.append(_normalizing(ctx, lay, stat_axes, rows, Layout(dims[-k:]), LAYER_NORM))
        if not stat_axes:
            break
    return candidates
