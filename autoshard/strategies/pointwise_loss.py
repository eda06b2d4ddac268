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
from autoshard.strategies.registry import register
from autoshard.tracing.trace import argument, tensor_inputs

NONE, MEAN_REDUCTION = 0, 1  # ATen's reduction codes (2: sum)


def _keeps_operands(node, in_shapes, out_shape, needs_grad, mask_itemsize) -> Saved:
    """Backward reads the operands (input, target and weights)."""
    return Saved(tuple(range(len(tensor_inputs(node)))))


@register(
    aten.mse_loss.default,
    aten.l1_loss.default,
    aten.smooth_l1_loss.default,
    aten.huber_loss.default,
    aten.binary_cross_entropy.default,
    aten.binary_cross_entropy_with_logits.default,
    aten.kl_div.default,
    aten.soft_margin_loss.default,
    saved=_keeps_operands,
    lowerings=(MEAN,),
)
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
