"""In-place pointwise ops (Falcon's ``attn_output.add_(mlp_output)``, a batch norm's
``num_batches_tracked.add_(1)``).

The result is the first operand's storage, so that operand must be used as it
is stored: a collective before the op would make it update a copy, and every
later reader of the original would miss the update. The op therefore follows
its first operand exactly; the other operands are split to match.

On the ranks an update of an activation runs out of place (the "out_of_place"
lowering), its readers after it reading its result: the stored operand may be
a collective's output, which autograd forbids updating in place. A parameter or
buffer is updated in place, as in the serial model. An update through a view
(``h[:, :4].mul_(2)``) would have to reach the shards of the viewed tensor:
autoshard refuses it (`StrategyError`) rather than compute it wrongly, unless
nothing reads that tensor after the update but through the view itself
(Funnel's ``attn = shifted[..., :n]; attn *= mask``): then the update reaches
nothing else, and runs out of place like any other. A tensor made of no input
(BEiT's relative position index, built from aranges) is updated through its
views in place, as in the serial model, and so is a buffer (an average updated
under ``torch.no_grad()`` reaches it through a ``detach``; ``ema.mul_(0.9).add_(x)``
updates it twice). Whatever runs in place (a buffer's
update, such a constant's, an op with no rule run replicated),
`check_updates_reach` refuses a program where a conversion comes between the
update and the storage it must reach.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import fx
from torch.ops import aten

from autoshard.errors import StrategyError
from autoshard.mesh import Mesh
from autoshard.strategies.base import Context, Lowering, Saved, Strategy, make
from autoshard.strategies.pointwise import aligned
from autoshard.strategies.registry import entry_for, register
from autoshard.tracing.storage import (
    aliases_its_input,
    is_view,
    operands_written,
    storage_owner,
    storage_sharers,
    writes_in_place,
)
from autoshard.tracing.trace import tensor_inputs

if TYPE_CHECKING:
    from autoshard.planning.plan import NodePlan

IN_PLACE = (
    aten.add_.Tensor,
    aten.add_.Scalar,
    aten.sub_.Tensor,
    aten.sub_.Scalar,
    aten.mul_.Tensor,
    aten.mul_.Scalar,
    aten.div_.Tensor,
    aten.div_.Scalar,
    aten.masked_fill_.Scalar,
    aten.detach_.default,
    # activations written in place (nn.ReLU(inplace=True), x.clamp_(...))
    aten.relu_.default,
    aten.sigmoid_.default,
    aten.tanh_.default,
    aten.silu_.default,
    aten.gelu_.default,
    aten.hardtanh_.default,
    aten.hardswish_.default,
    aten.leaky_relu_.default,
    aten.elu_.default,
    aten.threshold_.default,
    aten.clamp_.default,
    aten.clamp_.Tensor,
    aten.clamp_min_.default,
    aten.clamp_max_.default,
    aten.exp_.default,
    aten.neg_.default,
)


def out_of_place(op):
    """The functional twin of an in-place overload: ``aten.add_.Tensor`` → ``aten.add.Tensor``."""
    packet = getattr(aten, op._schema.name.split("::")[1].removesuffix("_"))
    return getattr(packet, op._overloadname)


def _after(node: fx.Node) -> list[fx.Node]:
    """The nodes after `node` in its graph, in order."""
    later, after = [], node.next
    while after.op != "root":
        later.append(after)
        after = after.next
    return later


def _storage_read_after(update: fx.Node, tensor: fx.Node, spared: set[fx.Node]) -> bool:
    """Whether a node after `update` reads the storage `tensor` shares through any
    tensor but those `spared`; always for an input's, parameter's or buffer's storage,
    which an update must reach."""
    owner = storage_owner(tensor)
    if owner.op != "call_function":
        return True
    later = set(_after(update))
    return any(later & set(t.users) for t in storage_sharers(owner) - spared)


def _read_only_through(view: fx.Node, update: fx.Node) -> bool:
    """Whether, after `update` (in place, on `view`), nothing reads the storage `view`
    views but `view` itself and what `update` returns: an activation's storage, read
    no other way, so that the update needs to reach no other tensor."""
    return not _storage_read_after(update, view, {view, update})


def check_updates_reach(graph: fx.Graph, plan) -> None:
    """Raise StrategyError where an update in place would miss what it updates: a node
    that writes its first operand in place, and runs so (an op with no rule, a buffer's
    update), where that operand, or a tensor it views on the way to its storage,
    arrives through a conversion, and the storage is read after the update other than
    through its result. The update lands on the converted copy, and those readers
    would miss it (``h[:, 0] = 0`` on a split ``h``: a ``fill_`` of a view, which no
    rule claims). Also where the update is of a model input the plan splits on entry,
    which would not reach the caller's tensor."""
    for node in graph.nodes:
        placed = plan.nodes.get(node.name)
        if placed is None:
            continue
        _check_written_as_stored(node, placed)
        if not writes_in_place(node):
            continue
        owner = storage_owner(node.args[0])
        if owner.op == "placeholder" and plan.entry_steps.get(owner.name):
            raise StrategyError(
                f"node '{node.name}' ({node.target}) updates the model's input "
                f"'{owner.name}' in place, which the plan splits on entry: each rank updates "
                "its own shard, and the tensor the caller passed would not change as the "
                f"serial model changes it. Update a copy ({owner.name} = {owner.name}.clone() "
                "first) or write it out of place, or make the update before calling the module"
            )
        if not runs_in_place(node, plan):
            continue
        link, steps = node, ()
        while aliases_its_input(link) and isinstance(link.args[0], fx.Node):
            here = plan.nodes.get(link.name)  # what converts link's operand, link views
            steps = here.input_steps[0] if here is not None and here.input_steps else ()
            if steps:
                break
            link = link.args[0]
        # read after it other than through what it returns (and that result's views)
        if steps and _storage_read_after(node, node.args[0], storage_sharers(node)):
            raise StrategyError(
                f"node '{node.name}' ({node.target}) updates '{node.args[0].name}' in place, "
                f"but the plan gives {'it' if link is node else repr(link.name)} a converted "
                f"copy ({steps[0].kind} over axis {steps[0].axis!r}) of what it reads: the "
                "update would not reach the tensor it updates. Write the update out of place "
                "(torch.where(mask, value, h), torch.cat of the parts, index_put without _), "
                "or plan this module 'replicated'"
            )


