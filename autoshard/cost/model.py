"""Time and memory per rank: the formulas the solver minimizes.

Every formula is a `Formula` (`autoshard.formula`): a sympy expression of shape
symbols, mesh sizes and hardware numbers and the plain-float function made from it.
What depends on the op (its FLOPs, its backward, what it saves) is in the op's
registry entry (`autoshard.strategies.registry`); this module applies it.

Time, from a `Hardware` profile:

- A collective over a mesh axis of size n whose link has latency α and
  bandwidth β, on a buffer of S bytes (the full buffer, as `Step.nbytes`
  counts it), costs (n−1)·α + (n−1)/n·S/β on a ring for an all-gather or a
  reduce-scatter, twice that for an all-reduce. Splits, ``to_partial`` and
  ``grad_all_reduce`` are free in forward; their backward is the collective
  `Step.backward` names (`step_time`).
- An op costs max(FLOPs/(peak·eff), bytes/(bandwidth·eff)) + launch floor,
  with FLOPs (its entry's) and bytes (inputs + output) from its local shapes
  (`node_compute_time`); the backward is a multiple of the forward
  (`backward_multiplier`, its entry's).

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

import functools
import operator
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import sympy
import torch
from torch import fx
from torch.ops import aten

from autoshard.cost.hardware import Hardware
from autoshard.formula import Formula
from autoshard.layout import Step
from autoshard.mesh import Mesh
from autoshard.strategies import Lowering, Saved, entry_for
from autoshard.strategies.pointwise import dropout_returns_input
from autoshard.strategies.registry import itemsize as _itemsize
from autoshard.strategies.registry import largest_operand
from autoshard.strategies.registry import numel as _numel
from autoshard.tracing.schema import argument
from autoshard.tracing.trace import differentiable, structure, tensor_inputs

if TYPE_CHECKING:
    from autoshard.planning.plan import Bucket, GatherBucket, NodePlan, Plan
    from autoshard.tracing.trace import Traced


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

# Any other op's backward reads the output gradient and what the op saved and
# writes the input gradients: about twice the forward's traffic.
OTHER_BACKWARD = 2.0


def step_time(
    step: Step, hardware: Hardware, mesh: Mesh, latency: bool = True
) -> tuple[float, float]:
    """Seconds of `step`'s forward and of its backward (which runs only if a gradient
    does); without `latency`, of its bytes alone (a step another call carries)."""
    link = hardware.link(mesh.index(step.axis))
    alpha = link.alpha if latency else 0.0

    def seconds(kind: str) -> float:
        if kind == "none":
            return 0.0
        return COLLECTIVES[kind](step.nbytes, step.group_size, alpha, link.beta)

    return seconds(step.forward_collective), seconds(step.backward_collective)


def _first_value(node: fx.Node) -> torch.Tensor:
    """The node's tensor, or the first of the tensors it returns (split, chunk)."""
    val = node.meta["val"]
    return val if isinstance(val, torch.Tensor) else val[0]


def _free(node: fx.Node) -> bool:
    """A view: it launches no kernel and moves no data (`OpEntry.free`)."""
    entry = entry_for(node.target)
    return entry is not None and entry.free


def _needs_grad(inputs: Sequence[fx.Node], needs_grad: Sequence[bool] | None) -> tuple[bool, ...]:
    if needs_grad is not None:
        return tuple(needs_grad)
    return tuple(differentiable(inp.meta["val"]) for inp in inputs)


def node_flops(node: fx.Node, local_in_shapes, local_out_shape) -> float:
    """Forward FLOPs of `node` on these local shapes, as its registry entry computes
    them (`OpEntry.flops`: products 2·M·K·N, attention 4·b·h·s_q·s_k·d, normalizations
    and softmaxes 5 per element). Views: 0. Anything else: 1 per element of its
    largest operand.
    """
    if _free(node):
        return 0.0
    entry = entry_for(node.target)
    if entry is not None and entry.flops is not None:
        return entry.flops(node, local_in_shapes, local_out_shape)
    return largest_operand(node, local_in_shapes, local_out_shape)


