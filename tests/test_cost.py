"""The cost model against closed forms: ring collectives, the compute roofline, the 3D
linear's communication volume (from the planner's own steps), and a GPT layer's
activation memory against Korthikanti et al. 2022 (no processes)."""

import dataclasses
import json
import math

import pytest
import sympy
import torch
import torch.nn.functional as F
from models import H, O, T, three_linears
from torch import nn

import autoshard
from autoshard.cost import model as cost
from autoshard.cost.hardware import Hardware
from autoshard.cost.model import (
    Cost,
    linear_3d_volume,
    node_compute_time,
    node_costs,
    parameter_bytes,
    saved_bytes,
    step_time,
)
from autoshard.layout import Step
from autoshard.mesh import Mesh
from autoshard.tracing.trace import tensor_inputs, trace


def _shapes(node):
    return [tuple(i.meta["val"].shape) for i in tensor_inputs(node)], tuple(node.meta["val"].shape)


def _calls(traced):
    return {n.name: n for n in traced.graph_module.graph.nodes if n.op == "call_function"}


# ------------------------------------------------------------------- collectives


def test_collective_formulas_are_the_ring_closed_forms():
    S, n, alpha, beta = cost.S, cost.n, cost.alpha, cost.beta
    ring = (n - 1) * alpha + (n - 1) / n * S / beta
    assert sympy.simplify(cost.ALL_GATHER.expr - ring) == 0
    assert sympy.simplify(cost.REDUCE_SCATTER.expr - ring) == 0
    assert sympy.simplify(cost.ALL_REDUCE.expr - 2 * ring) == 0
    values = {S: 3 << 20, n: 4, alpha: 5e-6, beta: 1e11}
    for formula in cost.COLLECTIVES.values():
        assert formula(*values.values()) == pytest.approx(float(formula.expr.subs(values)))


@pytest.mark.parametrize(
    "kind, backward, forward_rings, backward_rings",
    [
        ("all_gather", "reduce_scatter", 1, 1),
        ("all_gather", "split", 1, 0),
        ("reduce_scatter", "all_gather", 1, 1),
        ("all_reduce", "all_reduce", 2, 2),
        ("all_reduce", "identity", 2, 0),
        ("split", "all_gather", 0, 1),
        ("grad_all_reduce", "all_reduce", 0, 2),
        ("to_partial", "identity", 0, 0),
    ],
)
def test_step_time_per_axis_link(kind, backward, forward_rings, backward_rings):
    hw = Hardware.load("ib-cluster")  # axes a, b over InfiniBand, c over NVLink
    mesh = Mesh.from_shape((4, 2, 8))
    size = 1 << 20
    for axis, n, link in zip(mesh.names, mesh.sizes, hw.axes):
        ring = (n - 1) * link.alpha + (n - 1) / n * size / link.beta
        step = Step(kind, axis, 0, backward, size, n)
        assert step_time(step, hw, mesh) == pytest.approx(
            (forward_rings * ring, backward_rings * ring)
        )


# ----------------------------------------------------------------------- compute


def test_roofline_takes_the_larger_term():
    flops, nbytes, peak, bandwidth, eff, launch = 1e12, 1e9, 1e14, 1e12, 0.5, 1e-5
    compute, memory = flops / (peak * eff), nbytes / (bandwidth * eff)
    assert cost.ROOFLINE(flops, nbytes, peak, bandwidth, eff, launch) == compute + launch
    assert cost.ROOFLINE(flops / 100, nbytes, peak, bandwidth, eff, launch) == memory + launch


class _LinearRelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(1024, 1024)

    def forward(self, x):
        return torch.relu(self.fc(x))


