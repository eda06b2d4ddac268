"""`measure_memory` measures what autograd saves and the activation peak of a step:
exactly, on hand-computed cases; and on 8 gloo ranks against the cost model."""

import itertools
from collections import defaultdict
from functools import partial
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import autoshard
from autoshard.cost.hardware import Hardware
from autoshard.cost.model import node_costs
from autoshard.mesh import Mesh
from autoshard.planning.estimate import estimate, first_users, own_memory, totals
from autoshard.planning.planner import Knobs, plan_graph
from autoshard.planning.units import EPILOGUE, PROLOGUE, units_of
from autoshard.runtime.ranks import shared_pool
from autoshard.testing import load_factory, measure_memory
from autoshard.tracing.trace import trace

ROOT = Path(__file__).parents[1]
BATCH, SEQ, VOCAB, HIDDEN = 8, 32, 64, 32
F32 = 4
MESH = (2, 2, 2)


def gpt():
    return load_factory(f"{ROOT}/examples/gpt.py:gpt")(
        batch=BATCH, seq=SEQ, vocab=VOCAB, d_model=HIDDEN, n_head=4, n_layer=2
    )


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)), torch.randn(4, 16)


def test_saved_bytes_are_what_torch_derivatives_keep():
    # loss = mean((relu(x W1ᵀ + b1) W2ᵀ + b2)²), x needing no gradient. derivatives.yaml:
    # addmm 1 keeps x (for W1's gradient; W1ᵀ only if x needed one); relu keeps its
    # output h, which addmm 2 keeps too (for W2's gradient): one storage, counted once;
    # addmm 2 also keeps W2ᵀ, a view of a parameter, not counted; pow keeps its input y.
    # Neither the first product (relu keeps its output) nor biases nor pow's output count.
    model, x = mlp()
    x_bytes, h_bytes, y_bytes = 4 * 16 * F32, 4 * 32 * F32, 4 * 8 * F32
    measured = measure_memory(lambda: model(x).pow(2).mean().backward())
    assert measured.saved_bytes == x_bytes + h_bytes + y_bytes == 896


def test_a_checkpointed_region_keeps_only_its_inputs():
    # The checkpoint saves the region's input x outside its own saved-tensor hooks;
    # the region's ops pack into the checkpoint's hooks, which keep no tensor.
    model, x = mlp()
    step = lambda: checkpoint(model, x, use_reentrant=False).pow(2).mean().backward()  # noqa: E731
    assert measure_memory(step).saved_bytes == 4 * 16 * F32 + 4 * 8 * F32


def test_inner_saved_tensor_hooks_count_what_they_keep():
    # Hooks the step installs itself shadow measure_memory's; what counts is what they
    # return: here a half-precision copy per pack, so h, packed twice, is kept twice, and
    # W2ᵀ's copy is no parameter's storage.
    model, x = mlp()

    def step():
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t: (t.half(),), lambda p: p[0].float()
        ):
            model(x).pow(2).mean().backward()

    half = 2
    x_h, h_h, w2t_h, y_h = 4 * 16 * half, 4 * 32 * half, 32 * 8 * half, 4 * 8 * half
    assert measure_memory(step).saved_bytes == x_h + 2 * h_h + w2t_h + y_h == 1216


def test_the_peak_leaves_out_parameter_gradients():
    # Forward holds the product y [4, 8] and the scalar loss at once; backward makes
    # W's gradient [8, 16] (4× larger than y), which stays as W.grad: not counted.
    torch.manual_seed(0)
    layer, x = nn.Linear(16, 8, bias=False), torch.randn(4, 16)
    measured = measure_memory(lambda: layer(x).sum().backward())
    assert layer.weight.grad.nbytes == 8 * 16 * F32
    assert measured.peak_bytes == 4 * 8 * F32 + F32
    assert measured.saved_bytes == 4 * 16 * F32  # x, for W's gradient


def _plans() -> dict[str, autoshard.Plan]:
    """GPT planned five ways on 2×2×2: "3d" and "replicated", each also with every block
    part recomputed, and "3d" with every layer keeping its input as a shard
    (re-gathered in backward) and its weight whole."""
    model, inputs = gpt()
    traced = trace(model, inputs)
    mesh = Mesh.from_shape(MESH)
    plans = {}
    for family in ("3d", "replicated"):
        plans[family] = plan_graph(traced, mesh, family)
        recomputed = plan_graph(traced, mesh, family)
        recomputed.regions = {
            name: unit
            for name, unit in units_of(traced, recomputed).items()
            if unit not in (PROLOGUE, EPILOGUE)
        }
        plans[f"{family}, blocks recomputed"] = recomputed
    layers = [n for n, p in plans["3d"].nodes.items() if p.strategy.split_weight is not None]
    turned = dict.fromkeys(layers, Knobs(split_weight=False, regather=True))
    plans["3d, knobs turned"] = plan_graph(traced, mesh, "3d", knobs=turned)
    return plans