def backward_multiplier(node: fx.Node, needs_grad: Sequence[bool]) -> float:
    """The backward's time as a multiple of the forward's, as the node's registry
    entry says (`OpEntry.backward`: a product computes one gradient product per
    matrix operand that needs a gradient, attention 2.5×). Views: 0. Anything else:
    `OTHER_BACKWARD` when any input needs a gradient.
    """
    if _free(node) or not any(needs_grad):
        return 0.0
    entry = entry_for(node.target)
    if entry is not None and entry.backward is not None:
        return entry.backward(node, tuple(needs_grad))
    return OTHER_BACKWARD


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
    if _free(node):
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


def saved(
    node: fx.Node,
    local_in_shapes: Sequence[Sequence[int]],
    local_out_shape: Sequence[int],
    *,
    needs_grad: Sequence[bool] | None = None,
    mask_itemsize: int | None = None,
    lowering: Lowering | None = None,
) -> Saved:
    """What autograd keeps for `node`'s backward: what its op's registry entry says
    (`OpEntry.saved`, as torch's derivatives.yaml has it), or, where the node runs
    as a lowering that keeps other tensors (`lowering`, from its strategy), what that
    implementation keeps (`Lowering.saved`). `mask_itemsize` is a dropout mask's
    bytes per element (torch's native dropout keeps a bool mask; autoshard's lowering
    a noise tensor of the activation's dtype, the default).

    Nothing is kept when no input needs a gradient, or for an op with no entry or
    an entry that says nothing (views, add, sub, neg, sums, means, factories).
    `needs_grad` flags each tensor input (default: the floating-point ones).

    `autoshard ops` lists what each op's entry keeps.
    """
    ng = _needs_grad(tensor_inputs(node), needs_grad)
    if not any(ng):
        return Saved()
    entry = entry_for(node.target)
    keeps = entry.saved if entry is not None else None
    if lowering is not None and lowering.saved is not None:
        keeps = lowering.saved
    if keeps is None:
        return Saved()
    return keeps(node, local_in_shapes, local_out_shape, ng, mask_itemsize)


