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
from autoshard.strategies.base import (
    NAMED,
    Context,
    Lowering,
    Saved,
    Strategy,
    Unclaimed,
    batch_dims,
    make,
    parallel_axes,
)
from autoshard.strategies.registry import itemsize, numel, register
from autoshard.tracing.schema import argument

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
    if ctx.family in NAMED:
        return _named(ctx)
    candidates = []
    for x, y, z in permutations(ctx.mesh.names):
        tokens = batch_dims(ids_shape, (x, y), ctx.mesh)
        stored = Layout(tuple(tokens) + ((z,),)).normalized(ctx.mesh)
        out = Layout(((),) * len(ids_shape) + ((z,),), partial=(x, y)).normalized(ctx.mesh)
        # The pending sum is over x and y in any order, so the rows may be nested either
        # way (the nesting a tied lm-head reads, `planner._tied_stored_best`).
        for vocab in ((x, y), (y, x)):
            table = Layout((vocab, (z,))).normalized(ctx.mesh)
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
        # The weight knob of a layer: the table kept whole over the token axes, or
        # stored split over them too and gathered before the lookup (1/(x·y) of it).
        for store, split in ((feature_table, False), (table, True)):
            candidates.append(
                make(
                    "feature-parallel",
                    [feature_table, ids],
                    stored,
                    storage=(store, None),
                    detail="",
                    split_weight=split,
                )
            )
    return [
        c
        for c in candidates
        if not any(lay.indivisible(ctx.shape(i), ctx.mesh) for i, lay in enumerate(c.inputs))
        and not c.stored.indivisible(ctx.out_shape, ctx.mesh)
        and not c.storage_for(0).indivisible(ctx.shape(0), ctx.mesh)
    ]


def _named(ctx: Context) -> list[Strategy]:
    """The lookup under "dp" and "megatron": the ids as they arrive (split over the
    batch on the data-parallel axes, `autoshard.planning.planner.entry_layout`, or
    replicated: positions), the output split as the ids are. Under "megatron" ids the
    model is given (words) look up a table whose rows are split over the
    tensor-parallel axis: each rank looks up the ids it holds and the sum is
    all-reduced (Megatron's vocabulary-parallel embedding, and the layout a tied
    column-parallel lm-head reads). Ids the model makes itself (positions, token
    types), rows that do not divide, and "dp" read a whole table, as Megatron keeps
    its position table. The weight knob: the table also split over the data-parallel
    axes (gathered before the lookup) or kept whole over them."""
    mesh, ids = ctx.mesh, ctx.layout(1)
    data, tp = parallel_axes(ctx.family, mesh)
    tokens = ids.dims + ((),)
    given = ctx.inputs[1].op == "placeholder"
    vocab = tp if given and ctx.shape(0)[0] % mesh.count(tp) == 0 else ()
    table = Layout((vocab, ())).normalized(mesh)
    split = Layout((vocab, data)).normalized(mesh)
    out = Layout(tokens, partial=vocab).normalized(mesh)
    storages = [(table, False)]
    if not split.indivisible(ctx.shape(0), mesh):
        storages.append((split, True))
    return [
        make(
            ctx.family,
            [table, ids],
            out,
            Layout(tokens).normalized(mesh),
            storage=(store, None),
            lowering=VOCAB_EMBEDDING if table.dims[0] else None,
            detail=f"vocabulary over {','.join(table.dims[0]) or '-'}",
            split_weight=split_weight,
        )
        for store, split_weight in storages
    ]
