"""Inline the regions `torch.export` wraps in higher-order ops, so the planner sees one
flat graph of ATen ops.

A block under ``torch.no_grad()`` inside forward (a stop-gradient scale, position
ids) or under a disabled ``torch.autocast`` (Hugging Face's rotary tables) is exported
as a call of a submodule:

    submod_3 = self.submod_1
    add = torch.ops.higher_order.wrap_with_set_grad_enabled(False, submod_3, linear)
    getitem = add[0]

Its ops are copied in place of the call, and what leaves a no-grad region is
detached, which is exactly what the region meant. Any other region (``torch.cond``,
an enabled autocast) is refused with a `TraceError` naming the node: its meaning is
not a flat graph of the ops autoshard has rules for. A forward that applies a custom
`torch.autograd.Function` is warned of by name (`custom_functions_named`): export
keeps its forward ops only.
"""

from __future__ import annotations

import contextlib
import operator
import warnings

import torch
from torch import fx

from autoshard.errors import TraceError

higher_order = torch.ops.higher_order
_SET_GRAD = higher_order.wrap_with_set_grad_enabled
_AUTOCAST = higher_order.wrap_with_autocast


def _is_region(node: fx.Node) -> bool:
    # the one place autoshard names torch's private higher-order operator type
    return node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator)


def inline_regions(gm: fx.GraphModule) -> None:
    """Inline every region of `gm` (and of regions nested in them), in place."""
    graph = gm.graph
    for node in [n for n in graph.nodes if _is_region(n)]:
        body, operands, detached = _body(node, gm)
        inline_regions(body)
        with graph.inserting_before(node):
            outputs = _copied(graph, body, operands)
            if detached:
                outputs = [_detach(graph, out) for out in outputs]
        for user in list(node.users):
            if user.target is not operator.getitem:
                raise TraceError(f"node '{user.name}' reads region '{node.name}' whole")
            user.replace_all_uses_with(outputs[user.args[1]])
            graph.erase_node(user)
        graph.erase_node(node)
    for node in [n for n in graph.nodes if n.op == "get_attr" and not n.users]:
        if isinstance(getattr(gm, node.target, None), fx.GraphModule):
            graph.erase_node(node)  # the body of a region inlined above
    graph.lint()


def _body(node: fx.Node, gm: fx.GraphModule) -> tuple[fx.GraphModule, list, bool]:
    """The region's submodule, its operands, and whether its outputs carry no gradient."""
    if node.target is _SET_GRAD:
        enabled, submodule, *operands = node.args
        return getattr(gm, submodule.target), operands, not enabled
    if node.target is _AUTOCAST and not node.args[2]:  # (device, dtype, enabled, cache, ...)
        submodule, *operands = node.args[4:]
        return getattr(gm, submodule.target), operands, False
    what = "an enabled torch.autocast region" if node.target is _AUTOCAST else "a region"
    raise TraceError(
        f"node '{node.name}' ({node.target}) is {what} that autoshard cannot flatten into "
        "ATen ops with a sharding rule: compute both branches and select with torch.where "
        "instead of torch.cond, and cast explicitly (x.to(dtype)) instead of autocasting "
        "inside forward"
    )


def _copied(graph: fx.Graph, body: fx.GraphModule, operands: list) -> list:
    env = dict(zip([n for n in body.graph.nodes if n.op == "placeholder"], operands))
    for node in body.graph.nodes:
        if node.op == "output":
            return [env[out] if isinstance(out, fx.Node) else out for out in node.args[0]]
        if node.op != "placeholder":
            env[node] = graph.node_copy(node, lambda n: env[n])
    raise TraceError("a region's body has no output")


def _detach(graph: fx.Graph, value):
    if not isinstance(value, fx.Node) or not isinstance(value.meta.get("val"), torch.Tensor):
        return value
    detached = graph.call_function(torch.ops.aten.detach.default, (value,))
    detached.meta = dict(value.meta)
    return detached


@contextlib.contextmanager
def custom_functions_named(model: torch.nn.Module):
    """Warn of each custom `torch.autograd.Function` the forward applies: `torch.export`
    records the ops of its forward only, so the program differentiates those ops
    instead of running the Function's own backward. That is exact where the backward
    is the derivative of the forward (BLOOM's GeLU) and wrong where it is not (a
    straight-through estimator, Phi-MoE's router multiplier). Functions torch makes
    for a custom op with a registered autograd formula stay ops in the graph."""
    applied: list[type] = []
    original = torch.autograd.Function.apply.__func__

    def apply(cls, *args, **kwargs):
        applied.append(cls)
        return original(cls, *args, **kwargs)

    torch.autograd.Function.apply = classmethod(apply)
    try:
        yield
    finally:
        torch.autograd.Function.apply = classmethod(original)
    for name in sorted({f"{c.__module__}.{c.__qualname__}" for c in applied}):
        if not name.startswith("torch."):
            warnings.warn(
                f"{type(model).__name__}.forward applies the custom autograd Function {name}: "
                "autoshard differentiates the ops of its forward instead of running its "
                "backward, so its gradients equal the serial model's only if that backward "
                "is the forward's derivative; write it with differentiable torch ops, or "
                "check the parallel module with autoshard.testing.assert_equivalent",
                stacklevel=4,
            )
