"""Choose, per block part, a layout family and an order of the mesh axes for it,
whether to recompute it, and each layer's knobs: the minimum predicted step time
whose peak per-rank memory fits the budget.

The graph is cut into units (`autoshard.planning.units`): each repeated block
(``blocks.3``), cut again wherever one activation carries everything forward
(a transformer block's attention and MLP become ``blocks.3#0`` and
``blocks.3#1``), and the rest of the model before and after the blocks. Each
unit takes one option: a family (``"3d"``, ``"3d-allreduce"``,
``"replicated"``, …), for block parts whether it is a checkpoint region, and
per layer of the unit its two knobs — store the weight the other
way (split over M and gathered, or whole over M with its gradient
all-reduced) and save the input as its stored shard, gathered again in
backward. Where the mesh's axes differ (in size, or in their links), the
option also says in which order the family's roles take the axes
(`orientations`): a family in one order is a variant. A unit's cost under a
variant comes from planning the whole model in that variant once (identical
blocks are costed once); a knob's cost is the difference it makes to its
own layer, since no knob changes a layout. Two neighbouring units in
different variants also pay for converting what crosses between them.
Memory is tracked unit by unit (`autoshard.planning.estimate`): parameters P, then
each unit keeps kept[u] from its forward to its backward, and holds high[u]
of its own, less what its later nodes save, plus a node's transient buffers
while that node runs. Every plan
costed has its shared conversions and gradient buckets
(`autoshard.planning.collectives`): a conversion several layers of a unit share
is paid once, and knobs turned on all of them together may add what none adds
alone (j); the n[a] calls of bucket a (one axis, one dtype) are paid for the
whole step. The integer program HiGHS solves:

    minimize   Σ time·(x, z, s, j, e) + Σ α[a]·n[a]
    subject to Σ_o x[u, o] = 1                       one option per unit
               z[u, o, k] ≤ x[u, o]                  knob k only with its option
               Σ_g e[u, f, g] = y[u−1, f], Σ_f e = y[u, g]  neighbours in variants f, g
               s[u, o, v, p] ≥ z[u, o, k]            a value knobs k keep as stored, once
               j ≤ z[u, o, k] for each k of J,  j ≥ Σ_J z − |J| + 1   knobs J all on
               n[a]·BUCKET_BYTES ≥ Σ bucketed[a]·(x, z, j, e), n integer   calls per bucket
               P = Σ params·x + Σ params·z
               K[u] = K[u−1] + Σ kept·(x, z, s, j)   held from earlier units (s: its last p)
               H[u] = Σ high·(x, z, j, e)            what u holds of its own
               A[u, k] = A[u, k'] + Σ saved_(k, k']·(x, z, j, e)   saved after node k
               P + K[u−1] + H[u] − A[u, k] + rest_k·(x, z, s, e) ≤ peak ≤ budget − R
                                                     for each node k of u

where A[u, k] is what u's nodes after k save (not saved yet in forward, freed
in backward before k's runs; k' the next node with a row), and rest_k node
k's transient buffers under the option, knobs and crossings, and what it holds
of values kept once: exactly `estimate`'s maximum over the nodes, without a
column for it, less R, the program's outputs, which every choice holds alike. A
node's row is left out where another node's is at least as large in every column
(in a transformer block, most of them). Written so, most
columns are in H's row and one A row only, not in every node's (a third of
the nonzeros in LLaMA-3 70B's peak rows). A value knobs keep once counts from the first
of them that is on: s[p] ≥ z for each keeper at position p or before, one
column per position.

Here y[u, f] sums x over u's options of variant f. The e rows are written as
the coupling of two one-hot choices (e over every f and g, its sums over f and
over g equal to x and y): exact, and a far tighter relaxation than the three
rows each of the product; f and g run over classes of variants and options that
cross alike (`_crossing_classes`). `brute_force` enumerates every option and knob
setting, and the tests hold the two equal. The program counts a bucket's calls
from all its bytes; cut at block parts (`collectives._segments`), a big model's
buckets may make a call more per cut, which the plan's estimate counts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import math
import operator
from collections import ChainMap, defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
from highspy import HighsLp, HighsStatus, HighsVarType, MatrixFormat, kSolutionStatusFeasible
from highspy import _Highs as Highs  # see `_highs`
from scipy.sparse import coo_array
from torch import fx

from autoshard.cost.hardware import Hardware
from autoshard.cost.model import (
    NodeCost,
    NodeCosts,
    bucket_latency,
    may_view,
    node_cost,
    returned_bytes,
    storage_chain,
    storage_node,
    stored_bytes,
)
from autoshard.errors import BudgetError, StrategyError, human_bytes
from autoshard.mesh import Mesh
from autoshard.planning import plan as plan_module
from autoshard.planning.chunking import CHUNKS, chunkings
from autoshard.planning.collectives import share_collectives
from autoshard.planning.estimate import (
    Totals,
    estimate,
    first_users,
    own_memory,
    running_high,
    totals,
)
from autoshard.planning.options import PlanOptions
from autoshard.planning.paused_gc import paused_gc
from autoshard.planning.plan import ChunkedLoss, NodePlan, Plan, bucket_calls
from autoshard.planning.planner import (
    Knobs,
    can_regather,
    check_strategy,
    default_split,
    plan_graph,
    replanned,
)
from autoshard.planning.units import (
    EPILOGUE,
    in_block,
    kept_resident,
    outlines,
    units_of,
    updated_outside,
)
from autoshard.strategies import NAMED
from autoshard.tracing.trace import Traced, tensor_inputs

SPACES = {
    "3d": ("3d", "3d-allreduce", "replicated"),
    "all": ("3d", "3d-allreduce", "replicated", "any", "any-allreduce", "megatron", "dp"),
}

WHOLE_WEIGHT, SPLIT_WEIGHT, REGATHER = (
    "weight whole over M",
    "weight split over M",
    "input as shard",
)


@dataclass(frozen=True)
class Knob:
    """One layer's knob turned away from its family's default."""

    node: str
    kind: str  # WHOLE_WEIGHT | SPLIT_WEIGHT | REGATHER


@dataclass(frozen=True)
class Option:
    family: str
    checkpoint: bool
    knobs: frozenset[Knob] = frozenset()
    order: tuple[str, ...] = ()  # the mesh axes as the family's plan prefers them; () as given
    chunks: int = 1  # pieces its loss runs in over the tokens (`ChunkedLoss`)

    @property
    def base(self) -> Option:
        return Option(self.family, self.checkpoint, order=self.order, chunks=self.chunks)

    @property
    def variant(self) -> tuple[str, tuple[str, ...]]:
        """The plan this option's unit runs as: its family, in its order of the axes."""
        return self.family, self.order

    def __str__(self) -> str:
        kinds = sorted({k.kind for k in self.knobs})
        counted = [f"{kind} ×{sum(k.kind == kind for k in self.knobs)}" for kind in kinds]
        family = self.family + (f" ({','.join(self.order)})" if self.order else "")
        chunked = [f"loss in {self.chunks} chunks"] * (self.chunks > 1)
        return " + ".join([family] + ["recompute"] * self.checkpoint + chunked + counted)


Variant = tuple[str, tuple[str, ...]]


def orientations(mesh: Mesh, hardware: Hardware) -> list[tuple[str, ...]]:
    """One order of the mesh axes for each class of orders that cost differently; ()
    first, for the mesh's own. Axes of equal size over equal links are
    interchangeable: on a cube of identical links every order costs the same."""
    kind = {name: (mesh.size(name), hardware.link(i)) for i, name in enumerate(mesh.names)}
    seen, out = set(), []
    for order in itertools.permutations(mesh.names):
        key = tuple(kind[name] for name in order)
        if key not in seen:
            seen.add(key)
            out.append(() if order == mesh.names else order)
    return out


@dataclass(frozen=True)
class Effect:
    """What an option, or a knob on top of it, adds: seconds and bytes per rank."""

    time: float
    params: float  # parameters, gradients, optimizer state
    kept: float  # held from the unit's forward to its backward
    high: float  # the unit's own activations while it runs, transients aside
    # parameter-gradient bytes it puts in gradient buckets, per (axis, dtype): the
    # buckets' calls (their latency) are priced for the whole step, not per unit
    buckets: tuple[tuple[tuple[str, str], int], ...] = ()
    # of `high`, the saved bytes first kept at each node of the unit, by its position:
    # not held yet, or freed, while an earlier node runs (`estimate.running_high`)
    saved_at: tuple[tuple[int, float], ...] = ()

    def __sub__(self, other: Effect) -> Effect:
        return Effect(
            self.time - other.time,
            self.params - other.params,
            self.kept - other.kept,
            self.high - other.high,
            _sparse_difference(self.buckets, other.buckets),
            _sparse_difference(self.saved_at, other.saved_at),
        )


def _sparse_difference(after, before) -> tuple:
    """(key, number) pairs `after` less `before`, zeros left out."""
    out = defaultdict(int, after)
    for key, number in before:
        out[key] -= number
    return tuple(sorted((key, b) for key, b in out.items() if b))


