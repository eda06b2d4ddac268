"""Candidate strategies per ATen op: how a node may run on the mesh.

A rule receives a `Context` (the node, the mesh, the layouts its inputs are
stored in, the family the user asked for) and returns candidate
`Strategy`s; the planner picks one. A strategy carries everything the
passes need: the layout each tensor input must arrive in, the layout the
local op computes (possibly a pending sum), the layout the node stores
after its own collectives, where the gradients of replicated inputs come
back partial, and how parameters the node owns are stored.

Rules are registered per ATen overload:

    @register(aten.relu.default, aten.tanh.default)
    def pointwise(ctx): ...

An op with no rule runs replicated (`replicated_fallback`), with a warning.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import fx

from autoshard.layout import Layout, Step
from autoshard.mesh import Mesh

FAMILIES = ("3d", "3d-allreduce", "replicated", "any", "any-allreduce")


@dataclass(frozen=True)
class Strategy:
    family: str
    inputs: tuple[Layout, ...]
    output: Layout
    stored: Layout
    grad_partial: tuple[frozenset[str], ...]
    storage: tuple[
        Layout | None, ...
    ] = ()  # for inputs the node owns (parameters): how to store them
    epilogue: tuple[int, ...] = ()  # inputs applied after the output collectives (a linear's bias)
    lowering: str | None = None  # a local implementation in autoshard.ops instead of the ATen op
    internal: tuple[Step, ...] = ()  # collectives inside the lowering (a norm's statistics)
    outputs: tuple[Layout, ...] = ()  # per output, for ops that return several tensors
    detail: str = ""
    # The two knobs of a layer (DESIGN.md): is the weight stored split over the M axes
    # too and gathered before use (True), or kept whole over them with its gradient
    # all-reduced (False); None where the op has no such choice.
    split_weight: bool | None = None
    # Inputs saved for backward as the shard they are stored in and gathered again
    # there, instead of as the gathered operand the op computes on.
    regather: tuple[int, ...] = ()

    def storage_for(self, i: int) -> Layout:
        own = self.storage[i] if i < len(self.storage) else None
        return own or self.inputs[i]


def make(
    family: str,
    inputs,
    output: Layout,
    stored: Layout | None = None,
    *,
    relative_to: dict[int, Layout] | None = None,
    **kw,
) -> Strategy:
    """A strategy whose replicated inputs get partial gradients where the work is split.

    An input replicated over an axis that its node's output is not
    replicated over feeds split work: each rank's gradient is a share of
    the whole. `relative_to` names another output layout for some inputs
    (a bias added after the output collectives).
    """
    inputs = tuple(inputs)
    grads = []
    for i, layout in enumerate(inputs):
        out = (relative_to or {}).get(i, output)
        axes = {a for a in out.sharded_axes + out.partial if layout.replicates(a)}
        grads.append(frozenset(axes))
    return Strategy(family, inputs, output, stored or output, tuple(grads), **kw)


@dataclass
class Context:
    node: fx.Node
    mesh: Mesh
    inputs: list[fx.Node]  # tensor inputs, in argument order
    layouts: list[
        Layout | None
    ]  # their stored layouts; None where the node may choose (parameters)
    family: str

    def shape(self, i: int) -> tuple[int, ...]:
        return tuple(self.inputs[i].meta["val"].shape)

    @property
    def out_shape(self) -> tuple[int, ...]:
        val = self.node.meta["val"]
        return tuple(val.shape) if is_tensor(self.node) else ()

    def layout(self, i: int) -> Layout:
        return self.layouts[i] or Layout.replicated(len(self.shape(i)))


Rule = Callable[[Context], list[Strategy]]
_REGISTRY: dict[object, Rule] = {}


def register(*ops) -> Callable[[Rule], Rule]:
    """Register `rule` for each of `ops`; an op registered twice is an error (the
    second rule would silently replace the first)."""

    def wrap(rule: Rule) -> Rule:
        for op in ops:
            if op in _REGISTRY:
                raise ValueError(
                    f"{op} already has the rule {_REGISTRY[op].__module__}."
                    f"{_REGISTRY[op].__qualname__}; {rule.__module__}.{rule.__qualname__} "
                    "cannot claim it too: one rule per op"
                )
            _REGISTRY[op] = rule
        return rule

    return wrap


def rule_for(target) -> Rule | None:
    return _REGISTRY.get(target)


def replicated_fallback(ctx: Context) -> list[Strategy]:
    inputs = [Layout.replicated(len(ctx.shape(i))) for i in range(len(ctx.inputs))]
    return [make("replicated", inputs, Layout.replicated(len(ctx.out_shape)), detail="no rule")]


def is_tensor(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


from autoshard.strategies import (  # noqa: E402,F401  (each module registers its rules)
    attention,
    embedding,
    linear,
    loss,
    norm,
    pointwise,
    reduction,
    replicated,
    views,
)
