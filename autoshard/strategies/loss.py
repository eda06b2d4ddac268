"""Cross-entropy and negative log-likelihood over class-split scores, computed
class-parallel (`autoshard.runtime.losses`).

The scores are never gathered: per row, the maximum, the sum of exponentials and the
target's score (with its class weight, and the sums label smoothing needs) are each
reduced over the class axes (a few numbers per row), and a mean or sum over the rows
is reduced over the axes that split them; `ignore_index` rows count for nothing.
Every reduction, per-class weights, label smoothing and class probabilities as
targets are claimed, for scores [rows, classes], [classes] or [N, classes, d1, ...].
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from torch import fx
from torch.ops import aten

from autoshard.layout import Layout, Step
from autoshard.mesh import Mesh
from autoshard.runtime import losses
from autoshard.strategies.base import Context, Lowering, Saved, Strategy, Unclaimed, make
from autoshard.strategies.registry import itemsize, normalizing_flops, numel, register
from autoshard.tracing.schema import argument
from autoshard.tracing.trace import tensor_inputs

if TYPE_CHECKING:
    from autoshard.planning.plan import NodePlan


def class_dim(ndim: int) -> int:
    """The dim of a loss's scores that holds the classes: 1, or 0 for one sample's."""
    return 1 if ndim > 1 else 0


def _class_dim(node: fx.Node) -> int:
    return class_dim(tensor_inputs(node)[0].meta["val"].dim())


def _weighted(node: fx.Node) -> bool:
    return argument(node, "weight") is not None


def _rows(node: fx.Node, in_shapes) -> int:
    """Local rows: the local scores' elements over their classes."""
    return numel(in_shapes[0]) // in_shapes[0][_class_dim(node)]


def _soft(node: fx.Node) -> bool:
    """Whether the targets are class probabilities (not indices)."""
    return tensor_inputs(node)[1].meta["val"].is_floating_point()


def _mean_count(node: fx.Node) -> int:
    """A mean keeps its divisor, a view of the (loss, divisor) pair it is reduced in."""
    return 2 * itemsize(node) if argument(node, "reduction") == losses.MEAN else 0


def _moved(node: fx.Node, in_shapes, i: int = 0) -> int:
    """Input `i` (the scores, or probabilities as targets) made [rows, classes]: a copy
    where the class dim is not innermost in memory (scores permuted from [..., classes],
    as a flattened loss is traced, move back for free)."""
    tensor = tensor_inputs(node)[i].meta["val"]
    if tensor.movedim(_class_dim(node), -1).is_contiguous():
        return 0
    return numel(in_shapes[i]) * itemsize(node.args[i])


def _native_saved(node, in_shapes, out_shape, needs_grad, mask_itemsize) -> Saved:
    """The log-softmax of the logits and the targets; against class indices also
    nll_loss's total weight (a number), and with label smoothing the mask of ignored
    rows and, for a mean, its divisor (their count, int64, or their weights' sum)."""
    item = itemsize(tensor_inputs(node)[0])
    log_softmax = numel(in_shapes[0]) * item
    if _soft(node):
        return Saved((1,), extra_bytes=log_softmax)
    extra = log_softmax + item
    if argument(node, "label_smoothing"):
        extra += _rows(node, in_shapes)
        if argument(node, "reduction") == losses.MEAN:
            extra += item if _weighted(node) else 8
    return Saved((1,), extra_bytes=extra)


def _cross_entropy_saved(node, in_shapes, out_shape, needs_grad, mask_itemsize) -> Saved:
    """`autoshard.runtime.losses.cross_entropy` keeps the local softmax; per row the
    target's index (int64) and two bool masks, with class weights the row's weight
    and with smoothing too its softmax coefficient; for a mean the divisor. Against
    probabilities: the softmax, the targets, per row the sum of their weights, and the
    log-softmax where the targets need a gradient."""
    item = itemsize(node.args[0])
    if _soft(node):  # the targets as [rows, classes]: a copy where the class dim is not last
        softmax = numel(in_shapes[0]) * item
        extra = softmax * (1 + needs_grad[1]) + _rows(node, in_shapes) * item + _mean_count(node)
        moved = _moved(node, in_shapes, 1)
        return Saved(() if moved else (1,), extra_bytes=extra + moved)
    per_row = 8 + 2 + item * (_weighted(node) * (1 + bool(argument(node, "label_smoothing"))))
    softmax = numel(in_shapes[0]) * item
    return Saved(extra_bytes=softmax + _rows(node, in_shapes) * per_row + _mean_count(node))


def _cross_entropy_workspace(node, in_shapes, out_shape) -> int:
    """The shifted logits, alive with the logits and the softmax it keeps (and the
    logits moved to [rows, classes] where that is a copy)."""
    return numel(in_shapes[0]) * itemsize(node.args[0]) + _moved(node, in_shapes)


def _nll_saved(node, in_shapes, out_shape, needs_grad, mask_itemsize) -> Saved:
    """`autoshard.runtime.losses.nll_loss` keeps the scores it picks from (for the pick's
    gradient: the scores themselves, or their copy as [rows, classes] where the class
    dim is not last), per row the target's index (int64), whether this rank holds it and
    the row's weight; for a mean the divisor."""
    per_row = 8 + 1 + itemsize(node.args[0])
    moved = _moved(node, in_shapes)
    extra = _rows(node, in_shapes) * per_row + _mean_count(node) + moved
    return Saved(() if moved else (0,), extra_bytes=extra)


