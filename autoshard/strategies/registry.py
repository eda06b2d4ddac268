"""One entry per ATen op: everything autoshard knows about it, in one place.

An `OpEntry` holds the op's candidate rule (how it may run on the mesh), its
compute (forward FLOPs on local shapes and the backward's time as a multiple of
the forward's), what autograd keeps for its backward, and the lowerings its
rule may choose (`Lowering`: how it runs on shards where the ATen op on shards
is not it). The planner asks `rule_for`, the cost model `entry_for`, and the
passes run the `Lowering` a chosen strategy holds: nothing is looked up by name
except a plan read back from JSON (`lowering_named`).

Each op module registers its entries next to its rule:

    @register(aten.layer_norm.default, flops=normalizing_flops, saved=_saved,
              lowerings=(LAYER_NORM,))
    def layer_norm(ctx): ...

    register(operator.getitem, free=True)()   # an entry without a rule

An op registered twice is an error: the second entry would silently replace the
first. What is missing takes the default: an op with no rule runs replicated
(with a warning), one with no `flops` costs one FLOP per element of its largest
operand, one with no `backward` twice its forward, one with no `saved` keeps
nothing. `autoshard ops` prints every entry.

    >>> from torch.ops import aten
    >>> entry = entry_for(aten.layer_norm.default)
    >>> entry.rule.__name__, [lowering.name for lowering in entry.lowerings]
    ('layer_norm', ['layer_norm'])
    >>> entry_for(aten.view.default).free, entry_for(aten.view.default).aliases
    (True, True)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import fx

from autoshard.strategies.base import SERIAL_STRIDES, Lowering, Rule, Saved, SavedRule

Shapes = Sequence[Sequence[int]]
Flops = Callable[[fx.Node, Shapes, Sequence[int]], float]
Backward = Callable[[fx.Node, tuple[bool, ...]], float]

# Normalizations and softmaxes: a max or mean, a sum, a subtraction, an exp or a
# division and a scale, about 5 FLOPs per element.
NORMALIZING_FLOPS_PER_ELEMENT = 5
STATISTIC_BYTES = 4  # norms and attention keep their per-row statistics in fp32
INDEX_BYTES = 8  # indices an op keeps for backward (a max pool's, a sort's) are int64


@dataclass(frozen=True)
class OpEntry:
    """What autoshard knows about `op` (see the module's docstring for the defaults)."""

    op: object  # an ATen overload (or operator.getitem)
    rule: Rule | None = None  # its candidate strategies
    flops: Flops | None = None  # forward FLOPs from local (input shapes, output shape)
    backward: Backward | None = None  # backward time / forward time, from needs_grad
    saved: SavedRule | None = None  # what autograd keeps for its backward
    free: bool = False  # launches no kernel and moves no data: costs nothing
    aliases: bool = False  # its output is a view of its first input's storage
    lowerings: tuple[Lowering, ...] = ()  # what its rule's strategies may lower to
    # A layer of it may keep an activation input as its stored shard for backward and
    # gather it again there (the regather knob): `autoshard.runtime.ops.keep_shard`
    # has its derivative. Without it the planner never turns that knob on it.
    regathers: bool = False


_ENTRIES: dict[object, OpEntry] = {}
_LOWERINGS: dict[str, Lowering] = {SERIAL_STRIDES.name: SERIAL_STRIDES}  # of ops with no rule


def register(
    *ops,
    flops: Flops | None = None,
    backward: Backward | None = None,
    saved: SavedRule | None = None,
    free: bool = False,
    aliases: bool = False,
    lowerings: tuple[Lowering, ...] = (),
    regathers: bool = False,
) -> Callable[[Rule | None], Rule | None]:
    """The entry of each of `ops`: the rule it decorates (call it with nothing for an
    op with no rule) and these facts. An op registered twice is an error."""

    def wrap(rule: Rule | None = None) -> Rule | None:
        for op in ops:
            if op in _ENTRIES:
                raise ValueError(
                    f"{op} already has {_described(_ENTRIES[op].rule)}; "
                    f"{_described(rule)} cannot claim it too: one entry per op"
                )
        for lowering in lowerings:
            known = _LOWERINGS.setdefault(lowering.name, lowering)
            if known is not lowering:
                raise ValueError(f"two lowerings are named {lowering.name!r}: rename one")
        for op in ops:
            _ENTRIES[op] = OpEntry(
                op, rule, flops, backward, saved, free, aliases, lowerings, regathers
            )
        return rule

    return wrap


def _described(rule: Rule | None) -> str:
    if rule is None:
        return "an entry without a rule"
    return f"the rule {rule.__module__}.{rule.__qualname__}"


def entry_for(op) -> OpEntry | None:
    """The entry of `op` (an fx node's target), None for an op autoshard has none for."""
    return _ENTRIES.get(op)


def rule_for(op) -> Rule | None:
    entry = _ENTRIES.get(op)
    return entry.rule if entry is not None else None


def entries() -> list[OpEntry]:
    """Every entry, in registration order."""
    return list(_ENTRIES.values())


def lowering_named(name: str) -> Lowering:
    """The lowering called `name` (for a plan read back from JSON)."""
    if name not in _LOWERINGS:
        raise KeyError(f"no lowering is named {name!r}; there are {sorted(_LOWERINGS)}")
    return _LOWERINGS[name]


# ------------------------------------------------------- what the entries share


def numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


def itemsize(node: fx.Node) -> int:
    """Bytes per element of the node's tensor, or of the first it returns (split)."""
    val = node.meta["val"]
    return (val if isinstance(val, torch.Tensor) else val[0]).element_size()


def largest_operand(node: fx.Node, in_shapes: Shapes, out_shape: Sequence[int]) -> float:
    """Elements of the largest of the node's tensor inputs and output: one FLOP per
    element, the default for an elementwise op."""
    return max([numel(s) for s in in_shapes] + [numel(out_shape)])


def normalizing_flops(node: fx.Node, in_shapes: Shapes, out_shape: Sequence[int]) -> float:
    """A normalization's or softmax's FLOPs: `NORMALIZING_FLOPS_PER_ELEMENT` per element."""
    return largest_operand(node, in_shapes, out_shape) * NORMALIZING_FLOPS_PER_ELEMENT


def keeps_output(node, in_shapes, out_shape, needs_grad, mask_itemsize) -> Saved:
    """Backward needs only the output: d relu = (y > 0), d tanh = 1 − y², softmax."""
    return Saved(output=True)


def keeps_input(node, in_shapes, out_shape, needs_grad, mask_itemsize) -> Saved:
    """Backward needs the (first) input: gelu, silu, log, abs, pow."""
    return Saved((0,))


def keeps_inputs(node, in_shapes, out_shape, needs_grad, mask_itemsize) -> Saved:
    """Backward needs every tensor input: maximum, minimum and clamp with tensor bounds
    compare them for either gradient."""
    return Saved(tuple(range(len(in_shapes))))


def each_for_the_other(needs_grad: Sequence[bool], a: int, b: int) -> Saved:
    """A product of inputs a and b keeps each for the other's gradient: a when b needs
    one, b when a does (a · b, a · b + c, a matrix times a vector, a dot product)."""
    return Saved(tuple(i for i, other in ((a, b), (b, a)) if needs_grad[other]))


def keeps_operands(node, in_shapes, out_shape, needs_grad, mask_itemsize) -> Saved:
    """a · b (mul, mv, vdot) keeps each operand for the other's gradient; a product with
    a Python number keeps nothing."""
    if len(in_shapes) != 2:
        return Saved()
    return each_for_the_other(needs_grad, 0, 1)


def on_cpu(node: fx.Node) -> bool:
    """Whether the node runs on the CPU, where some kernels keep what CUDA's do not."""
    val = node.meta["val"]
    return (val if isinstance(val, torch.Tensor) else val[0]).device.type == "cpu"
