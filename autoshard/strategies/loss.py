"""Cross-entropy over vocabulary-sharded logits, computed vocabulary-parallel.

The logits are never gathered: the row maximum, the sum of exponentials and
the target's logit are each reduced over the vocabulary axes (a few numbers
per token), and the mean (or sum) over tokens is reduced over the token axes;
`ignore_index` targets count for neither. Per-class weights, label smoothing,
reduction "none", probabilities as targets and logits of other than two dims
are not claimed: those calls run replicated.
"""

from __future__ import annotations

from torch.ops import aten

from autoshard.layout import Layout, Step
from autoshard.strategies.base import Context, Strategy, Unclaimed, make, register
from autoshard.tracing.trace import argument


@register(aten.cross_entropy_loss.default)
def cross_entropy(ctx: Context) -> list[Strategy]:
    node = ctx.node
    reduction = argument(node, "reduction")
    if reduction not in (1, 2):
        raise Unclaimed("reduction='none'")
    if argument(node, "weight") is not None:
        raise Unclaimed("per-class weight")
    if argument(node, "label_smoothing"):
        raise Unclaimed(f"label_smoothing={argument(node, 'label_smoothing')}")
    if len(ctx.shape(0)) != 2 or ctx.shape(1) != ctx.shape(0)[:1]:
        raise Unclaimed(f"logits {list(ctx.shape(0))} with target {list(ctx.shape(1))}")
    if ctx.inputs[1].meta["val"].is_floating_point():
        raise Unclaimed("class probabilities as target")
    logits = ctx.layout(0)
    tokens, vocab = logits.dims
    target = Layout((tokens,))
    itemsize = ctx.inputs[0].meta["val"].element_size()
    local_tokens = ctx.shape(0)[0] // ctx.mesh.count(tokens)

    def reduce(axes, nbytes):
        return tuple(
            Step("all_reduce", a, None, "identity", nbytes, ctx.mesh.size(a)) for a in axes
        )

    # max (no gradient); the sum of exponentials with the target logit, in one buffer;
    # then the loss with the token count (a mean's divisor)
    row = local_tokens * itemsize
    internal = (
        reduce(vocab, row) + reduce(vocab, 2 * row) + reduce(tokens, itemsize * (3 - reduction))
    )
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
