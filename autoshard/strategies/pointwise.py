"""Pointwise ops follow their largest input; broadcast operands are split to match.

An operand that broadcasts along a dim the output shards is replicated there:
its gradient then comes back partial, which the planner reduces.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from torch import fx
from torch.ops import aten

from autoshard.layout import Layout
from autoshard.mesh import Mesh
from autoshard.runtime import ops
from autoshard.strategies.base import Context, Lowering, Saved, Strategy, make
from autoshard.strategies.registry import (
    each_for_the_other,
    itemsize,
    keeps_input,
    keeps_inputs,
    keeps_operands,
    keeps_output,
    numel,
    on_cpu,
    register,
)
from autoshard.tracing.modes import FOLLOWS_MODE
from autoshard.tracing.trace import tensor_inputs

if TYPE_CHECKING:
    from autoshard.planning.plan import NodePlan

# Grouped by what autograd keeps for their backward (as torch's derivatives.yaml).
OTHERS = (  # counted as keeping nothing (add, sub, neg, casts and copies keep nothing)
    aten.add.Tensor,
    aten.sub.Tensor,
    aten.add.Scalar,
    aten.sub.Scalar,
    aten.mul.Scalar,
    aten.div.Scalar,
    aten.rsub.Scalar,
    aten.neg.default,
    aten.clone.default,
    aten.contiguous.default,
    aten.to.dtype,
    aten._to_copy.default,
    aten.to.dtype_layout,
    aten.to.device,
    aten.lerp.Scalar,  # each gradient is grad times a number: (1 − weight) and weight
    aten.sign.default,
    aten.sgn.default,
    aten.round.default,
    aten.floor.default,
    aten.ceil.default,
    aten.trunc.default,
    # comparisons and logical ops: masks, built elementwise from ids and positions
    aten.eq.Tensor,
    aten.eq.Scalar,
    aten.ne.Tensor,
    aten.ne.Scalar,
    aten.le.Tensor,
    aten.le.Scalar,
    aten.lt.Tensor,
    aten.lt.Scalar,
    aten.ge.Tensor,
    aten.ge.Scalar,
    aten.gt.Tensor,
    aten.gt.Scalar,
    aten.__and__.Tensor,
    aten.__or__.Tensor,
    aten.bitwise_and.Tensor,
    aten.bitwise_or.Tensor,
    aten.logical_not.default,
    aten.bitwise_not.default,
)
KEEP_OUTPUT = (
    aten.exp.default,
    aten.sqrt.default,
    aten.rsqrt.default,
    aten.relu.default,
    aten.tanh.default,
    aten.sigmoid.default,
    aten.reciprocal.default,  # −grad · result²
)
KEEP_INPUT = (
    aten.pow.Tensor_Scalar,
    aten.square.default,  # pow(x, 2)
    aten.cos.default,
    aten.sin.default,
    aten.clamp.default,
    aten.log.default,
    aten.abs.default,
    aten.gelu.default,
    aten.silu.default,
    # torch.nn's other activations (an RReLU in training draws its slopes: not here)
    aten.elu.default,
    aten.celu.default,
    aten.selu.default,
    aten.leaky_relu.default,
    aten.hardtanh.default,
    aten.hardswish.default,
    aten.hardsigmoid.default,
    aten.mish.default,
    aten.softshrink.default,
    aten.hardshrink.default,
    aten.threshold.default,
    aten.clamp_min.default,  # F.normalize's floor under the norm
    aten.clamp_max.default,
)
KEEP_INPUTS = (aten.maximum.default, aten.minimum.default, aten.clamp.Tensor)


def aligned(out: Layout, shape, out_shape) -> Layout:
    """`out` as seen by an operand of `shape` broadcast to `out_shape`."""
    offset = len(out_shape) - len(shape)
    return Layout(
        tuple(
            out.dims[d + offset] if shape[d] == out_shape[d + offset] else ()
            for d in range(len(shape))
        )
    )


def follow(ctx: Context, lowering: Lowering | None = None) -> list[Strategy]:
    """The output laid out as the operand of its own shape (else the one of most dims)."""
    shapes = [ctx.shape(i) for i in range(len(ctx.inputs))]
    same = [i for i, shape in enumerate(shapes) if shape == ctx.out_shape]
    primary = same[0] if same else max(range(len(shapes)), key=lambda i: len(shapes[i]))
    out = ctx.layout(primary)
    inputs = [aligned(out, shape, ctx.out_shape) for shape in shapes]
    return [make("follow", inputs, out, lowering=lowering)]


def _keeps_divisor(node, in_shapes, out_shape, needs_grad, mask_itemsize) -> Saved:
    """a / b keeps b, and a too if b needs a gradient."""
    if len(tensor_inputs(node)) != 2:
        return Saved()
    return Saved((0, 1) if needs_grad[1] else (1,))


def _keeps_mask(node, in_shapes, out_shape, needs_grad, mask_itemsize) -> Saved:
    """masked_fill(x, mask, value) keeps the mask."""
    return Saved((1,))


def _keeps_factors(node, in_shapes, out_shape, needs_grad, mask_itemsize) -> Saved:
    """addcmul(x, a, b) = x + value · a · b keeps each factor for the other's gradient."""
    return each_for_the_other(needs_grad, 1, 2)


