"""Cross-entropy over vocabulary-sharded logits, computed vocabulary-parallel.

The logits are never gathered: the row maximum, the sum of exponentials and
the target's logit are each reduced over the vocabulary axes (a few numbers
per token), and the mean (or sum) over tokens is reduced over the token axes;
`ignore_index` targets count for neither. Per-class weights, label smoothing,
reduction "none", probabilities as targets and logits of other than two dims
are not claimed: those calls run replicated.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import fx
from torch.ops import aten

from autoshard.layout import Layout, Step
from autoshard.mesh import Mesh
from autoshard.runtime import ops
from autoshard.strategies.base import Context, Lowering, Saved, Strategy, Unclaimed, make
from autoshard.strategies.registry import itemsize, normalizing_flops, numel, register
from autoshard.tracing.trace import argument, tensor_inputs

if TYPE_CHECKING:
    from autoshard.planning.plan import NodePlan


def _native_saved(node, in_shapes, out_shape, needs_grad, mask_itemsize) -> Saved:
    """The log-softmax of the logits and the targets."""
    return Saved((1,), extra_bytes=numel(in_shapes[0]) * itemsize(tensor_inputs(node)[0]))


def _vocab_parallel(node: fx.Node, placed: NodePlan, mesh: Mesh) -> None:
    logits, target = node.args[:2]
    reduction, ignore_index = argument(node, "reduction"), argument(node, "ignore_index")
    tokens, vocab = placed.strategy.inputs[0].dims
    node.target = ops.cross_entropy
    node.args = (logits, target)
    node.kwargs = {
        "vocab_size": logits.meta["val"].shape[-1],
        "vocab_axes": vocab,
        "token_axes": tokens,
        "node": node.name,
        "ignore_index": ignore_index,
        "reduction": reduction,
    }


def _vocab_parallel_saved(node, in_shapes, out_shape, needs_grad, mask_itemsize) -> Saved:
    """`autoshard.runtime.ops.cross_entropy` keeps the local softmax, per row the
    target's index (int64) and two bool masks, and for a mean the token count (a view
    of the (loss, count) pair it is reduced in: two values)."""
    logits, item = numel(in_shapes[0]), itemsize(tensor_inputs(node)[0])
    rows = numel(in_shapes[0][:-1])
    count = 2 * item if argument(node, "reduction") == 1 else 0
    return Saved(extra_bytes=logits * item + rows * (8 + 2) + count)


def _vocab_parallel_workspace(node, in_shapes, out_shape) -> int:
    """The shifted logits, alive with the logits and the softmax it keeps."""
    return numel(in_shapes[0]) * itemsize(tensor_inputs(node)[0])


CROSS_ENTROPY = Lowering(
    "cross_entropy",
    _vocab_parallel,
    saved=_vocab_parallel_saved,
    workspace=_vocab_parallel_workspace,
)


@register(
    aten.cross_entropy_loss.default,
    flops=normalizing_flops,
    saved=_native_saved,
    lowerings=(CROSS_ENTROPY,),
)
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
            lowering=CROSS_ENTROPY,
            internal=internal,
            detail=f"vocabulary over {','.join(vocab) or '-'}",
        )
    ]