def saved_bytes(
    node: fx.Node,
    local_in_shapes: Sequence[Sequence[int]],
    local_out_shape: Sequence[int],
    *,
    needs_grad: Sequence[bool] | None = None,
    mask_itemsize: int | None = None,
    held: Sequence[bool] | None = None,
    lowering: Lowering | None = None,
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

    step_time: float  # seconds: compute, recompute and communication, less `overlapped`
    peak_memory: int  # bytes
    compute: float  # seconds of forward and backward compute
    recompute: float  # seconds replaying checkpointed regions (their compute and collectives)
    communication: dict[str, float] = field(default_factory=dict)  # seconds per mesh axis
    # seconds of `communication` that run while other work does (`Plan.overlap`)
    overlapped: float = 0.0

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
            overlapped=float(data.get("overlapped", 0.0)),
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


def _aliases(value: fx.Node) -> bool:
    """Its output is a view of its first input's storage (`OpEntry.aliases`)."""
    entry = entry_for(value.target)
    return entry is not None and entry.aliases


def _bucketed_comm(node_plan: NodePlan, plan: Plan, hardware: Hardware) -> dict[str, float]:
    """Seconds per axis of the node's share of gradient buckets: the bandwidth of each
    gradient a bucket reduces for it. A bucket's latency is the plan's, not a node's
    (`bucket_latency`)."""
    out: dict[str, float] = defaultdict(float)
    for _, step in plan.bucketed_steps(node_plan):
        link = hardware.link(plan.mesh.index(step.axis))
        out[step.axis] += ALL_REDUCE(step.nbytes, step.group_size, 0.0, link.beta)
    return dict(out)


def bucket_seconds(bucket: Bucket, mesh: Mesh, hardware: Hardware) -> float:
    """Seconds of all of `bucket`'s calls: each call's latency, and its bytes'."""
    link = hardware.link(mesh.index(bucket.axis))
    bandwidth = ALL_REDUCE(bucket.nbytes, bucket.group_size, 0.0, link.beta)
    return len(bucket.calls) * bucket_latency(bucket.axis, mesh, hardware) + bandwidth


def gather_seconds(bucket: GatherBucket, mesh: Mesh, hardware: Hardware) -> float:
    """Seconds of a gather bucket's backward: one reduce-scatter of its gradients."""
    link = hardware.link(mesh.index(bucket.axis))
    return REDUCE_SCATTER(bucket.nbytes, bucket.group_size, link.alpha, link.beta)


def bucket_latency(axis: str, mesh: Mesh, hardware: Hardware) -> float:
    """Seconds of latency of one gradient-bucket call over `axis` (its bandwidth is
    priced with the gradients it reduces)."""
    link = hardware.link(mesh.index(axis))
    return ALL_REDUCE(0, mesh.size(axis), link.alpha, link.beta)


# Ops that return a view of their input where its strides allow one, a copy elsewhere.
_RESHAPES = (aten.reshape.default, aten.flatten.using_ints, aten.unflatten.int)
# Conversions that return their input itself where it has the dtype and device asked
# for (a float32 model's `hidden_states.to(torch.float32)`).
_CASTS = (aten.to.dtype, aten.to.dtype_layout, aten.to.device)


def _casts_to_itself(value: fx.Node) -> bool:
    if value.target not in _CASTS or argument(value, "copy"):
        return False
    source, val = tensor_inputs(value)[0].meta.get("val"), value.meta.get("val")
    return (
        isinstance(source, torch.Tensor)
        and isinstance(val, torch.Tensor)
        and ((source.dtype, source.device) == (val.dtype, val.device))
    )


def views_input(value: fx.Node) -> bool:
    """Whether `value` is its first input's storage under any plan: a view op, or a
    cast to the dtype and device the input has already."""
    return _aliases(value) or _casts_to_itself(value)


def may_view(value: fx.Node) -> bool:
    """Whether some plan may make `value` a view of its input (`storage_node`)."""
    maybe = (operator.getitem, aten.dropout.default, *_RESHAPES)  # as the plan decides
    return value.target in maybe or views_input(value)


def _viewed(value: fx.Node, plan: Plan) -> fx.Node | None:
    """The node whose storage `value` views, or None: a view's input, or for one
    output of a split (a getitem) the split, whose outputs all view its input."""
    if value.target is operator.getitem:
        return value.args[0] if _aliases(value.args[0]) else None
    if views_input(value) or (value.target in _RESHAPES and _reshape_views(value, plan)):
        return tensor_inputs(value)[0]
    if value.target is aten.dropout.default and dropout_returns_input(value):
        return tensor_inputs(value)[0]
    return None


def _reshape_views(value: fx.Node, plan: Plan) -> bool:
    """Whether a reshape on this rank returns a view, as `Tensor.view` allows: on the
    local shapes, with the input's strides in the order the trace gives them (a
    flash attention's output is laid out [B, S, H, D], so merging its heads back is
    a view; a key repeated over grouped heads is a view where one key head is local)."""
    placed = plan.nodes.get(value.name)
    source = tensor_inputs(value)[0]
    val = source.meta.get("val")
    if placed is None or not isinstance(val, torch.Tensor):
        return False
    shape = placed.strategy.inputs[0].local_shape(tuple(val.shape), plan.mesh)
    out_shape = placed.strategy.output.local_shape(placed.shape, plan.mesh)
    return _view_allowed(tuple(val.shape), val.stride(), tuple(shape), tuple(out_shape))


@functools.cache
def _view_allowed(
    serial: tuple[int, ...], strides: tuple[int, ...], shape: tuple[int, ...], out: tuple[int, ...]
) -> bool:
    """Whether the local `shape` of a tensor laid out as the serial one (`serial` with
    `strides`) views as `out`."""
    local, running = [0] * len(shape), 1
    for d in sorted(range(len(shape)), key=lambda d: (strides[d], -d)):  # innermost first
        broadcast = strides[d] == 0 and serial[d] != 1
        local[d] = 0 if broadcast else running
        running *= 1 if broadcast else shape[d]
    try:
        torch.empty_strided(shape, local, device="meta").view(out)
    except RuntimeError:
        return False
    return True


def storage_node(value: fx.Node, plan: Plan) -> fx.Node:
    """The node whose storage `value` is: itself, or what it views through view ops
    that take no collective (a view exported from the serial model is a view of the
    local tensor too, since that tensor came out of the same op on a shard).
    `views_of` walks the same steps the other way."""
    return storage_chain(value, plan)[-1]


def storage_chain(value: fx.Node, plan: Plan) -> list[fx.Node]:
    """`value`, then each node it views in turn, ending at its `storage_node`."""
    chain = [value]
    while (source := _shares_storage_of(chain[-1], plan)) is not None:
        chain.append(source)
    return chain


def _shares_storage_of(value: fx.Node, plan: Plan) -> fx.Node | None:
    """The node `value` views on this rank, or None: a view that takes no collective."""
    placed = plan.nodes.get(value.name)  # None for a getitem: it has no layout of its own
    if placed is not None and any(placed.input_steps):
        return None
    return _viewed(value, plan)


def views_of(storage: fx.Node, plan: Plan) -> set[fx.Node]:
    """`storage` and every node whose `storage_node` it is: the values that share it."""
    found, todo = {storage}, [storage]
    while todo:
        value = todo.pop()
        for user in value.users:
            if user not in found and _shares_storage_of(user, plan) is value:
                found.add(user)
                todo.append(user)
    return found


def storage_of(value: fx.Node, plan: Plan) -> str:
    """The name of `value`'s `storage_node`: what tensors kept as stored are counted by."""
    return storage_node(value, plan).name


def stored_bytes(value: fx.Node, plan: Plan) -> int:
    """Bytes of `value` on one rank as the plan stores it (0 for what it does not lay out).
    A split's outputs count as one storage: its input as the split receives it, or the
    pieces cut from it (`views.split`), which is as many bytes or fewer."""
    val = value.meta.get("val")
    if isinstance(val, (tuple, list)) and _aliases(value) and value.name in plan.nodes:
        outputs = plan.nodes[value.name].strategy.outputs
        return sum(
            _numel(layout.local_shape(tuple(piece.shape), plan.mesh)) * piece.element_size()
            for layout, piece in zip(outputs, val)
        )
    layout = plan.stored_layout(value)
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
    forward its activation inputs that it does not keep (as read, or their gathered
    copies), its result before the output collectives and its lowering's workspace
    (`Lowering.workspace`); in backward the gradient of its result, of
    each activation input that needs one (at the sizes it computes on; one the op
    broadcasts also at the result's size, before autograd sums it down) and of each
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
        if i not in keeps or (node_plan.input_steps[i] and i in strategy.regather)
    )
    if strategy.lowering is not None and strategy.lowering.workspace is not None:
        forward += strategy.lowering.workspace(node, in_shapes, out_shape)
    reduced = [i for i, steps in enumerate(node_plan.input_steps) if steps]
    backward = (
        result * node_plan.needs_grad
        + sum(
            size[i]
            for i in range(len(inputs))
            if node_plan.input_needs_grad[i] and (i in activations or i in reduced)
        )
        + sum(
            result
            for i in activations
            if node_plan.input_needs_grad[i] and _broadcast(in_shapes[i], out_shape)
        )
        + sum(size[i] for i in strategy.regather)
    )
    return max(forward, backward)


def _broadcast(shape: Sequence[int], out_shape: Sequence[int]) -> bool:
    """Whether a tensor of `shape` broadcasts to a larger `out_shape`."""
    if len(shape) > len(out_shape) or _numel(shape) >= _numel(out_shape):
        return False
    return all(s in (1, o) for s, o in zip(reversed(shape), reversed(out_shape)))


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
    held = _held(node_plan, plan, inputs)
    if alike is None:
        known = _node_cost(node, node_plan, plan, hardware, mask_itemsize, held)
    else:
        key = (*_alike_key(node, node_plan, plan, inputs), held)
        known = alike.get(key)
        if known is None:
            known = alike[key] = _node_cost(node, node_plan, plan, hardware, mask_itemsize, held)
    forward, backward, parts, transient = known
    parts = dict(parts)
    strategy = node_plan.strategy
    # which calls are the node's own depends on the plan around it (conversions it
    # shares, gradients a bucket reduces), so it is not part of what alike nodes share
    comm_forward, comm_backward = _comm(plan.node_steps(node_plan), hardware, plan.mesh)
    for axis, seconds in _bucketed_comm(node_plan, plan, hardware).items():
        comm_backward[axis] = comm_backward.get(axis, 0.0) + seconds
    for step, first in plan.gathered_steps(node_plan):  # the bucket's first pays its call
        f, b = step_time(step, hardware, plan.mesh, latency=first)
        comm_forward[step.axis] = comm_forward.get(step.axis, 0.0) + f
        comm_backward[step.axis] = comm_backward.get(step.axis, 0.0) + b
    for step in node_plan.regathered_steps():  # backward gathers the kept shard again
        seconds = step_time(step, hardware, plan.mesh)[0]
        comm_backward[step.axis] = comm_backward.get(step.axis, 0.0) + seconds
    conversions = plan.conversions
    # An input kept as it is stored (a shard kept for a re-gather too), or the output
    # kept as it is stored, is the very tensor every other node that keeps it (or a
    # view of it) keeps: named by its storage, so it counts once. A view kept counts
    # as the storage it views (an expanded mask as its small source).
    shared = {}
    for part in list(parts):
        if part == "output" and not node_plan.output_steps:
            shared.update(_as_stored(node, parts.pop(part), plan))
        elif isinstance(part, int) and (node.name, part) in conversions:
            # a conversion several nodes read (`Plan.shared`) is one tensor
            shared["converted " + conversions[node.name, part]] = parts.pop(part)
        elif isinstance(part, int) and inputs[part].op != "get_attr":
            if not node_plan.input_steps[part] or part in strategy.regather:
                shared.update(_as_stored(inputs[part], parts.pop(part), plan))
    return NodeCost(
        forward,
        backward,
        dict(comm_forward),
        dict(comm_backward),
        sum(parts.values()),
        transient + plan.gather_pending.get(node.name, 0) + _returning(node, plan),
        shared,
    )


def returned_bytes(graph: fx.Graph) -> int:
    """Bytes of the program's outputs, each whole on every rank: what the caller
    holds while backward runs (`out = model(x)`, then `out.loss.backward()`, with
    the logits still in `out`): a parameter too, whole, gathered if it is stored split
    (a constant for the solver: once too many where it is stored whole)."""
    outputs = tensor_inputs(graph.output_node())
    return sum(_numel(_first_value(value).shape) * _itemsize(value) for value in outputs)


def _returning(node: fx.Node, plan: Plan) -> int:
    """Bytes the program holds at once while it gathers its outputs whole, after its
    last node (`comm.all_gather`, step by step: the step's input, the gathered buffer,
    and, gathered along a dim other than 0, that buffer moved back to its dim; the
    outputs gathered before it), counted with the last node's transients, less the
    outputs themselves, which count from there to the end of backward
    (`returned_bytes`): 0 for any other node."""
    if node.name != next(reversed(plan.nodes)):
        return 0
    high = returned = 0
    for steps in plan.output_steps:
        gathers = [s for s in steps if s.forward_collective == "all_gather"]
        for step in gathers:
            held = step.nbytes // step.group_size + (2 if step.dim else 1) * step.nbytes
            high = max(high, returned + held)
        returned += gathers[-1].nbytes if gathers else 0
    return high - returned


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
        plan.chunks(node.name),
    )