def test_node_compute_time_roofline():
    hw = Hardware.load("nvlink-8")
    traced = trace(_LinearRelu(), (torch.randn(64, 1024),))
    linear, relu = _calls(traced)["linear"], _calls(traced)["relu"]

    def expected(flops, nbytes):
        return max(
            flops / (hw.peak("float32") * hw.efficiency),
            nbytes / (hw.memory_bandwidth * hw.efficiency),
        )

    # The linear is compute-bound: 2·M·K·N FLOPs outweigh x, W, b and y.
    flops = 2 * 64 * 1024 * 1024
    moved = 4 * (64 * 1024 + 1024 * 1024 + 1024 + 64 * 1024)
    assert flops / hw.peak("float32") > moved / hw.memory_bandwidth
    forward, backward = node_compute_time(linear, *_shapes(linear), torch.float32, hw)
    assert forward == pytest.approx(expected(flops, moved) + hw.launch_floor)
    assert backward == pytest.approx(2 * forward)  # input and weight gradients
    no_input_grad = node_compute_time(
        linear, *_shapes(linear), torch.float32, hw, needs_grad=(False, True, True)
    )
    assert no_input_grad[1] == pytest.approx(forward)  # the weight's gradient only

    # relu is memory-bound: one FLOP per element, 8 bytes per element moved.
    forward, backward = node_compute_time(relu, *_shapes(relu), torch.float32, hw)
    assert forward == pytest.approx(expected(64 * 1024, 8 * 64 * 1024) + hw.launch_floor)
    assert backward == pytest.approx(cost.OTHER_BACKWARD * forward)


def test_attention_flops():
    q = torch.randn(2, 4, 128, 32)
    traced = trace(_Attention(), (q,))
    node = _calls(traced)["scaled_dot_product_attention"]
    b, h, s, d = q.shape
    assert cost.node_flops(node, *_shapes(node)) == 4 * b * h * s * s * d


class _Attention(nn.Module):
    def forward(self, q):
        return F.scaled_dot_product_attention(q, q, q, is_causal=True)


# ------------------------------------------------------------------------ memory


def test_parameter_bytes():
    assert parameter_bytes(1000, 4) == 16 * 1000  # fp32 Adam: param, grad, exp_avg, exp_avg_sq
    assert parameter_bytes(1000, 2, cost.OPTIMIZERS["adam-mixed"]) == 16 * 1000  # as in ZeRO
    assert parameter_bytes(1000, 4, cost.OPTIMIZERS["sgd"]) == 8 * 1000


# ------------------------------------------------------- 3D linear, from the planner


def test_linear_3d_volume_matches_the_planner():
    d = 2
    model, inputs = three_linears()
    plan = autoshard.plan(model, (d, d, d), inputs, strategy="3d")
    middle = next(n for n in plan.nodes.values() if n.module == "middle")
    steps = middle.steps_with_grad()
    forward = sum(s.ring_bytes(s.forward_collective) for s, _ in steps)
    backward = sum(s.ring_bytes(s.backward_collective) for s, grad in steps if grad)
    volume = linear_3d_volume(T, H, O, d) * 4  # fp32 elements → bytes
    assert forward == pytest.approx(float(volume)) and backward == pytest.approx(float(volume))

    t, h, o = sympy.symbols("T H O", positive=True)
    on_4 = linear_3d_volume(t, h, o, 4)  # the symbolic form, as the CLI prints it
    assert sympy.simplify(on_4 - sympy.Rational(3, 64) * (t * h + h * o + t * o)) == 0


