"""Rewrite a traced graph's spellings of one computation into the one the rules know.

Falcon writes its layers as ``x @ self.weight.T``: a transpose of a parameter
(``aten.numpy_T``) and an activation-by-activation ``matmul``, which no layer
rule would see as a layer. It is ``aten.linear(x, weight)``, exactly:

    # before                                  # after
    numpy_t = aten.numpy_T(weight)            linear = aten.linear(x, weight)
    matmul = aten.matmul(x, numpy_t)

GPT-2's Conv1D flattens the tokens around its product,
``addmm(bias, x.view(-1, K), weight).view(B, S, N)``: flattened, batch and sequence
are one dim, which a rank can hold a part of only as one block, so a batch smaller
than the axes that split tokens could not be split further over the sequence. It is
the product on ``x`` itself, ``matmul(x, weight)`` and the bias added (likewise ``mm``,
and ``linear`` on flattened tokens). Hugging Face's causal-LM loss flattens them too,
``cross_entropy(logits.view(-1, V), labels.view(-1))``: that is the loss over the
tokens unflattened, ``cross_entropy(logits.permute(0, 2, 1), labels)`` (classes at dim
1, as the loss takes them; the same rows, so the same mean, ignored rows and weights).

Phi-3 slices its fused q/k/v projection, ``qkv[..., :q]``, ``qkv[..., q:q + kv]`` and
``qkv[..., q + kv:]``: slices that cut a tensor into consecutive pieces, the whole of
it, are a split, ``split_with_sizes(qkv, [q, kv, kv], -1)``, whose pieces the split's
rule can cut to each rank's shard where the projection splits its features (a slice
alone must gather them). Only a product's result is read so: elsewhere (rotary
embeddings' halves, ``x[..., :d // 2]`` and ``x[..., d // 2:]``) slices stay slices.

Mixture-of-experts layers multiply by a transposed expert parameter
(``grouped_mm_fallback(x, weight.transpose(1, 2), offs)``): that is
`autoshard.tracing.experts.grouped_mm_nt(x, weight, offs)`, which reads the parameter itself.

A tensor made in forward, ``torch.tensor(data, device=x.device)`` (BigBird's random
blocks), traces as a copy detached in place (``aten.detach_``), which the in-place rules
would refuse as an update of a view: an in-place detach changes no value, only what
autograd records, so it is ``aten.detach``, read by everything after it. Likewise
``nn.Dropout(inplace=True)``'s ``aten.dropout_`` is ``aten.dropout`` read in its
input's place, where nothing else shares that input's storage.

A buffer updated in place in forward (``self.steps += 1``) is written back by
torch.export as a copy of the updated buffer into itself, ``copy_(steps, add_)``:
no value changes, but autograd's version counter does, and a product that saved
the buffer for backward (``h * self.steps``) then fails there. That copy is dropped.

RoFormer reshapes by example, ``x.reshape_as(other)``: shapes are static in a
traced graph, so that is ``aten.reshape(x, other's shape)`` (and ``expand_as``,
``aten.expand``, and ``view_as``). Likewise ``x.mT`` is a transpose, ``movedim`` a
permute and ``tile`` a repeat.

XLNet, Funnel and ProphetNet write attention as ``einsum("bind,bjnd->bnij", q, k)``,
which no rule knows. A two-operand einsum is a batched matmul between permutes and
reshapes, which the rules do know (index letters: batch in both operands and the
output, contracted in both only, free in one and the output):

    # before                                  # after
    einsum = aten.einsum("bind,bjnd->bnij",   einsum_permute = aten.permute(q, [0, 2, 1, 3])
                         [q, k])              einsum_permute_1 = aten.permute(k, [0, 2, 3, 1])
                                              einsum_matmul = aten.matmul(einsum_permute,
                                                                          einsum_permute_1)

and where one operand is a 2-D parameter and nothing is batched, a layer:
``einsum("bld,hd->blh", x, weight)`` is ``aten.linear(x, weight)``.

Losses of two operands (``F.mse_loss(h, target)``, L1, smooth L1, Huber) broadcast
them first, ``broadcast_tensors([h, target])``, a list of views no rule knows: each
is its operand itself where it has the common shape, and else ``aten.expand`` to it.

EfficientNet's convolutions pad by name (``nn.Conv2d(..., padding="same")``), which
traces as another overload, ``aten.conv2d.padding``. "valid" pads nothing, and "same"
pads dilation × (kernel − 1) along each spatial dim: where that is even, half on
each side, and ATen itself runs the numeric overload with those paddings, so that
is the ``aten.conv2d.default`` the convolution rule knows. (Where it is odd, one
side pads more: ATen pads the input first, and that call is left as it is.)

The CPU has no histogram of integers: ``histc(ids)`` of an integer tensor is
``histc(ids.float())`` cast back (Hugging Face's grouped experts pick the dtype by
the device they are traced on, and a model built on meta picks the integer one).
"""

