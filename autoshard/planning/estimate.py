"""What a plan costs per rank and per step: time and peak memory, from the cost model.

    cost = estimate(traced, plan, Hardware.load("nvlink-8"))
    cost.step_time, cost.peak_memory, cost.communication  # seconds, bytes, seconds per axis

Time is the sum over nodes of forward and backward compute and collectives,
plus, for nodes in a recomputed region, their forward compute and
collectives once more, plus the latency of each gradient-bucket call (a
bucket's bandwidth is priced with the gradients it reduces), less what of the
buckets' reductions runs while other work does (`autoshard.planning.overlap`).

Memory follows the step unit by unit (`autoshard.planning.units`): parameters with
their gradients and optimizer state live throughout; each unit keeps what
it saves for backward (a recomputed unit only its inputs) from its forward
until its own backward, so while node k of unit u runs — forward, or backward
after every later unit has freed its activations — the rank holds

    parameters + returned + Σ kept[v < u] + high[u] − saved[u, > k] + transient[k]

where high[u] is u's own saved activations (for a recomputed unit, its
inputs plus everything its replay saves again) and the gradient of its
inputs; saved[u, > k] what u's nodes after k save, which they have not saved
yet in forward and have freed in backward before k's backward runs (a replay
saves all of them before backward starts: the last node's term); and
transient[k] the buffers k holds only while it runs (gathered operands,
unreduced results, their gradients); returned is the program's outputs, whole,
which the caller holds through backward (`returned_bytes`; in forward, where they
are not made yet, an upper bound). The peak is the largest of these.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from autoshard.cost.hardware import Hardware
from autoshard.cost.model import (
    Cost,
    NodeCost,
    bucket_latency,
    node_costs,
    parameter_bytes,
    returned_bytes,
    storage_node,
    stored_bytes,
)
from autoshard.planning.collectives import dtype_name
from autoshard.planning.overlap import overlapped
from autoshard.planning.plan import Plan
from autoshard.planning.units import kept_resident, units_of
from autoshard.tracing.trace import Traced, tensor_inputs


@dataclass(frozen=True)
class Totals:
    """The costs of a set of nodes (a block, a region, the whole plan)."""

    compute: float
    forward: float  # forward compute and collectives: what a recomputation replays
    comm: dict[str, float]
    saved: int
    params: int
    entry: int  # bytes of the activations that enter the set from outside
    transients: tuple[int, ...]  # per node of the set, in order: its transient buffers
    # per node, in order: the bytes of `saved` first kept there (a value several
    # nodes keep, at the first); they add up to `saved`
    saved_at: tuple[int, ...]
    entering_at: tuple[int, ...]  # of those, the bytes of values from outside the set
    resident: int = 0  # bytes of what it makes that many units read (see `totals`)
    # in `saved`: values kept once, by name: (name, bytes, position of the first keeper)
    kept_as_stored: tuple[tuple[str, int, int], ...] = ()
    # bytes of parameter gradients that gradient buckets reduce, per (axis, dtype)
    bucketed: tuple[tuple[tuple[str, str], int], ...] = ()

    @property
    def time(self) -> float:
        return self.compute + sum(self.comm.values())

    @functools.cached_property
    def replayed_at(self) -> tuple[int, ...]:
        """Per node, what a replay of the set saves again there: all but what enters
        (`own_memory` asks for it once per knob of the set)."""
        return tuple(s - e for s, e in zip(self.saved_at, self.entering_at))


def totals(
    traced: Traced,
    plan: Plan,
    costs: Mapping[str, NodeCost],
    names,
    optimizer: float,
    first_users: dict[str, str],
    resident: frozenset[str] = frozenset(),
) -> Totals:
    """Sum the costs of the nodes `names`; a parameter counts with its first user
    (`first_users`: FQN → node name, from `first_users`). An activation many units
    read (`resident`: storage names, from `kept_resident`) counts once, with the
    set that makes it, for as long as the step runs; not where it is read."""
    names = list(dict.fromkeys(names))  # ordered: float sums must not depend on hashing
    members = set(names)
    graph = traced.nodes
    compute = forward = 0.0
    comm: dict[str, float] = defaultdict(float)
    saved = params = 0
    saved_at = [0] * len(names)
    first_kept: dict[str, int] = {}  # value kept as stored → the first node keeping it
    entering: dict[str, int] = {}  # storage → bytes: views of one tensor enter once
    shared: dict[str, int] = {}  # values kept as they are stored: once, whoever keeps them
    bucketed: dict[tuple[str, str], int] = defaultdict(int)
    owned: dict[str, None] = {}  # the parameters whose first user is one of `names`
    for position, name in enumerate(names):
        cost = costs[name]
        inputs = tensor_inputs(graph[name])
        for i, step in plan.bucketed_steps(plan.nodes[name]):
            bucketed[step.axis, dtype_name(inputs[i])] += step.nbytes
        compute += cost.forward_compute + cost.backward_compute
        forward += cost.forward_compute + sum(cost.forward_comm.values())
        for axis, seconds in [*cost.forward_comm.items(), *cost.backward_comm.items()]:
            comm[axis] += seconds
        saved += cost.saved_bytes
        saved_at[position] += cost.saved_bytes
        shared.update(cost.shared)
        for value in cost.shared:
            first_kept.setdefault(value, position)
        for inp in inputs:
            if inp.op == "get_attr":
                if first_users.get(inp.target) == name:
                    owned[inp.target] = None
            elif inp.name not in members:
                storage = storage_node(inp, plan)
                if storage.name not in resident and storage.name not in members:
                    entering[storage.name] = stored_bytes(storage, plan)
    once = tuple((v, b, first_kept[v]) for v, b in shared.items() if v not in resident)
    saved += sum(b for _, b, _ in once)
    entering_at = [0] * len(names)
    for value, nbytes, position in once:
        saved_at[position] += nbytes
        if value in entering:
            entering_at[position] += nbytes
    for fqn in owned:
        tensor = traced.parameters[fqn]
        numel = math.prod(plan.storage[fqn].local_shape(tuple(tensor.shape), plan.mesh))
        # Buffers and frozen parameters: the tensor alone, no gradient, no optimizer state.
        multiplier = optimizer if tensor.requires_grad else -1.0
        params += int(parameter_bytes(numel, tensor.element_size(), multiplier))
    made = sum(stored_bytes(graph[value], plan) for value in resident if value in members)
    return Totals(
        compute,
        forward,
        dict(comm),
        saved,
        params,
        sum(entering.values()),
        tuple(costs[name].transient_bytes for name in names),
        tuple(saved_at),
        tuple(entering_at),
        made,
        once,
        tuple(sorted(bucketed.items())),
    )


def first_users(traced: Traced, plan: Plan) -> dict[str, str]:
    """Parameter FQN → the name of the first node that uses it."""
    first: dict[str, str] = {}
    for node in traced.graph_module.graph.nodes:
        if node.name in plan.nodes:
            for inp in tensor_inputs(node):
                if inp.op == "get_attr":
                    first.setdefault(inp.target, node.name)
    return first


def own_memory(total: Totals, recomputed: bool) -> tuple[int, int, tuple[int, ...]]:
    """What a unit keeps from its forward to its backward, what it holds of its own
    while it runs, its transient buffers aside (see the module docstring), and of
    that, per node, the saved bytes first kept there: its saved activations, and the
    gradient of what enters it, which grows while its backward runs; a recomputed
    unit also holds its inputs, and replays the rest (what the replay keeps of its
    inputs is the very tensors it holds already)."""
    if recomputed:
        kept = total.entry + total.resident
        return kept, kept + total.entry + total.saved - sum(total.entering_at), total.replayed_at
    kept = total.saved + total.resident
    return kept, kept + total.entry, total.saved_at


def running_high(own: float, saved_at: Sequence[float], transients: Sequence[float]) -> float:
    """The most a unit holds of its own while one of its nodes runs (the module
    docstring's high[u] − saved[u, > k] + transient[k] over its nodes k): `own` from
    `own_memory`, `saved_at` and `transients` per node, in order."""
    after, high = 0.0, -math.inf
    for saved, transient in zip(reversed(saved_at), reversed(transients)):
        high = max(high, own - after + transient)
        after += saved
    return high


def estimate(traced: Traced, plan: Plan, hardware: Hardware, optimizer: float = 2.0) -> Cost:
    """The plan's cost (see the module docstring)."""
    costs = node_costs(traced, plan, hardware)
    users = first_users(traced, plan)
    members: dict[str, list[str]] = defaultdict(list)
    units = units_of(traced, plan)
    for name, unit in units.items():
        members[unit].append(name)
    resident = kept_resident(traced, plan, units, costs)
    whole = totals(traced, plan, costs, list(plan.nodes), optimizer, users)
    comm = dict(whole.comm)
    for axis, seconds in costs["output"].forward_comm.items():
        comm[axis] = comm.get(axis, 0.0) + seconds
    for bucket in plan.buckets:  # each call's latency; its bandwidth is in the nodes'
        latency = len(bucket.calls) * bucket_latency(bucket.axis, plan.mesh, hardware)
        comm[bucket.axis] = comm.get(bucket.axis, 0.0) + latency
    recompute = 0.0
    held = peak = 0
    returned = returned_bytes(traced.graph_module.graph)
    for names in members.values():
        total = totals(traced, plan, costs, names, optimizer, users, resident)
        recomputed = any(name in plan.regions for name in names)
        recompute += total.forward if recomputed else 0.0
        kept, own, saved_at = own_memory(total, recomputed)
        high = running_high(own, saved_at, total.transients)
        peak = max(peak, int(whole.params + returned + held + high))
        held += kept
    hidden = overlapped(plan, costs, hardware)
    return Cost(
        step_time=whole.compute + recompute + sum(comm.values()) - hidden,
        peak_memory=int(peak),
        compute=whole.compute,
        recompute=recompute,
        communication=comm,
        overlapped=hidden,
    )
