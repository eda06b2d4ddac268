"""One entry per op: a second registration is an error; what the cost model and the
passes use is the entry's; the explicit-attention matmuls (q @ kᵀ, p @ v) take the
activation-product rule and keep the scores split."""

import importlib
import json
import math
import operator
import pkgutil
from pathlib import Path

import pytest
import torch
from torch.ops import aten
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import autoshard
from autoshard.errors import PlanError
from autoshard.mesh import Mesh
from autoshard.planning.plan import Plan
from autoshard.planning.planner import plan_graph
from autoshard.runtime.ranks import shared_pool
from autoshard.strategies import (
    Lowering,
    entries,
    entry_for,
    lowering_named,
    register,
    rule_for,
)
from autoshard.strategies.linear import matmul
from autoshard.strategies.norm import LAYER_NORM
from autoshard.testing import load_factory
from autoshard.tracing.trace import trace

GPT = Path(__file__).parents[1] / "examples/gpt.py"
MESH = (2, 2, 2)


def test_registering_an_op_twice_is_an_error():
    with pytest.raises(ValueError, match="aten.matmul.default already has the rule"):
        register(aten.matmul.default)(lambda ctx: [])
    assert rule_for(aten.matmul.default) is matmul
    with pytest.raises(ValueError, match="getitem.* already has an entry without a rule"):
        register(operator.getitem, free=True)()
    # a second lowering of a known name is refused before anything is registered
    clash = Lowering("layer_norm", lambda node, placed, mesh: None)
    with pytest.raises(ValueError, match="two lowerings are named 'layer_norm'"):
        register(aten.cummax.default, lowerings=(clash,))(lambda ctx: [])
    assert entry_for(aten.cummax.default) is None


def test_every_op_has_one_entry():
    ops = [entry.op for entry in entries()]
    assert len(ops) == len(set(ops))
    assert all(entry_for(op).op is op for op in ops)


def test_every_lowering_can_be_read_back_from_a_saved_plan():
    """Every lowering is known by its name (one an entry lists, or the one of ops with
    no rule): one that is not could not be read back from a saved plan (attention's
    causal rows were such a one)."""
    modules = pkgutil.iter_modules(autoshard.strategies.__path__, "autoshard.strategies.")
    defined = [
        value
        for info in modules
        for value in vars(importlib.import_module(info.name)).values()
        if isinstance(value, Lowering)
    ]
    assert len(defined) > 5
    assert all(lowering_named(lowering.name) is lowering for lowering in defined)


def test_the_plan_names_the_entries_lowerings():
    # every lowering a chosen strategy takes is one its op's entry lists, and a plan
    # read back from JSON holds the same objects
    model, inputs = load_factory(f"{GPT}:gpt")()
    traced = trace(model, inputs)
    plan = autoshard.plan(model, MESH, inputs, strategy="3d")
    lowered = {n: p.strategy.lowering for n, p in plan.nodes.items() if p.strategy.lowering}
    assert LAYER_NORM in lowered.values()
    for name, lowering in lowered.items():
        assert lowering in entry_for(traced.nodes[name].target).lowerings, name
    again = Plan.from_json(plan.to_json())
    assert {n: p.strategy.lowering for n, p in again.nodes.items()} == {
        n: p.strategy.lowering for n, p in plan.nodes.items()
    }
    assert all(again.nodes[n].strategy.lowering is lowering for n, lowering in lowered.items())
    data = json.loads(plan.to_json())
    node = next(n for n in data["nodes"] if n["strategy"]["lowering"] == "layer_norm")
    node["strategy"]["lowering"] = "layer_normal"
    with pytest.raises(PlanError, match=r"strategy.lowering: no lowering is named 'layer_normal'"):
        Plan.from_json(json.dumps(data))


BATCH, HEADS, SEQ = 4, 4, 32  # the scores, 4·4·32·32, outsize every other tensor


def _explicit():
    return load_factory(f"{GPT}:gpt_explicit")(batch=BATCH, n_head=HEADS, seq=SEQ)


def test_explicit_attention_scores_split_over_batch_and_heads():
    model, inputs = _explicit()
    plan = plan_graph(trace(model, inputs), Mesh.from_shape(MESH), "3d")
    scores = [placed for placed in plan.nodes.values() if placed.op == "aten.matmul.default"]
    assert len(scores) == 4  # q @ kᵀ and p @ v in each of two blocks
    for placed in scores:
        batch, heads, rows, cols = placed.strategy.stored.dims
        assert batch and heads and not cols, (placed.name, placed.strategy.stored)
        assert math.prod(placed.local_shape) * math.prod(MESH) == math.prod(placed.shape)


class _Largest(TorchDispatchMode):
    """The most elements of any tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def _largest_job(mesh):
    torch.manual_seed(0)
    model, inputs = _explicit()
    serial = _Largest()
    with serial:
        model(*inputs).backward()
    parallel = autoshard.parallelize(model, mesh, inputs, strategy="3d")
    rank = _Largest()
    with rank:
        parallel(*inputs).backward()
    return serial.numel, rank.numel


def test_no_rank_holds_the_whole_scores():
    # Serially the largest tensors are the [B, heads, S, S] scores and probabilities
    # (and their gradients). Replicated, every rank would hold them whole; split over
    # batch and heads a rank holds an eighth, and the largest it makes is a quarter
    # of the MLP's hidden activation, [B, S, 4·d] split over M.
    for serial, rank in shared_pool(math.prod(MESH)).run(_largest_job, MESH):
        assert serial == BATCH * HEADS * SEQ * SEQ
        assert rank <= serial // 4