from __future__ import annotations

import math
import operator

import torch
from torch import fx
from torch.ops import aten

from autoshard.tracing.experts import GROUPED_MM, grouped_mm_nt
from autoshard.tracing.schema import schema_arguments
from autoshard.tracing.storage import (
    operands_written,
    schema_returns,
    storage_owner,
    storage_sharers,
    writes_in_place,
)

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
    layers_on_unflattened_tokens(graph)
    losses_on_unflattened_tokens(graph)
    fold_transposed_experts(graph)
    reshape_by_shape(graph)
    permutes_by_number(graph)
    slices_as_splits(graph)
    updates_out_of_place(graph)
    pad_convolutions_by_number(graph)
    einsum_as_products(graph)
    broadcasts_as_expands(graph)
    drop_copies_into_themselves(graph)
    integer_histograms_in_float(graph)


def integer_histograms_in_float(graph: fx.Graph) -> None:
    """``histc(ids)`` of an integer tensor → ``histc(ids.float())`` cast back, in place.
    The CPU has no integer histogram, and a model that picks the dtype by the device it
    is traced on (Hugging Face's grouped experts: float on the CPU, int elsewhere)
    traced on the meta device makes the integer one. Counts of integers are exact in
    float32 up to 2²⁴."""
    to, histc = aten._to_copy.default, aten.histc.default
    for node in list(graph.find_nodes(op="call_function", target=histc)):
        ids, counts = node.args[0].meta["val"], node.meta["val"]
        if ids.is_floating_point():
            continue
        f32 = {"dtype": torch.float32}
        with graph.inserting_before(node):
            as_float = _call_like(graph, node, to, (node.args[0],), ids.to(**f32), f32)
            args = (as_float, *node.args[1:])
            counted = _call_like(graph, node, histc, args, counts.to(**f32), dict(node.kwargs))
            back = _call_like(graph, node, to, (counted,), counts, {"dtype": ids.dtype})
        node.replace_all_uses_with(back)
        graph.erase_node(node)


def broadcasts_as_expands(graph: fx.Graph) -> None:
    """``broadcast_tensors([a, b])[i]`` → operand i, or ``aten.expand`` of it to the common
    shape, in place."""
    for node in list(graph.find_nodes(op="call_function", target=aten.broadcast_tensors.default)):
        operands = node.args[0]
        shape = list(node.meta["val"][0].shape)
        for user in list(node.users):
            if user.target is not operator.getitem:
                continue  # read whole: left as it is
            operand = operands[user.args[1]]
            if list(operand.meta["val"].shape) != shape:
                with graph.inserting_before(user):
                    expanded = graph.call_function(aten.expand.default, (operand, shape))
                expanded.meta = {**user.meta, "val": operand.meta["val"].expand(shape)}
                operand = expanded
            user.replace_all_uses_with(operand)
            graph.erase_node(user)
        if not node.users:
            graph.erase_node(node)


def pad_convolutions_by_number(graph: fx.Graph) -> None:
    """``conv2d(x, w, padding="same" | "valid")`` → ``conv2d(x, w, padding=[p, ...])``,
    in place, wherever each spatial dim pads as much on both sides."""
    for node in graph.nodes:
        numeric = _NAMED_PADDING.get(node.target) if node.op == "call_function" else None
        if numeric is None:
            continue
        x, weight, bias, stride, padding, dilation, groups = schema_arguments(node).values()
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


