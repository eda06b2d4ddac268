"""The whole-model policy planner: one strategy per node, chosen in graph order.

The user names a family per module (``"3d"``, ``"3d-allreduce"``,
``"replicated"``, ``"megatron"``, ``"dp"``, …, or a dict from module-path
patterns to those); each linear takes the candidate of its family that costs
the least communication given how its input is stored (under ``"megatron"``,
Megatron's own roles), and every other op follows its inputs. Parameters
are stored the way their first consumer wants them, and one that several nodes
read (a tied table) in the nesting that moves the least over all of them
(`_tied_stored_best`); inputs arrive whole on
every rank and are split on entry the way the first 3D linear reads them.

    >>> from autoshard.tracing.trace import trace
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    >>> traced = trace(model, (torch.randn(8, 16),))
    >>> plan = plan_graph(traced, Mesh.from_shape((2, 2, 2)), "3d")
    >>> plan.nodes["linear"].strategy.detail
    'M=a K=c N=b'
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import itertools
import math
import operator
import warnings
from dataclasses import dataclass

import torch
from torch import fx

from autoshard.errors import ShapeError, StrategyError
from autoshard.layout import Layout, redistribute, steps_ring_bytes
from autoshard.mesh import Mesh
from autoshard.planning.plan import NodePlan, Plan
from autoshard.planning.units import unit_of
from autoshard.strategies import (
    FAMILIES,
    NAMED,
    Context,
    Strategy,
    Unclaimed,
    all_reduces,
    batch_dims,
    entry_for,
    is_tensor,
    parallel_axes,
    replicated_fallback,
    rule_for,
)
from autoshard.strategies.inplace import leaves_read
from autoshard.tracing.storage import storage_written_by
from autoshard.tracing.trace import (
    Traced,
    differentiable,
    module_path,
    structure,
    tensor_inputs,
)


def check_strategy(strategy) -> None:
    names = [strategy] if isinstance(strategy, str) else list((strategy or {}).values())
    for name in names:
        if name not in FAMILIES:
            raise StrategyError(f"unknown strategy {name!r}: choose one of {', '.join(FAMILIES)}")


def check_patterns(traced: Traced, strategy) -> None:
    """Every module pattern of a strategy dict must match the module of some op: a
    misspelt pattern would otherwise leave its modules at the default silently."""
    if not isinstance(strategy, dict):
        return
    paths = {module_path(n) for n in traced.graph_module.graph.nodes if n.op == "call_function"}
    for pattern in strategy:
        if pattern == "*" or any(fnmatch.fnmatchcase(p, pattern) for p in paths):
            continue
        inner = sorted(p for p in paths if fnmatch.fnmatchcase(p, pattern + ".*"))
        hint = f"; it names a parent module: write {pattern + '.*'!r}" if inner else ""
        known = ", ".join(repr(p) for p in sorted(paths - {""})[:8]) or "none"
        raise StrategyError(
            f"strategy pattern {pattern!r} matches no module that runs an op{hint} "
            f"(module paths: {known}{', …' if len(paths) > 9 else ''})"
        )


def family_of(path: str, strategy) -> str:
    """The family the user asked for at module `path`."""
    if strategy is None:
        return "3d"
    if isinstance(strategy, str):
        return strategy
    for pattern, family in strategy.items():
        if fnmatch.fnmatchcase(path, pattern):
            return family
    return strategy.get("*", "3d")


def entry_layout(val: torch.Tensor, family: str, mesh: Mesh) -> Layout:
    """How a model input is split on entry: tokens over the M (and N) axes, features over K,
    as the first linear of `family` reads it with roles M=a, K=c, N=b. Under "dp" and
    "megatron", every token dim (an id's, a float input's all but the features) over the
    data-parallel axes, batch first: each rank reads only its share of the batch."""
    if family in NAMED:
        data, _ = parallel_axes(family, mesh)
        tokens = max(val.ndim - 1, 0) if val.dtype.is_floating_point else val.ndim
        split = batch_dims(tuple(val.shape[:tokens]), data, mesh)
        return Layout(split + ((),) * (val.ndim - tokens)).normalized(mesh)
    if family == "replicated" or val.ndim < 2 or not val.dtype.is_floating_point:
        return Layout.replicated(val.ndim)
    a, b, c = mesh.names
    token_axes = (a,) if family.endswith("allreduce") else (a, b)
    dims = [list(d) for d in batch_dims(tuple(val.shape[:-1]), token_axes, mesh)] + [[]]
    if val.shape[-1] % mesh.size(c) == 0:
        dims[-1].append(c)
    return Layout(tuple(tuple(d) for d in dims)).normalized(mesh)


@dataclass(frozen=True)
class Knobs:
    """A layer's own choices, apart from its layouts (its two knobs): store the
    weight split over the M axes too (True) or kept whole over them (False), None for
    the family's default; and save the input as the stored shard, gathered again in
    backward, instead of the gathered operand."""

    split_weight: bool | None = None
    regather: bool = False


_DEFAULT_KNOBS = Knobs()


def default_split(family: str) -> bool:
    return not all_reduces(family)


def _itemsize(node: fx.Node) -> int:
    return node.meta["val"].element_size()


def _shape(node: fx.Node) -> tuple[int, ...]:
    return tuple(node.meta["val"].shape)


def _describe(node: fx.Node) -> str:
    path = module_path(node)
    return f"node '{node.name}' ({node.target}" + (f", module '{path}')" if path else ")")


def plan_graph(
    traced: Traced,
    mesh: Mesh,
    strategy=None,
    *,
    order: tuple[str, ...] | None = None,
    knobs: dict[str, Knobs] | None = None,
    fixed: dict[str, Strategy] | None = None,
    inputs: dict[str, Layout] | None = None,
    fallback: bool = False,
) -> Plan:
    """Plan every node.

    - `order`: the mesh axes in the order the planner prefers them (for roles
      that cost the same, the first axis takes M, the next N, the last K);
      default the mesh's own. The solver plans each family in every order that
      costs differently (`autoshard.planning.solver.orientations`).
    - `knobs` (node name → Knobs): a layer's knobs.
    - `fixed` (node name → Strategy): take this strategy for the node (its knobs
      still turn it); `inputs` (placeholder → layout): how model inputs are split on
      entry. The solver assembles its plan from these: each node as it is in the
      plan of its part's family and orientation (`solver.plan_choice`).
    - `fallback`: a node that no layout of its family divides takes the next family
      that fits ("3d" → "3d-allreduce" → "replicated"), noted in `Plan.fallbacks`;
      without it (a family the user forced) that node is a ShapeError.
    """
    check_strategy(strategy)
    check_patterns(traced, strategy)
    args = (traced, mesh, strategy, order, knobs, fixed, inputs, fallback)
    plan = _planned(*args, stored_as={})
    if fixed:  # every node's strategy is given, and with it where it wants each parameter
        return plan
    return _tied_stored_best(plan, traced, lambda stored_as: _planned(*args, stored_as=stored_as))


def _tied_stored_best(plan: Plan, traced: Traced, replan) -> Plan:
    """`plan`, or the plan with a parameter that several nodes read (a tied embedding
    and lm-head) stored otherwise, where that moves fewer bytes (then fewer calls).

    A parameter is stored as its first reader wants it, which cannot see what a later
    reader will want: the GPT example's table is stored with its rows split over a then
    b, which an lm-head whose output features are split over b reads only with its input
    gathered over b and a and split over b again (two calls a step more). Its other
    storages tried are the same shards nested in another order (each rank keeps as
    much): `replan(stored_as)` plans the model with parameter FQN → layout given, which
    every reader, the first included, converts from. Only a plan whose first reader's
    strategy stores the parameter so is taken: a parameter is stored as its first
    reader's strategy says (`check_plan`), and the solver's plan, which takes each
    node's strategy from such plans, stores it so (`plan_choice`)."""
    alternatives = _tied_alternatives(traced, plan)
    if not alternatives:
        return plan
    best, best_traffic = plan, _traffic(plan)
    for fqn, layouts in alternatives.items():
        for layout in layouts:
            with warnings.catch_warnings():  # the same nodes warn as in `plan`
                warnings.simplefilter("ignore")
                other = replan({fqn: layout})
            traffic = _traffic(other)
            if traffic < best_traffic and _stored_as_first_reader_says(traced, other, fqn):
                best, best_traffic = other, traffic
    return best


