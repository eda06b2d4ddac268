"""A layer's knobs: the weight stored split over M or whole over it, and
the input kept as its stored shard and gathered again in backward. Plans with every
knob turned run equal to serial, log exactly the predicted collectives (the
re-gathers as "backward"), and store and save what the cost model says."""

import math
from pathlib import Path

import pytest
import torch

import autoshard
from autoshard.cost.hardware import Hardware
from autoshard.cost.model import node_costs
from autoshard.layout import Layout
from autoshard.mesh import Mesh
from autoshard.planning.estimate import first_users
from autoshard.planning.planner import Knobs, default_split, plan_graph
from autoshard.runtime.ops import _PRODUCT_GRADS, keep_shard
from autoshard.runtime.ranks import shared_pool
from autoshard.strategies import entries
from autoshard.testing import assert_equivalent, load_factory
from autoshard.tracing.trace import trace

GPT = f"{Path(__file__).parents[1]}/examples/gpt.py:gpt"
LOOKUP = f"{Path(__file__).parent}/op_models.py:lookup_then_layer"
UP_AND_DOWN = f"{Path(__file__).parent}/op_models.py:up_and_down"
CHUNK = f"{Path(__file__).parent}/op_models.py:layer_on_a_chunk"
MESH = (2, 2, 2)


def _turned(family: str, regather: bool = True, spec: str = GPT):
    """The model planned in `family` with every layer's knobs turned."""
    model, inputs = load_factory(spec)()
    traced = trace(model, inputs)
    mesh = Mesh.from_shape(MESH)
    base = plan_graph(traced, mesh, family)
    layers = [n for n, p in base.nodes.items() if p.strategy.split_weight is not None]
    knobs = Knobs(split_weight=not default_split(family), regather=regather)
    return traced, base, plan_graph(traced, mesh, family, knobs=dict.fromkeys(layers, knobs))


def _logged(mesh, plan, spec=GPT):
    model, inputs = load_factory(spec)()
    parallel = autoshard.parallelize(model, mesh, inputs, plan=plan)
    with autoshard.comm_log() as log:
        parallel(*inputs).backward()
    return log.bytes_by("node", "kind", "axis", "phase"), parallel.plan.predicted_comm()


@pytest.mark.parametrize("family", ["3d", "3d-allreduce"])
def test_turned_knobs_match_serial_and_log_what_is_predicted(family):
    traced, base, plan = _turned(family)
    layers = [p for p in plan.nodes.values() if p.strategy.split_weight is not None]
    assert all(p.strategy.split_weight != default_split(family) for p in layers)
    if family == "3d":  # every layer's input arrives by an all-gather: all kept as shards
        assert all(p.strategy.regather for p in layers)
    for logged, predicted in shared_pool(8).run(_logged, MESH, plan):
        assert logged == predicted
        assert any(k[1] == "all_gather" and k[3] == "backward" for k in predicted)
    assert_equivalent(GPT, MESH, plan=plan)


def test_turned_knobs_of_convolutions_plain_and_transposed_match_serial():
    traced, base, plan = _turned("3d", spec=UP_AND_DOWN)
    kept = {p.op for p in plan.nodes.values() if p.strategy.regather}
    assert {"aten.conv2d.default", "aten.conv_transpose2d.input"} <= kept
    for logged, predicted in shared_pool(8).run(_logged, MESH, plan, UP_AND_DOWN):
        assert logged == predicted
    assert_equivalent(UP_AND_DOWN, MESH, plan=plan)


def test_a_layer_keeps_one_piece_of_a_chunk_as_its_shard():
    # The piece is a getitem: its stored layout is the chunk's output's. Costing the
    # kept shard raised before (ProphetNet under the default solver).
    model, inputs = load_factory(CHUNK)()
    traced = trace(model, inputs)
    plan = plan_graph(traced, Mesh.from_shape(MESH), "3d", knobs={"linear_1": Knobs(regather=True)})
    assert plan.nodes["linear_1"].strategy.regather == (0,)
    # the piece it keeps is its stored shard: a view of what `up` stores, counted once
    assert set(node_costs(traced, plan, Hardware.load("nvlink-8"))["linear_1"].shared) == {"linear"}
    assert_equivalent(CHUNK, MESH, plan=plan)


