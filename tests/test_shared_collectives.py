"""Collectives run once for several nodes: a conversion read by several nodes, the
parameter-gradient reductions of an axis packed into a bucket, a unit's parameter
gathers packed into one call each way, the vocabulary-parallel loss's sums in one
buffer. The program still equals serial, and every call and byte
is as the plan predicts."""

import dataclasses
from collections import Counter
from pathlib import Path

import torch

import autoshard
from autoshard.mesh import Mesh
from autoshard.planning import plan as plan_module
from autoshard.planning.collectives import gathered_step, share_collectives
from autoshard.planning.planner import plan_graph
from autoshard.planning.units import in_block, units_of
from autoshard.runtime.ranks import shared_pool
from autoshard.testing import assert_equivalent, load_factory
from autoshard.tracing.trace import tensor_inputs, trace

GPT = f"{Path(__file__).parents[1]}/examples/gpt.py:gpt"
BATCH_NORMS = f"{Path(__file__).parent}/op_models.py:batch_norms"
CLASS_LOSSES = f"{Path(__file__).parent}/op_models.py:class_losses"
MESH = (2, 2, 2)


def test_plan_shares_conversions_and_buckets_parameter_gradients():
    model, inputs = load_factory(GPT)()
    plan = autoshard.plan(model, MESH, inputs, strategy="3d")
    assert plan.shared  # q, k and v read one gathered layer-norm output
    for s in plan.shared:
        assert (
            plan.nodes[s.node].input_steps[s.input]
            == plan.nodes[s.source].input_steps[s.source_input]
        )
    served = [(name, i) for b in plan.buckets for name, i in b.serves]
    assert {b.axis for b in plan.buckets} == {"a", "b", "c"}
    # every parameter gradient a grad_all_reduce reduces is in a bucket of its axis
    for name, placed in plan.nodes.items():
        for i, steps in enumerate(placed.input_steps):
            if steps and all(s.kind == "grad_all_reduce" for s in steps):
                assert (name, i) in served or not placed.input_needs_grad[i]
    plain = dataclasses.replace(plan, shared=(), buckets=(), gathers=())  # each its own
    assert len(plan.predicted_calls()) < 0.6 * len(plain.predicted_calls())


def _gpt_3d(recomputed: bool = False) -> tuple:
    """The GPT example traced, its "3d" plan (with every block part recomputed), and
    the plan's units."""
    model, inputs = load_factory(GPT)()
    traced = trace(model, inputs)
    plan = plan_graph(traced, Mesh.from_shape(MESH), "3d")
    units = units_of(traced, plan)
    if recomputed:
        plan.regions = {name: unit for name, unit in units.items() if in_block(unit)}
    return traced, share_collectives(traced, plan, units), units


def test_a_units_parameter_gathers_are_one_call_each_way():
    traced, plan, units = _gpt_3d()
    served = {s: g for g in plan.gathers for s in g.serves}
    alone = Counter()  # (unit, axis) → gathers no bucket runs
    for name, placed in plan.nodes.items():
        for i, value in enumerate(tensor_inputs(traced.nodes[name])):
            step = gathered_step(value, placed, i, plan)
            if step is not None and (name, i) not in served:
                alone[units[name], step.axis] += 1
    assert plan.gathers and set(alone.values()) <= {1}  # one in its unit is a plain step
    for g in plan.gathers:
        assert len({units[name] for name, _ in g.serves}) == 1
        steps = [plan.nodes[name].input_steps[i] for name, i in g.serves]
        assert all(len(s) == 1 and s[0].axis == g.axis for s in steps)
        assert g.nbytes == sum(s[0].nbytes for s in steps)
    # q, k, v and the output projection of each block: their weights in one call
    assert sorted(len(g.serves) for g in plan.gathers) == [2, 2, 4, 4]


def test_gather_buckets_of_recomputed_units_gather_again_as_predicted():
    _, plan, _ = _gpt_3d(recomputed=True)
    calls = Counter(
        (c.kind, c.phase) for c in plan.predicted_calls() if c.node.startswith("gather")
    )
    assert calls == {
        ("all_gather", "forward"): 4,
        ("all_gather", "recompute"): 4,
        ("reduce_scatter", "backward"): 4,
    }
    for logged, predicted, _, _ in shared_pool(8).run(_calls, MESH, GPT, plan):
        assert logged == predicted
    assert_equivalent(GPT, MESH, plan=plan)


def test_no_reader_shares_a_conversion_made_before_an_update_in_place():
    # Both sums slice `m` alike; one conversion for both read it before the update
    # (the output was off by 148 before).
    name = f"{Path(__file__).parent}/op_models.py:updated_between_readers"
    model, inputs = load_factory(name)()
    plan = autoshard.plan(model, MESH, inputs, strategy="3d")
    assert not any({s.node, s.source} == {"add", "add_1"} for s in plan.shared)
    assert_equivalent(name, MESH, strategy="3d")