def _stored_as_first_reader_says(traced: Traced, plan: Plan, fqn: str) -> bool:
    """Whether the first node of `plan` that reads parameter `fqn` stores it as `plan`
    does (a feature-parallel lookup names one nesting of its table, whichever the
    table arrives in)."""
    for node in traced.graph_module.graph.nodes:
        if node.name not in plan.nodes:
            continue
        for i, inp in enumerate(tensor_inputs(node)):
            if inp.op == "get_attr" and inp.target == fqn:
                own = plan.nodes[node.name].strategy.storage_for(i).normalized(plan.mesh)
                return own == plan.storage[fqn].normalized(plan.mesh)
    return True


def _traffic(plan: Plan) -> tuple[float, int]:
    """Bytes a rank sends in a training step, then its collective calls."""
    calls = plan.predicted_calls()
    return sum(c.ring_bytes for c in calls), len(calls)


def _tied_alternatives(traced: Traced, plan: Plan) -> dict[str, list[Layout]]:
    """For each parameter that several planned nodes read, its stored layout's other
    nestings: each dim split over the same axes in another order."""
    out = {}
    for node in traced.graph_module.graph.nodes:
        if node.op != "get_attr" or sum(u.name in plan.nodes for u in node.users) < 2:
            continue
        stored = plan.storage.get(node.target)
        if stored is None:
            continue
        nestings = itertools.product(*(itertools.permutations(axes) for axes in stored.dims))
        layouts = [Layout(dims, stored.partial) for dims in nestings]
        if len(layouts) > 1:
            out[node.target] = [lay for lay in layouts if lay != stored]
    return out