def _held(node_plan: NodePlan, plan: Plan, inputs: Sequence[fx.Node]) -> tuple[bool, ...]:
    """Which inputs a node reads as the parameter itself, which `parameter_bytes`
    counts: one it reads as stored, or through a gradient bucket, whose forward
    hands each parameter back as a view of it (`autoshard.runtime.comm.grad_bucket`).
    Any other step makes a new tensor, which counts as saved where the node keeps it."""
    bucketed = {i for i, _ in plan.bucketed_steps(node_plan)}
    return tuple(
        inp.op == "get_attr" and (not node_plan.input_steps[i] or i in bucketed)
        for i, inp in enumerate(inputs)
    )


def _node_cost(node, node_plan, plan, hardware, mask_itemsize, held) -> tuple:
    """`node_cost`'s name-free part: compute seconds, the saved parts (`_saved_parts`)
    and the transient bytes (`held`: from `_held`)."""
    mesh = plan.mesh
    inputs = tensor_inputs(node)
    strategy = node_plan.strategy
    in_shapes = [
        strategy.inputs[i].local_shape(tuple(inp.meta["val"].shape), mesh)
        for i, inp in enumerate(inputs)
    ]
    out_shape = strategy.output.local_shape(node_plan.shape, mesh)
    chunks = plan.chunks(node.name)  # pieces of a chunked loss run one after the other
    piece_in = [
        shape if inp.op == "get_attr" else _piece(shape, chunks)
        for inp, shape in zip(inputs, in_shapes)
    ]
    forward, backward = (
        chunks * seconds
        for seconds in node_compute_time(
            node,
            piece_in,
            _piece(out_shape, chunks),
            _first_value(node).dtype,
            hardware,
            needs_grad=node_plan.input_needs_grad,
        )
    )
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
    transient = _transient_bytes(node, node_plan, piece_in, _piece(out_shape, chunks))
    if chunks > 1 and any(c.head == node.name for c in plan.chunked):
        # the pieces of the head's input (copies) or their gradients, held until all
        # pieces have run and the gathered input is freed or its gradient joined
        transient += _numel(in_shapes[0]) * _itemsize(inputs[0])
    return forward, backward, parts, transient


