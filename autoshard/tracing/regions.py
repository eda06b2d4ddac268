"""Inline the regions `torch.export` wraps in higher-order ops, so the planner sees one
flat graph of ATen ops.

A block under ``torch.no_grad()`` inside forward (a stop-gradient scale, position
ids) or under a disabled ``torch.autocast`` (Hugging Face's rotary tables) is exported
as a call of a submodule:

    submod_3 = self.submod_1
    add = torch.ops.higher_order.wrap_with_set_grad_enabled(False, submod_3, linear)
    getitem = add[0]

Its ops are copied in place of the call, and what enters a no-grad region is
detached, which is exactly what the region meant: nothing inside records a gradient,
so an op writing into a buffer there (spectral norm's power iteration,
``torch.mv(..., out=self._u)`` on the weight) runs as it did, and what leaves carries
no gradient. Any other region (``torch.cond``,
an enabled autocast) is refused with a `TraceError` naming the node: its meaning is
not a flat graph of the ops autoshard has rules for. A custom `torch.autograd.Function`
in forward is exported as its forward ops only: `check_custom_functions` refuses one
whose backward is not their derivative.
"""

from __future__ import annotations

import contextlib
import math
import operator
import threading
import warnings
from dataclasses import dataclass

import torch
from torch import fx
from torch.utils import _pytree as pytree

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
            if detached:  # no op of the region records a gradient, in-place ones included
                operands = [_detach(graph, operand) for operand in operands]
            outputs = _copied(graph, body, operands)
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
def custom_functions_recorded():
    """Record the first call of each custom `torch.autograd.Function` applied inside
    the block (its class, and its arguments as `Sample` specs), for
    `check_custom_functions`. Functions torch makes for a custom op with a registered
    autograd formula stay ops in the graph and are not recorded."""
    applied: dict[type, tuple] = {}
    original = torch.autograd.Function.apply.__func__
    tracing_thread = threading.get_ident()  # the patch is process-wide; others pass through

    def apply(cls, *args, **kwargs):
        mine = threading.get_ident() == tracing_thread
        if mine and not cls.__module__.startswith("torch.") and cls not in applied:
            applied[cls] = (_specs(args), _specs(kwargs))
        return original(cls, *args, **kwargs)

    torch.autograd.Function.apply = classmethod(apply)
    try:
        yield applied
    finally:
        torch.autograd.Function.apply = classmethod(original)


def check_custom_functions(model: torch.nn.Module, applied: dict[type, tuple]) -> None:
    """`torch.export` records the ops of a custom Function's forward only, so the
    program differentiates those ops instead of running the Function's own backward.
    That is exact where the backward is the forward's derivative (BLOOM's GeLU) and
    wrong where it is not (a straight-through estimator, Phi-MoE's router
    multiplier). Each Function is run once on random float64 inputs of the shapes it
    was traced with, both ways: a backward that differs is refused with a
    `TraceError`; one that cannot be run so is warned of."""
    for cls, (args, kwargs) in applied.items():
        name = f"{cls.__module__}.{cls.__qualname__}"
        try:
            exact = _backward_is_derivative(cls, args, kwargs)
        except Exception as e:  # a Function that random inputs or float64 do not suit
            warnings.warn(
                f"{type(model).__name__}.forward applies the custom autograd Function {name}, "
                f"whose backward autoshard could not compare with its forward's derivative "
                f"({type(e).__name__}: {e}): autoshard differentiates the ops of its forward "
                "instead of running its backward; check the parallel module with "
                "autoshard.testing.assert_equivalent",
                stacklevel=3,
            )
            continue
        if not exact:
            raise TraceError(
                f"{type(model).__name__}.forward applies the custom autograd Function {name}, "
                "whose backward is not the derivative of its forward (checked on random "
                "inputs): torch.export keeps its forward ops only, so the parallel program's "
                "gradients would differ from the serial model's. Write it with differentiable "
                "torch ops (a straight-through estimator as x + (f(x) - x).detach()), or "
                "register it as a custom op with its autograd formula "
                "(torch.library.custom_op + register_autograd)"
            )


@dataclass(frozen=True)
class Sample:
    """A tensor argument as traced: what a random stand-in for it needs."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    def drawn(self, generator: torch.Generator) -> torch.Tensor:
        if self.dtype.is_floating_point:
            x = torch.randn(self.shape, generator=generator, dtype=torch.float64)
            return x.requires_grad_(self.requires_grad)
        # zeros are a valid index into any non-empty dimension, and True a valid mask
        return (
            torch.ones(self.shape, dtype=self.dtype)
            if self.dtype == torch.bool
            else (torch.zeros(self.shape, dtype=self.dtype))
        )


def _specs(tree):
    return pytree.tree_map_only(
        torch.Tensor,
        lambda t: Sample(tuple(int(s) for s in t.shape), t.dtype, t.requires_grad),
        tree,
    )


# Past this many elements a Function's inputs (a 70B model's, planned on meta) are not
# drawn: it is warned of instead of checked.
CHECKED_ELEMENTS = 2**22


def _backward_is_derivative(cls: type, args, kwargs) -> bool:
    if kwargs:
        raise TypeError("Function.apply takes positional arguments only")
    samples = [s for s in pytree.tree_leaves(args) if isinstance(s, Sample)]
    if sum(math.prod(s.shape) for s in samples) > CHECKED_ELEMENTS:
        raise ValueError(f"its inputs hold more than {CHECKED_ELEMENTS} elements")
    generator = torch.Generator().manual_seed(0)
    args = pytree.tree_map_only(Sample, lambda s: s.drawn(generator), args)
    leaves, spec = pytree.tree_flatten(args)
    wanted = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
    if not wanted:
        return True  # nothing to differentiate

    class Applied(torch.nn.Module):
        def forward(self, *flat):
            return cls.apply(*pytree.tree_unflatten(list(flat), spec))

    exported = torch.export.export(Applied(), tuple(leaves), strict=False).module()
    # both ways from one seed (a Function that draws random numbers draws alike), and
    # the user's random state as it was
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        own = _gradients(cls.apply(*args), wanted)
        torch.manual_seed(0)
        of_forward = _gradients(exported(*leaves), wanted)
    return all(
        (a - b).abs().max() <= 1e-9 * max(1.0, a.abs().max().item())
        for a, b in zip(own, of_forward)
    )


def _gradients(outputs, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Gradients of a fixed random weighting of `outputs` (zeros where unused)."""
    generator = torch.Generator().manual_seed(1)
    outputs = [o for o in pytree.tree_leaves(outputs) if isinstance(o, torch.Tensor)]
    outputs = [o for o in outputs if o.requires_grad]
    if not outputs:
        return [torch.zeros_like(t) for t in inputs]
    weights = [torch.randn(o.shape, generator=generator, dtype=o.dtype) for o in outputs]
    loss = sum((o * w).sum() for o, w in zip(outputs, weights))
    grads = torch.autograd.grad(loss, inputs, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for t, g in zip(inputs, grads)]
