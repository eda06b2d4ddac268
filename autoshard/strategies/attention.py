"""Attention: batch and heads sharded, never sequence or head_dim.

`scaled_dot_product_attention` gathers any axis that splits the sequence or
head_dim of q, k, v and, where the head (or batch) count allows, splits the
heads over it instead; keys and values follow the query's batch and head
shards (with fewer key/value heads, grouped-query attention, they are
replicated over an axis whose count does not divide them). The explicit
form (q @ kᵀ, softmax, @ v) is a batched matmul, which never splits its
contraction, and a softmax, which never splits its reduced dim.
"""

from __future__ import annotations

import sympy
import torch
from torch.ops import aten

from autoshard.formula import Formula
from autoshard.layout import Layout
from autoshard.strategies.base import Context, Saved, Strategy, Unclaimed, make
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


def _query_layouts(ctx: Context) -> list[Layout]:
    """The query layout as it comes, and with its sequence/head_dim axes moved to the
    leading dims that divide them: heads (the innermost) first, then batch."""
    q = ctx.layout(0)
    lead = len(q.dims) - 2
    kept = Layout(q.dims[:lead] + ((), ()))
    dims = [list(axes) for axes in q.dims[:lead]]
    shape = ctx.shape(0)
    for axis in q.dims[-2] + q.dims[-1]:
        for d in reversed(range(lead)):
            if (shape[d] // ctx.mesh.count(dims[d])) % ctx.mesh.size(axis) == 0:
                dims[d].append(axis)
                break
    moved = Layout(tuple(tuple(axes) for axes in dims) + ((), ()))
    return [moved, kept] if moved != kept else [kept]


def _heads_key_and_value_follow(ctx: Context, q: Layout) -> Layout:
    """`q` with its heads (the dim before the sequence's) split over only as many of
    its axes (outermost first) as also split the key's and value's heads: under
    grouped-query attention (fewer key/value heads), query head i reads key head
    i // group, so a rank's query heads need exactly the key heads of the same block.
    A single key head is read by all."""
    h = len(q.dims) - 3
    if h < 0:
        return q
    heads = list(q.dims[h])
    while heads and any(
        ctx.shape(i)[h] != 1 and ctx.shape(i)[h] % ctx.mesh.count(heads) for i in (1, 2)
    ):
        heads.pop()
    return Layout(q.dims[:h] + (tuple(heads),) + q.dims[h + 1 :])


@register(
    aten.scaled_dot_product_attention.default,
    flops=_attention_flops,
    backward=_attention_backward,
    saved=_attention_saved,
)
def sdpa(ctx: Context) -> list[Strategy]:
    if argument(ctx.node, "dropout_p"):  # a mask drawn per shard is not the serial one
        raise Unclaimed(f"dropout_p={argument(ctx.node, 'dropout_p')}")
    candidates = []
    out_shape = ctx.out_shape
    for q in _query_layouts(ctx):
        q = _heads_key_and_value_follow(ctx, q)
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
                scores = Layout(q.dims[:lead] + ((), ()))
                inputs.append(aligned(scores, shape, out_shape[:-1] + (shape[-1],)))
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
