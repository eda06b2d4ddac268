"""Time and memory per rank: the formulas the solver minimizes.

Every formula is a `Formula`: a sympy expression of shape symbols, mesh sizes
and hardware numbers (to print, and to check against closed forms in tests)
and a plain-float function generated from it once (the solver evaluates it
thousands of times).

Time, from a `Hardware` profile:

- A collective over a mesh axis of size n whose link has latency α and
  bandwidth β, on a buffer of S bytes (the full buffer, as `Step.nbytes`
  counts it), costs (n−1)·α + (n−1)/n·S/β on a ring for an all-gather or a
  reduce-scatter, twice that for an all-reduce. Splits, ``to_partial`` and
  ``grad_all_reduce`` are free in forward; their backward is the collective
  `Step.backward` names (`step_time`).
- An op costs max(FLOPs/(peak·eff), bytes/(bandwidth·eff)) + launch floor,
  with FLOPs and bytes (inputs + output) from its local shapes
  (`node_compute_time`); the backward is a multiple of the forward
  (`backward_multiplier`).

Memory, in bytes per rank:

- parameters, gradients and optimizer state of the local shards
  (`parameter_bytes`; `OPTIMIZERS` gives the state multiplier of common
  optimizers);
- what autograd saves for each node's backward (`saved`, `saved_bytes`).

    >>> hw = Hardware.load("nvlink-8")
    >>> step = Step("all_gather", "b", 0, "reduce_scatter", 4 << 20, 2)   # 4 MiB over b
    >>> step_time(step, hw, Mesh.from_shape((2, 2, 2)))   # (forward, backward) seconds
    (8.660337777777779e-06, 8.660337777777779e-06)
    >>> ALL_REDUCE.expr
    2*S*(n - 1)/(beta*n) + 2*alpha*(n - 1)
    >>> from autoshard.planning.planner import plan_graph
    >>> from autoshard.tracing.trace import trace
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    >>> traced = trace(model, (torch.randn(8, 16),))
    >>> mesh = Mesh.from_shape((2, 2, 2))
    >>> costs = node_costs(traced, plan_graph(traced, mesh, "3d"), hw)   # per node of a plan
    >>> costs["linear_1"].saved_bytes, costs["linear_1"].forward_comm
    (768, {'c': 4.0002844444444445e-06, 'a': 4.000568888888888e-06, 'b': ...})
"""

from __future__ import annotations

import math
import operator
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import sympy
import torch
from torch import fx
from torch.ops import aten

from autoshard.cost.hardware import Hardware
from autoshard.layout import Step
from autoshard.mesh import Mesh
from autoshard.tracing.trace import structure, tensor_inputs

if TYPE_CHECKING:
    from autoshard.planning.plan import NodePlan, Plan
    from autoshard.tracing.trace import Traced


class Formula:
    """A sympy expression and the fast float function of `symbols` made from it."""

    def __init__(self, expr: sympy.Expr, *symbols: sympy.Symbol):
        self.expr = expr
        self.symbols = symbols

    @cached_property
    def _fn(self):
        return sympy.lambdify(self.symbols, self.expr, "math")

    def __call__(self, *values: float) -> float:
        return self._fn(*values)

    def __str__(self) -> str:
        return str(self.expr)


# ------------------------------------------------------------------------- time

# The sympy symbols the formulas are written in.
S, n, alpha, beta = sympy.symbols("S n alpha beta", positive=True)
_RING = (n - 1) * alpha + (n - 1) / n * S / beta
ALL_GATHER = REDUCE_SCATTER = Formula(_RING, S, n, alpha, beta)
ALL_REDUCE = Formula(2 * _RING, S, n, alpha, beta)
COLLECTIVES = {
    "all_gather": ALL_GATHER,
    "reduce_scatter": REDUCE_SCATTER,
    "all_reduce": ALL_REDUCE,
}

