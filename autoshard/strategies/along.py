"""Ops that work along some dims of their input and need each of those whole on a
rank (a maximum, a variance, a norm, a scan, a flip, a roll, an index of the largest,
a top k, a sort, a selection of rows by an index): those dims are gathered, the
others keep their shards; an index operand is whole, values and their indices are
laid out alike.

    x.amax(-1)             # x [B, S, H] split over B and H: H gathered, B stays split
    x.flip(1)              # S whole, B and H as they come

With no dims named, an op works along every dim (the flattened tensor), so nothing
is split; but ``flip(x, [])``, ``any(x, [])`` and ``all(x, [])`` work along none. A
dim kept in the result (``keepdim=True``, or an op that keeps the input's shape)
stays whole there. A 0-d input is whole.
"""

from __future__ import annotations

from torch.ops import aten

from autoshard.layout import Layout
from autoshard.strategies.base import Context, Saved, Strategy, Unclaimed, make, whole_operands
from autoshard.strategies.registry import INDEX_BYTES, keeps_input, keeps_output, numel, register
from autoshard.tracing.schema import argument


def _keeps_input_and_output(node, in_shapes, out_shape, needs_grad, mask_itemsize) -> Saved:
    """Backward needs the input and the result: amax's mask of the maxima, logsumexp's
    softmax, prod's quotient, std's divisor."""
    return Saved((0,), output=True)


# op → the argument naming the dims it works along
_INDICES = {aten.argmax.default: "dim", aten.argmin.default: "dim"}
_MOVES = {aten.roll.default: "dims", aten.flip.default: "dims"}
_KEEP_INPUT = {
    aten.var.correction: "dim",
    aten.var.dim: "dim",
    aten.glu.default: "dim",
    aten.nansum.default: "dim",
    aten.var_mean.dim: "dim",  # the mean's gradient needs nothing, the variance's x
    aten.var_mean.correction: "dim",
}
_KEEP_BOTH = {
    aten.std.correction: "dim",
    aten.std.dim: "dim",
    aten.amax.default: "dim",
    aten.amin.default: "dim",
    aten.logsumexp.default: "dim",
    aten.prod.dim_int: "dim",
    aten.cumprod.default: "dim",
    aten.logcumsumexp.default: "dim",
    aten.std_mean.dim: "dim",
    aten.std_mean.correction: "dim",
}
_RANKS = {  # values with their indices; backward scatters the gradient to the indices
    aten.max.dim: "dim",
    aten.min.dim: "dim",
    aten.topk.default: "dim",
    aten.sort.default: "dim",
    aten.sort.stable: "dim",
    aten.median.dim: "dim",
    aten.kthvalue.default: "dim",
    aten.mode.default: "dim",
}
_ARGSORTS = {aten.argsort.default: "dim", aten.argsort.stable: "dim"}  # the indices alone
_NORMS = {aten.linalg_vector_norm.default: "dim", aten.norm.ScalarOpt_dim: "dim"}
_TESTS = {
    aten.any.dim: "dim",
    aten.any.dims: "dim",
    aten.all.dim: "dim",
    aten.all.dims: "dim",
}
# an empty list of dims names none: these return their input as it is
_NONE_IF_EMPTY = frozenset({aten.flip.default, aten.any.dims, aten.all.dims})
_SELECTIONS = {aten.index_select.default: "dim"}  # rows of a sinusoidal table, by an index
_DIMS = {
    **_INDICES,
    **_MOVES,
    **_KEEP_INPUT,
    **_KEEP_BOTH,
    **_TESTS,
    **_SELECTIONS,
    **_RANKS,
    **_ARGSORTS,
    **_NORMS,
}


def along(ctx: Context) -> list[Strategy]:
    x = ctx.layout(0)
    nd = len(x.dims)
    results = ctx.result_shapes  # values and indices: laid out alike
    count = len(results)
    shape = results[0] if results else ctx.out_shape
    if nd == 0:
        whole = Layout.replicated(len(shape))
        return [make("follow", [x, *whole_operands(ctx, 1)], whole, outputs=(whole,) * count)]
    named = argument(ctx.node, _DIMS[ctx.node.target])
    named = [named] if isinstance(named, int) else named
    if named:
        worked = {d % nd for d in named}
    else:  # no dims: every one (the flattened tensor), or none where the op says so
        worked = set() if ctx.node.target in _NONE_IF_EMPTY else set(range(nd))
    whole = Layout(tuple(() if d in worked else axes for d, axes in enumerate(x.dims)))
    inputs = [whole, *whole_operands(ctx, 1)]  # an index whole
    if len(shape) == nd:  # keepdim, a scan, a flip, a roll, a selection, a top k
        return [make("follow", inputs, whole, outputs=(whole,) * count)]
    if len(shape) != nd - len(worked):
        raise Unclaimed(f"{_DIMS[ctx.node.target]}={named} for a result of shape {shape}")
    out = Layout(tuple(axes for d, axes in enumerate(whole.dims) if d not in worked))
    return [make("follow", inputs, out, outputs=(out,) * count)]


def _keeps_index(node, in_shapes, out_shape, needs_grad, mask_itemsize) -> Saved:
    return Saved((1,))


def _keeps_indices(node, in_shapes, out_shape, needs_grad, mask_itemsize) -> Saved:
    """The int64 indices it returns beside the values (as many)."""
    return Saved(extra_bytes=numel(out_shape) * INDEX_BYTES)


register(*_INDICES, *_MOVES, *_TESTS)(along)
register(*_SELECTIONS, saved=_keeps_index)(along)
register(*_KEEP_INPUT, saved=keeps_input)(along)
register(*_KEEP_BOTH, *_NORMS, saved=_keeps_input_and_output)(along)
register(*_RANKS, saved=_keeps_indices)(along)
register(*_ARGSORTS, saved=keeps_output)(along)  # sort's indices, which it returns