def _sparse(per_position) -> tuple[tuple[int, float], ...]:
    """(position, number) of the numbers that are not 0."""
    return tuple((p, b) for p, b in enumerate(per_position) if b)


@dataclass(frozen=True)
class Crossing:
    """What a unit costs more when a source of its inputs (the unit that makes an
    activation it reads, or first uses a parameter it reads, or the first unit, which
    splits the model's inputs) runs in another variant: its nodes convert those
    inputs from the source's layouts, and keep and hold them at other sizes."""

    effect: Effect
    # node → change in its transient bytes, the node by its position in the unit:
    # identical blocks share one Crossing
    transient: dict[int, float]


@dataclass
class Problem:
    units: list[str]  # in graph order
    options: dict[str, list[Option]]  # per unit, knobs at their defaults
    effect: dict[tuple[str, Option], Effect]
    knobs: dict[tuple[str, Option], dict[Knob, Effect]]  # per unit and option
    transient: dict[tuple[str, Option], dict[str, float]]  # node → bytes, knobs at defaults
    knob_transient: dict[tuple[str, Option, Knob], float]  # the knob's node, knob on
    # What a unit adds in an option when one of its sources runs in another variant
    # (`Crossing`), by (unit, source, the source's variant, the unit's option).
    crossing: dict[tuple[str, str, Variant, Option], Crossing]
    sources: dict[str, tuple[str, ...]] = field(default_factory=dict)  # unit → its sources
    plans: dict[Variant, Plan] = field(default_factory=dict)  # the whole model in each variant
    unit: dict[str, str] = field(default_factory=dict)  # node name → unit
    # per variant, what many units read: counted once (`autoshard.planning.units.kept_resident`)
    resident: dict[Variant, frozenset[str]] = field(default_factory=dict)
    # Per unit and option, a value its knobs keep as stored (the shard that layers
    # regathering one input save): kept once if any of those knobs is on, from the
    # first of them on (the position of its node in the unit). Its bytes are not in
    # the knobs' effects but here, with the knobs that keep it.
    kept_once: dict[tuple[str, Option], dict[str, tuple[Effect, dict[Knob, int]]]] = field(
        default_factory=dict
    )
    # Per unit and option, what knobs add together beyond the sum of what each adds
    # alone: a conversion several layers share is run by none of them once all of
    # them keep their input as stored (q, k and v regathering one layer-norm output).
    joint: dict[tuple[str, Option], list[tuple[Effect, frozenset[Knob]]]] = field(
        default_factory=dict
    )
    # seconds of latency of one gradient-bucket call, per (axis, dtype)
    bucket_latency: dict[tuple[str, str], float] = field(default_factory=dict)
    # the loss an option with chunks runs in pieces, by (unit, variant, chunks)
    chunked: dict[tuple[str, Variant, int], ChunkedLoss] = field(default_factory=dict)
    returned: float = 0.0  # bytes of the outputs, held through backward (`returned_bytes`)

    def restricted(self, families: tuple[str, ...]) -> Problem:
        """This problem with only the options of `families`: what `build_problem`
        builds for them alone, without planning and costing the model again."""
        options = {u: [o for o in opts if o.family in families] for u, opts in self.options.items()}
        missing = sorted(u for u, opts in options.items() if not opts)
        if missing:
            raise StrategyError(
                f"{families} give unit {missing[0]!r} no option: the problem was built for "
                f"{sorted({o.family for opts in self.options.values() for o in opts})}"
            )
        return dataclasses.replace(self, options=options)

    def choices(self, unit: str) -> list[Option]:
        """Every option of `unit` with every setting of its knobs."""
        out = []
        for option in self.options[unit]:
            knobs = list(self.knobs[unit, option])
            for n in range(len(knobs) + 1):
                for chosen in itertools.combinations(knobs, n):
                    out.append(dataclasses.replace(option, knobs=frozenset(chosen)))
        return out

    def evaluate(self, choice: dict[str, Option]) -> tuple[float, float]:
        """(step time, peak memory) of a choice: the sums the integer program makes."""
        time = params = held = 0.0
        highs = []
        bucketed: dict[tuple[str, str], int] = defaultdict(int)
        for unit in self.units:
            option = choice[unit]
            base = option.base
            effects = [self.effect[unit, base]]
            effects += [self.knobs[unit, base][k] for k in sorted(option.knobs, key=str)]
            for effect, keepers in self.kept_once.get((unit, base), {}).values():
                if (kept := _kept_from_first(effect, keepers, option.knobs)) is not None:
                    effects.append(kept)
            for effect, together in self.joint.get((unit, base), []):
                if together <= option.knobs:
                    effects.append(effect)
            transient = dict(self.transient[unit, base])
            for knob in sorted(option.knobs, key=str):
                if (unit, base, knob) in self.knob_transient:
                    transient[knob.node] = self.knob_transient[unit, base, knob]
            transients = list(transient.values())
            for source in self.sources[unit]:
                crossing = self.crossing.get((unit, source, choice[source].variant, base))
                if crossing is not None:
                    effects.append(crossing.effect)
                    for position, delta in crossing.transient.items():
                        transients[position] += delta
            time += sum(e.time for e in effects)
            params += sum(e.params for e in effects)
            saved_at = [0.0] * len(transients)
            for effect in effects:
                for position, nbytes in effect.saved_at:
                    saved_at[position] += nbytes
            own = sum(e.high for e in effects)
            highs.append(held + running_high(own, saved_at, transients))
            held += sum(e.kept for e in effects)
            for effect in effects:
                for key, nbytes in effect.buckets:
                    bucketed[key] += nbytes
        for key, nbytes in sorted(bucketed.items()):
            time += self.bucket_latency[key] * bucket_calls(nbytes)
        return time, params + self.returned + max(highs)


@paused_gc
def build_problem(
    traced: Traced,
    mesh: Mesh,
    hardware: Hardware,
    families: tuple[str, ...],
    optimizer: float,
    fallback: bool = True,
    loss_chunks: int | None = None,
    gather_buckets: bool = True,
) -> Problem:
    """The integer program of the module docstring, for `families` in every order of
    the axes that costs differently (`orientations`); "replicated" and the named
    families ("megatron", "dp") in the mesh's own order only, so that Megatron's
    tensor-parallel axis is the one the user's mesh puts last. With `fallback`, a node
    that no layout of a family divides is planned in that family's plan by the next
    family that fits (`plan_graph`), so the family stays an option for every other
    unit. The unit after the blocks also takes, per variant, each way of running its
    loss over the tokens in pieces (`autoshard.planning.chunking`): only in
    `loss_chunks` pieces where that is given (1: never in pieces)."""
    orders = orientations(mesh, hardware)
    plans = {
        (family, order): plan_graph(traced, mesh, family, order=order or None, fallback=fallback)
        for family in families
        for order in (orders if family not in ("replicated", *NAMED) else [()])
    }
    unit = units_of(traced, plans[families[0], ()])
    for plan in plans.values():
        plan.gather_buckets = gather_buckets
    plans = {v: share_collectives(traced, plan, unit) for v, plan in plans.items()}
    units = list(dict.fromkeys(unit.values()))
    members: dict[str, list[str]] = defaultdict(list)
    for name, u in unit.items():
        members[u].append(name)
    # costed when read: the nodes of one block of each kind, not those of every block
    all_costs = {v: NodeCosts(traced, plan, hardware) for v, plan in plans.items()}
    # Which units the choice recomputes is not known here: a value that only a replay
    # would keep is priced as kept, once, whether or not one is chosen; otherwise a
    # recomputed unit would keep it again with its inputs, once per unit (LLaMA-3 70B's
    # 80 layers: 1.3 GiB). Where no unit that reads it is recomputed, the price is
    # that value's bytes above the plan's estimate.
    block_parts = [name for name, u in unit.items() if in_block(u)]
    resident = {
        v: kept_resident(traced, plan, unit, all_costs[v], block_parts) for v, plan in plans.items()
    }
    problem = Problem(units, {}, {}, {}, {}, {}, {}, {}, plans, unit, resident)
    problem.returned = returned_bytes(traced.graph_module.graph)
    known: dict[tuple, _UnitCost] = {}
    replayable = {
        u
        for u in units
        if in_block(u)
        and not updated_outside(traced, plans[families[0], ()], members[u])
        and outlines(traced, members[u])
    }
    signatures = _Signatures(traced, plans, members)
    users = first_users(traced, plans[families[0], ()])  # every variant plans every node
    for (family, order), plan in plans.items():
        counts = CHUNKS if loss_chunks is None else (loss_chunks,) * (loss_chunks > 1)
        pieces: list[ChunkedLoss | None] = [
            c for c in chunkings(traced, plan, counts) if {unit[n] for n in c.nodes} == {EPILOGUE}
        ]
        if loss_chunks in (None, 1) or not pieces:  # unchunked, where it must be
            pieces.insert(0, None)
        for u in units:
            for chunked in pieces if u == EPILOGUE else [None]:
                chunked_plan, costs = _chunked(
                    traced, plan, all_costs[family, order], chunked, hardware
                )
                key = (family, order, signatures[(family, order), u], chunked)
                if key not in known:  # identical blocks cost the same: cost them once
                    known[key] = _unit_cost(
                        traced,
                        chunked_plan,
                        members[u],
                        costs,
                        users,
                        hardware,
                        optimizer,
                        u == units[-1],
                        resident[family, order],
                        unit,
                    )
                cost = known[key]
                _add_options(problem, u, members[u], family, order, cost, u in replayable, chunked)
    _add_crossings(problem, traced, members, hardware, optimizer, all_costs, signatures)
    for effect in _all_effects(problem):
        for axis, dtype in dict(effect.buckets):
            problem.bucket_latency[axis, dtype] = bucket_latency(axis, mesh, hardware)
    return problem


