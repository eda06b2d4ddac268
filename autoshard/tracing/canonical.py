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
"""

from __future__ import annotations

from torch import fx
from torch.ops import aten

from autoshard.tracing.experts import GROUPED_MM, grouped_mm_nt

_TRANSPOSES = (aten.numpy_T.default, aten.t.default)
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
