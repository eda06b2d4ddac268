"""Sums and means: a reduction over a sharded dim is a pending sum over its axes,
all-reduced by the node itself so that nothing downstream sees a partial value."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import fx
from torch.ops import aten

from autoshard.layout import Layout
from autoshard.mesh import Mesh
from autoshard.runtime import ops
from autoshard.strategies.base import Context, Lowering, Strategy, make
from autoshard.strategies.registry import register
from autoshard.tracing.schema import argument

if TYPE_CHECKING:
    from autoshard.planning.plan import NodePlan


def _share_of_mean(node: fx.Node, placed: NodePlan, mesh: Mesh) -> None:
    """A mean over sharded dims (or a loss averaged over its elements) as this rank's
    share of the global mean."""
    scale = 1 / mesh.count(placed.strategy.output.partial)
    node.args = (str(node.target), *node.args)
    node.target = ops.share_of_mean
    node.kwargs = {**node.kwargs, "scale": scale}


MEAN = Lowering("mean", _share_of_mean)


@register(
    aten.sum.default, aten.sum.dim_IntList, aten.mean.default, aten.mean.dim, lowerings=(MEAN,)
)
def reduction(ctx: Context) -> list[Strategy]:
    x = ctx.layout(0)
    nd = len(ctx.shape(0))
    whole = ctx.node.target in (aten.sum.default, aten.mean.default)
    asked = None if whole or not nd else argument(ctx.node, "dim")
    reduced = {d % nd for d in asked} if asked else set(range(nd))  # dim=[] reduces every dim
    keepdim = not whole and argument(ctx.node, "keepdim")
    partial = tuple(a for d in sorted(reduced) for a in x.dims[d])
    dims = tuple(
        () if d in reduced else x.dims[d] for d in range(nd) if keepdim or d not in reduced
    )
    is_mean = ctx.node.target in (aten.mean.default, aten.mean.dim)
    return [
        make(
            "follow",
            [x],
            Layout(dims, partial),
            Layout(dims),
            lowering=MEAN if is_mean and partial else None,
        )
    ]
