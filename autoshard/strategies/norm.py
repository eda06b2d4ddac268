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
    normalizing_flops,
    numel,
    on_cpu,
    register,
)
from autoshard.tracing.schema import argument, schema_arguments
from autoshard.tracing.trace import tensor_inputs

if TYPE_CHECKING:
    from autoshard.planning.plan import NodePlan


def _native_saved(node, in_shapes, out_shape, needs_grad, mask_itemsize) -> Saved:
    """The native kernels keep the input and fp32 statistics per row: mean and rstd
    (layer_norm), rstd (rms_norm's fused kernel, on CUDA)."""
    rows = numel(in_shapes[0][: -len(node.args[1])])
    statistics = 2 if node.target == aten.layer_norm.default else 1
    return Saved((0,), extra_bytes=rows * statistics * STATISTIC_BYTES)


def _rms_norm_saved(node, in_shapes, out_shape, needs_grad, mask_itemsize) -> Saved:
    """On CUDA the fused kernel (`_native_saved`). On the CPU rms_norm is composite,
    x · rsqrt(mean(x²) + eps) · weight computed in fp32 at least: for the input's
    gradient it keeps x (an fp32 copy of a lower-precision x), rstd per row and the
    weight; for the weight's, the normalized x (new, fp32 at least)."""
    if not on_cpu(node):
        return _native_saved(node, in_shapes, out_shape, needs_grad, mask_itemsize)
    x, item = numel(in_shapes[0]), itemsize(tensor_inputs(node)[0])
    computed = max(item, STATISTIC_BYTES)
    has_weight = argument(node, "weight") is not None
    needs_x, needs_weight = needs_grad[0], has_weight and needs_grad[1]
    rows = numel(in_shapes[0][: -len(node.args[1])])
    kept = ((0,) if item == computed else ()) + ((1,) if has_weight else ())
    extra = x * computed * needs_weight
    if needs_x:
        extra += rows * computed + (x * computed if item != computed else 0)
    return Saved(kept if needs_x else (), extra_bytes=extra)


def _group_norm_saved(node, in_shapes, out_shape, needs_grad, mask_itemsize) -> Saved:
    """native_group_norm keeps the input (made contiguous), the weight, and a mean and
    an rstd per sample and group, in the input's dtype."""
    has_weight = argument(node, "weight") is not None
    statistics = 2 * in_shapes[0][0] * argument(node, "num_groups")
    item = itemsize(tensor_inputs(node)[0])
    return Saved((0, 1) if has_weight else (0,), extra_bytes=statistics * item)


def _instance_norm_saved(node, in_shapes, out_shape, needs_grad, mask_itemsize) -> Saved:
    """instance_norm is composite: a batch norm over the input viewed as one sample of
    N·C channels. That keeps the input, and per channel of the view: the weight repeated
    N times, the running statistics repeated (both, where given), and the batch's mean
    and invstd in fp32 where it normalizes by them (use_input_stats)."""
    channels = in_shapes[0][0] * in_shapes[0][1]
    per_channel = STATISTIC_BYTES * 2 * bool(argument(node, "use_input_stats"))
    for name, count in (("weight", 1), ("running_mean", 2)):
        given = argument(node, name)
        if given is not None:
            per_channel += count * given.meta["val"].element_size()
    return Saved((0,), extra_bytes=channels * per_channel)


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
    """The native kernel keeps the input, the weight, and from the batch's statistics
    (training) the fp32 mean and invstd per channel; from the running statistics (eval)
    those are empty, and the running statistics (buffers) are kept instead."""
    has_weight = argument(node, "weight") is not None
    statistics = 2 * in_shapes[0][1] * STATISTIC_BYTES if argument(node, "training") else 0
    return Saved((0, 1) if has_weight else (0,), extra_bytes=statistics)


# from the batch's statistics, the batch or space split across mesh axes
BATCH_NORM = Lowering("batch_norm", _sharded_batch, saved=_sharded_batch_saved)


def _from_running(node: fx.Node, placed: NodePlan, mesh: Mesh) -> None:
    node.args, node.kwargs = tuple(schema_arguments(node).values()), {}
    node.target = ops.batch_norm_from_running


# from the running statistics: the ATen op on the rank's samples (`ops`' note on why)
FROM_RUNNING = Lowering("from_running", _from_running)


@register(
    aten.batch_norm.default,
    flops=normalizing_flops,
    saved=_batch_norm_saved,
    lowerings=(BATCH_NORM, FROM_RUNNING),
)
def batch_norm(ctx: Context) -> list[Strategy]:
    """Per channel: the weight, bias and running statistics split as the channels are
    (each rank updates its own channels' running statistics in place, as stored).
    From running statistics (eval) it is pointwise; from the batch's, the batch and
    space keep their shards and the statistics are combined over their axes, or are
    gathered first."""
    x = ctx.layout(0)
    from_batch = argument(ctx.node, "training")
    if not from_batch:  # pointwise, per channel
        affine = [Layout(x.dims[1:2])] * (len(ctx.inputs) - 1)
        return [make("follow", [x, *affine], x, lowering=FROM_RUNNING)]
    candidates = []
    for dims in (x.dims, ((),) + x.dims[1:2] + ((),) * (len(x.dims) - 2)):
        stat_axes = tuple(a for axes in dims[:1] + dims[2:] for a in axes)
        lay = Layout(dims)
        channels = lay.local_shape(ctx.shape(0), ctx.mesh)[1]
        candidates.append(
            _normalizing(ctx, lay, stat_axes, channels, Layout(dims[1:2]), BATCH_NORM)
        )
        if not stat_axes:
            break
    return candidates


@register(aten.rms_norm.default, flops=normalizing_flops, saved=_rms_norm_saved)
def rms_norm(ctx: Context) -> list[Strategy]:
    """Over its normalized (last) dims gathered; the rows keep their shards."""
    x = ctx.layout(0)
    k = len(argument(ctx.node, "normalized_shape"))
    whole = Layout(x.dims[:-k] + ((),) * k)
    return [make("follow", [whole, *whole_operands(ctx, 1)], whole)]


@register(aten.group_norm.default, flops=normalizing_flops, saved=_group_norm_saved)
@register(aten.instance_norm.default, flops=normalizing_flops, saved=_instance_norm_saved)
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
