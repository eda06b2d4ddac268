"""Is a plan the one for this model and mesh? Checked before a saved plan is applied.

A plan records a fingerprint of the graph it was made for (`fingerprint`: every
node's op, arguments, dtype and shape, every input and parameter by name); a
plan whose fingerprint differs is refused, naming the first node that differs.
Then every node is checked as the planner would have placed it
(`check_plan`): its strategy is one its op's rule proposes, every layout
divides the shapes it splits, and the steps into and out of each node turn the
stored layouts into the ones the node reads and stores. A hand-edited layout
fails one of these and names the node.

    >>> import autoshard
    >>> from autoshard.tracing.trace import trace
    >>> model, x = torch.nn.Linear(16, 8), torch.randn(8, 16)
    >>> plan = autoshard.plan(model, (2, 2, 2), (x,))
    >>> check_plan(plan, trace(model, (x,)))  # the model it was made for: passes
    >>> check_plan(plan, trace(torch.nn.Linear(16, 4), (x,)))
    Traceback (most recent call last):
    ...
    autoshard.errors.PlanError: the plan was made for another model: graph node 0 is ...
"""

from __future__ import annotations

import dataclasses
import operator
from collections import defaultdict

import torch
from torch import fx

from autoshard.errors import PlanError
from autoshard.layout import Layout, Step
from autoshard.mesh import Mesh
from autoshard.planning.chunking import chunkings
from autoshard.planning.plan import NodePlan, Plan
from autoshard.planning.planner import _candidates, _regathered
from autoshard.planning.units import updated_outside
from autoshard.strategies import FAMILIES, Context, Strategy, is_tensor, replicated_fallback
from autoshard.tracing.trace import Traced, module_path, tensor_inputs

_AGAIN = "plan again for this model (autoshard.plan, or parallelize without plan=)"


def fingerprint(traced: Traced) -> list[list]:
    """What the graph is made of, as a sorted list: each input and parameter by name
    with its dtype and shape, and each op with its arguments' shapes, its dtype and
    shape. Devices are left out (a plan made on one device applies on another), and so
    are node names and order: a model that iterates a set may trace the same ops in
    another order, under other names, in another process."""
    out = []
    for node in traced.graph_module.graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder":
            out.append([node.name, "input", "", *_described(val)])
        elif node.op == "get_attr":
            out.append([node.target, "parameter", "", *_described(traced.parameters[node.target])])
        else:
            args = fx.node.map_aggregate((node.args, node.kwargs), _argument)
            op = "output" if node.op == "output" else str(node.target)
            out.append(["", op, repr(args), *_described(val)])
    return sorted(out, key=lambda entry: (entry[1] not in ("input", "parameter"), repr(entry)))


def _argument(value):
    if isinstance(value, fx.Node):
        return _described(value.meta.get("val"))[1]  # its shape: names depend on order
    return "device" if isinstance(value, torch.device) else value


def _described(val) -> tuple[str, list | None]:
    if isinstance(val, torch.Tensor):
        return str(val.dtype).removeprefix("torch."), list(val.shape)
    if isinstance(val, (tuple, list)) and all(isinstance(v, torch.Tensor) for v in val):
        return "tuple", [list(v.shape) for v in val]
    return type(val).__name__, None


def _entry_text(entry: list) -> str:
    name, op, args, dtype, shape = entry
    return f"{name} = {op}{args} → {dtype}{shape if shape is not None else ''}"


def check_fingerprint(plan: Plan, traced: Traced) -> None:
    """PlanError naming the first node where the plan's graph and `traced` differ."""
    if not plan.graph:
        return  # made in this process by the planner (Plan.load refuses it): node by node
    current = fingerprint(traced)
    for i, (saved, now) in enumerate(zip(plan.graph, current)):
        if list(saved) != now:
            raise PlanError(
                f"the plan was made for another model: graph node {i} is "
                f"`{_entry_text(saved)}` in the plan but `{_entry_text(now)}` here; {_AGAIN}"
            )
    if len(plan.graph) != len(current):
        longer, which = (
            (plan.graph, "the plan's") if len(plan.graph) > len(current) else (current, "this")
        )
        raise PlanError(
            f"the plan was made for another model: {which} graph has "
            f"{abs(len(plan.graph) - len(current))} more nodes, from "
            f"`{_entry_text(longer[min(len(plan.graph), len(current))])}`; {_AGAIN}"
        )


