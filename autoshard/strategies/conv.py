"""Convolutions with a weight, plain and transposed: a linear over channels, batch as
the token dim.

For ``conv(x, w, b, stride, padding, dilation, groups)`` with x [B, C, *space],
w [O, C/groups, *kernel] and out [B, O, *space'] (a transposed convolution's w is
[C, O/groups, *kernel], and it takes an output_padding, of space too):

- ``groups == 1``: the linear's 3D roles (`strategies/linear.py`): M splits
  the batch, K the input channels C (of x and w, a pending sum), N the
  output channels O (of w, b and out). The bias is added after the output
  collectives. Space is never split: a window would cross the shard's edge.
- ``groups > 1`` (depthwise, grouped: Mamba's conv1d): no contraction crosses
  a group, so the channels of x, w, b and out are split together over whole
  groups, the batch over the other axes, and each rank convolves its own
  groups (`groups / count` of them, the "conv_groups" lowering).

stride, padding and dilation act on space only, which is never split, so every
value of them is exact. An input without a batch dim is not claimed.

    conv2d(x [8, 3, 16, 16] S0(a) S1(c), w [64, 3, 4, 4] S0(b) S1(c))  # M=a K=c N=b
"""

from __future__ import annotations

from itertools import product
from typing import TYPE_CHECKING

from torch import fx
from torch.ops import aten

from autoshard.layout import Layout
from autoshard.mesh import Mesh
from autoshard.strategies.base import (
    Context,
    Lowering,
    Saved,
    Strategy,
    Unclaimed,
    all_reduces,
    make,
    replicated_fallback,
)
from autoshard.strategies.linear import _layout, _roles, _valid
from autoshard.strategies.registry import numel, register
from autoshard.tracing.schema import argument, schema_arguments

if TYPE_CHECKING:
    from autoshard.planning.plan import NodePlan

TRANSPOSED = (
    aten.conv_transpose1d.default,
    aten.conv_transpose2d.input,
    aten.conv_transpose3d.input,
)
CONVOLUTIONS = (aten.conv1d.default, aten.conv2d.default, aten.conv3d.default, *TRANSPOSED)


def _own_groups(node: fx.Node, placed: NodePlan, mesh: Mesh) -> None:
    """A grouped convolution over split channels convolves only this rank's groups."""
    args = schema_arguments(node)
    args["groups"] = local_groups(args["groups"], placed.strategy.inputs[0], mesh)
    node.args, node.kwargs = tuple(args.values()), {}


CONV_GROUPS = Lowering("conv_groups", _own_groups)


def _weight_out_dim(node: fx.Node) -> int:
    """The dim of the weight that holds the output channels."""
    return 1 if node.target in TRANSPOSED else 0


def _flops(node: fx.Node, in_shapes, out_shape) -> float:
    """Two per product of an input element's group of weights: 2·out·(C/groups)·kernel,
    or for a transposed convolution 2·in·(O/groups)·kernel, on the local shapes."""
    per = numel(in_shapes[1][1:])
    return 2.0 * per * (numel(in_shapes[0]) if node.target in TRANSPOSED else numel(out_shape))


def _backward(node: fx.Node, needs_grad) -> float:
    """One convolution per gradient: of the input, of the weight."""
    return float(sum(needs_grad[:2]))


def _saved(node, in_shapes, out_shape, needs_grad, mask_itemsize) -> Saved:
    """The input and the weight (autograd's convolution keeps both for its one
    backward, whichever needs a gradient)."""
    return Saved((0, 1))