flops, nbytes, peak, bandwidth, efficiency, launch = sympy.symbols(
    "FLOPs bytes peak bandwidth efficiency launch", positive=True
)
ROOFLINE = Formula(
    sympy.Max(flops / (peak * efficiency), nbytes / (bandwidth * efficiency)) + launch,
    flops,
    nbytes,
    peak,
    bandwidth,
    efficiency,
    launch,
)

M, K, N = sympy.symbols("M K N", positive=True, integer=True)
MATMUL_FLOPS = Formula(2 * M * K * N, M, K, N)
# Attention over batch×heads BH: scores Q·Kᵀ and the weighted sum P·V, each a
# matmul: 4·b·h·s²·d when q, k, v share the head dim d.
BH, Sq, Sk, Dqk, Dv = sympy.symbols("BH S_q S_k D_qk D_v", positive=True, integer=True)
ATTENTION_FLOPS = Formula(2 * BH * Sq * Sk * (Dqk + Dv), BH, Sq, Sk, Dqk, Dv)

# Left matrix operand of each product, among the node's tensor inputs; the right one follows it.
MATMULS = {
    aten.linear.default: 0,
    aten.mm.default: 0,
    aten.matmul.default: 0,
    aten.bmm.default: 0,
    aten.addmm.default: 1,  # addmm(bias, x, w)
    aten.baddbmm.default: 1,  # baddbmm(self, batch1, batch2)
}
ATTENTION = {aten.scaled_dot_product_attention.default}
# Normalizations and softmaxes: a max or mean, a sum, a subtraction, an exp or a
# division and a scale, about 5 FLOPs per element.
NORMALIZING = {
    aten.layer_norm.default,
    aten.rms_norm.default,
    aten.softmax.int,
    aten._softmax.default,
    aten.log_softmax.int,
    aten._log_softmax.default,
    aten.cross_entropy_loss.default,
}
NORMALIZING_FLOPS_PER_ELEMENT = 5
# Views launch no kernel and move no data: they cost nothing.
VIEWS = {
    operator.getitem,
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.transpose.int,
    aten.t.default,
    aten.permute.default,
    aten.expand.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.slice.Tensor,
    aten.select.int,
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.unflatten.int,
    aten.flatten.using_ints,
    aten.alias.default,
    aten.detach.default,
}
# The backward of flash / memory-efficient attention runs five matmuls of the
# forward's size to the forward's two (dV, dP, dS→dQ, dK, plus recomputing P).
ATTENTION_BACKWARD = 2.5
# Any other op's backward reads the output gradient and what the op saved and
# writes the input gradients: about twice the forward's traffic.
OTHER_BACKWARD = 2.0


def step_time(step: Step, hardware: Hardware, mesh: Mesh) -> tuple[float, float]:
    """Seconds of `step`'s forward and of its backward (which runs only if a gradient does)."""
    link = hardware.link(mesh.index(step.axis))

    def seconds(kind: str) -> float:
        if kind == "none":
            return 0.0
        return COLLECTIVES[kind](step.nbytes, step.group_size, link.alpha, link.beta)

    return seconds(step.forward_collective), seconds(step.backward_collective)


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


def _first_value(node: fx.Node) -> torch.Tensor:
    """The node's tensor, or the first of the tensors it returns (split, chunk)."""
    val = node.meta["val"]
    return val if isinstance(val, torch.Tensor) else val[0]


def _itemsize(node: fx.Node) -> int:
    return _first_value(node).element_size()


def _needs_grad(inputs: list[fx.Node], needs_grad: Sequence[bool] | None) -> tuple[bool, ...]:
    if needs_grad is not None:
        return tuple(needs_grad)
    return tuple(inp.meta["val"].is_floating_point() for inp in inputs)