def _check_written_as_stored(node: fx.Node, placed: NodePlan) -> None:
    """Refuse an op that updates a tensor besides the one it returns (a batch norm's
    running statistics) where the plan gives it a converted copy of that tensor."""
    inputs = tensor_inputs(node)
    for written in operands_written(node):
        steps = placed.input_steps[inputs.index(written)] if placed.input_steps else ()
        if steps and not (writes_in_place(node) and written is node.args[0]):
            raise StrategyError(
                f"node '{node.name}' ({node.target}) updates '{written.name}' in place, but "
                f"the plan gives it a converted copy ({steps[0].kind} over axis "
                f"{steps[0].axis!r}): the update would not reach the tensor. Plan this "
                "module 'replicated'"
            )


def updated_in_place(value: fx.Node, plan) -> bool:
    """Whether a node updates the storage of `value` in place, and runs so (not out of
    place): a conversion of `value` made before the update is then not the value after
    it, and no reader after the update may share it."""
    return any(
        writes_in_place(n) and runs_in_place(n, plan)
        for n in storage_sharers(storage_owner(value)) - {value}
    )


def runs_in_place(node: fx.Node, plan) -> bool:
    placed = plan.nodes.get(node.name)
    return placed is None or placed.strategy.lowering is not OUT_OF_PLACE


def _functional(node: fx.Node, placed: NodePlan, mesh: Mesh) -> None:
    """An in-place op as its functional twin; the readers of its first operand that
    come after it read its result instead, as they read the updated tensor before."""
    updated = node.args[0]
    for user in [n for n in _after(node) if updated in n.all_input_nodes]:
        user.replace_input_with(updated, node)
    node.target = out_of_place(node.target)