def _piece(shape: Sequence[int], chunks: int) -> tuple[int, ...]:
    """`shape` of a tensor one of `chunks` pieces of a chunked loss holds: its first
    dim that `chunks` divides, the last one (features, vocabulary) aside, cut."""
    shape = tuple(shape)
    for d in range(max(len(shape) - 1, 1)):
        if chunks > 1 and d < len(shape) and shape[d] % chunks == 0:
            return (*shape[:d], shape[d] // chunks, *shape[d + 1 :])
    return shape


def node_costs(
    traced: Traced, plan: Plan, hardware: Hardware, *, mask_itemsize: int | None = None
) -> dict[str, NodeCost]:
    """`node_cost` of every node of `plan`, and under ``"output"`` the collectives
    that return the outputs."""
    return dict(NodeCosts(traced, plan, hardware, mask_itemsize=mask_itemsize))


class NodeCosts(Mapping[str, NodeCost]):
    """`node_costs`, each costed when first read: the solver reads the nodes of one
    block of each kind (`autoshard.planning.solver`), not those of the 80 identical
    blocks after it. Nodes alike share one `_node_cost` (`_alike_key`)."""

    def __init__(
        self, traced: Traced, plan: Plan, hardware: Hardware, *, mask_itemsize: int | None = None
    ):
        self.traced, self.plan, self.hardware = traced, plan, hardware
        self.mask_itemsize = mask_itemsize
        self._known: dict[str, NodeCost] = {}
        self._alike: dict = {}

    def __getitem__(self, name: str) -> NodeCost:
        known = self._known.get(name)
        if known is None:
            known = self._known[name] = self._cost(name)
        return known

    def _cost(self, name: str) -> NodeCost:
        plan = self.plan
        if name == "output":
            returned = [(step, True) for steps in plan.output_steps for step in steps]
            return NodeCost(0.0, 0.0, *_comm(returned, self.hardware, plan.mesh), 0)
        if name not in plan.nodes:
            raise KeyError(name)
        return node_cost(
            self.traced.nodes[name],
            plan.nodes[name],
            plan,
            self.hardware,
            mask_itemsize=self.mask_itemsize,
            alike=self._alike,
        )

    def __contains__(self, name: object) -> bool:  # without costing it
        return name == "output" or name in self.plan.nodes

    def __iter__(self) -> Iterator[str]:
        yield from self.plan.nodes
        yield "output"

    def __len__(self) -> int:
        return len(self.plan.nodes) + 1