def test_knobs_change_what_is_stored_and_saved_as_the_cost_model_says():
    traced, base, plan = _turned("3d")
    hardware = Hardware.load("nvlink-8")
    before, after = node_costs(traced, base, hardware), node_costs(traced, plan, hardware)
    owners = first_users(traced, base)  # a tied table is stored as the embedding wants
    d = 2
    for name, placed in plan.nodes.items():
        if placed.strategy.split_weight is None:
            continue
        inputs = traced.nodes[name].all_input_nodes
        weight = next(i for i, n in enumerate(inputs) if n.op == "get_attr")
        fqn = inputs[weight].target
        shape = tuple(traced.parameters[fqn].shape)
        if owners[fqn] == name:
            numel = traced.parameters[fqn].numel()
            assert math.prod(base.storage[fqn].local_shape(shape, base.mesh)) == numel // d**3
            assert math.prod(plan.storage[fqn].local_shape(shape, plan.mesh)) == numel // d**2
        # the input is kept at 1/d³ of the activation instead of 1/d², and backward
        # pays one more all-gather of it
        x = inputs[0 if weight else 1]
        numel, itemsize = x.meta["val"].numel(), x.meta["val"].element_size()
        assert before[name].saved_bytes - after[name].saved_bytes >= numel * itemsize // 8
        assert sum(after[name].backward_comm.values()) > sum(before[name].backward_comm.values())


PRODUCTS = [  # (op, its arguments, the input kept as a shard)
    ("aten.linear.default", [(2, 3, 4), (5, 4)], 0),
    ("aten.linear.default", [(2, 3, 4), (5, 4), (5,)], 0),
    ("aten.addmm.default", [(5,), (3, 4), (4, 5)], 1),
    ("aten.mm.default", [(3, 4), (4, 5)], 0),
    ("aten.matmul.default", [(2, 3, 4), (4, 5)], 0),
    ("aten.conv1d.default", [(2, 2, 8), (4, 2, 3)], 0),
    ("aten.conv2d.default", [(2, 3, 8, 8), (4, 3, 3, 3), (4,), [2, 1], [1], [1, 1], 1], 0),
    ("aten.conv2d.default", [(2, 4, 8, 8), (6, 2, 3, 3), None, [1], [0], [1], 2], 0),
    ("aten.conv_transpose1d.default", [(2, 4, 8), (4, 3, 2), (3,), [2]], 0),
    (  # stride, padding, output_padding, groups, dilation
        "aten.conv_transpose2d.input",
        [(2, 4, 5, 5), (4, 3, 3, 3), (6,), [2, 1], [1], [1, 0], 2, [1, 2]],
        0,
    ),
    ("aten.conv_transpose3d.input", [(2, 2, 3, 3, 3), (2, 2, 2, 2, 2)], 0),
]


@pytest.mark.parametrize("op, args, index", PRODUCTS)
def test_a_kept_shard_gets_the_gradients_autograd_gives(op, args, index):
    """keep_shard's own derivative of each product it takes equals the op's autograd
    (no mesh: no steps gather the kept input)."""
    torch.manual_seed(0)
    tensors = [torch.randn(a) if isinstance(a, tuple) else a for a in args]
    ours = [t.clone().requires_grad_() if isinstance(t, torch.Tensor) else t for t in tensors]
    theirs = [t.clone().requires_grad_() if isinstance(t, torch.Tensor) else t for t in tensors]
    out = keep_shard(op, *ours, index=index, steps=(), node="product", mesh=None)
    _, name, overload = op.split(".")
    want = getattr(getattr(torch.ops.aten, name), overload)(*theirs)
    grad = torch.randn_like(want)
    out.backward(grad)
    want.backward(grad)
    assert torch.allclose(out, want)
    for got, expected in zip(ours, theirs):
        if isinstance(got, torch.Tensor):
            assert torch.allclose(got.grad, expected.grad, atol=1e-5), f"{op}: {got.shape}"


def test_the_ops_that_regather_are_those_keep_shard_differentiates():
    regathering = {str(entry.op) for entry in entries() if entry.regathers}
    assert regathering == set(_PRODUCT_GRADS)


def test_an_embedding_never_regathers_its_ids():
    """Ids that arrive split over every axis (as the solver's plan passes them in when
    its first part runs data parallel) are all-gathered before the feature-parallel
    lookup; the regather knob turned on every layer keeps the linear's input as a
    shard but not the ids (keep_shard has no lookup's derivative), and the plan runs
    equal to serial."""
    model, inputs = load_factory(LOOKUP)()
    traced = trace(model, inputs)
    mesh = Mesh.from_shape(MESH)
    split_ids = {"ids": Layout((mesh.names, ()))}
    layers = dict.fromkeys(["embedding", "linear"], Knobs(regather=True))
    plan = plan_graph(traced, mesh, "3d", inputs=split_ids, knobs=layers)
    lookup = plan.nodes["embedding"]
    assert lookup.strategy.family == "feature-parallel"
    assert any(s.forward_collective == "all_gather" for s in lookup.input_steps[1])
    assert lookup.strategy.regather == ()
    assert plan.nodes["linear"].strategy.regather == (0,)
    assert_equivalent(LOOKUP, MESH, plan=plan)
