"""A parameter that several nodes read (a table tied to the lm-head) is stored as is
cheapest over all its readers, not as its first reader wants it: the GPT example's
and GPT-2's lm-heads read the table's rows nested as it is stored, so no conversion
gathers an axis only to split it again (their programs, equal to serial with every
call as predicted, are in test_shared_collectives and test_transformers)."""

from pathlib import Path

import pytest

import autoshard
from autoshard.testing import load_factory

TESTS = Path(__file__).parent
MESH = (2, 2, 2)


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