@register(
    *CONVOLUTIONS,
    flops=_flops,
    backward=_backward,
    saved=_saved,
    lowerings=(CONV_GROUPS,),
    regathers=True,
)
def convolution(ctx: Context) -> list[Strategy]:
    x_nd, w_nd = len(ctx.shape(0)), len(ctx.shape(1))
    if x_nd != w_nd:
        raise Unclaimed(f"an input without a batch dim {ctx.shape(0)}")
    if ctx.family == "replicated":
        return replicated_fallback(ctx)
    groups = argument(ctx.node, "groups")
    shapes = tuple(ctx.shape(i) for i in range(len(ctx.inputs)))
    if groups > 1:
        attempts = [_grouped(ctx, groups)]
    else:
        # Few input channels (an image's 3) take no K split: that axis splits the batch
        # too, or else the output channels.
        roles = _roles(ctx.family, ctx.mesh, ctx.layout(0).dims[1])
        attempts = [
            _dense(ctx, roles),
            _dense(ctx, [(m + k, (), n) for m, k, n in roles]),
            _dense(ctx, [(m, (), n + k) for m, k, n in roles]),
        ]
    for candidates in attempts:
        valid = _valid(shapes, ctx.out_shape, ctx.mesh, candidates)
        if valid:
            return valid
    raise Unclaimed(f"no split of {shapes} divides on mesh {ctx.mesh}")


def _dense(ctx: Context, roles) -> list[Strategy]:
    """The 3D candidates of a linear, with channels at dim 1 and the batch at dim 0, for
    each (M, K, N) assignment of mesh axes in `roles`."""
    nd, mesh = len(ctx.shape(0)), ctx.mesh
    n_dim = _weight_out_dim(ctx.node)  # the weight's output channels; 1 - n_dim its input's
    bias = 2 if len(ctx.inputs) == 3 else None
    allreduce = all_reduces(ctx.family)
    candidates = []
    for m, k, n in roles:
        x_in = _layout(nd, [(0, m), (1, k)])
        w_in = _layout(nd, [(n_dim, n), (1 - n_dim, k)])
        out = _layout(nd, [(0, m), (1, n)], partial=k)
        stored = _layout(nd, [(0, m), (1, n)] + ([] if allreduce else [(0, k)]))
        # The weight knob, as for a linear: kept whole over M (gradient all-reduced) or
        # split over M too and gathered before use; the family's default first.
        whole, split = (w_in, False), (_layout(nd, [(n_dim, n + m), (1 - n_dim, k)]), True)
        storages = [whole, split] if allreduce else [split, whole]
        roles = " ".join(f"{r}={','.join(axes) or '-'}" for r, axes in zip("MKN", (m, k, n)))
        for w_store, split_weight in storages:
            inputs = [x_in.normalized(mesh), w_in.normalized(mesh)]
            storage = [None, w_store.normalized(mesh)]
            if bias is not None:
                bias_in = _layout(1, [(0, n)]).normalized(mesh)
                inputs.append(bias_in)
                storage.append(bias_in)
            candidates.append(
                make(
                    ctx.family,
                    inputs,
                    out.normalized(mesh),
                    stored.normalized(mesh),
                    relative_to={bias: stored.normalized(mesh)} if bias is not None else None,
                    storage=tuple(storage),
                    epilogue=(bias,) if bias is not None else (),
                    detail=roles,
                    split_weight=split_weight,
                )
            )
    return candidates


def _grouped(ctx: Context, groups: int) -> list[Strategy]:
    """Whole groups of channels over some axes, the batch over the others."""
    nd, mesh = len(ctx.shape(0)), ctx.mesh
    candidates = []
    for roles in product("BGR", repeat=len(mesh.names)):
        batch = tuple(a for a, r in zip(mesh.names, roles) if r == "B")
        channels = tuple(a for a, r in zip(mesh.names, roles) if r == "G")
        if groups % mesh.count(channels):
            continue
        x = _layout(nd, [(0, batch), (1, channels)]).normalized(mesh)
        w = _layout(nd, [(0, channels)]).normalized(mesh)
        inputs = [x, w] + [_layout(1, [(0, channels)]).normalized(mesh)] * (len(ctx.inputs) - 2)
        detail = f"batch={','.join(batch) or '-'} groups={','.join(channels) or '-'}"
        candidates.append(make(ctx.family, inputs, x, lowering=CONV_GROUPS, detail=detail))
    return candidates


def local_groups(groups: int, channels: Layout, mesh) -> int:
    """The groups one rank convolves when the channels are split as `channels` says."""
    return groups // mesh.count(channels.dims[1])