def node_flops(node: fx.Node, local_in_shapes, local_out_shape) -> float:
    """Forward FLOPs of `node` on these local shapes.

    Products (linear, addmm, mm, matmul, bmm, baddbmm): 2·M·K·N. Attention:
    4·b·h·s_q·s_k·d (`ATTENTION_FLOPS`). Normalizations and softmaxes: 5 per
    element. Views: 0. Anything else: 1 per element of its largest operand.
    """
    op = node.target
    if op in VIEWS:
        return 0.0
    if op in MATMULS:
        k = local_in_shapes[MATMULS[op]][-1]
        cols = local_out_shape[-1] if local_out_shape else 1
        return MATMUL_FLOPS(_numel(local_out_shape) // cols, k, cols)
    if op in ATTENTION:
        q, key, v = local_in_shapes[:3]
        return ATTENTION_FLOPS(_numel(q[:-2]), q[-2], key[-2], q[-1], v[-1])
    largest = max([_numel(s) for s in local_in_shapes] + [_numel(local_out_shape)])
    return largest * (NORMALIZING_FLOPS_PER_ELEMENT if op in NORMALIZING else 1)


def backward_multiplier(node: fx.Node, needs_grad: Sequence[bool]) -> float:
    """The backward's time as a multiple of the forward's.

    A product computes one gradient product per matrix operand that needs a
    gradient (a linear: 2× with the input's gradient, 1× for the first layer
    whose input needs none). Attention: `ATTENTION_BACKWARD`. Views: 0.
    Anything else: `OTHER_BACKWARD` when any input needs a gradient.
    """
    op = node.target
    if op in VIEWS or not any(needs_grad):
        return 0.0
    if op in MATMULS:
        x = MATMULS[op]
        return float(sum(needs_grad[x : x + 2]))
    return ATTENTION_BACKWARD if op in ATTENTION else OTHER_BACKWARD


def node_compute_time(
    node: fx.Node,
    local_in_shapes: Sequence[Sequence[int]],
    local_out_shape: Sequence[int],
    dtype: torch.dtype,
    hardware: Hardware,
    *,
    needs_grad: Sequence[bool] | None = None,
) -> tuple[float, float]:
    """Seconds of `node`'s forward and backward on one rank: the roofline of its
    FLOPs against ``hardware.peak(dtype)`` and of the bytes it reads and writes
    (tensor inputs + output, at their own dtypes) against the memory bandwidth,
    plus the launch floor. `needs_grad` flags each tensor input (default: the
    floating-point ones)."""
    if node.target in VIEWS:
        return 0.0, 0.0
    inputs = tensor_inputs(node)
    moved = sum(_numel(s) * _itemsize(i) for s, i in zip(local_in_shapes, inputs))
    moved += _numel(local_out_shape) * _itemsize(node)
    forward = ROOFLINE(
        node_flops(node, local_in_shapes, local_out_shape),
        moved,
        hardware.peak(dtype),
        hardware.memory_bandwidth,
        hardware.efficiency,
        hardware.launch_floor,
    )
    return forward, forward * backward_multiplier(node, _needs_grad(inputs, needs_grad))


# ----------------------------------------------------------------------- memory

P, itemsize, state = sympy.symbols("P itemsize optimizer_multiplier", positive=True)
PARAMETER_BYTES = Formula(P * itemsize * (2 + state), P, itemsize, state)
# Optimizer-state bytes per parameter byte. The gradient has the parameter's dtype.
OPTIMIZERS = {
    "adam": 2.0,  # fp32 parameters: exp_avg and exp_avg_sq in fp32, 8 B per 4 B parameter
    "adam-mixed": 6.0,  # bf16/fp16 parameters: fp32 master, exp_avg, exp_avg_sq: 12 B per 2 B
    "sgd-momentum": 1.0,  # one momentum buffer
    "sgd": 0.0,
}


def parameter_bytes(
    numel: int, itemsize: int, optimizer_multiplier: float = OPTIMIZERS["adam"]
) -> float:
    """Bytes of `numel` local parameter elements, their gradients and the optimizer's state:
    numel·itemsize·(2 + optimizer_multiplier). Adam in fp32 (the default): 16 B per
    parameter; Adam with bf16 parameters and an fp32 master copy (``OPTIMIZERS["adam-mixed"]``):
    2 + 2 + 12 = 16 B per parameter, as in ZeRO (Rajbhandari et al. 2020)."""
    return PARAMETER_BYTES(numel, itemsize, optimizer_multiplier)


STATISTIC_BYTES = 4  # norms keep their per-row statistics in fp32 (the accumulation type)
_SAVE_OUTPUT = {  # backward needs only the output: d relu = (y > 0), d tanh = 1 − y², ...
    aten.relu.default,
    aten.sigmoid.default,
    aten.tanh.default,
    aten.exp.default,
    aten.sqrt.default,
    aten.rsqrt.default,
    aten.softmax.int,
    aten._softmax.default,
    aten.log_softmax.int,
    aten._log_softmax.default,
}
_SAVE_INPUT = {  # backward needs the input
    aten.gelu.default,
    aten.silu.default,
    aten.log.default,
    aten.abs.default,
    aten.pow.Tensor_Scalar,
}


@dataclass(frozen=True)
class Saved:
    """What autograd keeps for one node's backward."""

    inputs: tuple[int, ...] = ()  # tensor inputs kept, as indices into tensor_inputs(node)
    output: bool = False  # the node's output kept
    extra_bytes: int = 0  # buffers the op makes for its backward (masks, statistics)


def saved(
    node: fx.Node,
    local_in_shapes: Sequence[Sequence[int]],
    local_out_shape: Sequence[int],
    *,
    needs_grad: Sequence[bool] | None = None,
    mask_itemsize: int | None = None,
    lowering: str | None = None,
) -> Saved:
    """What autograd keeps for `node`'s backward, op by op (as torch's derivatives.yaml),
    or, where the node runs as one of autoshard's lowerings (`lowering`, from its
    strategy), what that implementation keeps (`_LOWERED`):

    - products (linear, addmm, mm, matmul, bmm, baddbmm) and mul: each matrix
      operand, if the other one needs a gradient (a linear keeps its input for
      the weight's gradient and its weight for the input's);
    - div(a, b): b, and a too if b needs a gradient;
    - relu, sigmoid, tanh, exp, sqrt, rsqrt, softmax, log_softmax: the output;
    - gelu, silu, log, abs, pow: the input;
    - dropout: a mask of the output's size, `mask_itemsize` bytes per element,
      nothing when p = 0 or not training. torch's native dropout keeps a bool
      mask (1 byte); autoshard's lowering multiplies by a noise tensor of the
      activation's dtype, the default here;
    - layer_norm: the input and an fp32 mean and rstd per row; rms_norm: the
      input and an fp32 rstd per row (the native kernels);
    - masked_fill: the mask; where: the condition;
    - embedding: the indices (the weight is a parameter);
    - cross_entropy_loss: the log-softmax of the logits and the targets;
    - scaled_dot_product_attention: q, k, v (and a mask, if given), the output
      and an fp32 logsumexp per query (flash and memory-efficient kernels; the
      math fallback would also keep the s² probabilities);
    - everything else (views, add, sub, neg, sums, means, factories): nothing.

    Nothing is kept when no input needs a gradient. `needs_grad` flags each
    tensor input (default: the floating-point ones).
    """
    op = node.target
    inputs = tensor_inputs(node)
    ng = _needs_grad(inputs, needs_grad)
    if not any(ng):
        return Saved()
    if lowering in _LOWERED:
        return _LOWERED[lowering](node, local_in_shapes, local_out_shape, ng)
    if op in MATMULS or (op == aten.mul.Tensor and len(inputs) == 2):
        x = MATMULS.get(op, 0)
        return Saved(tuple(i for i, other in ((x, x + 1), (x + 1, x)) if ng[other]))
    if op == aten.div.Tensor and len(inputs) == 2:
        return Saved((0, 1) if ng[1] else (1,))
    if op in _SAVE_OUTPUT:
        return Saved(output=True)
    if op in _SAVE_INPUT:
        return Saved((0,))
    if op == aten.dropout.default:
        p, train = (list(node.args[1:]) + [0.5, True])[:2]
        if p == 0 or not train:
            return Saved()
        mask = mask_itemsize if mask_itemsize is not None else _itemsize(node)
        return Saved(extra_bytes=_numel(local_out_shape) * mask)
    if op in (aten.layer_norm.default, aten.rms_norm.default):
        k = len(node.args[1])
        rows = _numel(local_in_shapes[0][:-k])
        statistics = 2 if op == aten.layer_norm.default else 1
        return Saved((0,), extra_bytes=rows * statistics * STATISTIC_BYTES)
    if op in (aten.masked_fill.Scalar, aten.masked_fill.Tensor):
        return Saved((1,))
    if op == aten.where.self:
        return Saved((0,))
    if op == aten.embedding.default:
        return Saved((1,))
    if op == aten.cross_entropy_loss.default:
        return Saved((1,), extra_bytes=_numel(local_in_shapes[0]) * _itemsize(inputs[0]))
    if op in ATTENTION:
        queries = _numel(local_in_shapes[0][:-1])
        return Saved(tuple(range(len(inputs))), output=True, extra_bytes=queries * STATISTIC_BYTES)
    return Saved()


def _lowered_layer_norm(node, in_shapes, out_shape, ng) -> Saved:
    """`autoshard.runtime.ops.layer_norm` over sharded features keeps the centered input, rstd
    per row (in the input's dtype), the normalized input (for the weight's gradient)
    and the weight (for the input's)."""
    x, item = _numel(in_shapes[0]), _itemsize(tensor_inputs(node)[0])
    rows = _numel(in_shapes[0][: -len(node.args[1])])
    weight = (1,) if len(tensor_inputs(node)) > 1 and ng[0] else ()
    return Saved(weight, extra_bytes=(2 * x + rows) * item)


def _lowered_cross_entropy(node, in_shapes, out_shape, ng) -> Saved:
    """`autoshard.runtime.ops.cross_entropy` over sharded logits keeps the local softmax and per
    row the target's index (int64) and two bool masks."""
    logits, item = _numel(in_shapes[0]), _itemsize(tensor_inputs(node)[0])
    rows = _numel(in_shapes[0][:-1])
    return Saved(extra_bytes=logits * item + rows * (8 + 2) + item)


def _lowered_vocab_embedding(node, in_shapes, out_shape, ng) -> Saved:
    """`autoshard.runtime.ops.vocab_embedding` keeps the local indices and the float mask of the
    ids this rank holds."""
    ids = _numel(in_shapes[1])
    return Saved(extra_bytes=ids * (8 + _itemsize(node)))


_LOWERED = {
    "layer_norm": _lowered_layer_norm,
    "cross_entropy": _lowered_cross_entropy,
    "vocab_embedding": _lowered_vocab_embedding,
}


def saved_bytes(
    node: fx.Node,
    local_in_shapes: Sequence[Sequence[int]],
    local_out_shape: Sequence[int],
    *,
    needs_grad: Sequence[bool] | None = None,
    mask_itemsize: int | None = None,
    held: Sequence[bool] | None = None,
    lowering: str | None = None,
) -> int:
    """Bytes of what `saved` lists, on one rank. Inputs flagged in `held` are
    resident anyway and not counted (default: parameters and buffers, the
    ``get_attr`` inputs, which `parameter_bytes` counts). A tensor that two
    nodes keep counts for each; `saved` says which, to count it once."""
    return sum(
        _saved_parts(
            node,
            local_in_shapes,
            local_out_shape,
            needs_grad=needs_grad,
            mask_itemsize=mask_itemsize,
            held=held,
            lowering=lowering,
        ).values()
    )


def _saved_parts(
    node, local_in_shapes, local_out_shape, *, needs_grad, mask_itemsize, held, lowering
) -> dict[int | str, int]:
    """`saved_bytes` by part: tensor input index, "output", or "extra" (buffers the
    op makes)."""
    inputs = tensor_inputs(node)
    held = held if held is not None else [inp.op == "get_attr" for inp in inputs]
    kept = saved(
        node,
        local_in_shapes,
        local_out_shape,
        needs_grad=needs_grad,
        mask_itemsize=mask_itemsize,
        lowering=lowering,
    )
    parts: dict[int | str, int] = {"extra": kept.extra_bytes}
    for i in kept.inputs:
        if not held[i]:
            parts[i] = _numel(local_in_shapes[i]) * _itemsize(inputs[i])
    if kept.output:
        parts["output"] = _numel(local_out_shape) * _itemsize(node)
    return parts


# ------------------------------------------------------------------ closed forms


def linear_3d_volume(T, H, O, d) -> sympy.Expr:
    """Elements a rank moves in the forward of one linear X[T,H]·W[H,O] under the
    3D all-gather/reduce-scatter design on a d×d×d cube (Bian et al. 2021):
    (d−1)/d³·(T·H + H·O + T·O). Arguments may be numbers or sympy symbols."""
    T, H, O, d = map(sympy.sympify, (T, H, O, d))
    return (d - 1) / d**3 * (T * H + H * O + T * O)


# --------------------------------------------------------------------- results


@dataclass
class Cost:
    """What a plan costs per rank and per training step."""

    step_time: float  # seconds: compute, recompute and communication
    peak_memory: int  # bytes
    compute: float  # seconds of forward and backward compute
    recompute: float  # seconds replaying checkpointed regions (their compute and collectives)
    communication: dict[str, float] = field(default_factory=dict)  # seconds per mesh axis

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Cost:
        return cls(
            step_time=float(data["step_time"]),
            peak_memory=int(data["peak_memory"]),
            compute=float(data["compute"]),
            recompute=float(data["recompute"]),
            communication={str(k): float(v) for k, v in data["communication"].items()},
        )


@dataclass(frozen=True)
class NodeCost:
    """One node of a plan on one rank: its compute and collectives, and what it saves."""

    forward_compute: float  # seconds
    backward_compute: float  # seconds
    forward_comm: dict[str, float]  # seconds per mesh axis
    backward_comm: dict[str, float]  # seconds per mesh axis
    saved_bytes: int  # kept for backward, apart from `shared`
    transient_bytes: int = 0  # gathered operands and unreduced results alive while it runs
    shared: dict[str, int] = field(default_factory=dict)  # value → bytes, kept as stored


def _comm(
    steps: list[tuple[Step, bool]], hardware: Hardware, mesh: Mesh
) -> tuple[dict[str, float], dict[str, float]]:
    forward: dict[str, float] = defaultdict(float)
    backward: dict[str, float] = defaultdict(float)
    for step, grad in steps:
        f, b = step_time(step, hardware, mesh)
        forward[step.axis] += f
        if grad:
            backward[step.axis] += b
    return dict(forward), dict(backward)


_VIEWS = {  # ops whose output is a view of their input (expand: of fewer elements, slice: more)
    aten.view.default,
    aten.transpose.int,
    aten.permute.default,
    aten.t.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.squeeze.default,
    aten.alias.default,
    aten.expand.default,
    aten.slice.Tensor,
    aten.select.int,
}


def storage_node(value: fx.Node, plan: Plan) -> fx.Node:
    """The node whose storage `value` is: itself, or what it views through view ops
    that take no collective (a view exported from the serial model is a view of the
    local tensor too, since that tensor came out of the same op on a shard)."""
    while value.target in _VIEWS and value.name in plan.nodes:
        if any(plan.nodes[value.name].input_steps):
            break
        value = tensor_inputs(value)[0]
    return value


def storage_of(value: fx.Node, plan: Plan) -> str:
    """The name of `value`'s `storage_node`: what tensors kept as stored are counted by."""
    return storage_node(value, plan).name


def stored_bytes(value: fx.Node, plan: Plan) -> int:
    """Bytes of `value` on one rank as the plan stores it (0 for what it does not lay out)."""
    layout = plan.stored_layout(value)
    val = value.meta.get("val")
    if layout is None or not hasattr(val, "shape"):
        return 0
    return _numel(layout.local_shape(tuple(val.shape), plan.mesh)) * val.element_size()


def _as_stored(value: fx.Node, nbytes: int, plan: Plan) -> dict[str, int]:
    """{storage name: bytes} of a tensor kept as stored: `nbytes` when it is its own
    storage, else the bytes of the storage it views."""
    storage = storage_node(value, plan)
    if storage is value or storage.op == "get_attr":
        return {value.name: nbytes} if storage is value else {}
    return {storage.name: stored_bytes(storage, plan)}


def _transient_bytes(node, node_plan, in_shapes, out_shape) -> int:
    """The largest of what a node holds only while it runs, forward or backward: in
    forward the gathered copies of its activation inputs that it does not keep and its
    result before the output collectives; in backward the gradient of its result, of
    each activation input that needs one (at the sizes it computes on) and of each
    parameter that reaches it through a collective (before that gradient is reduced
    onto the stored shard), and any input gathered again. A parameter's own
    gradient is parameter bytes; a gathered parameter kept for backward is saved
    bytes."""
    inputs = tensor_inputs(node)
    strategy = node_plan.strategy
    keeps = saved(
        node,
        in_shapes,
        out_shape,
        needs_grad=node_plan.input_needs_grad,
        lowering=strategy.lowering,
    ).inputs
    size = [_numel(shape) * _itemsize(inp) for inp, shape in zip(inputs, in_shapes)]
    activations = [i for i, inp in enumerate(inputs) if inp.op != "get_attr"]
    result = _numel(out_shape) * _itemsize(node)
    forward = result * bool(node_plan.output_steps) + sum(
        size[i]
        for i in activations
        if node_plan.input_steps[i] and (i not in keeps or i in strategy.regather)
    )
    reduced = [i for i, steps in enumerate(node_plan.input_steps) if steps]
    backward = (
        result * node_plan.needs_grad
        + sum(
            size[i]
            for i in range(len(inputs))
            if node_plan.input_needs_grad[i] and (i in activations or i in reduced)
        )
        + sum(size[i] for i in strategy.regather)
    )
    return max(forward, backward)


def node_cost(
    node: fx.Node,
    node_plan: NodePlan,
    plan: Plan,
    hardware: Hardware,
    *,
    mask_itemsize: int | None = None,
    alike: dict | None = None,
) -> NodeCost:
    """A node's costs on one rank at the plan's local shapes: each tensor input at
    its strategy's input layout (a gathered operand is what the node computes on
    and saves), the node's own result at the strategy's output layout. A
    parameter that reaches the node through a step is a new tensor, so it counts
    as saved when the node keeps it. An input the node keeps as its stored shard
    (`Strategy.regather`) counts at that size, and backward pays its gathers
    once more. `alike`: a cache the calls of one `node_costs` share."""
    inputs = tensor_inputs(node)
    if alike is None:
        known = _node_cost(node, node_plan, plan, hardware, mask_itemsize)
    else:
        key = _alike_key(node, node_plan, plan, inputs)
        known = alike.get(key)
        if known is None:
            known = alike[key] = _node_cost(node, node_plan, plan, hardware, mask_itemsize)
    forward, backward, comm_forward, comm_backward, parts, transient = known
    parts = dict(parts)
    strategy = node_plan.strategy
    # An input kept as it is stored (a shard kept for a re-gather too), or the output
    # kept as it is stored, is the very tensor every other node that keeps it (or a
    # view of it) keeps: named by its storage, so it counts once. A view kept counts
    # as the storage it views (an expanded mask as its small source).
    shared = {}
    for part in list(parts):
        if part == "output" and not node_plan.output_steps:
            shared.update(_as_stored(node, parts.pop(part), plan))
        elif isinstance(part, int) and inputs[part].op != "get_attr":
            if not node_plan.input_steps[part] or part in strategy.regather:
                shared.update(_as_stored(inputs[part], parts.pop(part), plan))
    return NodeCost(
        forward,
        backward,
        dict(comm_forward),
        dict(comm_backward),
        sum(parts.values()),
        transient,
        shared,
    )


def _alike_key(node, placed: NodePlan, plan: Plan, inputs) -> tuple:
    """What `_node_cost` reads, names aside: the node's `structure`, its plan's fields
    and how its inputs are stored. Objects count by identity: the planner gives the
    nodes of identical blocks the very same strategies and steps, and the plan keeps
    them alive while `node_costs` runs."""
    return (
        structure(node),
        placed.shape,
        id(placed.strategy),
        id(placed.input_steps),
        id(placed.output_steps),
        placed.input_needs_grad,
        placed.needs_grad,
        tuple(id(plan.stored_layout(inp)) for inp in inputs),
    )


def _node_cost(node, node_plan, plan, hardware, mask_itemsize) -> tuple:
    """`node_cost`'s name-free part: compute seconds, collective seconds per axis, the
    saved parts (`_saved_parts`) and the transient bytes."""
    mesh = plan.mesh
    inputs = tensor_inputs(node)
    strategy = node_plan.strategy
    in_shapes = [
        strategy.inputs[i].local_shape(tuple(inp.meta["val"].shape), mesh)
        for i, inp in enumerate(inputs)
    ]
    out_shape = strategy.output.local_shape(node_plan.shape, mesh)
    forward, backward = node_compute_time(
        node,
        in_shapes,
        out_shape,
        _first_value(node).dtype,
        hardware,
        needs_grad=node_plan.input_needs_grad,
    )
    held = [inp.op == "get_attr" and not node_plan.input_steps[i] for i, inp in enumerate(inputs)]
    kept_shapes = [
        plan.stored_layout(inp).local_shape(tuple(inp.meta["val"].shape), mesh)
        if i in strategy.regather
        else shape
        for i, (inp, shape) in enumerate(zip(inputs, in_shapes))
    ]
    parts = _saved_parts(
        node,
        kept_shapes,
        out_shape,
        needs_grad=node_plan.input_needs_grad,
        mask_itemsize=mask_itemsize,
        held=held,
        lowering=strategy.lowering,
    )
    comm_forward, comm_backward = _comm(node_plan.steps_with_grad(), hardware, mesh)
    for step in node_plan.regathered_steps():  # backward gathers the kept shard again
        seconds = step_time(step, hardware, mesh)[0]
        comm_backward[step.axis] = comm_backward.get(step.axis, 0.0) + seconds
    transient = _transient_bytes(node, node_plan, in_shapes, out_shape)
    return forward, backward, comm_forward, comm_backward, parts, transient


def node_costs(
    traced: Traced, plan: Plan, hardware: Hardware, *, mask_itemsize: int | None = None
) -> dict[str, NodeCost]:
    """`node_cost` of every node of `plan`, and under ``"output"`` the collectives
    that return the outputs."""
    graph_nodes = traced.nodes
    alike: dict = {}  # nodes alike are costed once (`_alike_key`)
    out = {
        name: node_cost(
            graph_nodes[name], placed, plan, hardware, mask_itemsize=mask_itemsize, alike=alike
        )
        for name, placed in plan.nodes.items()
    }
    returned = [(step, True) for steps in plan.output_steps for step in steps]
    out["output"] = NodeCost(0.0, 0.0, *_comm(returned, hardware, plan.mesh), 0)
    return out
