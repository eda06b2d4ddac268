"""Where the solver cuts a model into units: the parts of each repeated block, and
the rest of the model before the first block and after the last.

A unit takes one decision (its layout family, whether it is recomputed), and
memory is tracked unit by unit: what each keeps until its backward runs.

    >>> import torch
    >>> from torch import nn
    >>> from autoshard.mesh import Mesh
    >>> from autoshard.planning.planner import plan_graph
    >>> from autoshard.tracing.trace import trace
    >>> model = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3)))
    >>> traced = trace(model, (torch.randn(4, 8),))
    >>> units_of(traced, plan_graph(traced, Mesh.from_shape((2, 2, 2)), "3d"))["relu_1"]
    '1#1'
"""

from __future__ import annotations

import math
import operator
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import fx

from autoshard.cost.model import storage_of, views_input, views_of
from autoshard.planning.plan import Plan
from autoshard.strategies.inplace import runs_in_place
from autoshard.tracing.storage import operands_written, storage_owner
from autoshard.tracing.trace import Traced


def unit_of(path: str) -> str:
    """The repeated block a module path belongs to ('blocks.3' for 'blocks.3.attn.q'),
    or '' outside any: the unit a plan's decisions and checkpoint regions are made for."""
    parts = path.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ""


PROLOGUE, EPILOGUE = "<prologue>", "<epilogue>"


def in_block(unit: str) -> bool:
    """Whether a unit of `units_of` is a part of a repeated block."""
    return not unit.startswith("<")


def units_of(traced: Traced, plan: Plan) -> dict[str, str]:
    """Node name → its unit: a part of a repeated block, or for the rest of the model
    the prologue (before the first block), the epilogue (after the last) or what
    runs between two stacks of blocks (`<after encoder.block.5>`, an encoder's
    final norm): it runs, and keeps what it keeps, between them.

    A block is cut wherever one activation carries everything forward (after a
    transformer block's attention residual, say): its parts are `blocks.3#0`,
    `blocks.3#1`, each a unit of its own."""
    out, last_block = {}, ""
    blocks: dict[str, list[str]] = defaultdict(list)
    for node in plan.nodes.values():
        block = unit_of(node.module)
        last_block = block or last_block
        out[node.name] = block or (f"<after {last_block}>" if last_block else PROLOGUE)
        if block:
            blocks[block].append(node.name)
    for name, unit in out.items():
        if unit == f"<after {last_block}>":
            out[name] = EPILOGUE
    graph = traced.nodes
    broadcast = _read_by_many(traced, plan, {n: unit_of(p.module) for n, p in plan.nodes.items()})
    for block, names in blocks.items():
        parts = _parts(graph, names, broadcast)
        if len(parts) > 1:
            for i, part in enumerate(parts):
                for name in part:
                    out[name] = f"{block}#{i}"
    return out


def outlines(traced: Traced, names: Sequence[str]) -> bool:
    """Whether a unit's nodes (`names`, in graph order) can run as one region, replayed
    in backward: no node between its first and last depends on one of them and feeds
    another (a block applied twice, `h = h + blk(h)` in a loop: the second application
    reads what the first made through the residual sum between them)."""
    members = set(names)
    reading: set[str] = set()  # the nodes between them, not theirs, that read them
    node, last = traced.nodes[names[0]], traced.nodes[names[-1]]
    while node is not last:
        node = node.next
        reads = {a.name for a in node.all_input_nodes}
        parent = node.args[0] if node.target is operator.getitem else None
        if isinstance(parent, fx.Node) and parent.name in members:
            members.add(node.name)
        if node.name in members:
            if not reads.isdisjoint(reading):
                return False
        elif not reads.isdisjoint(members) or not reads.isdisjoint(reading):
            reading.add(node.name)
    return True


def updated_outside(traced: Traced, plan: Plan, names: Iterable[str]) -> str | None:
    """The first of `names` (a unit's nodes) that updates in place, and runs so, storage
    made outside them (a batch norm's running statistics, a counted buffer, a model
    input), in words; None if none does. Such a unit is never recomputed: a replay in
    backward would update that storage a second time, and autograd refuses to replay
    from an input changed since forward."""
    names = list(names)
    members = set(names)
    for name in names:
        node = traced.nodes[name]
        for written in operands_written(node):
            owner = storage_owner(written)
            if owner.name not in members and runs_in_place(node, plan):
                what = repr(owner.name)
                if owner.op == "get_attr":
                    kind = isinstance(traced.parameters[owner.target], torch.nn.Parameter)
                    what = f"{'parameter' if kind else 'buffer'} '{owner.target}'"
                return f"node '{name}' ({node.target}) updates {what} in place"
    return None