def _planned(traced, mesh, strategy, order, knobs, fixed, inputs, fallback, *, stored_as) -> Plan:
    """`plan_graph`'s plan, with each parameter in `stored_as` (FQN → layout) stored so."""
    planning = mesh.relabeled(order) if order else mesh
    graph = traced.graph_module.graph
    default_family = (
        family_of("", strategy) if not isinstance(strategy, dict) else strategy.get("*", "3d")
    )
    fixed, knobs = fixed or {}, knobs or {}
    stored: dict[fx.Node, Layout] = {}
    needs_grad: dict[fx.Node, bool] = {}
    storage: dict[str, Layout] = {}
    entry_steps: dict[str, tuple] = {}
    nodes: dict[str, NodePlan] = {}
    notes: list[str] = []
    fallbacks: dict[str, str] = {}
    output_steps: tuple = ()
    placed_alike: dict[tuple, NodePlan] = {}  # `_context_key` → a node placed in that context
    # The fixed strategies, numbered by identity (`fixed` keeps them alive): the solver
    # gives identical blocks the very same objects, and numbers hash fast.
    fixed_number = {id(s): i for i, s in enumerate({id(s): s for s in fixed.values()}.values())}

    def place(node: fx.Node) -> None:
        nonlocal output_steps
        if node.op == "placeholder":
            val = node.meta["val"]
            entry = (inputs or {}).get(node.name) or entry_layout(val, default_family, planning)
            stored[node] = storage[node.name] = entry
            whole = Layout.replicated(val.ndim)
            entry_steps[node.name] = tuple(
                redistribute(whole, entry, tuple(val.shape), val.element_size(), mesh)
            )
            # An input that requires grad gets the serial gradient: every consumer reduces
            # the gradient it sends back (its input steps), and the entry split's
            # backward gathers the full gradient on every rank.
            needs_grad[node] = bool(val.requires_grad and differentiable(val))
        elif node.op == "get_attr":
            tensor = traced.parameters[node.target]
            needs_grad[node] = bool(tensor.requires_grad and differentiable(tensor))
            if node.target in stored_as:
                stored[node] = storage[node.target] = stored_as[node.target]
        elif node.op == "call_function" and node.target is operator.getitem:
            parent, index = node.args
            stored[node] = stored[parent][index]
            needs_grad[node] = needs_grad[parent]
        elif node.op == "call_function" and node.meta.get("val") is not None:
            operands = tensor_inputs(node)
            chosen = fixed.get(node.name)
            path = module_path(node)
            family = chosen.family if chosen else family_of(path, strategy)
            layouts = [stored.get(n) for n in operands]
            own = knobs.get(node.name, _DEFAULT_KNOBS)
            fixed_as = fixed_number.get(id(chosen)) if chosen is not None else None
            key = _context_key(node, family, layouts, operands, stored, needs_grad, own, fixed_as)
            template = placed_alike.get(key)
            if template is not None:
                nodes[node.name] = _reuse(
                    template, node, path, operands, stored, needs_grad, storage
                )
                return
            families = _fallbacks(family) if fallback and chosen is None else [family]
            for attempt, family in enumerate(families):
                ctx = Context(node, planning, operands, layouts, family)
                candidates, message = _candidates(ctx, mesh)
                last = attempt == len(families) - 1
                try:
                    if not last and candidates[0].detail == "no layout divides":
                        raise ShapeError(message)
                    nodes[node.name] = _place(
                        node, ctx, candidates, stored, needs_grad, storage, planning, own, chosen
                    )
                except ShapeError:
                    if last:
                        raise
                    continue
                if family != families[0]:  # fell back: say so, the note stays with the plan
                    fallbacks[node.name] = _fallback_message(ctx, families[0], mesh)
                    warnings.warn(fallbacks[node.name], stacklevel=4)
                elif message:
                    warnings.warn(message, stacklevel=4)
                    notes.append(message)
                elif key is not None:  # a warning names its node: no reuse
                    placed_alike[key] = nodes[node.name]
                break
        elif node.op == "output":
            for v in tensor_inputs(node):
                if v not in stored and v.op == "get_attr":  # only returned: stored whole
                    stored[v] = storage[v.target] = Layout.replicated(len(_shape(v)))
            output_steps = tuple(
                tuple(
                    redistribute(
                        stored[v], Layout.replicated(len(_shape(v))), _shape(v), _itemsize(v), mesh
                    )
                )
                for v in tensor_inputs(node)
            )

    # A stretch of a repeated block placed like an earlier one, from the same layouts
    # in, is copied from it whole (`_Run`): the 80 blocks of a deep model cost one.
    order, runs = _runs(traced)
    placed_runs: dict[tuple, tuple[int, tuple[fx.Node, ...]]] = {}
    position = 0
    while position < len(order):
        run = runs.get(position)
        if run is None:
            place(order[position])
            position += 1
            continue
        outside = tuple(order[i] for i in run.outside)
        key = (
            run.shape,
            tuple((stored.get(n), needs_grad.get(n), n in stored) for n in outside),
            tuple(
                (
                    fixed_number.get(id(fixed.get(n.name))),
                    knobs.get(n.name),
                    family_of(path, strategy),
                )
                for n, path in zip(order[position : run.end], run.paths)
            ),
        )
        template = placed_runs.get(key)
        if template is not None:
            first, read = template
            for offset, node in enumerate(order[position : run.end]):
                alike = order[first + offset]
                if alike in stored:
                    stored[node], needs_grad[node] = stored[alike], needs_grad[alike]
                if alike.name in nodes:
                    nodes[node.name] = nodes[alike.name].renamed(node.name, run.paths[offset])
            for node, alike in zip(outside, read):  # parameters stored on first use
                if node not in stored and alike in stored:
                    stored[node] = storage[node.target] = stored[alike]
        else:
            before = (len(notes), len(fallbacks))
            for node in order[position : run.end]:
                place(node)
            if (len(notes), len(fallbacks)) == before:  # a warning names its node: no copies
                placed_runs[key] = (position, outside)
        position = run.end
    _localize(graph, nodes, stored, planning, mesh)
    return Plan(mesh, nodes, storage, entry_steps, output_steps, notes, fallbacks=fallbacks)


