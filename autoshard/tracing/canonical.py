"""Rewrite a traced graph's spellings of one computation into the one the rules know.

Falcon writes its layers as ``x @ self.weight.T``: a transpose of a parameter
(``aten.numpy_T``) and an activation-by-activation ``matmul``, which no layer
rule would see as a layer. It is ``aten.linear(x, weight)``, exactly:

    # before                                  # after
    numpy_t = aten.numpy_T(weight)            linear = aten.linear(x, weight)
    matmul = aten.matmul(x, numpy_t)

Mixture-of-experts layers multiply by a transposed expert parameter
(``grouped_mm_fallback(x, weight.transpose(1, 2), offs)``): that is
`autoshard.tracing.experts.grouped_mm_nt(x, weight, offs)`, which reads the parameter itself.

A tensor made in forward, ``torch.tensor(data, device=x.device)`` (BigBird's random
blocks), traces as a copy detached in place (``aten.detach_``), which the in-place rules
would refuse as an update of a view: an in-place detach changes no value, only what
autograd records, so it is ``aten.detach``, read by everything after it.

RoFormer reshapes by example, ``x.reshape_as(other)``: shapes are static in a
traced graph, so that is ``aten.reshape(x, other's shape)``.

EfficientNet's convolutions pad by name (``nn.Conv2d(..., padding="same")``), which
traces as another overload, ``aten.conv2d.padding``. "valid" pads nothing, and "same"
pads dilation × (kernel − 1) along each spatial dim: where that is even, half on
each side, and ATen itself runs the numeric overload with those paddings, so that
is the ``aten.conv2d.default`` the convolution rule knows. (Where it is odd, one
side pads more: ATen pads the input first, and that call is left as it is.)
"""

from __future__ import annotations

from torch import fx
from torch.ops import aten

from autoshard.tracing.experts import GROUPED_MM, grouped_mm_nt

_TRANSPOSES = (aten.numpy_T.default, aten.t.default)
_NAMED_PADDING = {
    aten.conv1d.padding: aten.conv1d.default,
    aten.conv2d.padding: aten.conv2d.default,
    aten.conv3d.padding: aten.conv3d.default,
}
_PRODUCTS = (aten.matmul.default, aten.mm.default)


def _transposed_weight(node: fx.Node) -> fx.Node | None:
    """The 2-D parameter `node` transposes, if it is a plain transpose of one."""
    if node.op != "call_function" or node.kwargs:
        return None
    plain = node.target in _TRANSPOSES and len(node.args) == 1
    swapped = node.target == aten.transpose.int and sorted(d % 2 for d in node.args[1:]) == [0, 1]
    weight = node.args[0]
    if (plain or swapped) and weight.op == "get_attr" and weight.meta["val"].dim() == 2:
        return weight
    return None


def canonicalize(graph: fx.Graph) -> None:
    """Every rewrite of this module, in place."""
    fold_transposed_weights(graph)
    fold_transposed_experts(graph)
    reshape_by_shape(graph)
    detach_out_of_place(graph)
    pad_convolutions_by_number(graph)


def pad_convolutions_by_number(graph: fx.Graph) -> None:
    """``conv2d(x, w, padding="same" | "valid")`` → ``conv2d(x, w, padding=[p, ...])``,
    in place, wherever each spatial dim pads as much on both sides."""
    for node in graph.nodes:
        numeric = _NAMED_PADDING.get(node.target) if node.op == "call_function" else None
        if numeric is None:
            continue
        x, weight, bias, stride, padding, dilation, groups = _schema_arguments(node)
        kernel = weight.meta["val"].shape[2:]
        dilation = list(dilation) if isinstance(dilation, (list, tuple)) else [dilation]
        dilation = dilation * len(kernel) if len(dilation) == 1 else dilation
        if padding == "valid":
            sides = [0] * len(kernel)
        else:  # "same": ATen pads d·(k−1) in all, half on each side when it is even
            total = [d * (k - 1) for d, k in zip(dilation, kernel)]
            if any(t % 2 for t in total):
                continue
            sides = [t // 2 for t in total]
        node.target = numeric
        node.args, node.kwargs = (x, weight, bias, stride, sides, dilation, groups), {}


def _schema_arguments(node: fx.Node) -> list:
    """Every argument of the ATen call `node` in its schema's order, defaults filled in."""
    return [
        node.args[i]
        if i < len(node.args) and not arg.kwarg_only
        else node.kwargs.get(arg.name, arg.default_value if arg.has_default_value() else None)
        for i, arg in enumerate(node.target._schema.arguments)
    ]


def detach_out_of_place(graph: fx.Graph) -> None:
    """``detach_(x)`` → ``detach(x)``, which every reader of `x` after it reads, in place."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    for node in graph.find_nodes(op="call_function", target=aten.detach_.default):
        node.target = aten.detach.default
        after = order[node]
        node.args[0].replace_all_uses_with(node, lambda user, after=after: order[user] > after)


def fold_transposed_experts(graph: fx.Graph) -> None:
    """``grouped_mm_fallback(x, weight.transpose(1, 2), offs)`` → ``grouped_mm_nt(x, weight,
    offs)`` for every 3-D parameter, in place."""
    for node in list(graph.nodes):
        if node.op != "call_function" or str(node.target) != GROUPED_MM or node.kwargs:
            continue
        x, transposed, offs = node.args
        if transposed.op != "call_function" or transposed.target != aten.transpose.int:
            continue
        weight, *dims = transposed.args
        if weight.op != "get_attr" or weight.meta["val"].dim() != 3:
            continue
        if sorted(d % 3 for d in dims) != [1, 2]:
            continue
        node.target, node.args = grouped_mm_nt, (x, weight, offs)
        if not transposed.users:
            graph.erase_node(transposed)


def reshape_by_shape(graph: fx.Graph) -> None:
    """``reshape_as(x, other)`` → ``reshape(x, other.shape)``, in place."""
    for node in graph.find_nodes(op="call_function", target=aten.reshape_as.default):
        x, other = node.args
        node.target, node.args = aten.reshape.default, (x, list(other.meta["val"].shape))


def fold_transposed_weights(graph: fx.Graph) -> None:
    """``matmul(x, weightᵀ)`` → ``linear(x, weight)`` for every 2-D parameter, in place."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _PRODUCTS or node.kwargs:
            continue
        x, transposed = node.args
        weight = _transposed_weight(transposed)
        if weight is None or x.meta["val"].dim() < 1:
            continue
        node.target, node.args = aten.linear.default, (x, weight)
        if not transposed.users:
            graph.erase_node(transposed)
