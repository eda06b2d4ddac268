"""The named uniform layouts: "dp" (data parallel over every axis) and "megatron"
(Megatron-LM's tensor parallelism over the mesh's last axis, data parallel over the
others). Each equals serial, lays its weights out as its namesake does, and runs
exactly its namesake's collectives, call for call as the plan predicts."""

from collections import Counter
from pathlib import Path

import pytest
import torch

import autoshard
from autoshard.cost.hardware import Hardware
from autoshard.layout import Layout
from autoshard.mesh import Mesh
from autoshard.planning.solver import (
    SPACES,
    build_problem,
    plan_choice,
    smallest_peak,
    solve,
)
from autoshard.runtime.ranks import shared_pool
from autoshard.testing import assert_equivalent, load_factory
from autoshard.tracing.trace import trace

ROOT = Path(__file__).parents[1]
GPT, LLAMA = f"{ROOT}/examples/gpt.py:gpt", f"{ROOT}/examples/llama.py:llama"
MODELS = f"{ROOT}/tests/models.py"
COLUMN, ROW = Layout((("c",), ())), Layout(((), ("c",)))  # a weight [out, in] over c


@pytest.mark.parametrize(
    "factory, mesh, strategy",
    [
        (GPT, (2, 2, 2), "megatron"),
        (GPT, (1, 2, 4), "megatron"),
        (GPT, (8,), "megatron"),  # one axis: tensor parallel over all 8 ranks
        (f"{MODELS}:gpt_batch8", (2, 2, 2), "dp"),
        (f"{MODELS}:gpt_batch8", (1, 1, 8), "dp"),
        (LLAMA, (2, 2, 2), "megatron"),
        (f"{MODELS}:llama_kv4", (1, 2, 4), "megatron"),  # 4 key/value heads over c
        (f"{MODELS}:llama_batch8", (2, 2, 2), "dp"),
        (f"{MODELS}:llama_batch8", (1, 1, 8), "dp"),
        (f"{MODELS}:gpt_batch8", (2, 2, 2), {"*": "dp", "blocks.*.mlp.*": "megatron"}),
        (f"{ROOT}/tests/hf_zoo.py:llama", (2, 2, 2), "megatron"),
        (f"{MODELS}:scaled_by_a_scalar", (2, 2, 2), "megatron"),  # a 0-d input
        (f"{MODELS}:scaled_by_a_scalar", (2, 2, 2), "dp"),
    ],
    ids=lambda v: Path(v).name.replace(".py", "") if isinstance(v, str) else str(v),
)
def test_named_strategies_match_serial(factory, mesh, strategy):
    report = assert_equivalent(factory, mesh, strategy=strategy)
    assert sum(m.what == "grad" for m in report) > 0  # every gradient was compared


def _plan(factory: str, mesh, strategy):
    model, inputs = load_factory(factory)()
    return autoshard.plan(model, mesh, inputs, strategy=strategy)


def test_megatron_splits_columns_then_rows_over_the_last_axis():
    gpt, llama = _plan(GPT, (2, 2, 2), "megatron"), _plan(LLAMA, (2, 2, 2), "megatron")
    column = ("attn.q.", "attn.k.", "attn.v.", "mlp.fc.", "q_proj", "k_proj", "v_proj")
    column += ("gate_proj", "up_proj")
    row = ("attn.proj.", "mlp.proj.", "o_proj", "down_proj")
    for plan in (gpt, llama):
        for name, layout in plan.storage.items():
            if not name.startswith("blocks.") or not name.endswith("weight"):
                continue
            if any(part in name for part in column):
                assert layout == COLUMN, name
            elif any(part in name for part in row):
                assert layout == ROW, name
            else:  # norms: whole
                assert not layout.sharded_axes, name
        # the vocabulary-parallel word embedding, which the tied lm-head reads as stored
        assert plan.storage.get("wte.weight", plan.storage.get("embed.weight")) == COLUMN
    assert not gpt.storage["wpe.weight"].sharded_axes  # a position table stays whole
    # the residual stream: split over the batch on a, b, whole over c
    norms = [n for n in gpt.nodes.values() if n.op == "aten.layer_norm.default"]
    assert {n.strategy.stored for n in norms} == {Layout((("a", "b"), (), ()))}


def _megatron_calls(layers: int, position_table: bool) -> Counter:
    """Megatron-LM's collectives in one step on 2×2×2 (tensor parallel over c, data
    parallel over a and b), per (kind, axis, phase)."""
    calls = Counter()
    calls["all_reduce", "c", "forward"] = (
        1  # the vocabulary-parallel embedding's sum
        + 2 * layers  # g: after each row-parallel layer (attention and MLP output)
        + 2  # the vocabulary-parallel loss: row maxima, then (sum of exp, target logit)
    )
    calls["all_reduce", "c", "backward"] = (
        2 * layers  # f: at each column-parallel input group (q, k, v; fc or gate, up)
        + 1  # f at the column-parallel lm-head
    )
    for axis in ("a", "b"):
        calls["all_reduce", axis, "forward"] = 1  # the loss's mean over tokens
        # the gradient bucket; and a position table's output gradient, summed over the
        # batch shards (Megatron sums the table's gradient in its bucket instead)
        calls["all_reduce", axis, "backward"] = 1 + position_table
    return calls


