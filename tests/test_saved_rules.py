"""Every op's registry entry says exactly what autograd keeps for its backward: per node
of the op models and of a few Hugging Face models, run serially, the bytes autograd
packs while the node runs equal what the entry lists (`autoshard.testing.saved_by_node`).
One process, no ranks."""

import inspect
import warnings

import hf_zoo
import op_models
import pytest
import torch

from autoshard.testing import saved_by_node
from autoshard.tracing.trace import trace

# The op models that trace (the others are there to be refused).
UNTRACEABLE = {"cond_branch", "straight_through"}
OP_MODELS = sorted(
    name
    for name, factory in vars(op_models).items()
    if inspect.isfunction(factory)
    and factory.__module__ == op_models.__name__
    and not name.startswith("_")
    and not inspect.signature(factory).parameters
    and name not in UNTRACEABLE
)
ZOO = ["llama", "gpt2", "bert_mlm", "t5", "mixtral", "falcon", "wav2vec2", "resnet"]


def _mismatches(factory) -> list:
    torch.manual_seed(0)
    model, inputs = factory()
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rows = saved_by_node(trace(model, inputs), inputs)
    assert rows
    return [row for row in rows if row.measured != row.predicted]


@pytest.mark.parametrize("name", OP_MODELS)
def test_op_models_keep_what_their_entries_say(name):
    assert _mismatches(getattr(op_models, name)) == []


@pytest.mark.parametrize("name", ZOO)
def test_hugging_face_models_keep_what_their_entries_say(name):
    assert _mismatches(getattr(hf_zoo, name)) == []
