"""Cross-entropy over vocabulary-sharded logits, computed vocabulary-parallel.

The logits are never gathered: the row maximum, the sum of exponentials and
the target's logit are each reduced over the vocabulary axes (a few numbers
per token), and the mean over tokens is reduced over the token axes.
"""

from __future__ import annotations

from torch.ops import aten

from autoshard.layout import Layout, Step
from autoshard.strategies import Context, Strategy, make, register, replicated_fallback


@register(aten.cross_entropy_loss.default)
def cross_entropy(ctx: Context) -> list[Strategy]:
    args = list(ctx.node.args) + [None] * 6
    reduction = args[3] if args[3] is not None else ctx.node.kwargs.get("reduction", 1)
    smoothing = args[5] if args[5] is not None else ctx.node.kwargs.get("label_smoothing", 0.0)
    weighted = len(ctx.inputs) > 2
    if len(ctx.shape(0)) != 2 or reduction not in (1, 2) or smoothing or weighted:
        return replicated_fallback(ctx)  # per-class weights, smoothing, "none": gather first
    logits = ctx.layout(0)
    tokens, vocab = logits.dims
    target = Layout((tokens,))
    itemsize = ctx.inputs[0].meta["val"].element_size()
    local_tokens = ctx.shape(0)[0] // ctx.mesh.count(tokens)

    def reduce(axes, nbytes):
        return tuple(
            Step("all_reduce", a, None, "identity", nbytes, ctx.mesh.size(a)) for a in axes
        )

    # max (no gradient), sum of exponentials, target logit; then loss and token count
    internal = reduce(vocab, local_tokens * itemsize) * 3 + reduce(tokens, itemsize) * 2
    return [
        make(
            "vocab-parallel",
            [logits, target],
            Layout(()),
            lowering="cross_entropy",
            internal=internal,
            detail=f"vocabulary over {','.join(vocab) or '-'}",
        )
    ]