def _predicted(plan) -> tuple[int, int]:
    """(bytes kept from forward to backward, activation peak) the cost model predicts
    for one rank: each unit keeps its saved activations, a recomputed one its inputs."""
    model, inputs = gpt()
    traced = trace(model, inputs)
    hardware = Hardware.load("cpu-gloo")
    costs, users = node_costs(traced, plan, hardware), first_users(traced, plan)
    members = defaultdict(list)
    for name, unit in units_of(traced, plan).items():
        members[unit].append(name)
    kept = 0
    for names in members.values():
        total = totals(traced, plan, costs, names, 2.0, users)
        kept += own_memory(total, any(name in plan.regions for name in names))[0]
    params = totals(traced, plan, costs, list(plan.nodes), 2.0, users).params
    return kept, estimate(traced, plan, hardware).peak_memory - params


def _compiled(plans) -> dict:
    """Each plan applied to gpt, once here for every rank."""
    model, inputs = gpt()
    return {name: autoshard.compile(model, MESH, inputs, plan=plan) for name, plan in plans.items()}


def _measured(mesh, programs):
    out = {}
    for name, compiled in programs.items():
        torch.manual_seed(0)
        model, inputs = gpt()
        parallel = autoshard.parallelize(model, mesh, inputs, compiled=compiled)
        out[name] = measure_memory(partial(_training_step, parallel, inputs))
    return out


def _training_step(parallel, inputs):
    parallel(*inputs).backward()


# Measured on gpt (8×32 tokens, d = 32, vocab 64, 2 layers, p = 0), torch 2.13, fp32,
# every rank alike: what is kept equals the prediction exactly for all five plans.
# The activation peak adds, at the unit running at the worst moment, the gradient of
# its inputs and the transients of its worst node (gathered operands, unreduced
# result, gradients in flight); when backward frees each buffer is not modelled, so
# the prediction may miss a little (3d with blocks recomputed: 140 736 B predicted,
# 144 648 B measured, −2.7%) and, where a replayed unit frees much as its backward
# proceeds, overshoot (replicated with blocks recomputed: +26%).
PEAK_BELOW, PEAK_ABOVE = 0.05, 0.30


def test_measured_activation_memory_against_the_prediction_on_2x2x2(capsys):
    plans = _plans()
    per_rank = shared_pool(8).run(_measured, MESH, _compiled(plans))
    for name, plan in plans.items():
        saved, peak = _predicted(plan)
        measured = [ranks[name] for ranks in per_rank]
        m = measured[0]
        with capsys.disabled():
            print(
                f"\n{name}: saved {m.saved_bytes} B measured, {saved} B predicted "
                f"({m.saved_bytes / saved - 1:+.2%}); activation peak {m.peak_bytes} B "
                f"measured, {peak} B predicted ({m.peak_bytes / peak - 1:+.2%})"
            )
        assert {m.saved_bytes for m in measured} == {saved}, measured
        # When backward frees a buffer may differ by a few kB between ranks.
        for m in measured:
            assert (1 - PEAK_BELOW) * m.peak_bytes <= peak <= (1 + PEAK_ABOVE) * m.peak_bytes
    # The saved-input knob keeps 1/d³ of each layer input instead of 1/d² (and q, k, v
    # keep one shard between them): a third less is kept.
    before, after = per_rank[0]["3d"].saved_bytes, per_rank[0]["3d, knobs turned"].saved_bytes
    assert after < 0.7 * before


class _Norm(nn.Module):
    def __init__(self, weight: bool, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16)) if weight else None
        self.bias = nn.Parameter(torch.randn(16)) if bias else None

    def forward(self, x):
        return nn.functional.layer_norm(x, (16,), self.weight, self.bias)


@pytest.mark.parametrize("weight,bias", list(itertools.product([True, False], repeat=2)))
@pytest.mark.parametrize("grads", ["all", "input", "parameters"])
def test_a_split_layer_norm_keeps_what_its_rule_says(weight, bias, grads):
    # The kernel of a layer norm over split features (here over no axis: one rank), for
    # every set of affine parameters and of tensors that need a gradient.
    from autoshard.cost.model import saved_bytes
    from autoshard.runtime.ops import _ShardedLayerNorm
    from autoshard.strategies.norm import LAYER_NORM

    norm = _Norm(weight, bias)
    x = torch.randn(4, 16, requires_grad=grads != "parameters")
    for p in norm.parameters():
        p.requires_grad_(grads != "input")
    if not x.requires_grad and not any(p.requires_grad for p in norm.parameters()):
        pytest.skip("nothing needs a gradient")
    [node] = [n for n in trace(norm, (x,)).graph_module.graph.nodes if n.op == "call_function"]
    needs_grad = [x.requires_grad] + [p.requires_grad for p in norm.parameters()]
    shapes = [(4, 16)] + [(16,)] * len(needs_grad[1:])
    predicted = saved_bytes(node, shapes, (4, 16), needs_grad=needs_grad, lowering=LAYER_NORM)

    def step():
        _ShardedLayerNorm.apply(x, norm.weight, norm.bias, 1e-5, 1, (), "norm").sum().backward()

    assert measure_memory(step, exclude=list(norm.parameters())).saved_bytes == predicted
