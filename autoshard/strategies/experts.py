"""Experts' products (`autoshard.tracing.experts.grouped_mm_nt`): tensor parallel inside every
expert, the tokens whole.

For x [S, H] (tokens sorted by expert), w [E, O, H] and offs [E], the rows of
each expert are data-dependent, so the tokens (and the experts) are not split;
every expert's product is: two mesh axes split H (x and w, a pending sum over
them, all-reduced) and one splits O (w and the output), or one splits H and two
O. Each rank stores 1/8 of every expert's weight on 2×2×2 and computes 1/8 of
every product; offs is whole everywhere.

    grouped_mm_nt(x [S, H] S1(a,b), w [E, O, H] S1(c) S2(a,b), offs)  # K=a,b N=c
"""

from __future__ import annotations

from itertools import permutations

from autoshard.layout import Layout
from autoshard.strategies.base import Context, Saved, Strategy, make, replicated_fallback
from autoshard.strategies.linear import _valid
from autoshard.strategies.registry import register
from autoshard.tracing.experts import grouped_mm_nt


def _keeps_tokens_and_weight(node, in_shapes, out_shape, needs_grad, mask_itemsize) -> Saved:
    """Hugging Face's grouped_mm_fallback saves its input and weight for backward
    whichever needs the gradient (its setup_context); offs it holds as an attribute."""
    return Saved((0, 1))


@register(grouped_mm_nt, saved=_keeps_tokens_and_weight)
def grouped_mm(ctx: Context) -> list[Strategy]:
    if ctx.family == "replicated":
        return replicated_fallback(ctx)
    mesh = ctx.mesh
    candidates = []
    for order in permutations(mesh.names):
        for cut in range(1, len(order)):
            k, n = order[:cut], order[cut:]
            x = Layout(((), k)).normalized(mesh)
            w = Layout(((), n, k)).normalized(mesh)
            out = Layout(((), n), partial=k).normalized(mesh)
            offs = Layout.replicated(1)
            detail = f"K={','.join(k)} N={','.join(n)}"
            candidates.append(
                make(
                    ctx.family,
                    [x, w, offs],
                    out,
                    Layout(((), n)).normalized(mesh),
                    storage=(None, w, None),
                    detail=detail,
                )
            )
    shapes = tuple(ctx.shape(i) for i in range(len(ctx.inputs)))
    return _valid(shapes, ctx.out_shape, mesh, candidates)
