"""An example input that requires grad gets exactly the serial gradient, on every rank
(`assert_equivalent` compares it), under several plans and meshes; one planned without
it refuses an input that requires grad instead of returning a gradient never summed."""

from pathlib import Path

import pytest

from autoshard.api import parallelize
from autoshard.errors import InputError
from autoshard.testing import assert_equivalent, load_factory

MODELS = str(Path(__file__).parent / "views_models.py")


@pytest.mark.parametrize(
    "factory, mesh, planning",
    [
        ("two_inputs_with_grad", (2, 2, 2), {"strategy": "3d"}),
        ("two_inputs_with_grad", (1, 2, 4), {"strategy": "3d-allreduce"}),
        ("two_inputs_with_grad", (2, 1, 1), {"strategy": "replicated"}),
        ("transposed_linear_input_grad", (2, 2, 2), {"strategy": "3d"}),
        ("attention_input_grad", (2, 2, 2), {"strategy": "3d-allreduce"}),
        ("attention_input_grad", (1, 2, 4), {"memory_budget": 40_000, "hardware": "cpu-gloo"}),
    ],
    ids=str,
)
def test_input_gradient_matches_serial(factory, mesh, planning):
    report = assert_equivalent(f"{MODELS}:{factory}", mesh, steps=2, **planning)
    assert {m.name for m in report if m.name.startswith("input")} >= {"input 0"}


def _grad_without_plan(device_mesh) -> str:
    model, (x,) = load_factory(f"{MODELS}:transposed_linear")()
    parallel = parallelize(model, device_mesh, (x,), strategy="3d")
    try:
        parallel(x.requires_grad_(True))
    except InputError as e:
        return str(e)
    return "no error"


def test_an_input_that_requires_grad_unplanned_is_refused(rank_pool):
    for message in rank_pool.run(_grad_without_plan, (2, 2, 2)):
        assert "input 'x' requires grad" in message and "requires_grad_(True)" in message
