"""Attention: batch, heads and queries sharded, never keys or head_dim.

`scaled_dot_product_attention` gathers any axis that splits head_dim of q, k, v and,
where the head (or batch) count allows, splits the heads over it instead; keys and
values follow the query's batch and head shards (with fewer key/value heads,
grouped-query attention, they are replicated over an axis whose count does not
divide them). An axis that splits the query's sequence may be moved to its heads or
batch likewise, or kept: each query row attends on its own, so a rank computes the
rows it holds against every key and value (gathered over that axis; their gradients
are partial sums over it). A causal call (`is_causal`) keeps its rows as the
lowering `causal_rows`, which masks a rank's rows from their place in the whole.
The explicit form (q @ kᵀ, softmax, @ v) is a batched matmul, which never splits its
contraction, and a softmax, which never splits its reduced dim.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import sympy
import torch
from torch import fx
from torch.ops import aten

from autoshard.formula import Formula
from autoshard.layout import Layout
from autoshard.mesh import Mesh
from autoshard.runtime import ops
from autoshard.strategies.base import Context, Lowering, Saved, Strategy, Unclaimed, make
from autoshard.strategies.pointwise import aligned
from autoshard.strategies.registry import (
    STATISTIC_BYTES,
    keeps_output,
    normalizing_flops,
    numel,
    on_cpu,
    register,
)
from autoshard.strategies.views import _dim_arg, _unshard
from autoshard.tracing.schema import argument
from autoshard.tracing.trace import tensor_inputs

if TYPE_CHECKING:
    from autoshard.planning.plan import NodePlan

# Attention over batch×heads BH: scores Q·Kᵀ and the weighted sum P·V, each a
# matmul: 4·b·h·s²·d when q, k, v share the head dim d.
BH, Sq, Sk, Dqk, Dv = sympy.symbols("BH S_q S_k D_qk D_v", positive=True, integer=True)
ATTENTION_FLOPS = Formula(2 * BH * Sq * Sk * (Dqk + Dv), BH, Sq, Sk, Dqk, Dv)
# The backward of flash / memory-efficient attention runs five matmuls of the
# forward's size to the forward's two (dV, dP, dS→dQ, dK, plus recomputing P).
ATTENTION_BACKWARD = 2.5


def _attention_flops(node, in_shapes, out_shape) -> float:
    q, key, v = in_shapes[:3]
    return ATTENTION_FLOPS(numel(q[:-2]), q[-2], key[-2], q[-1], v[-1])


def _attention_backward(node, needs_grad) -> float:
    return ATTENTION_BACKWARD


def _attention_saved(node, in_shapes, out_shape, needs_grad, mask_itemsize) -> Saved:
    """What torch's CPU and CUDA kernels keep. Flash and memory-efficient attention:
    q, k, v (and a mask, if given), the output and an fp32 logsumexp per query; a
    boolean mask is kept as the additive mask torch makes of it, a new tensor of the
    query's dtype at the (broadcast) shape the mask is passed. A mask that needs a
    gradient (a learned position bias), or inputs that are not 4-D (every fused kernel
    takes [B, H, S, D] only), or dropout on the CPU (whose flash kernel has none), take
    the math fallback: it keeps v, q and k scaled (new tensors) and the s²
    probabilities; with dropout also the probabilities dropped and dropout's mask (as
    `_dropout_mask`: a noise tensor of their dtype on the CPU, bool on CUDA)."""
    inputs = tensor_inputs(node)
    itemsize = inputs[0].meta["val"].element_size()
    q, key = in_shapes[0], in_shapes[1]
    dropout = bool(argument(node, "dropout_p"))
    if len(q) != 4 or (len(inputs) > 3 and needs_grad[3]) or (dropout and on_cpu(node)):
        scores = numel(q[:-1]) * key[-2]
        kept = scores * itemsize
        if dropout:
            kept += scores * (itemsize + (itemsize if on_cpu(node) else 1))
        return Saved((2,), extra_bytes=(numel(q) + numel(key)) * itemsize + kept)
    extra = numel(q[:-1]) * STATISTIC_BYTES
    kept = tuple(range(len(inputs)))
    if len(inputs) > 3 and inputs[3].meta["val"].dtype == torch.bool:
        kept = kept[:3]
        extra += numel(in_shapes[3]) * itemsize
    return Saved(kept, output=True, extra_bytes=extra)


def _causal_rows_saved(node, in_shapes, out_shape, needs_grad, mask_itemsize) -> Saved:
    """What attention keeps, and, on the fused kernels' path, the additive mask torch
    makes of the boolean one `ops.causal_rows` passes ([rows, keys])."""
    kept = _attention_saved(node, in_shapes, out_shape, needs_grad, mask_itemsize)
    q, key = in_shapes[0], in_shapes[1]
    if len(q) != 4:
        return kept
    itemsize = tensor_inputs(node)[0].meta["val"].element_size()
    return Saved(kept.inputs, kept.output, kept.extra_bytes + q[-2] * key[-2] * itemsize)


def _causal_rows_workspace(node, in_shapes, out_shape) -> int:
    return in_shapes[0][-2] * in_shapes[1][-2]  # the boolean mask


def _causal_rows(node: fx.Node, placed: NodePlan, mesh: Mesh) -> None:
    q, key, value = node.args[:3]
    node.args = (q, key, value)
    node.kwargs = {
        "scale": argument(node, "scale"),
        "enable_gqa": argument(node, "enable_gqa"),
        "queries": q.meta["val"].shape[-2],
        "query_axes": placed.strategy.inputs[0].dims[-2],
    }
    node.target = ops.causal_rows


CAUSAL_ROWS = Lowering("causal_rows", _causal_rows, _causal_rows_saved, _causal_rows_workspace)


def _query_layouts(ctx: Context) -> list[Layout]:
    """The layouts attention may take its query in, from the one it comes in: the axes
    over its sequence and head_dim moved to the leading dims that take them (heads,
    the innermost, first, then batch); or splitting the query rows, with the axes
    over the sequence kept there and head_dim's moved, or with every one moved where
    it fits; an axis no dim takes is gathered. Only those that keep the most axes: an
    axis gathered where it could split the work has every rank of it compute and keep
    the same scores, s² each.

    The heads take an axis only where the key's and value's heads divide over it too:
    under grouped-query attention (fewer key/value heads) query head i reads key head
    i // group, so a rank's query heads need exactly the key heads of the same block
    (a single key head is read by all). An axis the heads come with that the key's do
    not divide over moves like the others."""
    q = ctx.layout(0)
    lead = len(q.dims) - 2
    heads = lead - 1
    shape = ctx.shape(0)
    count, size = ctx.mesh.count, ctx.mesh.size
    key_heads = [ctx.shape(i)[heads] for i in (1, 2)] if heads >= 0 else []

    def takes(d: int, axes: list[str], axis: str) -> bool:
        n = count(axes) * size(axis)
        if shape[d] % n:
            return False
        return d != heads or all(k == 1 or k % n == 0 for k in key_heads)

    kept = [[] for _ in range(lead)]
    unplaced = []
    for d in range(lead):
        for axis in q.dims[d]:
            (kept[d] if takes(d, kept[d], axis) else unplaced).append(axis)

    def placed(moving: tuple[str, ...], rows: tuple[str, ...], onto_rows: bool) -> Layout:
        dims = [list(axes) for axes in kept] + [list(rows)]
        for axis in moving:
            fits = [d for d in reversed(range(lead)) if takes(d, dims[d], axis)]
            if onto_rows and shape[-2] % (count(dims[lead]) * size(axis)) == 0:
                fits.append(lead)
            if fits:
                dims[fits[0]].append(axis)
        return Layout(tuple(tuple(axes) for axes in dims) + ((),))

    seq, others = q.dims[-2], tuple(unplaced) + q.dims[-1]
    layouts = [
        placed(seq + others, (), onto_rows=False),
        placed(others, seq, onto_rows=True),
        placed(seq + others, (), onto_rows=True),
    ]
    most = max(len(layout.sharded_axes) for layout in layouts)
    return list(dict.fromkeys(layout for layout in layouts if len(layout.sharded_axes) == most))


@register(
    aten.scaled_dot_product_attention.default,
    flops=_attention_flops,
    backward=_attention_backward,
    saved=_attention_saved,
    lowerings=(CAUSAL_ROWS,),
)
def sdpa(ctx: Context) -> list[Strategy]:
    if argument(ctx.node, "dropout_p"):  # a mask drawn per shard is not the serial one
        raise Unclaimed(f"dropout_p={argument(ctx.node, 'dropout_p')}")
    candidates = []
    out_shape = ctx.out_shape
    causal = bool(argument(ctx.node, "is_causal"))
    for q in _query_layouts(ctx):
        lead = len(q.dims) - 2
        inputs = [q]
        for i in range(1, len(ctx.inputs)):
            shape = ctx.shape(i)
            if i in (1, 2):  # key, value: the query's leading shards, where they have
                # the dim (fewer heads, or a batch of 1, broadcast) and it divides
                leading = tuple(
                    axes
                    if shape[d] == out_shape[d]
                    or shape[d] % ctx.mesh.count(axes) == 0
                    and shape[d] != 1
                    else ()
                    for d, axes in enumerate(q.dims[:lead])
                )
                inputs.append(Layout(leading + ((), ())))
            else:  # the mask broadcasts against the scores [..., S_q, S_k]
                scores = Layout(q.dims[:lead] + (q.dims[-2], ()))
                inputs.append(aligned(scores, shape, out_shape[:-1] + (shape[-1],)))
        if q.dims[-2]:
            lowering = CAUSAL_ROWS if causal else None
            candidates.append(make("follow", inputs, q, lowering=lowering, detail="queries"))
        else:
            candidates.append(make("follow", inputs, q, detail="batch and heads"))
    return candidates


@register(
    aten._softmax.default,
    aten.softmax.int,
    aten._log_softmax.default,
    aten.log_softmax.int,
    flops=normalizing_flops,
    saved=keeps_output,
)
def softmax(ctx: Context) -> list[Strategy]:
    x = _unshard(ctx.layout(0), _dim_arg(ctx, 1))
    return [make("follow", [x], x)]