_OUT_OF_PLACE = {
    aten.detach_.default: aten.detach.default,
    aten.dropout_.default: aten.dropout.default,
}


def updates_out_of_place(graph: fx.Graph) -> None:
    """``detach_(x)`` → ``detach(x)`` and ``dropout_(x, p, train)`` → ``dropout(x, p,
    train)``, which every reader of `x` after it reads, in place. A dropout changes
    values: it is rewritten only where nothing else shares x's storage (x made as a new
    tensor and viewed by nothing), so that no other reader could have seen the update."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        functional = _OUT_OF_PLACE.get(node.target) if node.op == "call_function" else None
        x = node.args[0] if functional is not None else None
        if functional is None or (functional is aten.dropout.default and _shared(x, node)):
            continue
        node.target = functional
        after = order[node]
        x.replace_all_uses_with(node, lambda user, after=after: order[user] > after)


def _shared(x: fx.Node, update: fx.Node) -> bool:
    """Whether x's storage may be read other than as `x` itself: x is not a new tensor
    made in forward (an input, a parameter, a view, one result of several), or a node
    but `update` views it."""
    made = x.op == "call_function" and x.target is not operator.getitem
    return not made or any(_aliases(n) for n in (x, *x.users) if n is not update)


def _aliases(node: fx.Node) -> bool:
    return any(r.alias_info is not None for r in schema_returns(node))


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


_BY_SHAPE = {
    aten.reshape_as.default: aten.reshape.default,
    aten.expand_as.default: aten.expand.default,
    aten.view_as.default: aten.view.default,
}


def reshape_by_shape(graph: fx.Graph) -> None:
    """``reshape_as(x, other)`` → ``reshape(x, other.shape)``, and ``expand_as`` and
    ``view_as`` likewise, in place."""
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in _BY_SHAPE:
            x, other = node.args
            node.target, node.args = _BY_SHAPE[node.target], (x, list(other.meta["val"].shape))


def permutes_by_number(graph: fx.Graph) -> None:
    """``x.mT`` → ``transpose(x, -2, -1)``, ``movedim(x, i, j)`` → ``permute(x, order)``
    and ``tile(x, reps)`` → ``repeat(x, reps)``, the reps padded with ones to x's
    dims, in place."""
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target == aten.mT.default:
            node.target, node.args = aten.transpose.int, (node.args[0], -2, -1)
        elif node.target == aten.movedim.int:
            x, source, destination = node.args
            nd = x.meta["val"].dim()
            order = list(range(nd))
            order.insert(destination % nd, order.pop(source % nd))
            node.target, node.args = aten.permute.default, (x, order)
        elif node.target == aten.tile.default:
            x, reps = node.args
            padded = [1] * (x.meta["val"].dim() - len(reps)) + list(reps)
            node.target, node.args = aten.repeat.default, (x, padded)


# what a fused projection is: a product, on flattened tokens or not, bias added or not
_PROJECTIONS = (*_PRODUCTS, aten.linear.default, aten.addmm.default)


def slices_as_splits(graph: fx.Graph) -> None:
    """Slices of a product's result along one dim, step 1, that cut it into two or more
    consecutive pieces covering it → ``split_with_sizes`` and a ``getitem`` per piece,
    in place, where nothing updates that tensor's storage in place (autograd refuses
    an update of one of several views a function returns, or of their base)."""
    for x in list(graph.nodes):
        if x.op != "call_function" or x.target not in _PROJECTIONS or _storage_updated(x):
            continue
        by_dim: dict[int, list[tuple[int, int, fx.Node]]] = {}
        for user in x.users:
            bounds = _slice_bounds(user, x)
            if bounds is not None:
                dim, start, end = bounds
                by_dim.setdefault(dim, []).append((start, end, user))
        for dim, pieces in by_dim.items():
            pieces.sort(key=lambda piece: piece[:2])
            ends = [0] + [end for _, end, _ in pieces]
            consecutive = all(start == ends[i] for i, (start, _, _) in enumerate(pieces))
            whole = ends[-1] == x.meta["val"].shape[dim]
            empty = any(start == end for start, end, _ in pieces)
            if len(pieces) < 2 or not consecutive or not whole or empty:
                continue
            _split_in_place_of(graph, x, dim, [user for _, _, user in pieces])


def _storage_updated(x: fx.Node) -> bool:
    """Whether a node updates in place the storage `x` shares: through x, what x views,
    or any view of those."""
    sharing = storage_sharers(storage_owner(x))
    return any(set(operands_written(user)) & sharing for node in sharing for user in node.users)


def _slice_bounds(node: fx.Node, x: fx.Node) -> tuple[int, int, int] | None:
    """(dim, start, end) of `node`, a slice of `x` with step 1, bounds as Python clamps
    them; None for anything else."""
    if node.target != aten.slice.Tensor or node.args[0] is not x:
        return None
    args = schema_arguments(node)
    if args["step"] != 1:
        return None
    shape = x.meta["val"].shape
    dim = args["dim"] % len(shape)
    start, end, _ = slice(args["start"], args["end"]).indices(shape[dim])
    return dim, start, max(start, end)


def _split_in_place_of(graph: fx.Graph, x: fx.Node, dim: int, slices: list[fx.Node]) -> None:
    """`slices`, consecutive pieces of `x` along `dim`, in order, as one split's pieces."""
    sizes = [node.meta["val"].shape[dim] for node in slices]
    with graph.inserting_after(x):
        split = graph.create_node(
            "call_function", aten.split_with_sizes.default, (x, sizes, dim), name=f"{x.name}_split"
        )
    split.meta = {**slices[0].meta, "val": tuple(node.meta["val"] for node in slices)}
    for i, node in enumerate(slices):
        with graph.inserting_before(node):
            piece = graph.create_node("call_function", operator.getitem, (split, i))
        piece.meta = dict(node.meta)
        node.replace_all_uses_with(piece)
        graph.erase_node(node)
        piece.name = node.name


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