@dataclass(frozen=True)
class _Run:
    """A stretch of consecutive nodes traced in one repeated block (`unit_of`), none
    of which updates a tensor in place. Runs of equal `shape` compute the same ops
    (`structure`) wired alike: each reads, at the same places, its own earlier nodes
    or the nodes outside it (`outside`, positions in the graph, in order of first
    read), so given those laid out alike, they are planned alike."""

    end: int  # position after its last node
    shape: int
    outside: tuple[int, ...]
    paths: tuple[str, ...]  # `module_path` of each node


def _runs(traced: Traced) -> tuple[list[fx.Node], dict[int, _Run]]:
    """The graph's nodes in order, and its runs by the position of their first node;
    found once per graph."""
    meta = traced.graph_module.meta
    known = meta.get("autoshard_runs")
    if known is not None and len(known[0]) == len(traced.nodes):
        return known
    order = list(traced.graph_module.graph.nodes)
    position = _positions(traced)
    blocks = [_block(node) for node in order]
    shapes: dict[tuple, int] = {}
    runs: dict[int, _Run] = {}
    start = 0
    while start < len(order):
        end = start + 1
        while end < len(order) and blocks[end] and blocks[end] == blocks[start]:
            end += 1
        if blocks[start] and not any(_mutates(n.target) for n in order[start:end]):
            shape, outside = _wiring(order[start:end], position)
            paths = tuple(module_path(n) for n in order[start:end])
            runs[start] = _Run(end, shapes.setdefault(shape, len(shapes)), outside, paths)
        start = end
    meta["autoshard_runs"] = (order, runs)
    return order, runs


