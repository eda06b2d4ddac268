"""Which nodes of a graph share one storage: views and updates in place, as the ops'
schemas declare them.

A view (``x[:, :4]``, ``x.transpose(0, 1)``, one of the pieces ``split`` returns, a
``Tensor.to`` that converts nothing) and an in-place op's result (``h.add_(1)``) share
their first operand's storage; `storage_owner` walks back to the node that made it
and `storage_sharers` forward to everything that views or updates it:

    owner = storage_owner(node)                 # the tensor `node` is a view of
    written = any(set(operands_written(u)) & storage_sharers(owner)
                  for n in storage_sharers(owner) for u in n.users)
"""

from __future__ import annotations

import operator

import torch
from torch import fx
from torch.ops import aten

from autoshard.tracing.schema import argument


def writes_in_place(node: fx.Node) -> bool:
    """Whether `node` returns its first operand, updated in place (its schema says so)."""
    return any(r.alias_info is not None and r.alias_info.is_write for r in schema_returns(node))


# Norms that update their running statistics from the batch, though their schema
# marks nothing written: the argument that says they do, in place
_UPDATES_RUNNING_STATISTICS = {
    aten.batch_norm.default: "training",
    aten.instance_norm.default: "use_input_stats",
}


def written_arguments(op, args: tuple, kwargs: dict) -> list:
    """What a call of `op` with `args` and `kwargs` updates in place: the arguments its
    schema marks written (an in-place op's first operand, ``index_put_``'s), and a batch
    or instance norm's running statistics where it updates them from the batch."""
    schema = getattr(op, "_schema", None)
    if schema is None:
        return []
    given = {
        a.name: args[i] if i < len(args) else kwargs.get(a.name, a.default_value)
        for i, a in enumerate(schema.arguments)
    }
    written = [a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write]
    flag = _UPDATES_RUNNING_STATISTICS.get(op)
    if flag is not None and given[flag]:
        written += ["running_mean", "running_var"]
    return [given[name] for name in written]


def operands_written(node: fx.Node) -> list[fx.Node]:
    """The nodes `node` updates in place (`written_arguments`)."""
    if node.op != "call_function":
        return []
    written = written_arguments(node.target, node.args, node.kwargs)
    return [value for value in written if isinstance(value, fx.Node)]


def schema_returns(node: fx.Node) -> tuple:
    """The results the schema of `node`'s op declares (none for what has no schema)."""
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    return tuple(schema.returns) if schema is not None else ()


def returns_its_input(node: fx.Node) -> bool:
    """Whether a `Tensor.to` call returns its input itself, as its schema's alias says
    it may: only when it converts nothing and is not asked for a copy (`copy=True`, a
    dtype or device changed, or a memory format the input is not in: a fresh tensor)."""
    source, result = node.args[0].meta.get("val"), node.meta.get("val")
    if source is None or result is None:
        return True  # unknown: treated as the alias the schema allows
    names = {a.name for a in node.target._schema.arguments}
    copy = argument(node, "copy") if "copy" in names else False
    layout = argument(node, "memory_format") if "memory_format" in names else None
    converts = (source.dtype, source.device) != (result.dtype, result.device)
    reformats = layout not in (None, torch.preserve_format) and not source.is_contiguous(
        memory_format=layout
    )
    return not (copy or converts or reformats)


def is_view(node) -> bool:
    """Whether `node` returns a view of another tensor (an in-place op's result, which
    its schema also marks as an alias, is the updated tensor itself: `h.add_(1).mul_(2)`)."""
    if node.op == "call_function" and node.target is operator.getitem:
        return is_view(node.args[0])  # one of the views `split` or `chunk` returns
    if node.op == "call_function" and getattr(node.target, "overloadpacket", None) is aten.to:
        return returns_its_input(node)
    return node.op == "call_function" and any(
        r.alias_info is not None and not r.alias_info.is_write for r in schema_returns(node)
    )


def aliases_its_input(node: fx.Node) -> bool:
    """Whether `node`'s result shares its first operand's storage: a view, or an
    in-place result."""
    return is_view(node) or writes_in_place(node)


def storage_owner(node: fx.Node) -> fx.Node:
    """The node whose result is the storage `node` shares (through views and updates)."""
    while aliases_its_input(node) and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def storage_sharers(node: fx.Node) -> set[fx.Node]:
    """`node` and every node that views or updates it, and so on: one storage."""
    out, stack = set(), [node]
    while stack:
        here = stack.pop()
        if here not in out:
            out.add(here)
            stack += [u for u in here.users if aliases_its_input(u) and u.args[0] is here]
    return out


def storage_written_by(node: fx.Node) -> set[fx.Node]:
    """The nodes sharing the storage `node` updates in place (the tensor, its views and
    its updates' results); none if `node` writes nothing in place."""
    return storage_sharers(storage_owner(node)) if writes_in_place(node) else set()
