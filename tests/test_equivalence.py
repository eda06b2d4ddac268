"""The parallel program equals the serial model: outputs, every gradient, and the
parameters after three SGD steps, on real gloo meshes."""

from pathlib import Path

import pytest

from autoshard.testing import assert_equivalent

MODELS = str(Path(__file__).parent / "models.py")
MIXED = {"layers.*.fc1": "3d-allreduce", "layers.1.*": "replicated", "head": "3d"}


@pytest.mark.parametrize("mesh", [(2, 2, 2), (1, 2, 4), (2, 1, 1), (1, 1, 1)])
@pytest.mark.parametrize("strategy", ["3d", "3d-allreduce", "replicated", MIXED], ids=str)
def test_mlp_matches_serial(mesh, strategy):
    report = assert_equivalent(f"{MODELS}:mlp", mesh, strategy=strategy, steps=3, rtol=1e-5)
    grads = {m.name for m in report if m.what == "grad"}
    assert {"layers.0.fc1.weight", "layers.1.norm.bias", "head.bias"} <= grads
    assert {m.step for m in report if m.what == "output"} == {0, 1, 2}


def test_two_dimensional_input_on_a_cube():
    assert_equivalent(f"{MODELS}:mlp_2d_input", (2, 2, 2), strategy="3d")


def test_a_difference_is_caught():
    # `perturbed_mlp`'s serial reference has one weight off by 1e-3: the check must fail.
    with pytest.raises(AssertionError, match="differs from the serial model"):
        assert_equivalent(f"{MODELS}:perturbed_mlp", (2, 2, 2), strategy="3d", steps=1)