def _class_parallel(kernel, node: fx.Node, placed: NodePlan, mesh: Mesh) -> None:
    """Rewrite `node` as a call of `kernel` (`autoshard.runtime.losses`)."""
    scores, target = node.args[:2]
    class_dim = _class_dim(node)
    dims = placed.strategy.inputs[0].dims
    kwargs = {
        "classes": scores.meta["val"].shape[class_dim],
        "class_dim": class_dim,
        "class_axes": dims[class_dim],
        "row_axes": tuple(a for d, axes in enumerate(dims) if d != class_dim for a in axes),
        "node": node.name,
        "ignore_index": argument(node, "ignore_index"),
        "reduction": argument(node, "reduction"),
    }
    if kernel is losses.cross_entropy:
        kwargs["label_smoothing"] = argument(node, "label_smoothing")
    weight = argument(node, "weight")
    node.target = kernel
    node.args = (scores, target, weight)
    node.kwargs = kwargs


def _cross_entropy(node: fx.Node, placed: NodePlan, mesh: Mesh) -> None:
    _class_parallel(losses.cross_entropy, node, placed, mesh)


def _nll(node: fx.Node, placed: NodePlan, mesh: Mesh) -> None:
    _class_parallel(losses.nll_loss, node, placed, mesh)


# (rewrites by name, not partials: a plan's lowerings compare equal after pickling)
CROSS_ENTROPY = Lowering(
    "cross_entropy",
    _cross_entropy,
    saved=_cross_entropy_saved,
    workspace=_cross_entropy_workspace,
)
NLL = Lowering("nll_loss", _nll, saved=_nll_saved)


def _class_split(ctx: Context, lowering: Lowering, row_sums: int) -> list[Strategy]:
    """Scores as they come; the target split as their rows (probabilities as the
    scores), any class weight as their classes; `row_sums` numbers per row reduced
    over the class axes (after the rows' maximum, for the cross-entropy), and the loss
    over the row axes unless kept per row."""
    node = ctx.node
    scores = ctx.shape(0)
    class_dim = _class_dim(node)
    rows = scores[:class_dim] + scores[class_dim + 1 :]
    soft = _soft(node)
    if ctx.shape(1) != (scores if soft else rows):
        raise Unclaimed(f"scores {list(scores)} with target {list(ctx.shape(1))}")
    layout = ctx.layout(0)
    dims = layout.dims
    classes = dims[class_dim]
    row_dims = dims[:class_dim] + dims[class_dim + 1 :]
    target = Layout(row_dims)
    inputs = [layout, layout if soft else target] + [Layout((classes,))] * _weighted(node)
    reduction = argument(node, "reduction")
    item = ctx.inputs[0].meta["val"].element_size()
    row = math.prod(target.local_shape(rows, ctx.mesh)) * item

    def reduce(axes, nbytes):
        return tuple(
            Step("all_reduce", a, None, "identity", nbytes, ctx.mesh.size(a)) for a in axes
        )

    internal = reduce(classes, row_sums * row)
    if lowering is CROSS_ENTROPY:  # the rows' maximum first (no gradient)
        internal = reduce(classes, row) + internal
    if reduction in (losses.MEAN, losses.SUM):  # the loss, with a mean's divisor
        row_axes = tuple(a for axes in row_dims for a in axes)
        internal += reduce(row_axes, item * (1 + (reduction == losses.MEAN)))
    output = target if reduction not in (losses.MEAN, losses.SUM) else Layout(())
    detail = f"classes over {','.join(classes) or '-'}"
    return [
        make("vocab-parallel", inputs, output, lowering=lowering, internal=internal, detail=detail)
    ]


@register(
    aten.cross_entropy_loss.default,
    flops=normalizing_flops,
    saved=_native_saved,
    lowerings=(CROSS_ENTROPY,),
)
def cross_entropy(ctx: Context) -> list[Strategy]:
    # per row: the sum of exponentials and the target's logit; its class weight; for
    # smoothing the sum of (weighted) logits, and with weights the sum of the weights.
    # Against probabilities: the sum of exponentials, of (weighted) targets and of
    # their products with the logits.
    if _soft(ctx.node):
        return _class_split(ctx, CROSS_ENTROPY, 3)
    weighted, smoothed = _weighted(ctx.node), bool(argument(ctx.node, "label_smoothing"))
    return _class_split(ctx, CROSS_ENTROPY, 2 + weighted + smoothed + (weighted and smoothed))


def _native_nll_saved(node, in_shapes, out_shape, needs_grad, mask_itemsize) -> Saved:
    """The scores and the targets (and the total weight, a number)."""
    return Saved((0, 1), extra_bytes=itemsize(node.args[0]))


@register(aten.nll_loss_nd.default, saved=_native_nll_saved, lowerings=(NLL,))
def nll_loss(ctx: Context) -> list[Strategy]:
    # per row: the target's score, and its class weight
    return _class_split(ctx, NLL, 1 + _weighted(ctx.node))