def test_megatron_runs_megatrons_collectives_and_fewer_than_any():
    for factory, position_table in ((GPT, True), (LLAMA, False)):
        plan = _plan(factory, (2, 2, 2), "megatron")
        calls = plan.predicted_calls()
        assert Counter((c.kind, c.axis, c.phase) for c in calls) == _megatron_calls(
            2, position_table
        )
        assert {b.axis for b in plan.buckets} == {"a", "b"}  # data parallel's gradients
        assert Counter(c.node for c in calls)["linear"] == 1  # q, k, v: one, shared
        for old in ("any", "any-allreduce"):  # the per-layer greedy choice
            assert len(calls) < len(_plan(factory, (2, 2, 2), old).predicted_calls())
    assert len(_plan(GPT, (2, 2, 2), "megatron").predicted_calls()) == 18


def test_dp_replicates_every_parameter_and_reduces_only_gradients():
    model, inputs = load_factory(f"{MODELS}:llama_batch8")()
    plan = autoshard.plan(model, (2, 2, 2), inputs, strategy="dp")
    for name, _ in model.named_parameters():
        assert not plan.storage[name].sharded_axes, name
    assert plan.storage["idx"] == Layout((("a", "b", "c"), ()))  # each rank reads 1/8
    linears = [n for n in plan.nodes.values() if n.op == "aten.linear.default"]
    assert {n.strategy.stored for n in linears} == {Layout((("a", "b", "c"), (), ()))}
    calls = plan.predicted_calls()
    buckets = {b.name for b in plan.buckets}
    assert buckets == {"grad_bucket_a", "grad_bucket_b", "grad_bucket_c"}
    # the gradient buckets, and the loss's mean over the batch shards
    assert {c.node for c in calls} == buckets | {"cross_entropy_loss"}
    assert Counter(c.phase for c in calls) == {"backward": 3, "forward": 3}


def _logged(mesh, cases):
    """Each case's logged calls, and the calls its plan predicts."""
    out = []
    for factory, compiled in cases:
        torch.manual_seed(0)  # as the test process built it
        model, inputs = load_factory(factory)()
        parallel = autoshard.parallelize(model, mesh, inputs, compiled=compiled)
        with autoshard.comm_log() as log:
            parallel(*inputs).backward()
        logged = Counter((r.node, r.kind, r.axis, r.phase, r.bytes) for r in log.records)
        predicted = Counter(
            (c.node, c.kind, c.axis, c.phase, c.nbytes) for c in parallel.plan.predicted_calls()
        )
        out.append((logged, predicted))
    return out


def test_the_comm_log_is_the_predicted_calls():
    cases = [(GPT, "megatron"), (LLAMA, "megatron"), (f"{MODELS}:llama_batch8", "dp")]
    compiled = []
    for factory, strategy in cases:
        torch.manual_seed(0)  # as every rank builds the model
        model, inputs = load_factory(factory)()
        compiled.append((factory, autoshard.compile(model, (2, 2, 2), inputs, strategy=strategy)))
    for rank in shared_pool(8).run(_logged, (2, 2, 2), compiled):
        for (logged, predicted), case in zip(rank, cases):
            assert logged == predicted, case


def test_the_solver_takes_megatron_for_some_block_parts_and_the_plan_matches_serial():
    model, inputs = load_factory(GPT)()
    traced, mesh, hardware = trace(model, inputs), Mesh.from_shape((2, 2, 2)), "nvlink-8"
    problem = build_problem(traced, mesh, Hardware.load(hardware), SPACES["all"], 2.0)
    free = problem.evaluate(solve(problem, None))[1]
    budget = (smallest_peak(problem) + free) / 2  # neither all replicated nor at the floor
    choice = solve(problem, budget)
    assert any(option.family == "megatron" for option in choice.values())
    plan = plan_choice(traced, mesh, problem, choice, Hardware.load(hardware), 2.0)
    assert_equivalent(GPT, (2, 2, 2), plan=plan)


def test_the_command_line_takes_the_named_strategies():
    from autoshard.cli import parse_strategy

    assert parse_strategy("megatron") == "megatron"
    assert parse_strategy('{"*": "dp", "blocks.*": "megatron"}') == {
        "*": "dp",
        "blocks.*": "megatron",
    }
