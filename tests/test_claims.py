"""A rule handles every argument of the op it claims, or does not claim the call (it
then runs replicated, with a warning naming the argument); and no model gets an
internal error instead of a plan."""

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import autoshard
from autoshard.testing import assert_equivalent, load_factory

MODELS = str(Path(__file__).parent / "models.py")


def _plan(name, strategy="3d", mesh=(2, 2, 2)):
    model, inputs = load_factory(f"{MODELS}:{name}")()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = autoshard.plan(model, mesh, inputs, strategy=strategy)
    return plan, [str(w.message) for w in caught]


def _by_module(plan, op):
    return {n.module: n.strategy for n in plan.nodes.values() if n.op == op}


def test_every_embedding_form_is_planned_and_unclaimed_arguments_are_named():
    plan, warned = _plan("padded_embeddings")
    forms = _by_module(plan, "aten.embedding.default")
    assert forms["words"].family == "vocab-parallel" and forms["words"].lowering
    assert forms["kinds"].family == "feature-parallel"
    assert forms["counted"].family == "replicated"
    assert any("'counted'" in w and "scale_grad_by_freq=True" in w for w in warned)
    assert any("embedding_renorm_" in w and "runs replicated" in w for w in warned)


@pytest.mark.parametrize(
    "mesh, strategy", [((2, 2, 2), "3d"), ((2, 2, 2), "3d-allreduce"), ((1, 2, 4), "3d")]
)
def test_padding_rows_get_no_gradient(mesh, strategy):
    # the padding row is hit, and its gradient (zero in the serial model) is compared
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = assert_equivalent(f"{MODELS}:padded_embeddings", mesh, strategy=strategy)
    assert {"words.weight", "kinds.weight", "counted.weight"} <= {m.name for m in report}


def test_every_cross_entropy_argument_is_claimed():
    plan, warned = _plan("arguments")
    losses = [n for n in plan.nodes.values() if n.op == "aten.cross_entropy_loss.default"]
    assert [n.strategy.family for n in losses] == ["vocab-parallel"] * 6
    assert not [w for w in warned if "cross_entropy_loss" in w]


@pytest.mark.parametrize("strategy", ["3d", "3d-allreduce"])
def test_arguments_are_honoured(strategy):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_equivalent(f"{MODELS}:arguments", (2, 2, 2), strategy=strategy)


@pytest.mark.parametrize(
    "call, argument",
    [
        (
            lambda q: torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.5),
            "dropout_p=0.5",
        ),
        (
            lambda q: torch.nn.functional.embedding(q.long().abs(), torch.randn(8, 8), sparse=True),
            "sparse=True",
        ),
    ],
    ids=["sdpa-dropout", "sparse-embedding"],
)
def test_a_call_the_rule_cannot_shard_runs_replicated(call, argument):
    class Call(torch.nn.Module):
        def forward(self, x):
            return call(x)

    with pytest.warns(UserWarning, match=f"does not handle {argument}.*runs replicated"):
        autoshard.plan(Call(), (2, 2, 2), (torch.randn(8, 8, 8, 8),), strategy="3d")


def test_an_op_with_several_outputs_and_no_rule_runs_replicated():
    plan, warned = _plan("cumulative_max")
    assert len(plan.nodes["cummax"].strategy.outputs) == 2
    assert any("aten.cummax.default" in w and "runs replicated" in w for w in warned)


@pytest.mark.parametrize("strategy", ["3d", "3d-allreduce", None], ids=str)
def test_a_one_output_gate_runs_replicated_with_a_warning(strategy):
    plan, warned = _plan("router", strategy)  # the solver too: no family aborts it
    gate = _by_module(plan, "aten.linear.default")["gate"]
    assert gate.inputs[1].sharded_axes == ()
    assert any(
        "'gate'" in w and "gate_weight[1, 16]" in w and "runs replicated" in w for w in warned
    )


def test_a_router_matches_serial():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_equivalent(f"{MODELS}:router", (2, 2, 2), strategy="3d")


def test_type_as_follows_its_own_operand():
    plan, _ = _plan("scalar_type_as")
    type_as = next(n for n in plan.nodes.values() if n.op == "aten.type_as.default")
    assert type_as.shape == () and type_as.strategy.stored.dims == ()


_PLAN_HASH = """
import hashlib, sys, warnings
sys.path.insert(0, {tests!r})
import torch, autoshard, models
warnings.simplefilter("ignore")
torch.manual_seed(0)
model, inputs = models.set_of_buffers()
plan = autoshard.plan(model, (2, 2, 2), inputs, strategy="3d")
print(list(set(models.SetOfBuffers.NAMES)), hashlib.sha256(plan.to_json().encode()).hexdigest())
"""


def test_plans_are_identical_across_hash_seeds():
    script = _PLAN_HASH.format(tests=str(Path(__file__).parent))
    processes = [  # at once: each is mostly importing torch
        subprocess.Popen(
            [sys.executable, "-c", script],
            env={**os.environ, "PYTHONHASHSEED": seed},
            stdout=subprocess.PIPE,
            text=True,
        )
        for seed in ("1", "2", "3")
    ]
    runs = []
    for process in processes:
        out, _ = process.communicate(timeout=300)
        assert process.returncode == 0
        runs.append(out.strip().rsplit(" ", 1))
    assert len({order for order, _ in runs}) > 1  # the model met its buffers in other orders
    assert len({digest for _, digest in runs}) == 1
