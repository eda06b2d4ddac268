"""A parameter that several nodes read (a table tied to the lm-head) is stored as is
cheapest over all its readers, not as its first reader wants it: the GPT example's
and GPT-2's lm-heads read the table's rows nested as it is stored, so no conversion
gathers an axis only to split it again (their programs, equal to serial with every
call as predicted, are in test_shared_collectives and test_transformers)."""

from pathlib import Path

import pytest

import autoshard
from autoshard.cost.hardware import Hardware
from autoshard.mesh import Mesh
from autoshard.planning import planner
from autoshard.planning.solver import build_problem, plan_choice
from autoshard.planning.verify import check_plan
from autoshard.runtime.ranks import shared_pool
from autoshard.testing import load_factory
from autoshard.tracing.trace import trace

TESTS = Path(__file__).parent
MESH = (2, 2, 2)
TIED = f"{TESTS}/op_models.py:tied_head"


def _round_trips(plan) -> list[tuple[str, int]]:
    """(node, input) whose conversion gathers an axis and then splits it again."""
    out = []
    for name, placed in plan.nodes.items():
        for i, steps in enumerate(placed.input_steps):
            gathered = set()
            for step in steps:
                if step.kind == "all_gather":
                    gathered.add(step.axis)
                elif step.kind == "split" and step.axis in gathered:
                    out.append((name, i))
    return out


@pytest.mark.parametrize(
    "factory", [f"{TESTS.parent}/examples/gpt.py:gpt", f"{TESTS}/hf_zoo.py:gpt2"], ids=str
)
def test_a_tied_table_is_stored_as_the_lm_head_reads_it(factory):
    if "hf_zoo" in factory:
        pytest.importorskip("transformers")
    model, inputs = load_factory(factory)()
    plan = autoshard.plan(model, MESH, inputs, strategy="3d")
    assert _round_trips(plan) == []
    table = next(n for n in plan.nodes.values() if n.op == "aten.embedding.default")
    head = next(n for n in plan.nodes.values() if n.module.endswith("lm_head"))
    # the lm-head gathers the table over one axis, the outer one it is stored nested in
    weight_steps = head.input_steps[1]
    assert [s.kind for s in weight_steps] == ["all_gather"]
    assert table.strategy.inputs[0].dims[0][0] == head.strategy.inputs[1].dims[0][0]


def _logged(mesh, plan):
    model, inputs = load_factory(TIED)()
    parallel = autoshard.parallelize(model, mesh, inputs, plan=plan)
    with autoshard.comm_log() as log:
        parallel(*inputs).sum().backward()
    return log.bytes_by("node", "kind", "axis", "phase"), parallel.plan.predicted_comm()


def test_the_solver_emits_the_tied_storage_it_priced(monkeypatch):
    """The solver prices each family's plan and emits each node's strategy from it,
    which names where the node's parameters are stored; so a family's plan stores a
    tied table as its lookup's strategy names it, even where another nesting moves
    fewer bytes (here made so: the feature-parallel lookup names one nesting only).
    The solver's plan then converts every input as priced, the program logs that,
    and the plan passes `check_plan`."""
    model, inputs = load_factory(TIED)()
    traced = trace(model, inputs)
    mesh, hardware = Mesh.from_shape(MESH), Hardware.load("nvlink-8")
    own = planner.plan_graph(traced, mesh, "3d")
    [other] = planner._tied_alternatives(traced, own)["embed.weight"]
    traffic = planner._traffic
    monkeypatch.setattr(
        planner, "_traffic", lambda p: (p.storage["embed.weight"] != other, *traffic(p))
    )
    problem = build_problem(traced, mesh, hardware, ("3d",), 2.0)
    [priced] = problem.plans.values()
    choice = {u: next(o for o in problem.options[u] if not o.checkpoint) for u in problem.units}
    plan = plan_choice(traced, mesh, problem, choice, hardware, 2.0)
    assert plan.storage["embed.weight"] == priced.storage["embed.weight"]
    for name, placed in plan.nodes.items():
        assert placed.input_steps == priced.nodes[name].input_steps, name
    check_plan(plan, traced)
    for logged, predicted in shared_pool(8).run(_logged, MESH, plan):
        assert logged == predicted
