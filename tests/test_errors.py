"""Bad input gets a clear exception naming the cause, on every rank, and never a hang."""

from pathlib import Path

import pytest
import torch

import autoshard
from autoshard.runtime.ranks import RankError, shared_pool
from autoshard.testing import load_factory

MODELS = str(Path(__file__).parent / "models.py")


def _load(name):
    return load_factory(f"{MODELS}:{name}")()


def test_unknown_strategy():
    model, inputs = _load("mlp")
    with pytest.raises(autoshard.StrategyError, match="unknown strategy '4d'"):
        autoshard.plan(model, (2, 2, 2), inputs, strategy="4d")
    with pytest.raises(autoshard.StrategyError, match="'tp'"):
        autoshard.plan(model, (2, 2, 2), inputs, strategy={"layers.*": "tp"})


def test_mesh_of_four_axes():
    model, inputs = _load("mlp")
    with pytest.raises(autoshard.MeshError, match=r"\(2, 2, 2, 2\)"):
        autoshard.plan(model, (2, 2, 2, 2), inputs)


def test_untraceable_model_reports_what_torch_export_said_and_what_to_do():
    model, inputs = _load("branchy")
    with pytest.raises(autoshard.TraceError) as raised:
        autoshard.plan(model, (2, 2, 2), inputs)
    message = str(raised.value)
    cause = raised.value.__cause__
    said = next(line.strip() for line in str(cause).splitlines() if line.strip())
    assert f"could not trace Branchy: {type(cause).__name__}: {said}" in message
    assert "raised by: File" in message and "if x.sum() > 0:" in message  # the call in forward
    assert "torch.export.export(model, example_inputs, strict=False)" in message
    assert "control flow" not in message  # no guess at the cause


def test_indivisible_dim_names_node_module_and_sizes():
    model, inputs = _load("indivisible_mlp")
    with pytest.warns(UserWarning, match=r"'linear'.*layers\.0\.fc1.*\[8, 4, 5\].*runs replicated"):
        plan = autoshard.plan(model, (2, 2, 2), inputs, strategy="3d")
    assert plan.nodes["linear"].strategy.inputs[0].sharded_axes == ()


def test_parallelize_without_a_process_group():
    model, inputs = _load("mlp")
    with pytest.raises(autoshard.MeshError, match="initialized torch.distributed"):
        autoshard.parallelize(model, None, inputs)


def _mesh_smaller_than_world(mesh):
    model, inputs = _load("mlp")
    autoshard.parallelize(model, mesh["c"], inputs)


def _inputs_of_another_shape(mesh):
    model, inputs = _load("mlp")
    parallel = autoshard.parallelize(model, mesh, inputs)
    parallel(torch.randn(4, 4, 16))


def test_mesh_size_must_equal_world_size():
    with pytest.raises(RankError, match="MeshError: the mesh has 2 devices .* 8 ranks"):
        shared_pool(8).run(_mesh_smaller_than_world, (2, 2, 2))


def test_call_with_inputs_of_another_shape():
    with pytest.raises(RankError, match=r"InputError: inputs of shapes \[\(4, 4, 16\)\]"):
        shared_pool(8).run(_inputs_of_another_shape, (2, 2, 2))
