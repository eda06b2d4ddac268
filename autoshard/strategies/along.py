"""Ops that work along some dims of their input and need each of those whole on a
rank (a maximum, a variance, a scan, a flip, a roll, an index of the largest): those
dims are gathered, the others keep their shards.

    x.amax(-1)             # x [B, S, H] split over B and H: H gathered, B stays split
    x.flip(1)              # S whole, B and H as they come

With no dims named, an op works along every dim (the flattened tensor): nothing is
split. A dim kept in the result (``keepdim=True``, or an op that keeps the input's
shape) stays whole there.
"""

from __future__ import annotations

from torch.ops import aten

from autoshard.layout import Layout
from autoshard.strategies.base import Context, Saved, Strategy, Unclaimed, make
from autoshard.strategies.registry import keeps_input, register
from autoshard.tracing.trace import argument


def _keeps_input_and_output(node, in_shapes, out_shape, needs_grad, mask_itemsize) -> Saved:
    """Backward needs the input and the result: amax's mask of the maxima, logsumexp's
    softmax, prod's quotient."""
    return Saved((0,), output=True)


# op → the argument naming the dims it works along
_INDICES = {aten.argmax.default: "dim", aten.argmin.default: "dim"}
_MOVES = {aten.roll.default: "dims", aten.flip.default: "dims"}
_KEEP_INPUT = {
    aten.var.correction: "dim",
    aten.var.dim: "dim",
    aten.std.correction: "dim",
    aten.std.dim: "dim",
}
_KEEP_BOTH = {
    aten.amax.default: "dim",
    aten.amin.default: "dim",
    aten.logsumexp.default: "dim",
    aten.prod.dim_int: "dim",
    aten.cumprod.default: "dim",
    aten.logcumsumexp.default: "dim",
}
_TESTS = {
    aten.any.dim: "dim",
    aten.any.dims: "dim",
    aten.all.dim: "dim",
    aten.all.dims: "dim",
}
_DIMS = {**_INDICES, **_MOVES, **_KEEP_INPUT, **_KEEP_BOTH, **_TESTS}


def along(ctx: Context) -> list[Strategy]:
    x = ctx.layout(0)
    nd = len(x.dims)
    named = argument(ctx.node, _DIMS[ctx.node.target])
    named = [named] if isinstance(named, int) else named
    worked = {d % nd for d in named} if named else set(range(nd))
    whole = Layout(tuple(() if d in worked else axes for d, axes in enumerate(x.dims)))
    if len(ctx.out_shape) == nd:  # keepdim, a scan, a flip, a roll
        return [make("follow", [whole], whole)]
    if len(ctx.out_shape) != nd - len(worked):
        raise Unclaimed(f"{_DIMS[ctx.node.target]}={named} for a result of shape {ctx.out_shape}")
    out = Layout(tuple(axes for d, axes in enumerate(whole.dims) if d not in worked))
    return [make("follow", [whole], out)]


register(*_INDICES, *_MOVES, *_TESTS)(along)
register(*_KEEP_INPUT, saved=keeps_input)(along)
register(*_KEEP_BOTH, saved=_keeps_input_and_output)(along)