def test_node_costs_of_a_3d_plan():
    d = 2
    model, inputs = three_linears()
    traced = trace(model, inputs)
    bucketed = autoshard.plan(model, (d, d, d), inputs, strategy="3d")
    plan = dataclasses.replace(bucketed, gathers=())  # each weight gathered by its own call
    hw = Hardware.load("cpu-gloo")  # the same link on every axis
    costs = node_costs(traced, plan, hw)
    assert set(costs) == set(plan.nodes) | {"output"}

    middle = next(n for n in plan.nodes.values() if n.module == "middle")
    c = costs[middle.name]
    link = hw.axes[0]
    # In one gather bucket, the three weights' gathers are one call each way: the first
    # layer's cost carries its latency, the others' only their bytes.
    (bucket,) = bucketed.gathers
    assert [name for name, _ in bucket.serves] == [
        n.name for n in plan.nodes.values() if n.op == "aten.linear.default"
    ]
    in_bucket = node_costs(traced, bucketed, hw)
    for phase in ("forward_comm", "backward_comm"):
        for name, _ in bucket.serves:
            saved = sum(getattr(costs[name], phase).values())
            saved -= sum(getattr(in_bucket[name], phase).values())
            latency = 0.0 if name == bucket.serves[0][0] else (d - 1) * link.alpha
            assert saved == pytest.approx(latency)
    # Three collectives (input gather over N, weight gather over M, output scatter over K),
    # one α each on a ring of d, and the closed-form volume at β.
    volume = float(linear_3d_volume(T, H, O, d)) * 4
    assert sum(c.forward_comm.values()) == pytest.approx(
        3 * (d - 1) * link.alpha + volume / link.beta
    )
    assert sum(c.backward_comm.values()) == pytest.approx(sum(c.forward_comm.values()))
    # It saves its gathered input X[T/d, H/d] and gathered weight W[H/d, O/d] (1/d² each).
    assert c.saved_bytes == 4 * (T * H + H * O) // d**2
    flops = 2 * (T // d) * (H // d) * (O // d)  # on the local shards
    assert c.forward_compute == pytest.approx(
        max(flops / hw.peak("float32"), 4 * (T * H + H * O + T * O) / d**2 / hw.memory_bandwidth)
        / hw.efficiency
        + hw.launch_floor
    )
    assert c.backward_compute == pytest.approx(2 * c.forward_compute)


def test_cost_dict_round_trip():
    c = Cost(1.5e-3, 3 << 30, 1e-3, 2e-4, {"a": 1e-4, "b": 2e-4, "c": 0.0})
    assert Cost.from_dict(json.loads(json.dumps(c.to_dict()))) == c


# ------------------------------------------- a GPT layer's activations (Korthikanti)


class GPTLayer(nn.Module):
    """Megatron's GPT layer as Korthikanti et al. 2022 count it: LayerNorms, attention
    with explicit scores, causal mask, softmax and dropout on the probabilities, dropout
    after the attention projection and after a GELU MLP of 4h. Activations [s, b, h]."""

    def __init__(self, h: int, heads: int, p: float = 0.1):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        s, b, h = x.shape
        q, k, v = (
            t.reshape(s, b * self.heads, h // self.heads).transpose(0, 1)
            for t in self.qkv(self.ln1(x)).split(h, -1)
        )
        scores = q @ k.transpose(1, 2) / math.sqrt(h // self.heads)
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        probs = self.drop(scores.masked_fill(~causal, float("-inf")).softmax(-1))
        context = (probs @ v).transpose(0, 1).reshape(s, b, h)
        x = x + self.drop(self.proj(context))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


def test_gpt_layer_activations_match_korthikanti():
    s, b, h, a = 256, 2, 512, 8  # 5·a·s/h = 20: the s² term is 37% of the total
    model = GPTLayer(h, a).half().train()
    traced = trace(model, (torch.randn(s, b, h, dtype=torch.half),))
    nodes = [n for n in _calls(traced).values() if isinstance(n.meta["val"], torch.Tensor)]

    # Korthikanti counts dropout masks at 1 byte per element (torch's bool mask).
    total = sum(saved_bytes(n, *_shapes(n), mask_itemsize=1) for n in nodes)
    korthikanti = 34 * s * b * h + 5 * a * s * s * b
    assert total == pytest.approx(korthikanti, rel=0.05)
    assert total == pytest.approx(korthikanti, rel=0.01)  # the rest: causal mask, LN statistics

    # autoshard's dropout multiplies by fp16 noise: one more byte per dropped element
    # (the attention probabilities a·s²·b and the two h-wide dropouts s·b·h each).
    as_lowered = sum(saved_bytes(n, *_shapes(n)) for n in nodes)
    assert as_lowered - total == a * s * s * b + 2 * s * b * h


class _Scaled(nn.Module):
    """A linear scaled by one entry of a buffer (and of a frozen parameter) of `n` floats."""

    def __init__(self, n: int):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.register_buffer("table", torch.ones(n))
        self.frozen = nn.Parameter(torch.ones(n), requires_grad=False)

    def forward(self, x):
        return self.fc(x) * self.table[0] * self.frozen[0]


def test_buffers_and_frozen_parameters_count_once_in_the_peak():
    # Neither has a gradient nor optimizer state: each costs its own bytes, on every
    # rank (they are replicated), and nothing else in the plan changes with their size.
    big, small = 1 << 16, 1
    x = torch.randn(8, 16)
    mesh, hardware = (2, 2, 2), Hardware.load("nvlink-8")
    peaks = [
        autoshard.plan(_Scaled(n), mesh, (x,), strategy="3d", hardware=hardware).cost.peak_memory
        for n in (big, small)
    ]
    assert peaks[0] - peaks[1] == 2 * (big - small) * 4  # 256 KiB each, float32