def resident_values(traced: Traced, plan: Plan, units: dict[str, str]) -> frozenset[str]:
    """The storage of every activation read in more than one unit besides its own
    (`units`: node → unit, from `units_of`): a causal mask, rotary tables, position
    ids. Such a tensor lives from where it is made until the backward of its first
    reader, nearly the whole step, and counts once (`autoshard.planning.estimate.totals`)."""
    storages = (storage_of(traced.nodes[v], plan) for v in _read_by_many(traced, plan, units))
    return frozenset(s for s in storages if s in plan.nodes)  # inputs count where they enter


def kept_resident(
    traced: Traced,
    plan: Plan,
    units: dict[str, str],
    costs: Mapping,
    recomputed: Iterable[str] | None = None,
) -> frozenset[str]:
    """The `resident_values` something keeps for backward (`costs`: `node_costs`): a
    node keeps it as it is stored (`NodeCost.shared`), or a recomputed unit reads it
    (a replay keeps its inputs; `recomputed`: the nodes of recomputed units, by
    default the plan's regions). Any other (a boolean mask that attention keeps only
    as the additive mask it makes) dies with its last reader's forward, and counts
    where it enters a unit."""
    resident = resident_values(traced, plan, units)
    replayed = set(plan.regions if recomputed is None else recomputed)
    kept = set()
    for storage in resident:
        # only a node that is one of its views, or reads one, can keep it
        views = views_of(traced.nodes[storage], plan)
        reads = [(value, user) for value in views for user in value.users]
        replayed_by_another = any(
            user.name in replayed and units.get(value.name) != units[user.name]
            for value, user in reads
        )
        if replayed_by_another or any(  # asked in turn: costing a node takes time
            node.name in plan.nodes and storage in costs[node.name].shared
            for node in views | {user for _, user in reads}
        ):
            kept.add(storage)
    return frozenset(kept)


def _read_by_many(traced: Traced, plan: Plan, units: dict[str, str]) -> set[str]:
    """Values read by nodes of two or more units other than the one that makes them."""
    readers: dict[str, set[str]] = defaultdict(set)
    for name in plan.nodes:
        for inp in traced.nodes[name].all_input_nodes:
            if inp.op != "get_attr" and units.get(inp.name) != units[name]:
                readers[inp.name].add(units[name])
    return {value for value, read_in in readers.items() if len(read_in) > 1}


def _parts(graph: dict, names: list[str], broadcast: set[str]) -> list[list[str]]:
    """`names` (a block's nodes, in order) cut after every node past which a single
    activation is live: produced in the block and used later, or entering the block
    and used by a later node of it. Parameters, and values that many blocks read
    (`broadcast`: they live throughout anyway), do not count. No part is only views
    of what enters it (a float32 model's no-op `x.to(float32)`): replayed, it would
    keep as its input the very tensor the next part keeps."""
    position = {name: i for i, name in enumerate(names)}
    last_use: dict[str, float] = {}  # value → position of its last use (inf: outside)
    for name in names:
        for inp in graph[name].all_input_nodes:
            if inp.op != "get_attr" and inp.name not in broadcast:
                last_use[inp.name] = max(last_use.get(inp.name, -1), position[name])
        if any(user.name not in position for user in graph[name].users):
            last_use[name] = math.inf
        else:
            last_use.setdefault(name, -1)
            for user in graph[name].users:
                last_use[name] = max(last_use[name], position[user.name])
    # live at j: a value produced at p ≤ j (or entering) whose last use is after j
    n = len(names)
    produced, entering = [0] * (n + 1), [0] * (n + 1)  # changes in the counts, per j
    for value, last in last_use.items():
        counts, first = (produced, position[value]) if value in position else (entering, 0)
        end = min(last, n)
        if first < end:
            counts[first] += 1
            counts[int(end)] -= 1
    parts, start, produced_live, entering_live = [], 0, 0, 0
    for j in range(n - 1):
        produced_live += produced[j]
        entering_live += entering[j]
        # a part that only views what enters it (a no-op cast) would keep it again
        if (
            produced_live == 1
            and entering_live == 0
            and not all(views_input(graph[name]) for name in names[start : j + 1])
        ):
            parts.append(names[start : j + 1])
            start = j + 1
    parts.append(names[start:])
    return parts