def _chunked(
    traced: Traced,
    plan: Plan,
    costs: Mapping[str, NodeCost],
    chunked: ChunkedLoss | None,
    hardware,
) -> tuple[Plan, Mapping[str, NodeCost]]:
    """`plan` and its node `costs` with `chunked`'s loss run in pieces (as they are for
    None): only the nodes it cuts cost otherwise."""
    if chunked is None:
        return plan, costs
    plan = dataclasses.replace(plan, chunked=(chunked,))
    again = {n: node_cost(traced.nodes[n], plan.nodes[n], plan, hardware) for n in chunked.nodes}
    return plan, ChainMap(again, costs)


def _all_effects(problem: Problem):
    yield from problem.effect.values()
    for knobs in problem.knobs.values():
        yield from knobs.values()
    for crossing in problem.crossing.values():
        yield crossing.effect
    for terms in problem.joint.values():
        for effect, _ in terms:
            yield effect


@dataclass(frozen=True)
class _KnobCost:
    position: int  # of the layer among its unit's nodes
    kind: str  # "weight" (the other storage) | REGATHER
    before: Totals  # the layer as its family plans it
    after: Totals  # the layer with the knob turned
    transient: float | None  # the layer's transient bytes with a REGATHER knob turned
    # values the knob makes the unit keep as stored, once: bytes, the first keeper's position
    kept_once: dict[str, tuple[int, int]]


@dataclass(frozen=True)
class _UnitCost:
    total: Totals
    output: float  # seconds returning the model's outputs, for the last unit
    knobs: tuple[_KnobCost, ...]
    # per conversion that layers share, each of them with REGATHER on: (their
    # positions, the unit's totals then); see `Problem.joint`
    shared_regathered: tuple[tuple[frozenset[int], Totals], ...] = ()


def _unit_cost(
    traced, plan, names, costs, users, hardware, optimizer, last, resident, unit_of
) -> _UnitCost:
    """A unit's totals in `plan`, and with each knob of each of its layers turned (the
    whole unit costed again: a tensor the layer then keeps as stored may be one that
    another node of the unit keeps too, and counts once; a conversion it shared is
    then run by another reader)."""

    alike: dict = {}  # keyed by the identity of strategies and steps: keep their plans
    alive = []

    def turned_totals(turns: dict[str, Knobs]) -> tuple[Plan, Totals, dict[str, NodeCost]]:
        alt = plan
        for name, knobs in turns.items():
            alt = replanned(traced, alt, name, knobs)
        alt = share_collectives(traced, alt, unit_of, names)
        alive.append(alt)
        alt_costs = {
            n: node_cost(traced.nodes[n], alt.nodes[n], alt, hardware, alike=alike) for n in names
        }
        total = totals(traced, alt, ChainMap(alt_costs, costs), names, optimizer, users, resident)
        return alt, total, alt_costs

    knobs = []
    regathering = set()
    before = totals(traced, plan, costs, names, optimizer, users, resident)
    for position, name in enumerate(names):
        placed = plan.nodes[name]
        if placed.strategy.split_weight is None:
            continue  # not a layer
        other = Knobs(split_weight=not default_split(placed.strategy.family))
        turns = [("weight", other)]
        if can_regather(traced.nodes[name]):
            turns.append((REGATHER, Knobs(regather=True)))
        for kind, turned in turns:
            alt, after, alt_costs = turned_totals({name: turned})
            if alt.nodes[name] == placed:
                continue  # nothing to turn: no other storage, no gathered input
            transient = None
            if kind == REGATHER:
                regathering.add(name)
                transient = alt_costs[name].transient_bytes
            already = {v for v, _, _ in before.kept_as_stored}
            once = {v: (b, p) for v, b, p in after.kept_as_stored if v not in already}
            knobs.append(_KnobCost(position, kind, before, after, transient, once))
    position = {name: k for k, name in enumerate(names)}
    shared_regathered = []
    for readers in _sharing(plan, names):
        if len(readers) > 1 and readers <= regathering:
            _, after, _ = turned_totals({name: Knobs(regather=True) for name in sorted(readers)})
            shared_regathered.append((frozenset(position[n] for n in readers), after))
    return _UnitCost(
        before,
        sum(costs["output"].forward_comm.values()) if last else 0.0,
        tuple(knobs),
        tuple(shared_regathered),
    )


def _sharing(plan: Plan, names) -> list[frozenset[str]]:
    """The nodes among `names` that read each conversion several of them share."""
    members = set(names)
    readers: dict[tuple[str, int], set[str]] = defaultdict(set)
    for s in plan.shared:
        if s.node in members:
            readers[s.source, s.source_input] |= {s.node, s.source}
    return [frozenset(r) for _, r in sorted(readers.items())]


def _add_options(
    problem: Problem,
    u: str,
    names,
    family: str,
    order,
    cost: _UnitCost,
    replayable: bool,
    chunked: ChunkedLoss | None = None,
) -> None:
    """Unit `u`'s options in `family` and `order`, with or without recomputation (where
    it is `replayable`: block parts that update nothing made outside them), its loss run
    in pieces as `chunked` says, and the knobs worth having under each."""
    chunks = chunked.chunks if chunked is not None else 1
    if chunked is not None:
        problem.chunked[u, (family, order), chunks] = chunked
    for checkpoint in (False, True) if replayable else (False,):
        option = Option(family, checkpoint, order=order, chunks=chunks)
        problem.options.setdefault(u, []).append(option)
        total = cost.total
        kept, high, saved_at = own_memory(total, checkpoint)
        recompute = total.forward if checkpoint else 0.0
        problem.effect[u, option] = Effect(
            total.time + cost.output + recompute,
            total.params,
            kept,
            high,
            total.bucketed,
            _sparse(saved_at),
        )
        problem.transient[u, option] = dict(zip(names, total.transients))
        problem.knobs[u, option] = {}
        # layers that share a conversion may be worth turning only all together
        together = set()
        for positions, after in cost.shared_regathered:
            if not checkpoint and _worth_having(_difference(total, after, False), None, 0):
                together |= {Knob(names[k], REGATHER) for k in positions}
        for knob_cost in cost.knobs:
            if knob_cost.kind == REGATHER and checkpoint:
                continue  # a replayed region keeps nothing of its own anyway
            in_pieces = chunked is not None and names[knob_cost.position] in chunked.nodes
            if knob_cost.kind == REGATHER and in_pieces:
                continue  # a head run in pieces keeps its pieces of the gathered input
            kind = knob_cost.kind
            if kind == "weight":
                kind = WHOLE_WEIGHT if default_split(family) else SPLIT_WEIGHT
            knob = Knob(names[knob_cost.position], kind)
            effect = _difference(knob_cost.before, knob_cost.after, checkpoint)
            transient = knob_cost.transient
            worth = _worth_having(effect, transient, total.transients[knob_cost.position])
            if worth or knob in together:
                kept_once = problem.kept_once.setdefault((u, option), {})
                for value, (nbytes, position) in knob_cost.kept_once.items():
                    once = Effect(0.0, 0, 0 if checkpoint else nbytes, nbytes)
                    keepers = kept_once.get(value, (once, {}))[1]
                    kept_once[value] = (once, {**keepers, knob: position})
                    effect = effect - dataclasses.replace(once, saved_at=((position, nbytes),))
                problem.knobs[u, option][knob] = effect
                if transient is not None:
                    problem.knob_transient[u, option, knob] = transient
        if not checkpoint:
            _add_joint(problem, u, option, names, cost)


def _add_joint(problem: Problem, u: str, option: Option, names, cost: _UnitCost) -> None:
    """`Problem.joint` for `option`: for each conversion several layers share, what
    turning REGATHER on all of them costs beyond what the MILP sums for them."""
    knobs = problem.knobs[u, option]
    kept_once = problem.kept_once.get((u, option), {})
    for positions, after in cost.shared_regathered:
        together = frozenset(Knob(names[k], REGATHER) for k in positions)
        if not together <= set(knobs):
            continue  # a layer's knob not worth having: never all on
        summed = [knobs[k] for k in sorted(together, key=str)]
        summed += [
            kept
            for once, keepers in kept_once.values()
            if (kept := _kept_from_first(once, keepers, together)) is not None
        ]
        extra = _difference(cost.total, after, False)
        for effect in summed:
            extra = extra - effect
        problem.joint.setdefault((u, option), []).append((extra, together))