def check_plan(plan: Plan, traced: Traced) -> None:
    """Refuse a plan that is not what the planner makes for `traced` on its mesh."""
    check_fingerprint(plan, traced)
    mesh = plan.mesh
    graph = traced.graph_module.graph
    placed = [n for n in graph.nodes if _placed(n)]
    if [n.name for n in placed] != list(plan.nodes):
        missing = [n.name for n in placed if n.name not in plan.nodes]
        extra = [n for n in plan.nodes if n not in traced.nodes]
        raise PlanError(
            f"the plan's nodes are not this model's (missing {missing[:3]}, not in the model "
            f"{extra[:3]}); {_AGAIN}"
        )
    stored: dict[fx.Node, object] = {}
    owner: dict[fx.Node, str] = {}  # parameter → the node that stores it (its first user)
    for node in graph.nodes:
        if node.op == "placeholder":
            stored[node] = _stored_input(plan, node, mesh)
        elif node.op == "get_attr":
            stored[node] = plan.storage.get(node.target) or Layout.replicated(
                traced.parameters[node.target].ndim
            )
            _divides(stored[node], _shape(node), f"parameter {node.target!r}", mesh)
        elif node.op == "call_function" and node.target is operator.getitem:
            parent, index = node.args
            stored[node] = stored[parent][index]
        elif _placed(node):
            here = plan.nodes[node.name]
            _check_node(node, here, stored, owner, plan, mesh)
            stored[node] = here.strategy.stored if is_tensor(node) else here.strategy.outputs
        elif node.op == "output":
            for i, (value, steps) in enumerate(zip(tensor_inputs(node), plan.output_steps)):
                whole = Layout.replicated(len(_shape(value)))
                _follow(stored[value], steps, whole, mesh, f"output {i} ({value.name!r})")
    for i, chunked in enumerate(plan.chunked):
        if chunked not in chunkings(traced, plan, (chunked.chunks,)):
            raise PlanError(
                f"plan.chunked[{i}] runs loss {chunked.loss!r} in {chunked.chunks} pieces, "
                "which this plan's layouts do not allow (a bias-free linear's logits, through "
                f"views only, into a vocabulary-parallel cross-entropy, tokens divisible); {_AGAIN}"
            )
    regions: dict[str, list[str]] = defaultdict(list)
    for name, region in plan.regions.items():
        regions[region].append(name)
    for region, names in regions.items():
        if (update := updated_outside(traced, plan, names)) is not None:
            raise PlanError(
                f"plan.regions recomputes {region!r}, whose {update}: a replay in backward "
                f"would update it a second time; {_AGAIN}"
            )


def _placed(node: fx.Node) -> bool:
    """Nodes the planner places (as `plan_graph` walks the graph)."""
    return (
        node.op == "call_function"
        and node.target is not operator.getitem
        and node.meta.get("val") is not None
    )


def _shape(node: fx.Node) -> tuple[int, ...]:
    return tuple(node.meta["val"].shape)


def _stored_input(plan: Plan, node: fx.Node, mesh: Mesh) -> Layout:
    layout = plan.storage.get(node.name)
    if layout is None or node.name not in plan.entry_steps:
        raise PlanError(f"the plan does not say how input {node.name!r} is split; {_AGAIN}")
    _divides(layout, _shape(node), f"input {node.name!r}", mesh)
    whole = Layout.replicated(len(_shape(node)))
    _follow(whole, plan.entry_steps[node.name], layout, mesh, f"input {node.name!r} on entry")
    return layout


def _check_node(node, here: NodePlan, stored, owner, plan: Plan, mesh: Mesh) -> None:
    where = f"node {node.name!r} ({node.target}" + (
        f", module {module_path(node)!r})" if module_path(node) else ")"
    )
    strategy = here.strategy
    inputs = tensor_inputs(node)
    if len(strategy.inputs) != len(inputs):
        raise PlanError(
            f"{where}: the plan gives {len(strategy.inputs)} input layouts for {len(inputs)} inputs"
        )
    if here.shape and here.shape != _shape(node):
        raise PlanError(f"{where}: the plan's shape {list(here.shape)} is not {list(_shape(node))}")
    for i, inp in enumerate(inputs):
        _divides(strategy.inputs[i], _shape(inp), f"{where} input {i} ({inp.name!r})", mesh)
    if here.shape:
        _divides(strategy.stored, here.shape, f"{where} stored", mesh)
        _follow(strategy.output, here.output_steps, strategy.stored, mesh, f"{where} output")
    first_use = []
    for i, inp in enumerate(inputs):
        if inp.op == "get_attr" and inp not in owner:
            owner[inp] = node.name
            first_use.append(i)
            if strategy.storage_for(i).normalized(mesh) != stored[inp].normalized(mesh):
                raise PlanError(
                    f"{where}: parameter {inp.target!r} is stored as {stored[inp]}, not as its "
                    f"first user stores it ({strategy.storage_for(i)}); {_AGAIN}"
                )
        src = stored[inp]
        _follow(
            src, here.input_steps[i], strategy.inputs[i], mesh, f"{where} input {i} ({inp.name!r})"
        )
    _check_rule(node, here, inputs, stored, first_use, mesh, where)