def test_a_layer_norm_over_split_features_makes_one_call_per_axis_each_way():
    model, inputs = load_factory(GPT)()
    plan = autoshard.plan(model, MESH, inputs, strategy="3d")
    norms = [n for n in plan.nodes.values() if n.op == "aten.layer_norm.default"]
    assert norms and all(n.strategy.internal for n in norms)
    for norm in norms:
        steps = norm.strategy.internal
        axes = {s.axis for s in steps}
        ways = Counter((s.forward_collective, s.backward_collective) for s in steps)
        assert ways == {("all_gather", "none"): len(axes), ("none", "all_reduce"): len(axes)}


def _calls(mesh, spec=GPT, plan=None):
    model, inputs = load_factory(spec)()
    parallel = autoshard.parallelize(model, mesh, inputs, plan=plan, strategy="3d")
    with autoshard.comm_log() as log:
        parallel(*inputs).sum().backward()
    logged = Counter((r.node, r.kind, r.axis, r.phase, r.bytes) for r in log.records)
    predicted = Counter(
        (c.node, c.kind, c.axis, c.phase, c.nbytes) for c in parallel.plan.predicted_calls()
    )
    buckets = {r.node: r for r in log.records if r.serves}
    planned = {b.name: b.serves for b in (*parallel.plan.buckets, *parallel.plan.gathers)}
    return logged, predicted, buckets, planned


def test_every_call_is_predicted_and_a_bucket_logs_once_naming_its_nodes():
    for logged, predicted, buckets, planned in shared_pool(8).run(_calls, MESH):
        assert logged == predicted  # each call, its node, kind, axis, phase and bytes
        assert set(buckets) == set(planned)
        for name, record in buckets.items():
            nodes = [n for n, _ in record.serves]
            assert nodes == list(dict.fromkeys(n for n, _ in planned[name]))
            assert sum(b for _, b in record.serves) == record.bytes


def test_a_batch_norm_over_a_split_batch_combines_its_statistics_as_predicted():
    """One all-gather of every rank's per-channel mean and M2 per axis that splits the
    batch or space, one all-reduce of two sums per axis in backward, as the plan says."""
    model, inputs = load_factory(BATCH_NORMS)()
    plan = autoshard.plan(model, MESH, inputs, strategy="3d")
    combined = [n for n in plan.nodes.values() if repr(n.strategy.lowering) == "batch_norm"]
    assert len(combined) == 3
    for logged, predicted, _, _ in shared_pool(8).run(_calls, MESH, BATCH_NORMS):
        assert logged == predicted
        assert {kind for node, kind, *_ in logged if node.startswith("batch_norm")} == {
            "all_gather",
            "all_reduce",
        }


def test_losses_over_split_classes_make_the_calls_predicted():
    """Per row the maximum and one buffer of sums (target score, class weight, what
    smoothing needs) over the class axes, the loss with a mean's divisor over the
    row axes (besides the conversions of their inputs)."""
    for logged, predicted, _, _ in shared_pool(8).run(_calls, MESH, CLASS_LOSSES):
        assert logged == predicted
        losses = {(kind, phase) for node, kind, _, phase, _ in logged if "_loss" in node}
        assert ("all_reduce", "forward") in losses


def test_shared_and_bucketed_program_equals_serial():
    assert_equivalent(GPT, MESH, strategy="3d")


def _stepped(mesh, programs):
    """Each program's logged calls and full gradients after one step."""
    out = []
    for compiled in programs:
        torch.manual_seed(0)
        model, inputs = load_factory(GPT)()
        parallel = autoshard.parallelize(model, mesh, inputs, compiled=compiled)
        with autoshard.comm_log() as log:
            parallel(*inputs).backward()
        logged = Counter((r.node, r.kind, r.axis, r.phase, r.bytes) for r in log.records)
        served = [r.serves for r in log.records if r.node.startswith("grad_bucket")]
        out.append((logged, served, parallel.full_grads()))
    return out


def test_a_bucket_over_the_cap_is_reduced_in_several_calls(monkeypatch):
    model, inputs = load_factory(GPT)()
    whole = autoshard.compile(model, MESH, inputs, strategy="3d")
    monkeypatch.setattr(plan_module, "BUCKET_BYTES", 256)
    cut = autoshard.compile(model, MESH, inputs, strategy="3d")
    assert all(len(b.calls) == -(-b.nbytes // 256) for b in cut.plan.buckets)
    assert sum(len(b.calls) for b in cut.plan.buckets) > len(cut.plan.buckets)
    predicted = Counter(
        (c.node, c.kind, c.axis, c.phase, c.nbytes) for c in cut.plan.predicted_calls()
    )
    for (_, _, plain), (logged, served, grads) in shared_pool(8).run(_stepped, MESH, [whole, cut]):
        assert logged == predicted
        assert all(sum(b for _, b in record) <= 256 for record in served)
        for name, grad in grads.items():
            assert torch.equal(grad, plain[name]), name