def _wiring(run: list[fx.Node], position: dict[str, int]) -> tuple[tuple, tuple[int, ...]]:
    """What each node of `run` computes and where its inputs come from (its own earlier
    nodes by offset, the nodes outside by number); and the positions of those outside
    (`position`: node name → position, `_positions`)."""
    start = position[run[0].name]
    outside: dict[str, int] = {}  # a node outside → its number in this run

    def wire(n: fx.Node):
        if start <= position[n.name] < start + len(run):
            return position[n.name] - start
        return ("outside", outside.setdefault(n.name, len(outside)))

    shape = tuple((structure(n), tuple(wire(i) for i in n.all_input_nodes)) for n in run)
    return shape, tuple(position[name] for name in outside)


def _block(node: fx.Node) -> str:
    """The repeated block a call was traced in (a getitem: that of what it unpacks)."""
    if node.op != "call_function":
        return ""
    if node.target is operator.getitem:
        node = node.args[0]
    return unit_of(module_path(node))


def _localize(graph: fx.Graph, nodes: dict[str, NodePlan], stored, planning: Mesh, mesh) -> None:
    """Compute locally what every reader only slices: a replicated value without a
    gradient (a causal mask from `arange`s, comparisons and `expand`) whose readers
    all split it, free, to one layout is made in that layout instead, by its own
    rule on its inputs sliced alike; its inputs are then tried in turn. So no rank
    builds or keeps a global mask that every rank uses a slice of.

    Walks the graph backward, so a chain is localized from its readers up."""
    for node in reversed(graph.nodes):
        placed = nodes.get(node.name)
        if placed is None or placed.needs_grad or not is_tensor(node):
            continue
        if placed.strategy.stored.sharded_axes or placed.strategy.stored.partial:
            continue
        wanted = _sliced_by_all(node, nodes)
        if wanted is None:
            continue
        operands = tensor_inputs(node)
        if any(inp.op == "get_attr" for inp in operands):
            continue  # a parameter or buffer is stored as its first reader reads it
        out_shape = _shape(node)
        if any(len(_shape(inp)) > len(out_shape) for inp in operands):
            continue  # not a broadcast (a view flattening dims): no slice of it to align
        layouts = [
            _aligned(wanted, _shape(inp), out_shape).normalized(planning) for inp in operands
        ]
        ctx = Context(node, planning, operands, layouts, placed.strategy.family)
        try:
            candidates, message = _candidates(ctx, mesh)
        except (ShapeError, StrategyError):
            continue
        fits = [
            c
            for c in candidates
            if not message
            and c.stored == wanted
            and c.output == wanted
            and c.inputs == tuple(layouts)
        ]
        if not fits:
            continue
        strategy = fits[0]
        steps = tuple(
            tuple(redistribute(stored[inp], lay, _shape(inp), _itemsize(inp), mesh))
            for inp, lay in zip(operands, layouts)
        )
        if any(s.kind != "split" for chain in steps for s in chain):
            continue  # an input is sharded otherwise: slicing it here would move data
        nodes[node.name] = dataclasses.replace(
            placed,
            strategy=strategy,
            local_shape=strategy.stored.local_shape(out_shape, mesh),
            input_steps=steps,
            output_steps=(),
        )
        stored[node] = strategy.stored
        for user in (u for u in node.users if u.name in nodes):
            reader = nodes[user.name]
            reader.input_steps = tuple(
                () if inp is node else reader.input_steps[j]
                for j, inp in enumerate(tensor_inputs(user))
            )


def _sliced_by_all(node: fx.Node, nodes: dict[str, NodePlan]) -> Layout | None:
    """The layout every reader of `node` splits it to, with nothing but free local
    splits; None if any reader does something else, or they want different layouts."""
    wanted = set()
    for user in node.users:
        reader = nodes.get(user.name)
        if reader is None:
            if user.op == "call_function" and user.meta.get("val") is None:
                continue  # a check of the tensor's metadata, which reads no data
            return None
        for j, inp in enumerate(tensor_inputs(user)):
            if inp is not node:
                continue
            steps = reader.input_steps[j]
            if not steps or any(s.kind != "split" for s in steps):
                return None
            wanted.add(reader.strategy.inputs[j])
    return wanted.pop() if len(wanted) == 1 else None


