"""`autoshard.compile` makes, once, what every rank needs: it pickles without the
weights, rebuilds the very program `emit` writes, and refuses a model that is not
the one it was compiled from (no ranks here; tests/test_zoo.py runs compiled
programs on ranks)."""

import pickle
import warnings
from pathlib import Path

import pytest
import torch

import autoshard
from autoshard.factory import load_factory
from autoshard.tracing.modes import trace_modes
from passes import emit

GPT = Path(__file__).parents[1] / "examples/gpt.py"


def _gpt():
    torch.manual_seed(0)
    return load_factory(f"{GPT}:gpt")()


def _programs(gm: torch.fx.GraphModule) -> dict[str, str]:
    return {n: m.code for n, m in gm.named_modules() if isinstance(m, torch.fx.GraphModule)}


@pytest.mark.parametrize("budget", [None, "tight"])
def test_compiled_pickles_and_rebuilds_the_emitted_program(budget):
    model, inputs = _gpt()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if budget is None:  # solved, with no budget
            compiled = autoshard.compile(model, (2, 2, 2), inputs)
        else:  # "3d" under a budget its plain plan exceeds: recomputation solved for
            free = autoshard.plan(model, (2, 2, 2), inputs, strategy="3d")
            limit = 0.8 * free.cost.peak_memory
            compiled = autoshard.compile(
                model, (2, 2, 2), inputs, strategy="3d", memory_budget=limit
            )
    if budget is not None:
        assert compiled.plan.regions  # a region to recompute: a nested program
    blob = pickle.dumps(compiled)
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert len(blob) < weights  # no weights inside
    again = pickle.loads(blob)
    rebuilt = again.program.build(again.parameters(model))
    want = emit(trace_modes(model, inputs), compiled.plan)
    assert _programs(rebuilt) == _programs(want)
    assert len(_programs(rebuilt)) == 1 + len(set(compiled.plan.regions.values()))


def test_a_model_unlike_the_compiled_one_is_refused():
    model, inputs = _gpt()
    compiled = autoshard.compile(model, (2, 2, 2), inputs, strategy="3d")
    name, param = next(iter(model.named_parameters()))
    with torch.no_grad():
        param.data = param.data.double()
    with pytest.raises(autoshard.InputError, match=f"'{name}' is float64"):
        compiled.parameters(model)
    with pytest.raises(autoshard.InputError, match="has no parameter"):
        compiled.parameters(torch.nn.Linear(2, 2))