_FLATTENS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def layers_on_unflattened_tokens(graph: fx.Graph) -> None:
    """``addmm(bias, x.view(-1, K), weight).view(B, S, N)`` → ``matmul(x, weight) + bias``
    (``mm`` and ``linear`` alike), in place, where nothing else reads the product."""
    for node in list(graph.nodes):
        weight, bias = _layer_operands(node)
        if weight is None:
            continue
        flat = node.args[1] if node.target == aten.addmm.default else node.args[0]
        x, (unflatten,) = flat.args[0], node.users
        if unflatten.meta["val"].shape[:-1] != x.meta["val"].shape[:-1]:
            continue
        val = unflatten.meta["val"]
        with graph.inserting_before(unflatten):
            if node.target == aten.linear.default:
                out = _call_like(graph, node, aten.linear.default, (x, weight, *bias), val)
            else:
                out = _call_like(graph, node, aten.matmul.default, (x, weight), val)
                if bias:
                    out = _call_like(graph, node, aten.add.Tensor, (out, *bias), val)
        unflatten.replace_all_uses_with(out)
        for dead in (unflatten, node, flat):
            if not dead.users:
                graph.erase_node(dead)


_LOSSES = (aten.cross_entropy_loss.default, aten.nll_loss_nd.default)
_CASTS = (aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.alias.default)
TRACE_CHECK = aten._assert_tensor_metadata.default  # a check the trace left, run by no one


