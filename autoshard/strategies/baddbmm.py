"""`baddbmm(bias, a, b, beta, alpha)` = beta·bias + alpha·(a @ b), a batched product with
a bias (Bloom's ALiBi scores): the product splits as `linear.activation_product` does
(batch and rows as `a` has them, contraction and columns whole) and the bias, which
broadcasts against the output, is split to match. beta and alpha act element by
element, so they need nothing."""

from __future__ import annotations

import dataclasses

from torch.ops import aten

from autoshard.strategies.base import Context, Strategy, make
from autoshard.strategies.linear import Product, activation_product
from autoshard.strategies.pointwise import aligned
from autoshard.strategies.registry import register


@register(aten.baddbmm.default, **Product(1).facts())  # baddbmm(self, batch1, batch2)
def baddbmm(ctx: Context) -> list[Strategy]:
    product = dataclasses.replace(ctx, inputs=ctx.inputs[1:], layouts=ctx.layouts[1:])
    out = []
    for s in activation_product(product):
        bias = aligned(s.output, ctx.shape(0), ctx.out_shape)
        out.append(make(s.family, [bias, *s.inputs], s.output, detail="batch and rows"))
    return out