def _kept_from_first(once: Effect, keepers: dict[Knob, int], on) -> Effect | None:
    """A value knobs keep once (`Problem.kept_once`: its effect, and each keeper's
    position) with the knobs `on` turned: held from the first of them that keeps it,
    or None where none does."""
    first = min((p for knob, p in keepers.items() if knob in on), default=None)
    return None if first is None else dataclasses.replace(once, saved_at=((first, once.high),))


def _difference(before: Totals, after: Totals, checkpoint: bool) -> Effect:
    """What a unit costs more as `after` than as `before` (a knob turned, a source of
    its inputs in another variant); replayed, the forward is paid again."""
    kept, high, saved_at = own_memory(after, checkpoint)
    kept_before, high_before, saved_at_before = own_memory(before, checkpoint)
    time = after.time - before.time
    if checkpoint:
        time += after.forward - before.forward
    return Effect(
        time,
        after.params - before.params,
        kept - kept_before,
        high - high_before,
        _sparse_difference(after.bucketed, before.bucketed),
        tuple((p, b - a) for p, (b, a) in enumerate(zip(saved_at, saved_at_before)) if b != a),
    )


def _worth_having(effect: Effect, transient: float | None, transient_before: float) -> bool:
    """A knob that costs time and saves no memory is never chosen; leave it out."""
    smaller_transient = transient is not None and transient < transient_before
    saves = min(effect.params, effect.kept, effect.high) < 0 or smaller_transient
    return saves or effect.time < 0


class _Signatures(dict):
    """(variant, unit) → a small number, equal for units planned alike: the same ops,
    shapes, strategies, steps and gradients in the same order, wired alike (identical
    blocks; computed once each). The first block differs from the others where it
    reads the model's input, which needs no gradient."""

    def __init__(self, traced: Traced, plans: dict[Variant, Plan], members: dict[str, list[str]]):
        super().__init__()
        numbers: dict[tuple, int] = {}
        # equal strategies and steps by number, each object hashed once: the planner
        # gives identical blocks the very same objects (the plans keep them alive)
        by_value: dict = {}
        by_id: dict[int, int] = {}

        def number(thing) -> int:
            known = by_id.get(id(thing))
            if known is None:
                known = by_id[id(thing)] = by_value.setdefault(thing, len(by_value))
            return known

        for variant, plan in plans.items():
            for u, names in members.items():
                signature = _signature(traced, plan, names, number)
                self[variant, u] = numbers.setdefault(signature, len(numbers))


def _signature(
    traced: Traced, plan: Plan, names: list[str], number: Callable[[object], int]
) -> tuple:
    """The unit of nodes `names` as `_Signatures` compares it: each node's plan, names
    aside, and where each of its inputs comes from (a node of the unit by position;
    what it reads from outside numbered as first read, with its storage)."""
    position = {name: k for k, name in enumerate(names)}
    outside: dict[str, tuple] = {}

    def wire(inp) -> int | tuple:
        if inp.name in position:
            return position[inp.name]
        key = (len(outside), inp.op, str(plan.stored_layout(inp)))
        return outside.setdefault(inp.name, key)

    return tuple(
        (_unnamed(plan.nodes[n], number), tuple(map(wire, tensor_inputs(traced.nodes[n]))))
        for n in names
    )


def _unnamed(p: NodePlan, number: Callable[[object], int]) -> tuple:
    """What a node plan says, but its names (its strategy and steps by `number`)."""
    return (
        p.op,
        p.shape,
        number(p.strategy),
        number(p.input_steps),
        number(p.output_steps),
        p.input_needs_grad,
        p.needs_grad,
    )


def _add_crossings(
    problem: Problem, traced: Traced, members, hardware, optimizer, costs, signatures
) -> None:
    """Each unit's `Crossing` per source, variant of the source and option of the unit:
    the unit's nodes costed with that source's nodes (its parameters' storage, the
    model's inputs' split) as the source's variant plans them, less the unit's own cost.
    Identical blocks wired alike are costed once."""
    users = first_users(traced, next(iter(problem.plans.values())))
    first_unit = problem.units[0]
    wiring, through = {}, {}
    for u in problem.units:
        wiring[u], through[u] = _wiring(traced, problem, members, u, users)
    problem.sources = {u: tuple(wiring[u]) for u in problem.units}
    wire_number: dict[tuple, int] = {}  # a number per wiring: keys hash fast
    known: dict[tuple, tuple[Totals, Totals, dict[int, float]] | None] = {}
    made: dict[tuple[tuple, bool], Crossing] = {}  # identical blocks share one Crossing
    # node costs the calls of `_crossed` share, keyed by the identity of strategies and
    # steps (`NodeCosts`): the plans they cost are kept alive in `alive`
    alike: dict = {}
    alive: list[Plan] = []
    alone: dict[tuple, Totals] = {}  # per unit, variant and loss pieces: its own totals
    for u in problem.units:
        wired_from = {v: wire_number.setdefault(w, len(wire_number)) for v, w in wiring[u].items()}
        for g_option in problem.options[u]:
            g = g_option.variant
            for v, wires in wiring[u].items():
                # a loss in pieces changes the crossing only where its nodes read from v
                chunked = problem.chunked.get((u, g, g_option.chunks))
                if chunked is not None and not any(
                    members[u][position] in chunked.nodes for position, *_ in wires
                ):
                    chunked = None
                own_plan, own_costs = _chunked(
                    traced, problem.plans[g], costs[g], chunked, hardware
                )
                wired = wired_from[v]
                # the units holding the views u keeps of v's storage, as g places them
                between = {problem.unit[name] for name in through[u].get(v, ())}
                viewing = tuple(signatures[g, w] for w in sorted(between))
                for f, source_plan in problem.plans.items():
                    if f == g:
                        continue
                    key = (f, g, signatures[g, u], wired, signatures[f, v], viewing, chunked)
                    if key not in known:
                        if (u, g, chunked) not in alone:
                            alone[u, g, chunked] = totals(
                                traced,
                                own_plan,
                                own_costs,
                                members[u],
                                optimizer,
                                users,
                                problem.resident[g],
                            )
                        known[key] = _crossed(
                            traced,
                            own_plan,
                            source_plan,
                            members,
                            u,
                            v,
                            through[u].get(v, set()),
                            v == first_unit,
                            users,
                            own_costs,
                            alone[u, g, chunked],
                            hardware,
                            optimizer,
                            (problem.resident[g], problem.resident[f]),
                            problem.unit,
                            alike,
                            alive,
                        )
                    if known[key] is None:
                        continue
                    once = (key, g_option.checkpoint)
                    if once not in made:
                        made[once] = _crossing(*known[key], g_option.checkpoint)
                    problem.crossing[u, v, f, g_option] = made[once]


def _wiring(traced, problem: Problem, members, u: str, users) -> tuple[dict, dict]:
    """Unit `u`'s sources, each with how u's nodes read from it (positions, not names,
    so that identical blocks compare equal), and per source the nodes of other units
    through which u keeps a view of the source's storage (a no-op cast in a block of
    its own, under some variant's plan): what u keeps depends on how they are placed."""
    out: dict[str, dict] = defaultdict(dict)
    through: dict[str, set[str]] = defaultdict(set)
    first_unit = problem.units[0]

    def made_at(value: fx.Node) -> tuple[str, int | str] | None:
        """The unit that makes an activation and where in it (a model input: by name)."""
        if value.op == "placeholder":
            return first_unit, value.name
        if value.target is operator.getitem:  # an output of a node with several
            value = value.args[0]
        unit = problem.unit.get(value.name)
        return None if unit is None else (unit, members[unit].index(value.name))

    for position, name in enumerate(members[u]):
        for i, inp in enumerate(tensor_inputs(traced.nodes[name])):
            if inp.op == "get_attr":
                source = problem.unit[users[inp.target]]
                where = members[source].index(users[inp.target])
            else:
                source, where = made_at(inp)
            if source != u:
                out[source][position, i, inp.op, where] = None
            # a view made outside u may view another unit's storage (one made in u
            # reads from outside through a node of u: its input is walked there)
            if inp.op != "call_function" or source == u or not may_view(inp):
                continue
            for plan in problem.plans.values():
                chain = storage_chain(inp, plan)
                for reader, viewed in zip(chain, chain[1:]):
                    made = made_at(viewed)
                    if made is None or made[0] in (u, made_at(reader)[0]):
                        continue
                    out[made[0]][position, i, "view", made[1]] = None
                    if problem.unit.get(reader.name, u) != u:
                        through[made[0]].add(reader.name)
    return {source: tuple(wires) for source, wires in out.items()}, through