def losses_on_unflattened_tokens(graph: fx.Graph) -> None:
    """``cross_entropy(x.view(-1, C), y.view(-1))`` → ``cross_entropy(x.permute(0, n-1,
    1, …), y)`` (``nll_loss`` alike, casts after either view made before it), in place,
    for class indices as targets and a mean or a sum (no per-row losses, whose shape
    would change). Losses that read one operand read one rewrite of it."""
    unflattened: dict[fx.Node, fx.Node] = {}  # an operand as read → as rewritten
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _LOSSES or len(node.args) < 2:
            continue
        scores, target = (_through_casts(arg) for arg in node.args[:2])
        if scores is None or target is None:
            continue
        (flat, casts), (flat_target, target_casts) = scores, target
        x, y = flat.args[0], flat_target.args[0]
        shape = tuple(x.meta["val"].shape)
        if len(shape) < 3 or tuple(flat.meta["val"].shape) != (math.prod(shape[:-1]), shape[-1]):
            continue
        if tuple(y.meta["val"].shape) != shape[:-1] or y.meta["val"].is_floating_point():
            continue
        if schema_arguments(node).get("reduction") == 0:
            continue
        order = [0, len(shape) - 1, *range(1, len(shape) - 1)]
        read_scores, read_target = node.args[:2]
        with graph.inserting_before(node):
            if read_scores not in unflattened:
                x = _cast_again(graph, x, casts)
                moved = graph.create_node(
                    "call_function", aten.permute.default, (x, order), name=f"{node.name}_classes"
                )
                moved.meta = {**node.meta, "val": x.meta["val"].permute(order)}
                unflattened[read_scores] = moved
            if read_target not in unflattened:
                unflattened[read_target] = _cast_again(graph, y, target_casts)
        node.args = (unflattened[read_scores], unflattened[read_target], *node.args[2:])
        for dead in [*reversed(casts), flat, *reversed(target_casts), flat_target]:
            if all(user.target == TRACE_CHECK for user in dead.users):  # read by its checks only
                for check in list(dead.users):
                    graph.erase_node(check)
                graph.erase_node(dead)


def _through_casts(node) -> tuple[fx.Node, list[fx.Node]] | None:
    """(the view or reshape `node` is, or casts of, and those casts, first first), or
    None."""
    casts = []
    while _call(node) and node.target in _CASTS:
        casts.insert(0, node)
        node = node.args[0]
    return (node, casts) if _call(node) and node.target in _FLATTENS else None


def _call(node) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function"


def _cast_again(graph: fx.Graph, value: fx.Node, casts: list[fx.Node]) -> fx.Node:
    """`value` through a copy of each of `casts`."""
    for cast in casts:
        args, kwargs = (value, *cast.args[1:]), dict(cast.kwargs)
        new = graph.create_node("call_function", cast.target, args, kwargs, name=cast.name)
        new.meta = {**cast.meta, "val": cast.target(value.meta["val"], *args[1:], **kwargs)}
        value = new
    return value


def _call_like(graph: fx.Graph, node: fx.Node, target, args: tuple, val, kwargs=None) -> fx.Node:
    """A call of `target` in `node`'s place, named after it, with its module and source."""
    name = f"{node.name}_{target._opname}"
    new = graph.create_node("call_function", target, args, kwargs, name=name)
    new.meta = {**node.meta, "val": val}
    return new


def _layer_operands(node: fx.Node) -> tuple[fx.Node | None, tuple]:
    """(weight, (bias,) or ()) of a layer on flattened tokens that one unflatten reads:
    ``addmm(bias, flat, weight)``, ``mm(flat, weight)`` or ``linear(flat, weight[, bias])``
    with a parameter for weight and ``flat`` a view of [..., K] as [-1, K]; else None."""
    if node.op != "call_function" or len(node.users) != 1 or node.kwargs:
        return None, ()
    if node.target == aten.addmm.default and len(node.args) == 3:
        bias, flat, weight = node.args
        bias = (bias,)
    elif node.target in (aten.mm.default, aten.linear.default):
        flat, weight, *bias = node.args
        bias = tuple(bias)
    else:
        return None, ()
    (user,) = node.users
    if user.target not in _FLATTENS or weight.op != "get_attr" or weight.meta["val"].dim() != 2:
        return None, ()
    if flat.op != "call_function" or flat.target not in _FLATTENS:
        return None, ()
    x = flat.args[0]
    shape = x.meta["val"].shape
    if len(shape) < 3 or tuple(flat.meta["val"].shape) != (math.prod(shape[:-1]), shape[-1]):
        return None, ()
    return weight, bias


def einsum_as_products(graph: fx.Graph) -> None:
    """``einsum(equation, [a, b])`` → permutes, reshapes and one ``matmul`` (or
    ``linear``), in place, wherever the equation has no ellipsis, no diagonal, no
    index summed within one operand and no broadcast size."""
    for node in list(graph.find_nodes(op="call_function", target=aten.einsum.default)):
        indices = _product_indices(node)
        if indices is not None:
            _rewrite_einsum(graph, node, *indices)