def _keeps_lerp_operands(node, in_shapes, out_shape, needs_grad, mask_itemsize) -> Saved:
    """lerp(start, end, weight) keeps the weight for start's and end's gradients
    (grad · (1 − weight), grad · weight), start and end for the weight's
    (grad · (end − start))."""
    kept = (2,) if needs_grad[0] or needs_grad[1] else ()
    return Saved(kept + ((0, 1) if needs_grad[2] else ()))


def _keeps_input_and_buffer(node, in_shapes, out_shape, needs_grad, mask_itemsize) -> Saved:
    """log_sigmoid keeps its input and the buffer log_sigmoid_forward returns: on the
    CPU a tensor of the input's size (exp(−|x|)), on CUDA an empty one."""
    buffer = numel(in_shapes[0]) * itemsize(node) if on_cpu(node) else 0
    return Saved((0,), extra_bytes=buffer)


register(*OTHERS)(follow)
register(*KEEP_OUTPUT, saved=keeps_output)(follow)
register(*KEEP_INPUT, saved=keeps_input)(follow)
register(*KEEP_INPUTS, saved=keeps_inputs)(follow)
register(aten.mul.Tensor, saved=keeps_operands)(follow)
register(aten.div.Tensor, aten.div.Tensor_mode, saved=_keeps_divisor)(follow)
register(aten.where.self, saved=keeps_input)(follow)  # the condition
register(aten.masked_fill.Scalar, aten.masked_fill.Tensor, saved=_keeps_mask)(follow)
register(aten.addcmul.default, saved=_keeps_factors)(follow)
register(aten.lerp.Tensor, saved=_keeps_lerp_operands)(follow)
register(aten.log_sigmoid.default, saved=_keeps_input_and_buffer)(follow)
register(aten.alias.default, free=True, aliases=True)(follow)


def _keeps_input_and_slopes(node, in_shapes, out_shape, needs_grad, mask_itemsize) -> Saved:
    """prelu keeps its input and its slopes: _prelu_kernel's one backward computes both
    gradients from both."""
    return Saved((0, 1))


@register(aten.prelu.default, saved=_keeps_input_and_slopes)
def prelu(ctx: Context) -> list[Strategy]:
    """``prelu(x, weight)``: one slope per channel (x's dim 1) split as the channels are,
    or one slope for all, whole."""
    x = ctx.layout(0)
    slopes = Layout((x.dims[1],)) if ctx.shape(1)[0] != 1 else Layout(((),))
    return [make("follow", [x, slopes], x)]


register(aten.detach.default, free=True)(follow)