def _crossed(
    traced,
    own: Plan,
    source: Plan,
    members,
    u,
    v,
    viewing: set[str],
    splits_inputs,
    users,
    own_costs,
    alone: Totals,
    hardware,
    optimizer,
    resident: tuple[frozenset[str], frozenset[str]],
    unit_of,
    alike: dict,
    alive: list[Plan],
):
    """Unit `u`'s totals and node transients in `own`'s plan with unit `v` as `source`
    plans it, and its own totals (`alone`); None where nothing changes. `viewing`:
    nodes of other units through which u keeps views of v's storage, placed again
    too, so that each is a view or a converted copy as the plan of that choice would
    make it.
    `resident`: what many units read and is counted once (`kept_resident`), in
    `own`'s plan and in `source`'s; of what v makes, only what both count once is
    (the readers may keep it in one and not in the other): never less than the
    plan of that choice holds. `alike`: `node_cost`'s cache, with `alive` the plans
    it has costed."""
    nodes = dict(own.nodes)
    nodes.update({name: source.nodes[name] for name in members[v]})
    storage = dict(own.storage)
    in_source = set(members[v])
    storage.update({fqn: source.storage[fqn] for fqn, user in users.items() if user in in_source})
    entry_steps = own.entry_steps
    if splits_inputs:
        storage.update({name: source.storage[name] for name in source.entry_steps})
        entry_steps = source.entry_steps
    context = dataclasses.replace(own, nodes=nodes, storage=storage, entry_steps=entry_steps)
    for name in [*members[u], *sorted(viewing)]:
        reads = tensor_inputs(traced.nodes[name])
        if any(_from(inp, v, members, users, splits_inputs) for inp in reads):
            context = replanned(traced, context, name, Knobs())
    own_resident, source_resident = resident
    both = own_resident - {s for s in own_resident - source_resident if unit_of[s] == v}
    if any(context.nodes[name] != own.nodes[name] for name in [*members[u], *viewing]):
        context = share_collectives(traced, context, unit_of, members[u])
    elif _reads_alike(traced, own, context, members[u], own_resident - both):
        return None
    alive.append(context)
    costs = {
        name: node_cost(traced.nodes[name], context.nodes[name], context, hardware, alike=alike)
        for name in members[u]
    }
    transient = {
        position: costs[name].transient_bytes - own_costs[name].transient_bytes
        for position, name in enumerate(members[u])
        if costs[name].transient_bytes != own_costs[name].transient_bytes
    }
    crossed = totals(traced, context, costs, members[u], optimizer, users, both)
    return None if crossed == alone and not transient else (crossed, alone, transient)


def _reads_alike(traced, own: Plan, context: Plan, names: list[str], uncounted) -> bool:
    """Whether the nodes `names`, placed alike in both plans, read what enters them
    from storage of the same size in `context` as in `own`, counted once in both
    (`uncounted`: storage counted once in `own` only)."""
    inside = set(names)
    for name in names:
        for inp in tensor_inputs(traced.nodes[name]):
            if inp.op == "get_attr" or inp.name in inside:
                continue
            stored, there = storage_node(inp, own), storage_node(inp, context)
            if stored is not there or stored.name in uncounted:
                return False
            if stored_bytes(stored, own) != stored_bytes(there, context):
                return False
    return True


def _from(inp, v: str, members, users, splits_inputs: bool) -> bool:
    if inp.op == "get_attr":
        return users[inp.target] in members[v]
    if inp.op == "placeholder":
        return splits_inputs
    return inp.name in members[v]


def _crossing(crossed: Totals, alone: Totals, transient, checkpoint: bool) -> Crossing:
    return Crossing(_difference(alone, crossed, checkpoint), transient)


GAP = 1e-2
"""HiGHS stops once its choice is proven within this fraction of the best (its step
time, or its peak for `smallest_peak`). The cost model is not that close to a real
step, while proving the last tenths of a percent among the near-identical choices of
many identical blocks can take minutes or stall: LLaMA-3 70B on 8×8×8 with 1M tokens
at 80 GiB, over Megatron, data parallel and the 3D families, took 12.7 s at 5e-3 and
was still 0.125 % away after 300 s at 1e-3; LLaMA-3 405B with 4M tokens of 8192 on
8×8×16 has its choice 0.72 % from the bound after 34 s, which at 5e-3 HiGHS spent
another 16 minutes, at its root node and then its `NODE_LIMIT`, failing to prove."""

NODE_LIMIT = 1000
"""Branch-and-bound nodes HiGHS may explore before it returns the best choice found
(`smallest_peak` and `solve` then hold a feasible choice, not one proven within
`GAP`): a bound on work, not on time, so every rank still plans alike."""

_HIGHS_OPTIONS = {
    "output_flag": False,
    # HiGHS's presolve restarts a search this small several times: off, the examples'
    # problems solve about twice as fast, to the same optimum
    "presolve": "off",
    # Its symmetry detection finds the identical blocks' columns, but the root's
    # relaxation and heuristics settle these problems (one node): off, LLaMA-3 70B on
    # 8×8×8 solves in 1.07 s instead of 1.47 s (and 29 s instead of 35 s at 12 GiB)
    "mip_detect_symmetry": False,
}


def solve(problem: Problem, budget: float | None) -> dict[str, Option]:
    """The best choice (within `GAP`), by HiGHS; raises BudgetError naming the smallest
    budget."""
    return solve_priced(problem, budget)[0]


STARTS = (SPACES["3d"], ("megatron",), ("dp",))
"""Parts of a larger space that `solve` solves alone first, where a problem holds one
beside other families: HiGHS starts from the fastest of their choices. Then its plan
is never slower than Megatron-LM's or data parallel's best, the plans users write
by hand (within `GAP` alone it could be up to 1 % slower), nor than the default
space's. HiGHS, holding a choice near its bound from the start, often stops far
sooner; LLaMA-3 70B on 8×8×8 over all five families at 80 GiB, with and without
the start (parts included): 1M tokens 14 s / 223 s (Megatron-LM's plan is within
the gap), 0.25M tokens 14 s / 21 s, 2M tokens of 8192 97 s / 29 s (there the
default space alone takes 57 s: nearly every block is recomputed). Started from
Megatron-LM's plan alone, 12 % slower than the best, the 0.25M case took 195 s."""


def solve_priced(problem: Problem, budget: float | None) -> tuple[dict[str, Option], float]:
    """`solve`, with the step time the integer program priced for its choice."""
    start, start_seconds = _start(problem, budget)
    choice, seconds = _milp(problem, budget, minimize_memory=False, start=start)
    if start is not None and (choice is None or start_seconds < seconds):
        # HiGHS drops a start it cannot complete, and recounts bucket calls after it
        choice, seconds = start, start_seconds
    if choice is None:
        smallest = smallest_peak(problem)
        raise BudgetError(
            f"no plan fits a memory budget of {human_bytes(budget)} per rank; the smallest that "
            f"fits is {human_bytes(smallest)} ({int(math.ceil(smallest))} bytes): raise "
            "memory_budget, or use a larger mesh"
        )
    return choice, seconds


def _start(problem: Problem, budget: float | None) -> tuple[dict[str, Option] | None, float]:
    """The fastest choice under `budget` of the `STARTS` that are part of the problem's
    space, not all of it, and offer every unit an option, and its priced seconds;
    (None, inf) where none does or fits. A start is optional: a part HiGHS calls
    infeasible is not tried again with its presolve."""
    if not _larger_than_a_start(problem):
        return None, math.inf
    best, best_seconds = None, math.inf
    for part in STARTS:
        try:
            part_problem = problem.restricted(part)
        except StrategyError:  # a unit it offers no option
            continue
        choice, seconds = _milp(part_problem, budget, minimize_memory=False, confirm=False)
        if choice is not None and seconds < best_seconds:
            best, best_seconds = choice, seconds
    return best, best_seconds


def _larger_than_a_start(problem: Problem) -> bool:
    """Whether `problem`'s space is larger than each of the `STARTS` (`strategy_space=
    "all"`), where HiGHS runs with its presolve: without it, it can work at its root
    node for many minutes, which `NODE_LIMIT` does not bound (GPT-3 175B, 1M tokens
    of 8192 on 8×8×8: not done after 15 minutes, 29 s with it; 2M tokens on 4×4×4,
    where nothing fits 80 GiB: its verdict 5 s, its smallest budget 21 s). The
    default space's problems solve about twice as fast without (its acceptance case
    plans in 0.45× export's time, 0.75× with presolve)."""
    families = {o.family for options in problem.options.values() for o in options}
    return not any(families <= set(part) for part in STARTS)


def smallest_peak(problem: Problem) -> float:
    """The lowest peak memory of any choice (bytes per rank), within `GAP`: a peak
    some choice has, so a budget of it fits."""
    return problem.evaluate(_milp(problem, None, minimize_memory=True)[0])[1]


_MIB = 2.0**20  # memory rows in MiB keep the coefficients near 1 for HiGHS
_KIB = 2.0**10