def _aligned(out: Layout, shape, out_shape) -> Layout:
    """`out` as seen by an operand of `shape` broadcast to `out_shape` (no more dims than
    it): split where the operand has the output's size, whole where it broadcasts."""
    offset = len(out_shape) - len(shape)
    return Layout(
        tuple(
            out.dims[d + offset] if shape[d] == out_shape[d + offset] else ()
            for d in range(len(shape))
        )
    )


def _context_key(node, family, layouts, operands, stored, needs_grad, knobs, fixed_as):
    """Everything `_place` reads about `node`, without names: equal keys, equal
    placements (the blocks of a deep model are planned once). None for an op that
    updates a tensor in place, whose rule looks at the graph around it."""
    if _mutates(node.target):
        return None
    return (
        structure(node),
        family,
        tuple(layouts),
        tuple((needs_grad[n], n in stored) for n in operands),
        knobs,
        fixed_as,  # the number of the strategy `fixed` gives it
    )


@functools.cache
def _mutates(target) -> bool:
    schema = getattr(target, "_schema", None)
    return schema is not None and schema.is_mutable


def _reuse(template: NodePlan, node, path, operands, stored, needs_grad, storage) -> NodePlan:
    """`template` (placed in the same `_context_key`) as the plan of `node`, traced in
    module `path`, with the effects `_place` has: parameters stored on first use, the
    node's own layout."""
    strategy = template.strategy
    for i, inp in enumerate(operands):
        if inp not in stored:
            stored[inp] = strategy.storage_for(i)
            storage[inp.target] = stored[inp]
    needs_grad[node] = template.needs_grad
    stored[node] = strategy.outputs if not is_tensor(node) else strategy.stored
    return template.renamed(node.name, path)  # the same layouts and steps, shared


def replanned(traced: Traced, plan: Plan, name: str, knobs: Knobs) -> Plan:
    """`plan` with node `name` placed again under `knobs`, every other node as it was
    (the knobs change no layout): what turning a layer's knobs would cost."""
    node = traced.nodes[name]
    inputs = tensor_inputs(node)
    placed = plan.nodes[name]
    order = _positions(traced)
    stored: dict[fx.Node, Layout] = {}
    for inp in inputs:  # a parameter is stored as its first user wants it
        earlier = plan.nodes.get(inp.name)
        if earlier is not None:
            stored[inp] = earlier.strategy.stored
        elif inp.op == "call_function" and inp.target is operator.getitem:
            stored[inp] = plan.stored_layout(inp)  # one output of a node with several
        elif inp.op != "get_attr":
            stored[inp] = plan.storage[inp.name]
        elif min(order[user.name] for user in inp.users) < order[name]:
            stored[inp] = plan.storage[inp.target]
    needs_grad = dict(zip(inputs, placed.input_needs_grad))
    ctx = Context(node, plan.mesh, inputs, [stored.get(n) for n in inputs], placed.strategy.family)
    storage: dict[str, Layout] = {}
    candidates, _ = _candidates(ctx, plan.mesh)
    again = _place(
        node, ctx, candidates, stored, needs_grad, storage, plan.mesh, knobs, placed.strategy
    )
    return dataclasses.replace(
        plan, nodes={**plan.nodes, name: again}, storage={**plan.storage, **storage}
    )


def _positions(traced: Traced) -> dict[str, int]:
    """Node name → its position in the graph, computed once per graph."""
    meta = traced.graph_module.meta
    known = meta.get("autoshard_positions")
    if known is None or len(known) != len(traced.nodes):
        known = meta["autoshard_positions"] = {n: i for i, n in enumerate(traced.nodes)}
    return known