@register(aten.type_as.default)
def type_as(ctx: Context) -> list[Strategy]:
    """`x.type_as(other)` has x's shape: `other` lends only its dtype (no data, no
    gradient), and is read as it is stored."""
    x = ctx.layout(0)
    return [make("follow", [x, *(ctx.layout(i) for i in range(1, len(ctx.inputs)))], x)]


def _rewrite_dropout(node: fx.Node, placed: NodePlan, mesh: Mesh) -> None:
    if node.meta.get(FOLLOWS_MODE):  # on in train mode only: read the program's flag
        with node.graph.inserting_before(node), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # fx warns of get_attr on a plain attribute
            training = node.graph.get_attr("training")
        node.args = (node.args[0], node.args[1], training)
    node.target = ops.dropout
    # the serial mask is drawn in the memory order of the input's strides (torch's CPU
    # dropout draws into empty_like(input)): a transposed input's mask differs
    stride = tuple(node.meta["val"].stride())
    node.kwargs = {"shape": placed.shape, "stride": stride, "dims": placed.strategy.stored.dims}


def _dropout_noise(node: fx.Node, in_shapes, out_shape) -> int:
    """The noise drawn for the global shape on every rank, as the serial program draws
    it, alive until this rank's part is cut from it: a global activation's worth."""
    if dropout_returns_input(node):
        return 0
    return numel(tuple(node.meta["val"].shape)) * itemsize(node)


DROPOUT = Lowering("dropout", _rewrite_dropout, workspace=_dropout_noise)


def dropout_returns_input(node: fx.Node) -> bool:
    """Whether a dropout returns its input itself (p = 0, or not training), as torch's
    and autoshard's (`ops.dropout`) do: a view of its storage, with nothing kept."""
    p, train = (list(node.args[1:]) + [0.5, True])[:2]
    return p == 0 or not train


def _dropout_mask(node, in_shapes, out_shape, needs_grad, mask_itemsize) -> Saved:
    """A mask of the output's size, `mask_itemsize` bytes per element, nothing when p = 0
    or not training. torch's native dropout keeps a bool mask (1 byte); autoshard's
    lowering multiplies by a noise tensor of the activation's dtype, the default."""
    if dropout_returns_input(node):
        return Saved()
    mask = mask_itemsize if mask_itemsize is not None else itemsize(node)
    return Saved(extra_bytes=numel(out_shape) * mask)


def _in_place_dropout_noise(node, in_shapes, out_shape, needs_grad, mask_itemsize) -> Saved:
    """dropout_ multiplies its input in place by a noise tensor of the input's dtype
    (on every device: torch's fused kernel is out of place only), nothing when p = 0 or
    not training. `updates_out_of_place` makes it a dropout where nothing else shares
    the input's storage; where something does it runs as it is (it has no rule)."""
    if dropout_returns_input(node):
        return Saved()
    return Saved(extra_bytes=numel(out_shape) * itemsize(node))


register(aten.dropout_.default, saved=_in_place_dropout_noise)()


def _alpha_dropout_noise(node, in_shapes, out_shape, needs_grad, mask_itemsize) -> Saved:
    """alpha_dropout multiplies its input by a noise tensor of the input's size and
    dtype, feature_alpha_dropout by one of a value per channel (the input's first two
    dims, ones after); nothing when p = 0 or not training. (No rule: they run
    replicated, drawing what the serial model draws.)"""
    if dropout_returns_input(node):
        return Saved()
    if node.target == aten.feature_alpha_dropout.default:
        out_shape = (*out_shape[:2], *[1] * (len(out_shape) - 2))
    return Saved(extra_bytes=numel(out_shape) * itemsize(node))


register(
    aten.alpha_dropout.default, aten.feature_alpha_dropout.default, saved=_alpha_dropout_noise
)()


@register(aten.dropout.default, saved=_dropout_mask, lowerings=(DROPOUT,))
def dropout(ctx: Context) -> list[Strategy]:
    # The mask is drawn for the global shape and sliced, so a sharded model drops
    # exactly what the serial model drops from the same random state.
    return follow(ctx, lowering=DROPOUT)