@dataclass
class IntegerProgram:
    """The MILP of the module docstring as HiGHS takes it (`integer_program`)."""

    columns: dict[tuple, int]  # ("x", unit, option), ("z", …), … → column index
    cost: np.ndarray  # seconds per column
    objective: np.ndarray
    matrix: coo_array
    lower: list[float]  # row bounds
    upper: list[float]
    integrality: np.ndarray
    column_lower: np.ndarray
    column_upper: np.ndarray
    # per bucket key, its n column and the KiB each column puts in the bucket
    calls: dict[tuple[str, str], tuple[int, dict[int, float]]] = field(default_factory=dict)

    def priced(self, x: np.ndarray) -> float:
        """Seconds of the solution `x`, each bucket's calls counted from its bytes: HiGHS
        may take n = bytes / BUCKET_BYTES ≤ 1e-6 for an integer, a call too few."""
        x = x.copy()
        for column, terms in self.calls.values():
            kib = sum(v * x[c] for c, v in terms.items())
            x[column] = bucket_calls(round(kib * _KIB))
        return float(self.cost @ x)

    def digest(self) -> str:
        """A hash of every number and its place: equal programs solve alike."""
        parts = [self.objective, self.matrix.row, self.matrix.col, self.matrix.data]
        parts += [np.asarray(self.lower), np.asarray(self.upper), self.integrality]
        parts += [self.column_lower, self.column_upper]
        return hashlib.sha256(b"".join(np.asarray(x).tobytes() for x in parts)).hexdigest()


def _milp(
    problem: Problem,
    budget: float | None,
    minimize_memory: bool,
    start: dict[str, Option] | None = None,
    confirm: bool = True,
):
    """HiGHS's choice for `problem` and its priced seconds, or (None, nan) where no
    choice fits (with `confirm`, once HiGHS with its presolve agrees); from the choice
    `start`, where given (HiGHS completes the columns that do not name an option or
    a knob)."""
    program = integer_program(problem, budget, minimize_memory)
    options = {**_HIGHS_OPTIONS, "mip_rel_gap": GAP, "mip_max_nodes": NODE_LIMIT}
    if _larger_than_a_start(problem):
        options["presolve"] = "on"
    given = {}
    if start is not None:
        for key, c in program.columns.items():
            if key[0] == "x":
                given[c] = float(start[key[1]].base == key[2])
            elif key[0] == "z":
                given[c] = float(start[key[1]].base == key[2] and key[3] in start[key[1]].knobs)
    x = _highs(program, options, given)
    if x is None and confirm:
        # Without presolve HiGHS has called a feasible program infeasible (a tiny RWKV
        # near its smallest budget: feasible at 374000 bytes, "infeasible" at 376000):
        # no plan is refused before HiGHS with presolve agrees.
        x = _highs(program, {**options, "presolve": "on"}, given)
    if x is None:
        return None, math.nan
    columns = program.columns
    chosen = {}
    for u in problem.units:
        option = next(o for o in problem.options[u] if x[columns["x", u, o]] > 0.5)
        knobs = [k for k in problem.knobs[u, option] if x[columns["z", u, option, k]] > 0.5]
        chosen[u] = dataclasses.replace(option, knobs=frozenset(knobs))
    return chosen, program.priced(x)  # seconds, as the program priced them


def _highs(program: IntegerProgram, options: dict, start: dict[int, float]) -> np.ndarray | None:
    """The columns of the best solution HiGHS finds for `program` (from the partial
    solution `start`, column → value), or None where it finds none."""
    matrix = program.matrix.tocsc()
    lp = HighsLp()
    lp.num_row_, lp.num_col_ = matrix.shape
    lp.col_cost_ = program.objective
    lp.col_lower_, lp.col_upper_ = program.column_lower, program.column_upper
    lp.row_lower_, lp.row_upper_ = np.asarray(program.lower), np.asarray(program.upper)
    lp.a_matrix_.format_ = MatrixFormat.kColwise
    lp.a_matrix_.num_row_, lp.a_matrix_.num_col_ = matrix.shape
    lp.a_matrix_.start_, lp.a_matrix_.index_ = matrix.indptr, matrix.indices
    lp.a_matrix_.value_ = matrix.data
    kinds = (HighsVarType.kContinuous, HighsVarType.kInteger)
    lp.integrality_ = [kinds[int(i)] for i in program.integrality]
    # highspy's public `Highs` prints HiGHS's banner as it is made, before its output
    # can be turned off (`autoshard show` would print it); the bare solver it wraps does not
    highs = Highs()
    for name, value in options.items():
        if highs.setOptionValue(name, value) != HighsStatus.kOk:  # a name HiGHS lacks
            raise ValueError(f"HiGHS refused option {name}={value!r}")
    highs.passModel(lp)
    if start:
        index = np.fromiter(start, np.int32, len(start))
        highs.setSolution(len(start), index, np.fromiter(start.values(), float, len(start)))
    highs.run()
    if highs.getInfo().primal_solution_status != kSolutionStatusFeasible:
        return None
    return np.asarray(highs.getSolution().col_value)