def _undescribed(strategy: Strategy) -> Strategy:
    """`strategy` without its detail, which describes it and changes nothing that runs:
    it names axes in the order the planner listed the mesh's (planned on a relabeled
    mesh, a size-1 axis is named in another place)."""
    return dataclasses.replace(strategy, detail="")


def _check_rule(node, here: NodePlan, inputs, stored, first_use, mesh: Mesh, where: str) -> None:
    """The strategy must be one the op's rule proposes, from the layouts its inputs are
    stored in or (a value converted on its way in) the ones it reads them in."""
    strategy = _undescribed(dataclasses.replace(here.strategy, regather=()))
    seen = [None if i in first_use else stored[inp] for i, inp in enumerate(inputs)]
    read = [None if i in first_use else here.strategy.inputs[i] for i in range(len(inputs))]
    # A block is planned with the values entering it in layouts the joined plan may
    # store otherwise (converting them on the way in): a rule that follows its input
    # (a split cutting its pieces over the axes its input arrived split on) was then
    # given what it stores.
    kept = here.strategy.stored
    arrived = [
        kept if r is not None and isinstance(kept, Layout) and kept.ndim == r.ndim else r
        for r in read
    ]
    # The family the node was planned under is not recorded (rules name their own,
    # "follow"): any family whose candidates hold the strategy will do.
    families = dict.fromkeys((here.strategy.family, *FAMILIES))
    tries = ((layouts, family) for layouts in (seen, read, arrived) for family in families)
    for layouts, family in tries:
        ctx = Context(node, mesh, inputs, layouts, family)
        proposed = _candidates(ctx, mesh)[0] + replicated_fallback(ctx)
        if strategy in map(_undescribed, proposed):
            break
    else:
        raise PlanError(
            f"{where}: its strategy ({here.strategy.family} {here.strategy.detail}, inputs "
            f"{', '.join(map(str, here.strategy.inputs))}, stored {here.strategy.stored}) is not "
            f"one the rule for {node.target} proposes: the plan was edited by hand or made by "
            f"another autoshard; {_AGAIN}"
        )
    if here.strategy.regather:
        expected = _regathered(node, dataclasses.replace(here, strategy=strategy)).strategy.regather
        if here.strategy.regather != expected:
            raise PlanError(
                f"{where}: regathers inputs {list(here.strategy.regather)}; only {list(expected)} "
                f"arrive by an all-gather and are kept for backward; {_AGAIN}"
            )


def _divides(layout: Layout, shape, what: str, mesh: Mesh) -> None:
    if layout.ndim != len(shape):
        raise PlanError(f"{what}: layout {layout} has {layout.ndim} dims, the tensor {list(shape)}")
    problem = layout.indivisible(shape, mesh)
    if problem:
        raise PlanError(f"{what}: layout {layout} cannot split {list(shape)}: {problem}; {_AGAIN}")


def _follow(src: Layout, steps: tuple[Step, ...], dst: Layout, mesh: Mesh, what: str) -> None:
    """The steps must turn `src` into `dst` (what each collective does to a layout)."""
    dims = [list(axes) for axes in src.normalized(mesh).dims]
    partial = set(src.normalized(mesh).partial)
    for step in steps:
        if mesh.size(step.axis) == 1:
            continue
        bad = step.dim is not None and not 0 <= step.dim < len(dims)
        if step.kind == "all_gather":
            bad = bad or step.dim is None or not dims[step.dim] or dims[step.dim][-1] != step.axis
            if not bad:
                dims[step.dim].pop()
        elif step.kind in ("split", "reduce_scatter"):
            used = any(step.axis in d for d in dims)
            bad = (
                bad
                or step.dim is None
                or used
                or (step.kind == "reduce_scatter") != (step.axis in partial)
            )
            if not bad:
                partial.discard(step.axis)
                dims[step.dim].append(step.axis)
        elif step.kind == "all_reduce":
            bad = bad or step.axis not in partial
            partial.discard(step.axis)
        elif step.kind == "to_partial":
            bad = bad or step.axis in partial
            partial.add(step.axis)
        if bad:
            raise PlanError(f"{what}: step {step} does not apply to the layout it meets; {_AGAIN}")
    result = Layout(tuple(map(tuple, dims)), tuple(sorted(partial)))
    if result != dst.normalized(mesh):
        raise PlanError(f"{what}: its steps make {result}, not the {dst} it needs; {_AGAIN}")
