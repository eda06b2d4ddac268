"""Losses computed element by element (mean squared and absolute error, smooth L1 and
Huber, binary cross-entropy with or without logits, KL divergence, soft margin): the
input, the target and any weights split alike, and a reduction over every element a
pending sum over every axis that splits them, which the node all-reduces ("mean":
each rank's mean as its share, `reduction.MEAN`).

    loss = F.mse_loss(self.head(x), target)   # head's output [tokens, d] split over a, c
    # each rank: mse_loss(its part, its target part) / 4, then all-reduced over a and c
"""

from __future__ import annotations

import torch
from torch.ops import aten

from autoshard.layout import Layout
from autoshard.strategies.base import Context, Saved, Strategy, Unclaimed, make
from autoshard.strategies.pointwise import aligned
from autoshard.strategies.reduction import MEAN
from autoshard.strategies.registry import itemsize, numel, register
from autoshard.tracing.schema import argument
from autoshard.tracing.trace import tensor_inputs

NONE, MEAN_REDUCTION = 0, 1  # ATen's reduction codes (2: sum)


def _keeps_operands(node, in_shapes, out_shape, needs_grad, mask_itemsize) -> Saved:
    """Backward reads the operands (input, target and weights)."""
    return Saved(tuple(range(len(tensor_inputs(node)))))


def _broadcast_bytes(node, in_shapes) -> int:
    """Bytes of a tensor of the operands' broadcast shape, in the input's dtype."""
    return numel(torch.broadcast_shapes(*in_shapes)) * itemsize(tensor_inputs(node)[0])


def _keeps_difference(node, in_shapes, out_shape, needs_grad, mask_itemsize) -> Saved:
    """l1_loss is composite, |input − target| reduced: abs keeps the difference (a new
    tensor of the broadcast shape) for either gradient."""
    return Saved(extra_bytes=_broadcast_bytes(node, in_shapes))


def _kl_div_saved(node, in_shapes, out_shape, needs_grad, mask_itemsize) -> Saved:
    """kl_div is composite. xlogy(t, t) − t · input keeps the target t for the input's
    gradient, and the input and t for t's. With log_target, exp(t) · (t − input) keeps
    exp(t) (new, t's size) for either gradient and t − input (new, the broadcast
    shape) for t's."""
    if argument(node, "log_target"):
        exp_target = numel(in_shapes[1]) * itemsize(tensor_inputs(node)[1])
        return Saved(extra_bytes=exp_target + _broadcast_bytes(node, in_shapes) * needs_grad[1])
    return Saved((0, 1) if needs_grad[1] else (1,))


@register(
    aten.mse_loss.default,
    aten.smooth_l1_loss.default,
    aten.huber_loss.default,
    aten.binary_cross_entropy.default,
    aten.binary_cross_entropy_with_logits.default,
    aten.soft_margin_loss.default,
    saved=_keeps_operands,
    lowerings=(MEAN,),
)
@register(aten.l1_loss.default, saved=_keeps_difference, lowerings=(MEAN,))
@register(aten.kl_div.default, saved=_kl_div_saved, lowerings=(MEAN,))
def pointwise_loss(ctx: Context) -> list[Strategy]:
    """The operands laid out as the one of their broadcast shape (the others as they
    broadcast: kl_div's input may be smaller than its target); the loss per element
    laid out alike, or its sum or mean pending over all that layout's axes."""
    shapes = [tuple(ctx.shape(i)) for i in range(len(ctx.inputs))]
    full = tuple(torch.broadcast_shapes(*shapes))
    if full not in shapes:
        raise Unclaimed(f"operands {[list(s) for s in shapes]}, none of them of their broadcast")
    x = ctx.layout(shapes.index(full))
    inputs = [aligned(x, shape, full) for shape in shapes]
    reduction = argument(ctx.node, "reduction")
    if reduction == NONE:
        return [make("follow", inputs, x)]
    partial = tuple(a for axes in x.dims for a in axes)
    lowering = MEAN if reduction == MEAN_REDUCTION and partial else None
    return [make("follow", inputs, Layout((), partial), Layout(()), lowering=lowering)]