@paused_gc
def integer_program(
    problem: Problem, budget: float | None, minimize_memory: bool
) -> IntegerProgram:
    """The MILP for `problem` under `budget`: its time, or with `minimize_memory`
    its peak, as the objective. Built in an order that depends on nothing but the
    problem (ranks that each solve must get the same plan, whatever their hash seed)."""
    columns: dict[tuple, int] = {}

    def column(*key) -> int:
        return columns.setdefault(key, len(columns))

    for u in problem.units:
        for option in problem.options[u]:
            column("x", u, option)
            for knob in problem.knobs[u, option]:
                column("z", u, option, knob)
            for value, (_, keepers) in problem.kept_once.get((u, option), {}).items():
                for position in sorted(set(keepers.values())):
                    column("s", u, option, value, position)
    for key in problem.bucket_latency:
        column("n", key)  # calls of the gradient buckets over that axis, of that dtype
    n_integer = len(columns)
    variants = {
        u: list(dict.fromkeys(o.variant for o in options)) for u, options in problem.options.items()
    }
    offered = {u: (set(options), set(variants[u])) for u, options in problem.options.items()}
    crossing = {  # those the options left (a test may leave some out) can take
        key: c
        for key, c in problem.crossing.items()
        if key[3] in offered[key[0]][0] and key[2] in offered[key[1]][1]
    }
    # c[unit, source, F, O] = y[source, F]·x[unit, O] for each class F of the source's
    # variants and class O of the unit's options of each pair that crosses (those with
    # no Crossing cost nothing): the couplings of two one-hot choices, whose sums over
    # F and over O are x and y. A class holds those that cross alike.
    classes = _crossing_classes(problem, crossing, variants)
    for (unit, source), (variant_classes, option_classes) in classes.items():
        for f in variant_classes:
            for o in option_classes:
                column("c", unit, source, f, o)
    for u in problem.units:
        for option in problem.options[u]:
            for k, _ in enumerate(problem.joint.get((u, option), [])):
                column("j", u, option, k)
    n_unit = len(columns)  # binaries, and the continuous columns in [0, 1]
    crossed: dict[str, dict[int, Crossing]] = defaultdict(dict)  # per unit, column → crossing
    for (unit, source), (variant_classes, option_classes) in classes.items():
        for f in variant_classes:
            for o in option_classes:
                c = crossing.get((unit, source, f[0], o[0]))
                if c is not None:
                    crossed[unit][columns["c", unit, source, f, o]] = c

    def unit_effects(u: str) -> list[tuple[int, Effect]]:
        """(column, effect) of u's options, knobs, values kept once (each in the
        column of its last keeper, which any of its keepers turns on; what it adds to
        the peak rows, from its first keeper that is on, is `_high_terms`'), joint
        knobs and crossings."""
        out = []
        for option in problem.options[u]:
            out.append((columns["x", u, option], problem.effect[u, option]))
            for knob, effect in problem.knobs[u, option].items():
                out.append((columns["z", u, option, knob], effect))
            for value, (effect, keepers) in problem.kept_once.get((u, option), {}).items():
                last = columns["s", u, option, value, max(keepers.values())]
                out.append((last, dataclasses.replace(effect, high=0.0)))
            for k, (effect, _) in enumerate(problem.joint.get((u, option), [])):
                out.append((columns["j", u, option, k], effect))
        out += [(c, crossing.effect) for c, crossing in crossed[u].items()]
        return out

    effects = {u: unit_effects(u) for u in problem.units}
    highs = {u: _high_terms(problem, effects[u], crossed[u], u, columns) for u in problem.units}
    for u in problem.units:
        column("K", u)
        column("H", u)  # u's high[u], the part every node's peak row has
        for i in range(len(highs[u].rows)):
            column("A", u, i)  # what u's nodes after its i-th peak row's node save
    params, peak = column("P"), column("peak")
    n = len(columns)
    cost = np.zeros(n)
    rows, cols, values, lower, upper = [], [], [], [], []

    def add(entries: dict[int, float], lo: float, hi: float) -> None:
        rows.extend([len(lower)] * len(entries))
        cols.extend(entries)
        values.extend(entries.values())
        lower.append(lo)
        upper.append(hi)

    # per unit and Effect field, Σ field·column over `unit_effects` as {column: coefficient}
    choice_terms: dict[str, dict[str, dict[int, float]]] = {}
    bucketed: dict[tuple[str, str], dict[int, float]] = defaultdict(lambda: defaultdict(float))
    for u in problem.units:
        terms = choice_terms[u] = {
            field: defaultdict(float) for field in ("time", "params", "kept")
        }
        for c, effect in effects[u]:
            terms["time"][c] += effect.time
            terms["params"][c] += effect.params
            terms["kept"][c] += effect.kept
            for key, nbytes in effect.buckets:
                bucketed[key][c] += nbytes / _KIB
        for i, value in terms["time"].items():
            cost[i] += value
        add({columns["x", u, o]: 1 for o in problem.options[u]}, 1, 1)
        for option in problem.options[u]:
            for knob in problem.knobs[u, option]:
                add({columns["z", u, option, knob]: 1, columns["x", u, option]: -1}, -np.inf, 0)
            # s[p] ≥ z for each knob that keeps the value at position p or before: the
            # value is kept once, if any of them is on, from the first on
            for value, (_, keepers) in problem.kept_once.get((u, option), {}).items():
                for position in sorted(set(keepers.values())):
                    once = columns["s", u, option, value, position]
                    for knob in sorted(keepers, key=str):
                        if keepers[knob] <= position:
                            add({columns["z", u, option, knob]: 1, once: -1}, -np.inf, 0)
            # j = the product of its knobs' z: j ≤ each, j ≥ their sum − (count − 1)
            for k, (_, together) in enumerate(problem.joint.get((u, option), [])):
                j = columns["j", u, option, k]
                knobs = {columns["z", u, option, knob]: -1.0 for knob in sorted(together, key=str)}
                for z in knobs:
                    add({j: 1.0, z: -1.0}, -np.inf, 0)
                add({j: 1.0, **knobs}, 1 - len(together), np.inf)
    # n·BUCKET_BYTES ≥ the bytes the buckets reduce, n integer: ⌈bytes / BUCKET_BYTES⌉
    # calls (HiGHS takes an n within 1e-6 of an integer as one: `_milp` recounts them)
    for key, terms in bucketed.items():
        calls = columns["n", key]
        cost[calls] += problem.bucket_latency[key]
        cap = plan_module.BUCKET_BYTES / _KIB
        add({calls: cap, **{c: -v for c, v in terms.items()}}, 0, np.inf)
    # Σ_f c[f, o] = x[unit, o] and Σ_o c[f, o] = y[source, f]: exactly the product for
    # one-hot x and y (memory rows may weigh c negatively), and a tight relaxation
    for (unit, source), (variant_classes, option_classes) in classes.items():
        for o in option_classes:
            terms = {columns["c", unit, source, f, o]: 1.0 for f in variant_classes}
            add({**terms, **{columns["x", unit, option]: -1.0 for option in o}}, 0, 0)
        for f in variant_classes:
            terms = {columns["c", unit, source, f, o]: 1.0 for o in option_classes}
            for option in problem.options[source]:
                if option.variant in f:
                    terms[columns["x", source, option]] = -1.0
            add(terms, 0, 0)
    # P = parameters; K[u] = K[u−1] + kept[u]; P + K[u−1] + high[u] at node k ≤ peak
    total_params: dict[int, float] = {params: -1.0}
    for u in problem.units:
        total_params.update({i: v / _MIB for i, v in choice_terms[u]["params"].items()})
    add(total_params, 0, 0)
    previous = None
    for u in problem.units:
        entries = {i: v / _MIB for i, v in choice_terms[u]["kept"].items()}
        entries[columns["K", u]] = -1.0
        if previous is not None:
            entries[columns["K", previous]] = 1.0
        add(entries, 0, 0)
        high = highs[u]
        add({**{i: -v for i, v in high.own.items()}, columns["H", u]: 1.0}, 0, 0)
        for i, (terms, later) in enumerate(zip(high.rows, high.saved_later)):
            # A[i] = A[i + 1] + what the nodes from this row's to the next one's save
            entries = {columns["A", u, i]: 1.0, **{c: -v for c, v in later.items()}}
            if i + 1 < len(high.rows):
                entries[columns["A", u, i + 1]] = -1.0
            add(entries, 0, 0)
            entries = {params: 1.0, peak: -1.0, columns["H", u]: 1.0, **terms}
            entries[columns["A", u, i]] = -1.0
            if previous is not None:
                entries[columns["K", previous]] = 1.0
            add(entries, -np.inf, 0)
        previous = u
    integrality = np.zeros(n)
    integrality[:n_integer] = 1
    upper_bounds = np.full(n, np.inf)
    upper_bounds[:n_unit] = 1
    upper_bounds[[columns["n", key] for key in problem.bucket_latency]] = np.inf
    lower_bounds = np.zeros(n)
    # knobs and crossings subtract
    free = [i for key, i in columns.items() if key[0] in ("K", "H", "A")]
    lower_bounds[free + [params]] = -np.inf
    if budget is not None:
        upper_bounds[peak] = (budget - problem.returned) / _MIB  # the outputs: a constant
    if minimize_memory:
        objective = np.zeros(n)
        objective[peak] = 1.0
    else:
        objective = cost / max(float(np.abs(cost).max()), 1e-30)
    matrix = coo_array((values, (rows, cols)), shape=(len(lower), n))
    calls = {key: (columns["n", key], terms) for key, terms in bucketed.items()}
    return IntegerProgram(
        columns,
        cost,
        objective,
        matrix,
        lower,
        upper,
        integrality,
        lower_bounds,
        upper_bounds,
        calls,
    )


@dataclass
class _High:
    """A unit's peak rows (`_high_terms`), as {column: MiB}: `own`, what every row has
    (high[u]); per row kept, in node order, its node's transients and what it holds
    of values kept once (`rows`), and what the nodes after it save up to the next
    row's node (`saved_later`; for the last row, all after it)."""

    own: dict[int, float]
    rows: list[dict[int, float]]
    saved_later: list[dict[int, float]]


def _high_terms(
    problem: Problem,
    effects: list[tuple[int, Effect]],
    crossed: dict[int, Crossing],
    u: str,
    columns,
) -> _High:
    """Unit `u`'s high at each of its nodes (`running_high`) over its options, knobs,
    values kept once, joint knobs and crossings (`effects`, from `unit_effects`):
    what the unit holds while that node runs, its transient buffers included. Split
    so that each column is in few rows: most, crossings in particular, are only in
    `own`, and what a node saves only in the `saved_later` of the row before it.
    Rows no choice can make the largest are left out (`_undominated`)."""
    names = list(problem.transient[u, problem.options[u][0]])
    n = len(names)
    own: dict[int, float] = defaultdict(float)
    saved: dict[int, np.ndarray] = defaultdict(lambda: np.zeros(n))  # bytes first kept at a node
    by_column: dict[int, np.ndarray] = defaultdict(lambda: np.zeros(n))  # the rest, per node
    for column, effect in effects:
        if effect.high:
            own[column] += effect.high / _MIB
        for position, nbytes in effect.saved_at:  # not yet saved, or freed, before it
            saved[column][position] += nbytes
    for option in problem.options[u]:
        transient = problem.transient[u, option]
        by_column[columns["x", u, option]] += np.fromiter(transient.values(), float, n)
        for knob in problem.knobs[u, option]:
            after = problem.knob_transient.get((u, option, knob))
            if after is not None:
                k = names.index(knob.node)
                by_column[columns["z", u, option, knob]][k] += after - transient[knob.node]
        for value, (effect, keepers) in problem.kept_once.get((u, option), {}).items():
            positions = sorted(set(keepers.values()))
            for start, end in zip(positions, [*positions[1:], n]):
                # kept from the first keeper that is on: s at the last keeper so far
                by_column[columns["s", u, option, value, start]][start:end] += effect.high
    for column, crossing in crossed.items():
        for position, delta in crossing.transient.items():
            by_column[column][position] += delta
    keys = np.array(sorted(by_column.keys() | saved.keys()))
    zeros = np.zeros(n)
    rest = np.stack([by_column.get(c, zeros) for c in keys.tolist()], axis=1)  # node × column
    first_kept = np.stack([saved.get(c, zeros) for c in keys.tolist()], axis=1)
    before = np.vstack([np.zeros((1, len(keys))), first_kept.cumsum(axis=0)])  # Σ p < k
    after = before[-1] - before[1:]  # what nodes after k save
    kept = _undominated(rest - after)
    rows, saved_later = [], []

    def terms(row: np.ndarray) -> dict[int, float]:
        nonzero = np.flatnonzero(row)
        return dict(zip(keys[nonzero].tolist(), (row[nonzero] / _MIB).tolist()))

    for i, k in enumerate(kept):
        stop = kept[i + 1] + 1 if i + 1 < len(kept) else n
        rows.append(terms(rest[k]))
        saved_later.append(terms(before[stop] - before[k + 1]))
    return _High(dict(own), rows, saved_later)


def _undominated(matrix: np.ndarray) -> list[int]:
    """The rows of `matrix` but those another row is at least as large as in every
    column (of equal rows, the first is kept): over columns in [0, 1], never the
    only largest."""
    covers = (matrix[:, None, :] >= matrix[None, :, :]).all(axis=2)  # [i, j]: row i ≥ row j
    equal = covers & covers.T
    strictly = covers & ~equal
    return [j for j in range(len(matrix)) if not strictly[:, j].any() and not equal[:j, j].any()]