OUT_OF_PLACE = Lowering("out_of_place", _functional)


def _saved_as_out_of_place(node, in_shapes, out_shape, needs_grad, mask_itemsize) -> Saved:
    """What its functional twin keeps: an activation's update runs out of place on the
    ranks, and in place autograd keeps as much (the result, relu_; or a copy of the
    operand as it was before the update, clamp_)."""
    keeps = entry_for(out_of_place(node.target)).saved
    if keeps is None:
        return Saved()
    return keeps(node, in_shapes, out_shape, needs_grad, mask_itemsize)


@register(*IN_PLACE, saved=_saved_as_out_of_place, lowerings=(OUT_OF_PLACE,))
def in_place(ctx: Context) -> list[Strategy]:
    target = ctx.inputs[0]
    owner = storage_owner(target)
    through_view = is_view(target) and not _read_only_through(target, ctx.node)
    if through_view and not _updatable_in_place(owner):
        if owner.op == "get_attr":
            raise StrategyError(
                f"node '{ctx.node.name}' ({ctx.node.target}) updates parameter "
                f"'{owner.target}' in place in forward{_through(target)}; autoshard cannot "
                "carry an update through a view to a parameter's shards. Update the "
                "parameter outside forward (before calling the module, under "
                "torch.no_grad()), or make it a buffer"
            )
        raise StrategyError(
            f"node '{ctx.node.name}' ({ctx.node.target}) updates '{target.name}', a view made "
            f"by {target.target}, in place; autoshard cannot carry that update to the viewed "
            "tensor's shards: write it out of place (h = h * 2, or torch.cat of the parts)"
        )
    out = ctx.layout(0)
    inputs = [out] + [aligned(out, ctx.shape(i), ctx.out_shape) for i in range(1, len(ctx.inputs))]
    # through a view of a buffer or of a tensor made of no input, in place:
    # `check_updates_reach` refuses the program if a conversion comes between
    # (an update of an update of a buffer, `ema.mul_(0.9).add_(x)`, reaches the buffer)
    lowering = OUT_OF_PLACE if owner.op == "call_function" and not through_view else None
    return [make("follow", inputs, out, lowering=lowering, detail="in place")]


def _through(view: fx.Node) -> str:
    """How an update reaches a parameter, as the user wrote it: a detach is what
    ``torch.no_grad()`` makes, not a view of the user's."""
    if view.target in (aten.detach.default, aten.alias.default):
        return " (under torch.no_grad())"
    return f" (through '{view.name}', {view.target})"


def _updatable_in_place(owner: fx.Node) -> bool:
    """Whether the storage `owner` makes may be updated in place through its views on
    the ranks, as in the serial model: a buffer (an exponential average updated under
    ``torch.no_grad()``, which reaches it through a ``detach``), or a tensor made of no
    input (BEiT's relative position index, built from aranges). Neither needs a
    gradient."""
    if owner.op == "get_attr":
        value = owner.meta.get("val")
        return isinstance(value, torch.Tensor) and not value.requires_grad
    return _made_of_no_input(owner)


def _made_of_no_input(node: fx.Node) -> bool:
    """Whether `node` is computed from no input, parameter or buffer: nothing in it
    needs a gradient, and every rank computes it alike."""
    return next(leaves_read([node]), None) is None


def leaves_read(nodes: list[fx.Node], past_detach: bool = True):
    """The inputs, parameters and buffers `nodes` are computed from (lazily, each
    once); with `past_detach` False, not those read only through a detach."""
    seen, stack = set(), list(nodes)
    while stack:
        here = stack.pop()
        if here in seen or (not past_detach and here.target is aten.detach.default):
            continue
        seen.add(here)
        if here.op in ("placeholder", "get_attr"):
            yield here
        else:
            stack += here.all_input_nodes