def _product_indices(node: fx.Node) -> tuple | None:
    """(a, b, out letters, operands, their shapes) of a two-operand einsum this module
    rewrites, or None."""
    equation, operands = node.args[0], node.args[1]
    if node.kwargs or len(node.args) != 2 or len(operands) != 2 or "." in equation:
        return None
    equation = equation.replace(" ", "")
    inputs, _, out = equation.partition("->")
    a, b = inputs.split(",")
    if "->" not in equation:  # implicit output: every letter seen once, in order
        out = "".join(sorted(c for c in a + b if (a + b).count(c) == 1))
    shapes = [tuple(op.meta["val"].shape) for op in operands]
    if any(len(set(s)) != len(s) for s in (a, b, out)) or set(out) - set(a + b):
        return None
    if (len(a), len(b)) != tuple(map(len, shapes)):
        return None
    if set(a + b) - set(out) - (set(a) & set(b)):
        return None  # summed within one operand
    size = dict(zip(a, shapes[0]))
    if any(size.get(c, n) != n for c, n in zip(b, shapes[1])):
        return None  # broadcast
    return a, b, out, operands, shapes


def _rewrite_einsum(graph, node, a, b, out, operands, shapes) -> None:
    size = {**dict(zip(a, shapes[0])), **dict(zip(b, shapes[1]))}
    x, y = operands
    if y.op != "get_attr" and x.op == "get_attr":  # the parameter on the right
        (a, x), (b, y) = (b, y), (a, x)
    batch = [c for c in out if c in a and c in b]
    contracted = [c for c in a if c in b and c not in out]
    free_a = [c for c in a if c not in b]
    free_b = [c for c in b if c not in a]

    def call(target, *args):
        new = graph.create_node("call_function", target, args, name=f"{node.name}_{target._opname}")
        new.meta = {**node.meta, "val": target(*(_value(arg) for arg in args))}
        return new

    def arranged(value, letters: str, order: list[str], groups: list[list[str]]):
        """`value` permuted to `order`, then reshaped to one dim per group."""
        if order != list(letters):
            value = call(aten.permute.default, value, [letters.index(c) for c in order])
        if any(len(group) != 1 for group in groups):
            value = call(aten.reshape.default, value, [_product(size, g) for g in groups])
        return value

    # against a right operand with no batch dims, matmul broadcasts the left's free dims
    rows = [[c] for c in free_a] if not batch and free_a else [free_a]
    with graph.inserting_before(node):
        batched = [[c] for c in batch]
        left = arranged(x, a, batch + free_a + contracted, [*batched, *rows, contracted])
        if not batch and y.op == "get_attr" and len(b) == 2 and contracted == [b[1]]:
            product = call(aten.linear.default, left, y)
        else:
            right = arranged(y, b, batch + contracted + free_b, [*batched, contracted, free_b])
            product = call(aten.matmul.default, left, right)
        done = batch + free_a + free_b
        if len(rows) != len(free_a) or len(free_b) != 1:
            product = call(aten.reshape.default, product, [size[c] for c in done])
        if done != list(out):
            product = call(aten.permute.default, product, [done.index(c) for c in out])
    node.replace_all_uses_with(product)
    graph.erase_node(node)


def _product(size: dict[str, int], letters: list[str]) -> int:
    return math.prod(size[c] for c in letters)


def _value(arg):
    return arg.meta["val"] if isinstance(arg, fx.Node) else arg


def drop_copies_into_themselves(graph: fx.Graph) -> None:
    """``copy_(t, u)`` where `u` is `t` updated in place (``add_(t, 1)``, …), in place:
    readers of the copy read `t`."""
    for node in list(graph.find_nodes(op="call_function", target=aten.copy_.default)):
        target, source = node.args[:2]
        while isinstance(source, fx.Node) and source is not target and writes_in_place(source):
            source = source.args[0]
        if source is target:
            node.replace_all_uses_with(target)
            graph.erase_node(node)