def _crossing_classes(
    problem: Problem, crossing: dict[tuple, Crossing], variants: dict[str, list[Variant]]
) -> dict[tuple[str, str], tuple[list[tuple[Variant, ...]], list[tuple[Option, ...]]]]:
    """Per pair (unit, source) that crosses, the source's variants and the unit's
    options in classes that cross alike: variants whose crossings equal for every
    option of the unit, options whose crossings equal for every variant of the
    source. The integer program couples classes, not each variant with each option:
    the same program in fewer columns (LLaMA-3 70B on 8×8×8: 28.6k instead of 38.8k;
    3D orders that lay a block's inputs out alike cross alike)."""

    numbered: dict[int, int] = {}  # id of a Crossing → a number, equal for equal ones
    alike_numbers: dict[tuple, int] = {}

    def same(c: Crossing) -> int:  # identical blocks share Crossing objects: seen once
        if id(c) not in numbered:
            alike = (c.effect, tuple(sorted(c.transient.items())))
            numbered[id(c)] = alike_numbers.setdefault(alike, len(alike_numbers))
        return numbered[id(c)]

    by_pair: dict[tuple[str, str], dict] = defaultdict(dict)
    for (unit, source, f, o), c in crossing.items():
        by_pair[unit, source][f, o] = same(c)
    out = {}
    for (unit, source), alike in by_pair.items():
        options, sources = problem.options[unit], variants[source]
        by_variant = defaultdict(list)
        for f in sources:
            by_variant[tuple(alike.get((f, o)) for o in options)].append(f)
        by_option = defaultdict(list)
        for o in options:
            by_option[tuple(alike.get((f, o)) for f in sources)].append(o)
        out[unit, source] = (
            [tuple(fs) for fs in by_variant.values()],
            [tuple(os) for os in by_option.values()],
        )
    return out


def brute_force(problem: Problem, budget: float | None) -> dict[str, Option] | None:
    """The optimal choice by enumeration (for tests on small problems)."""
    best, best_time = None, math.inf
    for combo in itertools.product(*(problem.choices(u) for u in problem.units)):
        choice = dict(zip(problem.units, combo))
        time, peak = problem.evaluate(choice)
        if (budget is None or peak <= budget) and time < best_time:
            best, best_time = choice, time
    return best


@paused_gc
def plan_model(traced: Traced, mesh: Mesh, options: PlanOptions) -> Plan:
    """The plan: forced by `options.strategy`, else solved; with its predicted cost.

    The solver's budget is `options.memory_budget`, or the hardware's memory per
    device. A single family with a budget solves only where to recompute."""
    strategy, memory_budget, hardware = options.strategy, options.memory_budget, options.hardware
    if options.strategy_space not in SPACES:
        raise StrategyError(
            f"strategy space {options.strategy_space!r} is not available: "
            f"choose one of {sorted(SPACES)}"
        )
    if strategy is not None and (memory_budget is None or not isinstance(strategy, str)):
        if memory_budget is not None:
            raise StrategyError("memory_budget needs strategy=None or a single family name")
        plan = plan_graph(traced, mesh, strategy)
        plan = share_collectives(traced, plan, units_of(traced, plan))
        plan.overlap = options.overlap is not False
        if options.loss_chunks not in (None, 1):
            plan.chunked = (_forced_chunks(traced, plan, options.loss_chunks),)
    else:
        check_strategy(strategy)
        space = (strategy,) if strategy else SPACES[options.strategy_space]
        if memory_budget is None:
            memory_budget = hardware.memory_per_device

        def problem_for(gather_buckets: bool) -> Problem:
            # A family the user forced must fit every node; the solver's own choice
            # falls back node by node to the next family that fits.
            return build_problem(
                traced,
                mesh,
                hardware,
                space,
                options.optimizer,
                fallback=not strategy,
                loss_chunks=options.loss_chunks,
                gather_buckets=gather_buckets,
            )

        problem = problem_for(True)
        if options.loss_chunks not in (None, 1) and not problem.chunked:
            _forced_chunks(traced, problem.plans[space[0], ()], options.loss_chunks)
            raise StrategyError(
                f"loss_chunks={options.loss_chunks}: the solver runs in pieces only a loss "
                "read after the model's last repeated block (an lm-head and its loss); this "
                "model's loss is not, so force a family (strategy='3d') to cut it anyway, "
                "or give loss_chunks=None"
            )
        try:
            choice = solve(problem, memory_budget)
        except BudgetError:
            # Gathered at a unit's start, a gather bucket's weights are held longer than
            # one at a time: where that is what keeps the budget from fitting, plan
            # without them (raising, if nothing fits still, with the smaller floor)
            problem = problem_for(False)
            choice = solve(problem, memory_budget)
        plan = plan_choice(
            traced, mesh, problem, choice, hardware, options.optimizer, options.overlap is not False
        )
        plan.reasons = reasons(problem, choice, memory_budget)
        return plan
    plan.cost = estimate(traced, plan, hardware, options.optimizer)
    return plan


def _forced_chunks(traced: Traced, plan: Plan, chunks: int) -> ChunkedLoss:
    """The loss of `plan` run in `chunks` pieces; StrategyError saying why it cannot be."""
    found = chunkings(traced, plan, (chunks,))
    if not found:
        counts = [k for k in range(2, chunks) if chunkings(traced, plan, (k,))]
        raise StrategyError(
            f"loss_chunks={chunks}: "
            + (
                f"the loss's tokens do not divide into {chunks} pieces here (they do into "
                f"{', '.join(map(str, counts))})"
                if counts
                else "no loss here runs in pieces (a vocabulary-parallel cross-entropy of "
                "the logits of a linear without bias, through views only)"
            )
            + ", or loss_chunks=None to let the solver choose"
        )
    return found[0]


@paused_gc
def plan_choice(
    traced,
    mesh,
    problem: Problem,
    choice: dict[str, Option],
    hardware,
    optimizer,
    overlap: bool = True,
):
    """The plan of `choice`: every node with the strategy the plan of its unit's variant
    gives it; a value crossing into a unit of another variant is converted straight
    to the layout its reader computes on, as `Crossing` prices it; conversions shared
    and gradients bucketed as the problem priced them, their reductions overlapped
    with backward if `overlap` (`Plan.overlap`)."""
    variant = {name: choice[u].variant for name, u in problem.unit.items()}
    fixed = {name: problem.plans[v].nodes[name].strategy for name, v in variant.items()}
    knobs: dict[str, Knobs] = {}
    for option in choice.values():
        for knob in option.knobs:
            turned = knobs.get(knob.node, Knobs())
            if knob.kind == REGATHER:
                knobs[knob.node] = Knobs(turned.split_weight, True)
            else:
                knobs[knob.node] = Knobs(knob.kind == SPLIT_WEIGHT, turned.regather)
    first = problem.plans[choice[problem.units[0]].variant]  # inputs split as it splits them
    inputs = {name: first.storage[name] for name in first.entry_steps}
    plan = plan_graph(traced, mesh, fixed=fixed, inputs=inputs, knobs=knobs)
    plan.gather_buckets = first.gather_buckets
    plan.chunked = tuple(
        problem.chunked[u, option.variant, option.chunks]
        for u, option in choice.items()
        if option.chunks > 1
    )
    plan.regions = {
        name: u for name, u in problem.unit.items() if choice[u].checkpoint and name in plan.nodes
    }
    plan.choices = {unit: str(option) for unit, option in choice.items()}
    plan.warnings += [  # the nodes that left their family, in the variants chosen
        note
        for name, v in variant.items()
        if (note := problem.plans[v].fallbacks.get(name)) is not None
    ]
    plan = share_collectives(traced, plan, problem.unit)
    plan.overlap = overlap
    plan.cost = estimate(traced, plan, hardware, optimizer)
    return plan


def reasons(problem: Problem, choice: dict[str, Option], budget: float | None) -> dict[str, str]:
    """Why each unit left replicated is so: what the fastest option of each other
    family would change, that unit alone switched (knobs at their defaults)."""
    time, _ = problem.evaluate(choice)
    out = {}
    for u in problem.units:
        if choice[u].family != "replicated":
            continue
        best: dict[str, tuple[float, float]] = {}  # family → (seconds more, peak)
        for option in problem.options[u]:
            if option.family == "replicated":
                continue
            t, peak = problem.evaluate({**choice, u: option})
            if option.family not in best or t - time < best[option.family][0]:
                best[option.family] = (t - time, peak)
        if not best:
            continue
        fits = {f: dt for f, (dt, peak) in best.items() if budget is None or peak <= budget}
        parts = [f"{f} would cost {dt * 1e3:.4g} ms more" for f, dt in sorted(fits.items())]
        parts += [
            f"{f} would peak at {human_bytes(peak)}, over the budget"
            for f, (_, peak) in sorted(best.items())
            if f not in fits
        ]
        out[u] = "replicated is fastest at this budget: " + "; ".join(parts)
    return out