def _candidates(ctx: Context, mesh: Mesh) -> tuple[list[Strategy], str | None]:
    """The node's candidates, and the warning to give when it runs replicated because
    its op has no rule, its rule does not claim this call, or no layout divides."""
    node = ctx.node
    rule = rule_for(node.target)
    if rule is None:
        message = f"no rule for {node.target} ({_describe(node)}): it runs replicated"
        return replicated_fallback(ctx), message
    try:
        candidates = rule(ctx)
    except Unclaimed as reason:
        message = (
            f"{_describe(node)}: the rule for {node.target} does not handle {reason}: "
            "it runs replicated"
        )
        fallback = [
            dataclasses.replace(c, detail=f"not {reason}") for c in replicated_fallback(ctx)
        ]
        return fallback, message
    if candidates:
        return candidates, None
    # Kept under the asked family, so that a plan assembled from the solver's fixed
    # strategies asks the rule again and gives the warning again.
    fallback = [
        dataclasses.replace(c, family=ctx.family, detail="no layout divides")
        for c in replicated_fallback(ctx)
    ]
    return fallback, _no_fit_message(ctx, node, mesh)


def _input_steps(ctx: Context, strategy, stored, needs_grad, mesh) -> list[list]:
    steps = []
    for i, inp in enumerate(ctx.inputs):
        grad = strategy.grad_partial[i] if needs_grad[inp] else frozenset()
        src = ctx.layouts[i] or strategy.storage_for(i)
        steps.append(redistribute(src, strategy.inputs[i], _shape(inp), _itemsize(inp), mesh, grad))
    return steps


def _writes_a_gradient(node: fx.Node, needs_grad: dict[fx.Node, bool]) -> bool:
    """Whether what `node` writes in place (its operands after the first) needs grad: it
    is computed from an input or parameter that needs grad through no detach (a value
    entering a ``torch.no_grad()`` region is detached: an average kept in a buffer)."""
    written = list(tensor_inputs(node)[1:])
    return any(needs_grad.get(leaf) for leaf in leaves_read(written, past_detach=False))


def _place(
    node, ctx, candidates, stored, needs_grad, storage, mesh, knobs: Knobs, chosen=None
) -> NodePlan:
    """The node's plan: `chosen`, or else the candidate of its family's default weight
    storage that moves the fewest bytes; with `knobs` turned."""
    multi = not is_tensor(node)

    def cost(strategy) -> tuple[float, int]:
        """Bytes sent, then (to break ties) the elements this rank keeps."""
        steps = _input_steps(ctx, strategy, stored, needs_grad, mesh)
        sent = sum(steps_ring_bytes(s) for s in steps)
        if multi:
            return sent, 0
        out = redistribute(strategy.output, strategy.stored, _shape(node), _itemsize(node), mesh)
        kept = math.prod(strategy.stored.local_shape(_shape(node), mesh))
        return sent + steps_ring_bytes(out), kept

    if chosen is None:
        defaults = [c for c in candidates if c.split_weight in (None, default_split(c.family))]
        chosen = min(defaults or candidates, key=cost)
    strategy = _turn_knobs(dataclasses.replace(chosen, regather=()), candidates, knobs)
    for i, inp in enumerate(ctx.inputs):
        problem = strategy.inputs[i].indivisible(_shape(inp), mesh)
        if problem:
            raise ShapeError(f"{_describe(node)}: input '{inp.name}' {problem}; {_ADVICE}")
    problem = not multi and strategy.stored.indivisible(_shape(node), mesh)
    if problem:
        raise ShapeError(f"{_describe(node)}: output {problem}; {_ADVICE}")

    in_steps = _input_steps(ctx, strategy, stored, needs_grad, mesh)
    for i, inp in enumerate(ctx.inputs):
        if inp not in stored:
            stored[inp] = strategy.storage_for(i)
            storage[inp.target] = stored[inp]
    first = node.meta["val"][0] if multi else node.meta["val"]
    needs_grad[node] = any(needs_grad[n] for n in ctx.inputs) and differentiable(first)
    written = storage_written_by(node)
    if written and _writes_a_gradient(node, needs_grad):
        # the storage it updates needs grad from now on, as in autograd
        for shared in written:  # (``out = zeros(n, k); out[:, :h] = layer(x)``)
            if shared.op == "get_attr":
                raise StrategyError(
                    f"node '{node.name}' ({node.target}) writes a value that needs a gradient "
                    f"into buffer '{shared.target}' in place: the buffer would carry this "
                    "step's autograd graph into the next (the serial model's second backward "
                    "fails too). Write into a copy (h = buffer.clone(), then update h), or "
                    "detach the value"
                )
            needs_grad[shared] = True
    if multi:
        stored[node] = strategy.outputs
        out_steps, shape = [], ()
    else:
        stored[node] = strategy.stored
        shape = _shape(node)
        out_steps = redistribute(strategy.output, strategy.stored, shape, _itemsize(node), mesh)
    placed = NodePlan(
        name=node.name,
        op=str(node.target),
        module=module_path(node),
        shape=shape,
        local_shape=strategy.stored.local_shape(shape, mesh),
        strategy=strategy,
        input_steps=tuple(tuple(s) for s in in_steps),
        output_steps=tuple(out_steps),
        input_needs_grad=tuple(needs_grad[n] for n in ctx.inputs),
        needs_grad=needs_grad[node],
    )
    return _regathered(node, placed) if knobs.regather else placed


