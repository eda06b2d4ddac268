"""The arguments of an ATen call node by name: the one place that reads an op's
schema (`OpOverload._schema`, private to torch)."""

from __future__ import annotations

from torch import fx


def argument(node: fx.Node, name: str):
    """The value of argument `name` of an ATen call node, given positionally or by
    keyword, or else its schema default.

    >>> import torch
    >>> from autoshard.tracing.trace import trace
    >>> traced = trace(torch.nn.Embedding(8, 4, padding_idx=3), (torch.tensor([1, 3]),))
    >>> argument(traced.nodes["embedding"], "padding_idx")
    3
    """
    for i, arg in enumerate(node.target._schema.arguments):
        if arg.name == name:
            if i < len(node.args) and not arg.kwarg_only:
                return node.args[i]
            if name in node.kwargs:
                return node.kwargs[name]
            return arg.default_value if arg.has_default_value() else None
    raise KeyError(f"{node.target} has no argument {name!r}")


def schema_arguments(node: fx.Node) -> dict:
    """Every argument of the ATen call `node` by name, in its schema's order, defaults
    filled in."""
    return {arg.name: argument(node, arg.name) for arg in node.target._schema.arguments}
