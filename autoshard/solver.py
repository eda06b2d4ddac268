"""Choose, per block part, a layout family and whether to recompute it: the
minimum predicted step time whose peak per-rank memory fits the budget.

The graph is cut into units: each repeated block (``blocks.3``,
``model.layers.7``), cut again wherever one activation carries everything
forward (a transformer block's attention and its MLP become ``blocks.3#0``
and ``blocks.3#1``), and the rest of the model before and after the blocks
(embeddings; final norm, head, loss). Each unit takes one option, a family
(``"3d"``, ``"3d-allreduce"``, ``"replicated"``) and, for block parts,
whether it is a checkpoint region. A unit's cost under a family comes from
planning the whole model in that family once and summing the cost model over
the unit's nodes (identical blocks cost the same); two neighbouring units in
different families also pay for converting the activations that cross between
them. The problem is an integer program solved by HiGHS:

    minimize   Σ time[u, o]·x[u, o] + Σ convert[u, f, g]·e[u, f, g]
    subject to Σ_o x[u, o] = 1                       one option per unit
               e[u, f, g] ≥ y[u−1, f] + y[u, g] − 1  neighbours in families f, g
               R ≥ replay[u, o]·x[u, o]              the largest region replayed
               Σ memory[u, o]·x[u, o] + R ≤ budget

where y[u, f] sums x over u's options of family f. `brute_force` enumerates
the same objective, and the tests hold the two equal.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from autoshard.cost import node_costs, step_time
from autoshard.errors import BudgetError, StrategyError
from autoshard.estimate import estimate, first_users, totals, unit_of
from autoshard.hardware import Hardware
from autoshard.layout import redistribute
from autoshard.mesh import Mesh
from autoshard.plan import Plan
from autoshard.planner import check_strategy, plan_graph
from autoshard.trace import Traced, tensor_inputs

SPACES = {
    "3d": ("3d", "3d-allreduce", "replicated"),
    "all": ("3d", "3d-allreduce", "replicated", "any", "any-allreduce"),
}


@dataclass(frozen=True)
class Option:
    family: str
    checkpoint: bool

    def __str__(self) -> str:
        return self.family + (" + recompute" if self.checkpoint else "")


@dataclass
class Problem:
    units: list[str]  # in graph order
    options: dict[str, list[Option]]  # per unit
    time: dict[tuple[str, Option], float]
    memory: dict[tuple[str, Option], float]  # kept through the step
    replay: dict[tuple[str, Option], float]  # extra while the unit is recomputed
    convert: dict[tuple[str, str, str], float]  # (unit, family before, family of unit)
    plans: dict[str, Plan] = field(default_factory=dict)  # the whole model in each family
    unit: dict[str, str] = field(default_factory=dict)  # node name → unit

    def evaluate(self, choice: dict[str, Option]) -> tuple[float, float]:
        """(step time, peak memory) of a choice."""
        time = sum(self.time[u, choice[u]] for u in self.units)
        for before, unit in zip(self.units, self.units[1:]):
            time += self.convert.get((unit, choice[before].family, choice[unit].family), 0.0)
        memory = sum(self.memory[u, choice[u]] for u in self.units)
        return time, memory + max(self.replay[u, choice[u]] for u in self.units)


def build_problem(
    traced: Traced, mesh: Mesh, hardware: Hardware, families: tuple[str, ...], optimizer: float
) -> Problem:
    plans = {f: plan_graph(traced, mesh, f) for f in families}
    unit = units_of(traced, plans[families[0]])
    units = list(dict.fromkeys(unit.values()))
    problem = Problem(units, {}, {}, {}, {}, {}, plans, unit)
    cache: dict[tuple, tuple] = {}
    for family, plan in plans.items():
        costs = node_costs(traced, plan, hardware)
        users = first_users(traced, plan)
        members: dict[str, list[str]] = defaultdict(list)
        for name, u in unit.items():
            members[u].append(name)
        for u in units:
            names = members[u]
            key = (family, _signature(plan, names))
            if key not in cache:  # identical blocks cost the same: sum them once
                total = totals(traced, plan, costs, names, optimizer, users)
                output = sum(costs["output"].forward_comm.values()) if u == units[-1] else 0.0
                cache[key] = (total, output)
            total, output = cache[key]
            block = u not in (PROLOGUE, EPILOGUE)
            options = [Option(family, False)] + ([Option(family, True)] if block else [])
            for option in options:
                problem.options.setdefault(u, []).append(option)
                recompute = total.forward if option.checkpoint else 0.0
                problem.time[u, option] = total.time + output + recompute
                kept = total.entry if option.checkpoint else total.saved
                problem.memory[u, option] = total.params + kept
                problem.replay[u, option] = total.saved if option.checkpoint else 0.0
    for u in units[1:]:
        names = {n for n, owner in unit.items() if owner == u}
        for f, g in itertools.permutations(plans, 2):
            problem.convert[u, f, g] = _boundary(traced, plans[f], plans[g], names, hardware, mesh)
    return problem


PROLOGUE, EPILOGUE = "<prologue>", "<epilogue>"


def units_of(traced: Traced, plan: Plan) -> dict[str, str]:
    """Node name → its unit: a part of a repeated block, or the prologue (before the
    first block) or epilogue (after) for the rest of the model.

    A block is cut wherever one activation carries everything forward (after a
    transformer block's attention residual, say): its parts are `blocks.3#0`,
    `blocks.3#1`, each a unit of its own."""
    out, seen_block = {}, False
    blocks: dict[str, list[str]] = defaultdict(list)
    for node in plan.nodes.values():
        block = unit_of(node.module)
        seen_block = seen_block or bool(block)
        out[node.name] = block or (EPILOGUE if seen_block else PROLOGUE)
        if block:
            blocks[block].append(node.name)
    graph = traced.nodes
    for block, names in blocks.items():
        parts = _parts(graph, names)
        if len(parts) > 1:
            for i, part in enumerate(parts):
                for name in part:
                    out[name] = f"{block}#{i}"
    return out


def _parts(graph: dict, names: list[str]) -> list[list[str]]:
    """`names` (a block's nodes, in order) cut after every node past which a single
    activation is live: produced in the block and used later, or entering the block
    and used by a later node of it. Parameters do not count."""
    position = {name: i for i, name in enumerate(names)}
    last_use: dict[str, float] = {}  # value → position of its last use (inf: outside)
    for name in names:
        for inp in graph[name].all_input_nodes:
            if inp.op != "get_attr":
                last_use[inp.name] = max(last_use.get(inp.name, -1), position[name])
        if any(user.name not in position for user in graph[name].users):
            last_use[name] = math.inf
        else:
            last_use.setdefault(name, -1)
            for user in graph[name].users:
                last_use[name] = max(last_use[name], position[user.name])
    parts, start = [], 0
    for j in range(len(names) - 1):
        live = [
            v
            for v, last in last_use.items()
            if last > j and (v not in position or position[v] <= j)
        ]
        if len(live) == 1 and live[0] in position:
            parts.append(names[start : j + 1])
            start = j + 1
    parts.append(names[start:])
    return parts


def _signature(plan: Plan, names: list[str]) -> tuple:
    return tuple((plan.nodes[n].op, plan.nodes[n].shape, plan.nodes[n].strategy) for n in names)


def _boundary(traced, before: Plan, after: Plan, names: set, hardware: Hardware, mesh: Mesh):
    """Seconds to convert what enters the nodes `names` from the layout `before`
    stores it in to the layout `after` does."""
    seconds = 0.0
    graph = traced.nodes
    entering = {
        inp
        for name in names
        for inp in tensor_inputs(graph[name])
        if inp.name in before.nodes and inp.name not in names and before.nodes[inp.name].shape
    }
    for inp in entering:
        val = inp.meta["val"]
        src, dst = before.nodes[inp.name].strategy.stored, after.nodes[inp.name].strategy.stored
        for step in redistribute(src, dst, tuple(val.shape), val.element_size(), mesh):
            seconds += sum(step_time(step, hardware, mesh))
    return seconds


def _columns(problem: Problem):
    xs = [(u, o) for u in problem.units for o in problem.options[u]]
    families = sorted({o.family for u in problem.units for o in problem.options[u]})
    edges = [(u, f, g) for (u, f, g), c in problem.convert.items() if c > 0]
    return xs, families, edges


def solve(problem: Problem, budget: float | None) -> dict[str, Option]:
    """The optimal choice, by HiGHS; raises BudgetError naming the smallest budget."""
    choice = _milp(problem, budget, minimize_memory=False)
    if choice is None:
        smallest = problem.evaluate(_milp(problem, None, minimize_memory=True))[1]
        raise BudgetError(
            f"no plan fits a memory budget of {_gib(budget)} per rank; the smallest that "
            f"fits is {_gib(smallest)} ({int(math.ceil(smallest))} bytes): raise "
            "memory_budget, or use a larger mesh"
        )
    return choice


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.3f} GiB"


def _milp(problem: Problem, budget: float | None, minimize_memory: bool):
    xs, families, edges = _columns(problem)
    n_x, n_e = len(xs), len(edges)
    n = n_x + n_e + 1  # … and R, the replay peak
    index = {key: i for i, key in enumerate(xs)}
    cost = np.zeros(n)
    memory = np.zeros(n)
    for i, key in enumerate(xs):
        cost[i] = problem.time[key]
        memory[i] = problem.memory[key]
    for j, edge in enumerate(edges):
        cost[n_x + j] = problem.convert[edge]
    memory[-1] = 1.0
    rows, lower, upper = [], [], []

    def add(row, lo, hi):
        rows.append(row)
        lower.append(lo)
        upper.append(hi)

    for unit in problem.units:
        row = np.zeros(n)
        for option in problem.options[unit]:
            row[index[unit, option]] = 1
        add(row, 1, 1)
    for j, (unit, f, g) in enumerate(edges):
        before = problem.units[problem.units.index(unit) - 1]
        row = np.zeros(n)
        row[n_x + j] = 1
        for option in problem.options[before]:
            row[index[before, option]] -= option.family == f
        for option in problem.options[unit]:
            row[index[unit, option]] -= option.family == g
        add(row, -1, np.inf)
    for key, i in index.items():
        if problem.replay[key]:
            row = np.zeros(n)
            row[-1], row[i] = 1, -problem.replay[key]
            add(row, 0, np.inf)
    if budget is not None:
        add(memory, -np.inf, budget)
    integrality = np.array([1] * n_x + [0] * (n_e + 1))
    upper_bounds = np.array([1] * (n_x + n_e) + [np.inf])
    scale = max(float(np.abs(cost).max()), 1e-30)
    objective = memory / max(float(memory.max()), 1.0) if minimize_memory else cost / scale
    result = milp(
        objective,
        constraints=LinearConstraint(np.array(rows), lower, upper),
        integrality=integrality,
        bounds=Bounds(np.zeros(n), upper_bounds),
        options={"presolve": True},
    )
    if result.x is None:
        return None
    return {u: o for (u, o), v in zip(xs, result.x[:n_x]) if v > 0.5}


def brute_force(problem: Problem, budget: float | None) -> dict[str, Option] | None:
    """The optimal choice by enumeration (for tests on small problems)."""
    best, best_time = None, math.inf
    for combo in itertools.product(*(problem.options[u] for u in problem.units)):
        choice = dict(zip(problem.units, combo))
        time, peak = problem.evaluate(choice)
        if (budget is None or peak <= budget) and time < best_time:
            best, best_time = choice, time
    return best


def plan_model(
    traced: Traced,
    mesh: Mesh,
    *,
    strategy=None,
    memory_budget: float | None = None,
    hardware: Hardware,
    strategy_space: str = "3d",
    optimizer: float = 2.0,
) -> Plan:
    """The plan: forced by `strategy`, else solved; with its predicted cost.

    The solver's budget is `memory_budget`, or the hardware's memory per device.
    A single family with a budget solves only where to recompute."""
    if strategy_space not in SPACES:
        raise StrategyError(
            f"strategy space {strategy_space!r} is not available: choose one of {sorted(SPACES)}"
        )
    if strategy is not None and (memory_budget is None or not isinstance(strategy, str)):
        if memory_budget is not None:
            raise StrategyError("memory_budget needs strategy=None or a single family name")
        plan = plan_graph(traced, mesh, strategy)
    else:
        check_strategy(strategy)
        space = (strategy,) if strategy else SPACES[strategy_space]
        if memory_budget is None:
            memory_budget = hardware.memory_per_device
        problem = build_problem(traced, mesh, hardware, space, optimizer)
        # The problem prices each unit as its family plans it alone; a unit next to one
        # of another family may be planned a little differently. If the plan itself
        # does not fit, solve again with the budget lowered by the overshoot.
        budget = memory_budget
        for _ in range(_REPAIRS):
            plan = _planned(traced, mesh, problem, solve(problem, budget), hardware, optimizer)
            overshoot = plan.cost.peak_memory - (memory_budget or math.inf)
            if overshoot <= 0:
                return plan
            budget -= overshoot
        raise BudgetError(
            f"no plan found within a memory budget of {_gib(memory_budget)} per rank "
            f"(the closest peaks at {_gib(plan.cost.peak_memory)}): raise memory_budget"
        )
    plan.cost = estimate(traced, plan, hardware, optimizer)
    return plan


_REPAIRS = 8


def _planned(traced, mesh, problem: Problem, choice: dict[str, Option], hardware, optimizer):
    families = {name: choice[u].family for name, u in problem.unit.items()}
    reference = {
        f: {name: node.strategy.stored for name, node in plan.nodes.items() if node.shape}
        for f, plan in problem.plans.items()
    }
    first = choice[problem.units[0]].family  # inputs are split on entry as it reads them
    plan = plan_graph(traced, mesh, first, families=families, reference=reference)
    plan.regions = {
        name: u for name, u in problem.unit.items() if choice[u].checkpoint and name in plan.nodes
    }
    plan.choices = {unit: str(option) for unit, option in choice.items()}
    plan.cost = estimate(traced, plan, hardware, optimizer)
    return plan