def can_regather(node: fx.Node) -> bool:
    """Whether the node's op can keep an input as its stored shard and gather it again
    in backward (its registry entry says so: `OpEntry.regathers`)."""
    entry = entry_for(node.target)
    return entry is not None and entry.regathers


def _regathered(node: fx.Node, placed: NodePlan) -> NodePlan:
    """`placed` with the saved-input knob on: each activation input that arrives
    through an all-gather, and that the node keeps for backward (a layer keeps it
    for its weight's gradient), is kept as its stored shard instead, where its op can
    (`can_regather`: an embedding's lookup cannot)."""
    inputs = tensor_inputs(node)
    weights = [g for inp, g in zip(inputs, placed.input_needs_grad) if inp.op == "get_attr"]
    regather = tuple(
        i
        for i, inp in enumerate(inputs)
        if any(weights)
        and placed.strategy.split_weight is not None
        and can_regather(node)
        and inp.op != "get_attr"
        and any(step.forward_collective == "all_gather" for step in placed.input_steps[i])
    )
    return dataclasses.replace(
        placed, strategy=dataclasses.replace(placed.strategy, regather=regather)
    )


def _turn_knobs(strategy, candidates, knobs: Knobs):
    """The candidate with `strategy`'s layouts and the weight storage `knobs` asks for."""
    if knobs.split_weight is None or strategy.split_weight in (None, knobs.split_weight):
        return strategy
    for c in candidates:
        same = (c.inputs, c.output, c.stored) == (strategy.inputs, strategy.output, strategy.stored)
        if same and c.split_weight == knobs.split_weight:
            return c
    return strategy


_ADVICE = (
    "use sizes divisible by the mesh axes that shard them, another mesh shape, "
    "or strategy 'replicated' for this module"
)


_NEXT_FAMILY = {
    "3d": "3d-allreduce",
    "any": "any-allreduce",
    "megatron": "dp",
    "3d-allreduce": "replicated",
    "any-allreduce": "replicated",
    "dp": "replicated",
}


def _fallbacks(family: str) -> list[str]:
    """`family`, then each family to try when it does not fit: "3d", "3d-allreduce", …"""
    out = [family]
    while out[-1] in _NEXT_FAMILY:
        out.append(_NEXT_FAMILY[out[-1]])
    return out


def _fallback_message(ctx: Context, asked: str, mesh: Mesh) -> str:
    shapes = ", ".join(f"{n.name}{list(_shape(n))}" for n in ctx.inputs)
    instead = "it runs replicated" if ctx.family == "replicated" else f"planned as {ctx.family!r}"
    return (
        f"{_describe(ctx.node)}: no {asked!r} layout on mesh {mesh} divides its tensors "
        f"({shapes}): {instead} instead"
    )


def _no_fit_message(ctx: Context, node: fx.Node, mesh: Mesh) -> str:
    shapes = ", ".join(f"{n.name}{list(_shape(n))}" for n in ctx.inputs)
    return (
        f"{_describe(node)}: no {ctx.family!r} layout on mesh {mesh} divides its tensors "
        f"({shapes}), so it runs replicated; to shard it, use sizes divisible by the mesh "
        "axes that shard them or another mesh shape"
    )


def inputs_planned_with_grad(traced: Traced, plan: Plan) -> dict[str, bool]:
    """For each model input (placeholder name), whether `plan` sends its gradient back
    exact: planned from an example input that requires grad, or read by no planned node
    (its gradient then comes straight from the gathered output)."""
    out = {}
    for node in traced.graph_module.graph.nodes:
        if node.op == "placeholder":
            flags = [
                plan.nodes[user.name].input_needs_grad[tensor_inputs(user).index(node)]
                for user in node.users
                if user.name in plan.nodes
            ]
            out[node.name] = all(flags)
    return out
