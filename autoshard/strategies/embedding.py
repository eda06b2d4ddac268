"""Embeddings: features split, and the vocabulary split too for large tables.

Vocabulary-parallel lookup: each rank holds a slice of the rows, looks up the
ids that fall in it (zeros elsewhere), and the pending sum over the
vocabulary axes is reduce-scattered onto the token dims. With the features
split over the third axis, the output is stored exactly as a 3D activation
(tokens over two axes, features over one), and the table is stored the way
a tied output projection reads its weight. The padding row (`padding_idx`)
gets no gradient in either form: the feature-parallel lookup keeps whole rows,
and the vocabulary-parallel one shifts the index into the rank's own rows.
"""

from __future__ import annotations

from itertools import permutations
from typing import TYPE_CHECKING

from torch import fx
from torch.ops import aten

from autoshard.layout import Layout
from autoshard.mesh import Mesh
from autoshard.runtime import ops
from autoshard.strategies.base import Context, Lowering, Saved, Strategy, Unclaimed, make
from autoshard.strategies.registry import itemsize, numel, register
from autoshard.tracing.trace import argument

if TYPE_CHECKING:
    from autoshard.planning.plan import NodePlan


def _keeps_indices(node, in_shapes, out_shape, needs_grad, mask_itemsize) -> Saved:
    """The indices (the weight is a parameter)."""
    return Saved((1,))


def _vocab_parallel(node: fx.Node, placed: NodePlan, mesh: Mesh) -> None:
    weight, ids = node.args[:2]
    padding_idx = argument(node, "padding_idx")
    node.target = ops.vocab_embedding
    node.args = (weight, ids)
    node.kwargs = {
        "vocab_size": weight.meta["val"].shape[0],
        "vocab_axes": placed.strategy.inputs[0].dims[0],
        "padding_idx": padding_idx,
    }


def _vocab_parallel_saved(node, in_shapes, out_shape, needs_grad, mask_itemsize) -> Saved:
    """`autoshard.runtime.ops.vocab_embedding` keeps the local indices and the float mask
    of the ids this rank holds."""
    return Saved(extra_bytes=numel(in_shapes[1]) * (8 + itemsize(node)))


VOCAB_EMBEDDING = Lowering("vocab_embedding", _vocab_parallel, saved=_vocab_parallel_saved)


def _token_dims(shape, axes, mesh) -> list[tuple[str, ...]]:
    """Place `axes` (outer first) on the first token dims that divide."""
    dims = [[] for _ in shape]
    local = list(shape)
    for axis in axes:
        for d, size in enumerate(local):
            if size % mesh.size(axis) == 0:
                dims[d].append(axis)
                local[d] //= mesh.size(axis)
                break
    return [tuple(d) for d in dims]


@register(aten.embedding.default, saved=_keeps_indices, lowerings=(VOCAB_EMBEDDING,))
def embedding(ctx: Context) -> list[Strategy]:
    # Both scale a row's gradient by how often the batch uses it, which a rank that
    # sees only part of the batch or of the table cannot count.
    for name in ("scale_grad_by_freq", "sparse"):
        if argument(ctx.node, name):
            raise Unclaimed(f"{name}=True")
    ids_shape = ctx.shape(1)
    rep_ids = Layout.replicated(len(ids_shape))
    if ctx.family == "replicated":
        return [
            make(
                "replicated", [Layout.replicated(2), rep_ids], Layout.replicated(len(ids_shape) + 1)
            )
        ]
    candidates = []
    for x, y, z in permutations(ctx.mesh.names):
        tokens = _token_dims(ids_shape, (x, y), ctx.mesh)
        stored = Layout(tuple(tokens) + ((z,),)).normalized(ctx.mesh)
        table = Layout(((x, y), (z,))).normalized(ctx.mesh)
        out = Layout(((),) * len(ids_shape) + ((z,),), partial=(x, y)).normalized(ctx.mesh)
        candidates.append(
            make(
                "vocab-parallel",
                [table, rep_ids],
                out,
                stored,
                lowering=VOCAB_EMBEDDING if table.dims[0] else None,
                detail=f"vocabulary over {','.join(table.dims[0]) or '-'}",
            )
        )
        feature_table = Layout(((), (z,))).normalized(ctx.mesh)
        ids = Layout(tuple(tokens)).normalized(ctx.mesh)
        candidates.append(make("feature-parallel", [feature_table, ids], stored, detail=""))
    return [
        c
        for c in candidates
        if not any(lay.indivisible(ctx.shape(i), ctx.mesh) for i, lay in enumerate(c.inputs))
        and not c.stored.indivisible(ctx.out_shape, ctx.mesh)
    ]
