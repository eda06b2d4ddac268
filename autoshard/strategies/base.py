"""What a rule is: `Context` in, `Strategy`s out; a strategy may name a `Lowering`.
Rules are registered with their op's entry (`autoshard.strategies.registry`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import fx
from torch.utils import _pytree as pytree

from autoshard.layout import Layout, Step
from autoshard.mesh import Mesh
from autoshard.runtime import ops

if TYPE_CHECKING:
    from autoshard.planning.plan import NodePlan

FAMILIES = ("3d", "3d-allreduce", "replicated", "any", "any-allreduce", "megatron", "dp")
# The named uniform layouts: data parallel over every axis, and Megatron-LM's tensor
# parallelism over one axis with data parallel over the others (`parallel_axes`).
NAMED = ("megatron", "dp")


def all_reduces(family: str) -> bool:
    """Whether `family`'s layers all-reduce their pending sums (the output whole over
    K) and keep their weights whole over M by default (gradients all-reduced), rather
    than reduce-scatter and gather the weight as "3d" does."""
    return family.endswith("allreduce") or family in NAMED


def parallel_axes(family: str, mesh: Mesh) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """A named family's (data-parallel axes, tensor-parallel axes). "dp": every axis
    splits the batch. "megatron": the last axis that splits anything (the fastest
    links: NVLink inside a node on ib-cluster, the mesh's last axis) is the
    tensor-parallel axis, the others split the batch; on a (1, 1, 8) mesh that is
    Megatron over all 8 ranks, on (8, 1, 1) plain data parallel."""
    if family == "dp":
        return mesh.names, ()
    wide = [a for a in mesh.names if mesh.size(a) > 1] or [mesh.names[-1]]
    tp = wide[-1]
    return tuple(a for a in mesh.names if a != tp), (tp,)


def batch_dims(shape, axes, mesh: Mesh) -> tuple[tuple[str, ...], ...]:
    """`axes` (outer first) placed on the leading dims of `shape` (its batch, then its
    sequence) that divide, each axis on the first dim that still does: how the named
    families split a tensor of tokens."""
    dims = [[] for _ in shape]
    local = list(shape)
    for axis in axes:
        for d, size in enumerate(local):
            if size % mesh.size(axis) == 0:
                dims[d].append(axis)
                local[d] //= mesh.size(axis)
                break
    return tuple(tuple(d) for d in dims)


@dataclass(frozen=True)
class Saved:
    """What autograd keeps for one node's backward."""

    inputs: tuple[int, ...] = ()  # tensor inputs kept, as indices into tensor_inputs(node)
    output: bool = False  # the node's output kept
    extra_bytes: int = 0  # buffers the op makes for its backward (masks, statistics)


# What a node keeps for backward, from its local input shapes, its local output
# shape, which tensor inputs need a gradient and the dropout mask's itemsize (None:
# the activation's).
SavedRule = Callable[
    [fx.Node, Sequence[Sequence[int]], Sequence[int], tuple[bool, ...], "int | None"], Saved
]
# Bytes a lowering's forward holds besides its inputs, what it keeps and its result,
# from the node and its local input and output shapes.
WorkspaceRule = Callable[[fx.Node, Sequence[Sequence[int]], Sequence[int]], int]


@dataclass(frozen=True)
class Lowering:
    """How a node runs on shards where the ATen op on its shards is not the op: the
    strategy that needs it names it (`Strategy.lowering`), `passes.localize` calls
    `rewrite(node, placed, mesh)` to turn the node into the local computation (an
    `autoshard.runtime.ops` kernel, or the op with local arguments), and the cost model
    reads `saved` where that computation keeps other tensors than the ATen op
    (None: the same), and `workspace`, the temporaries its forward holds at once
    with them (None: none)."""

    name: str
    rewrite: Callable[[fx.Node, NodePlan, Mesh], None]
    saved: SavedRule | None = None
    workspace: WorkspaceRule | None = None

    def __repr__(self) -> str:
        return self.name


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
    lowering: Lowering | None = None  # how the node runs on shards, if not as the ATen op
    internal: tuple[Step, ...] = ()  # collectives inside the lowering (a norm's statistics)
    outputs: tuple[Layout, ...] = ()  # per output, for ops that return several tensors
    detail: str = ""
    # The two knobs of a layer: is the weight stored split over the M axes
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

    @property
    def result_shapes(self) -> list[tuple[int, ...]]:
        """The shape of each tensor an op of several results returns (a split's pieces,
        values and their indices); none for an op of one."""
        val = self.node.meta["val"]
        return [tuple(t.shape) for t in val] if isinstance(val, (tuple, list)) else []

    def layout(self, i: int) -> Layout:
        return self.layouts[i] or Layout.replicated(len(self.shape(i)))


class Unclaimed(Exception):
    """Raised by a rule for a call it does not handle (an argument value it has no
    sharded form for, such as a dropout inside attention): the node runs replicated,
    with a warning naming `reason`."""


Rule = Callable[[Context], list[Strategy]]


def whole_operands(ctx: Context, start: int = 0) -> list[Layout]:
    """Replicated layouts for the node's tensor inputs from the `start`-th on (weights,
    biases, running statistics, indices)."""
    return [Layout.replicated(len(ctx.shape(i))) for i in range(start, len(ctx.inputs))]


def replicated_fallback(ctx: Context) -> list[Strategy]:
    inputs = whole_operands(ctx)
    val = ctx.node.meta["val"]
    # an op with several outputs (topk: values and indices) lays out each of them
    several = isinstance(val, (tuple, list))
    outputs = tuple(_replicated_like(v) for v in val) if several else ()
    return [
        make(
            "replicated",
            inputs,
            Layout.replicated(len(ctx.out_shape)),
            outputs=outputs,
            detail="no rule",
            lowering=SERIAL_STRIDES if _draws_by_strides(ctx.node) else None,
        )
    ]


def _draws_by_strides(node: fx.Node) -> bool:
    """A random op on a tensor the serial program lays out other than row-major (a
    transposed view): its numbers follow that layout, which a gathered operand lacks."""
    if torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
        return False
    return any(not inp.meta["val"].is_contiguous() for inp in _tensor_args(node))


def _tensor_args(node: fx.Node) -> list[fx.Node]:
    """The node's tensor arguments, in the order `pytree` meets them."""
    leaves = pytree.tree_leaves((node.args, node.kwargs))
    return [a for a in leaves if isinstance(a, fx.Node) and is_tensor(a)]


def _rewrite_on_serial_strides(node: fx.Node, placed: NodePlan, mesh: Mesh) -> None:
    strides = tuple(tuple(a.meta["val"].stride()) for a in _tensor_args(node))
    node.args, node.kwargs = (str(node.target), *node.args), {**node.kwargs, "strides": strides}
    node.target = ops.on_serial_strides


SERIAL_STRIDES = Lowering("on serial strides", _rewrite_on_serial_strides)


def _replicated_like(value) -> Layout:
    return Layout.replicated(value.ndim if isinstance(value, torch.Tensor) else 0)


def is_tensor(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)
