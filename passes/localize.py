"""Make every node compute on local shards.

ATen ops mostly work on shards unchanged. The ones that do not are either
given their local shape arguments, or lowered to the implementation in
`autoshard.runtime.ops` their strategy names:

    # before                                      # after (features split over c)
    layer_norm = aten.layer_norm(x, [16], w, b)   layer_norm = autoshard.runtime.ops.layer_norm(
                                                      x, w, b, 1e-05, normalized_ndim=1,
                                                      axes=('c',), node='layer_norm')
"""

from __future__ import annotations

import warnings

from torch import fx
from torch.ops import aten

from autoshard.mesh import Mesh
from autoshard.planning.plan import NodePlan, Plan
from autoshard.runtime import ops
from autoshard.strategies.conv import local_groups
from autoshard.strategies.inplace import out_of_place
from autoshard.tracing.modes import FOLLOWS_MODE
from autoshard.tracing.trace import argument


def _layer_norm(node: fx.Node, placed: NodePlan, mesh: Mesh) -> None:
    x = node.args[0]
    weight, bias, eps = (argument(node, name) for name in ("weight", "bias", "eps"))
    k = len(argument(node, "normalized_shape"))
    axes = tuple(a for dim in placed.strategy.inputs[0].dims[-k:] for a in dim)
    node.target = ops.layer_norm
    node.args = (x, weight, bias, eps)
    node.kwargs = {"normalized_ndim": k, "axes": axes, "node": node.name}


def _dropout(node: fx.Node, placed: NodePlan, mesh: Mesh) -> None:
    if node.meta.get(FOLLOWS_MODE):  # on in train mode only: read the program's flag
        with node.graph.inserting_before(node), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # fx warns of get_attr on a plain attribute
            training = node.graph.get_attr("training")
        node.args = (node.args[0], node.args[1], training)
    node.target = ops.dropout
    node.kwargs = {"shape": placed.shape, "dims": placed.strategy.stored.dims}


def _mean(node: fx.Node, placed: NodePlan, mesh: Mesh) -> None:
    scale = 1 / mesh.count(placed.strategy.output.partial)
    node.target = ops.mean
    node.kwargs = {**node.kwargs, "scale": scale}


_TO_LOCAL_SHAPE = (
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.squeeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
)


def _shape(node: fx.Node, placed: NodePlan, mesh: Mesh) -> None:
    """Views and expands name their output shape: give them the local one."""
    local = list(placed.strategy.stored.local_shape(placed.shape, mesh))
    if node.target == aten.unflatten.int:
        x, dim, sizes = node.args
        dim %= len(placed.shape) - len(sizes) + 1
        node.args = (x, dim, local[dim : dim + len(sizes)])
    elif node.target in _TO_LOCAL_SHAPE:
        # a shard may not be laid out in memory as the global tensor was: reshape, not
        # view; and a squeeze would also drop a dim that is 1 only on this rank
        node.target = aten.reshape.default
        node.args = (node.args[0], local)
    elif node.target == aten.expand.default:
        node.args = (node.args[0], local, *node.args[2:])


def _conv_groups(node: fx.Node, placed: NodePlan, mesh: Mesh) -> None:
    """A grouped convolution over split channels convolves only this rank's groups."""
    x, weight, bias, stride, padding, dilation, groups = (list(node.args) + [None, 1, 0, 1, 1])[:7]
    groups = node.kwargs.get("groups", groups)
    local = local_groups(groups, placed.strategy.inputs[0], mesh)
    node.args = (x, weight, bias, stride, padding, dilation, local)
    node.kwargs = {}


def _out_of_place(node: fx.Node, placed: NodePlan, mesh: Mesh) -> None:
    """An in-place op as its functional twin; the readers of its first operand that
    come after it read its result instead, as they read the updated tensor before."""
    updated = node.args[0]
    later, after = [], node.next
    while after.op != "root":
        if updated in after.all_input_nodes:
            later.append(after)
        after = after.next
    for user in later:
        user.replace_input_with(updated, node)
    node.target = out_of_place(node.target)


def _vocab_embedding(node: fx.Node, placed: NodePlan, mesh: Mesh) -> None:
    weight, ids = node.args[:2]
    padding_idx = argument(node, "padding_idx")
    node.target = ops.vocab_embedding
    node.args = (weight, ids)
    node.kwargs = {
        "vocab_size": weight.meta["val"].shape[0],
        "vocab_axes": placed.strategy.inputs[0].dims[0],
        "padding_idx": padding_idx,
    }


def _cross_entropy(node: fx.Node, placed: NodePlan, mesh: Mesh) -> None:
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


_LOWERINGS = {
    "layer_norm": _layer_norm,
    "dropout": _dropout,
    "mean": _mean,
    "shape": _shape,
    "vocab_embedding": _vocab_embedding,
    "cross_entropy": _cross_entropy,
    "conv_groups": _conv_groups,
    "out_of_place": _out_of_place,
}


class Localize:
    def __init__(self, plan: Plan):
        self.plan = plan

    def __call__(self, gm: fx.GraphModule) -> fx.GraphModule:
        for node in gm.graph.nodes:
            placed = self.plan.nodes.get(node.name)
            if placed is not None and placed.strategy.lowering:
                _LOWERINGS[placed.strategy.lowering](node, placed, self.plan.mesh)
        gm.recompile()
        return gm
