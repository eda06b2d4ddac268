"""Which collectives a plan runs once for several nodes: conversions shared by the
readers of one value, parameter-gradient reductions packed into buckets, and
parameter gathers packed per unit.

Both are read off a plan, so they change its calls, never its layouts:

- A value converted by the same steps for several readers in the same unit of the
  step (`autoshard.planning.units`: q, k and v all-gathering one layer-norm output
  over the same axis) is converted once (`SharedInput`); autograd sums the readers'
  gradients before the conversion's single backward.
- A parameter that enters split work replicated over an axis reaches it through a
  ``grad_all_reduce`` (identity forward, all-reduce backward). Those over one axis,
  of one dtype, are reduced together (`Bucket`), as DDP does: one flat buffer, in
  calls of at most `BUCKET_BYTES`, instead of one call per parameter.
- A parameter stored split over an axis that its one reader gathers (a 3D linear's
  weight, gathered over the axis that splits the rows it multiplies) is gathered
  with the others of its unit gathered over that axis (`GatherBucket`), as FSDP
  gathers a layer's parameters: one all-gather forward, one reduce-scatter backward,
  instead of one each per parameter.

The solver prices both (`autoshard.planning.solver`), so it calls this on every plan
it costs, with the units it plans by.

    >>> import torch, autoshard
    >>> from torch import nn
    >>> from autoshard.tracing.trace import trace
    >>> model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    >>> x = torch.randn(8, 16)
    >>> plan = autoshard.plan(model, (2, 2, 2), (x,), strategy="3d")
    >>> [(b.name, b.axis, len(b.serves)) for b in plan.buckets]
    [('grad_bucket_a', 'a', 2), ('grad_bucket_b', 'b', 1), ('grad_bucket_c', 'c', 1)]
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterable, Mapping

from torch import fx

from autoshard.layout import Step
from autoshard.planning.plan import (
    BUCKET_BYTES,
    Bucket,
    GatherBucket,
    NodePlan,
    Plan,
    SharedInput,
)
from autoshard.planning.planner import default_split
from autoshard.strategies.inplace import updated_in_place
from autoshard.tracing.trace import Traced, tensor_inputs


def share_collectives(
    traced: Traced, plan: Plan, unit_of: Mapping[str, str], names: Iterable[str] | None = None
) -> Plan:
    """`plan` with its shared conversions, gradient and gather buckets (`unit_of`: node →
    its unit). With `names` (in graph order), only among those nodes: what costing
    them needs."""
    order = list(plan.nodes if names is None else names)
    # only nodes whose inputs take steps share a conversion or reduce in a bucket
    inputs = {n: tensor_inputs(traced.nodes[n]) for n in order if any(plan.nodes[n].input_steps)}
    gathers = _gather_buckets(plan, unit_of, order, inputs) if plan.gather_buckets else ()
    bucketed = {served for g in gathers for served in g.serves}
    # per unit, in the order units first come: (axis, dtype) → what it reduces there
    per_unit: dict[str, dict[tuple[str, str], list]] = defaultdict(lambda: defaultdict(list))
    for name, values in inputs.items():
        placed = plan.nodes[name]
        for i, value in enumerate(values):
            for step in bucketed_steps(value, placed, i, plan):
                per_unit[unit_of[name]][step.axis, dtype_name(value)].append((name, i, step))
                bucketed.add((name, i))
    segments = _segments(list(per_unit.values()))
    dtypes = {dtype for groups in per_unit.values() for _, dtype in groups}
    buckets = tuple(
        Bucket(
            name=f"grad_bucket_{axis}"
            + (f"_{dtype}" if len(dtypes) > 1 else "")
            + (f"_{k}" if k else ""),
            axis=axis,
            group_size=served[0][2].group_size,
            dtype=dtype,
            nbytes=sum(step.nbytes for _, _, step in served),
            serves=tuple((name, i) for name, i, _ in served),
        )
        for k, groups in enumerate(segments)
        for (axis, dtype), served in sorted(groups.items())
    )
    first: dict[tuple, tuple[str, int]] = {}
    shared = []
    for name, values in inputs.items():
        placed = plan.nodes[name]
        for i, (value, steps) in enumerate(zip(values, placed.input_steps)):
            if not steps or i in placed.strategy.regather or (name, i) in bucketed:
                continue
            key = (value.name, steps, unit_of[name])
            if key not in first:
                first[key] = (name, i)
            elif not updated_in_place(value, plan):  # else a copy made before the update
                shared.append(SharedInput(name, i, *first[key]))
    return dataclasses.replace(plan, shared=tuple(shared), buckets=buckets, gathers=gathers)


def _gather_buckets(
    plan: Plan, unit_of: Mapping[str, str], order: list[str], inputs: dict[str, list[fx.Node]]
) -> tuple[GatherBucket, ...]:
    """The parameters `gathered_step` admits, per unit (and checkpoint region), axis and
    dtype, in a bucket where at least two share one; `order`: the nodes in graph order,
    `inputs`: the tensor inputs of those whose inputs take steps.

    A bucket gathers at the start of its unit, not at its first reader: what it holds
    then only shrinks as layers leave it (a knob the solver turns), which the solver,
    pricing each knob of a unit on its own, counts on."""
    groups: dict[tuple, list[tuple[str, int, Step]]] = defaultdict(list)
    for name, values in inputs.items():
        placed = plan.nodes[name]
        for i, value in enumerate(values):
            step = gathered_step(value, placed, i, plan)
            if step is not None:
                key = (unit_of[name], plan.regions.get(name), step.axis, dtype_name(value))
                groups[key].append((name, i, step))
    groups = {key: served for key, served in groups.items() if len(served) > 1}
    if not groups:
        return ()
    dtypes = {dtype for *_, dtype in groups}
    position = {name: k for k, name in enumerate(order)}
    start: dict[tuple, int] = {}  # (unit, region) → the position of its first node
    for k, name in enumerate(order):
        start.setdefault((unit_of[name], plan.regions.get(name)), k)
    out = []
    for (unit, region, axis, dtype), served in groups.items():
        first, last = start[unit, region], position[served[-1][0]]
        nbytes = sum(step.nbytes for *_, step in served)
        flat = nbytes + nbytes // served[0][2].group_size  # gathered, and this rank's part
        pending = []
        for k in range(first, last):  # what later readers' gathers hold meanwhile
            held = sum(step.nbytes for reader, _, step in served if position[reader] > k)
            pending.append((order[k], held + (flat if k == first else 0)))
        out.append(
            GatherBucket(
                name=f"gather_{axis}_{order[first]}" + (f"_{dtype}" if len(dtypes) > 1 else ""),
                axis=axis,
                group_size=served[0][2].group_size,
                dtype=dtype,
                nbytes=nbytes,
                serves=tuple((name, i) for name, i, _ in served),
                place=order[first],
                pending=tuple(pending),
            )
        )
    return tuple(out)


def gathered_step(value: fx.Node, placed: NodePlan, i: int, plan: Plan) -> Step | None:
    """The step of input `i` (`value`) of `placed` that a gather bucket may run: a
    parameter that needs a gradient, read by this node alone, reaching it by one
    all-gather that backward reduce-scatters, stored as its family stores it (a layer
    whose weight knob is turned stays out), not kept as its shard (`regather`), nor
    read by a loss run in pieces."""
    steps = placed.input_steps[i]
    if value.op != "get_attr" or len(steps) != 1 or not placed.input_needs_grad[i]:
        return None
    step = steps[0]
    admitted = (
        step.kind == "all_gather"
        and step.backward == "reduce_scatter"
        and step.nbytes
        and len(value.users) == 1
        and placed.strategy.split_weight in (None, default_split(placed.strategy.family))
        and i not in placed.strategy.regather
        and plan.chunks(placed.name) == 1
        and not updated_in_place(value, plan)  # gathered early, it would miss the update
    )
    return step if admitted else None


def _segments(units: list[dict[tuple[str, str], list]]) -> list[dict[tuple[str, str], list]]:
    """Consecutive units' gradient reductions (per unit: (axis, dtype) → (node, input,
    step) served), in groups that each fill no bucket past `BUCKET_BYTES` (a unit that
    does alone is a group of its own): a group's buckets are launched once backward is
    past the group's first reader, while the units before it still compute, as DDP
    launches a bucket once its gradients are ready. A model whose bucketed gradients
    fit one call (3D plans: biases and norm weights) keeps one bucket per axis."""
    segments: list[dict[tuple[str, str], list]] = []
    for groups in reversed(units):  # backward's order: the last unit's gradients first
        current = segments[-1] if segments else None
        # nothing joins a unit that fills a bucket alone, over any axis: its buckets
        # launch once backward is past it, not a unit later (`overlap.backward_end`)
        fits = (
            current is not None
            and all(_nbytes(served) <= BUCKET_BYTES for served in current.values())
            and all(
                _nbytes(current.get(key, ())) + _nbytes(served) <= BUCKET_BYTES
                for key, served in groups.items()
            )
        )
        if not fits:
            current = defaultdict(list)
            segments.append(current)
        for key, served in groups.items():
            current[key][:0] = served  # kept in graph order
    return segments[::-1]


def _nbytes(served) -> int:
    return sum(step.nbytes for _, _, step in served)


def bucketed_steps(value: fx.Node, placed: NodePlan, i: int, plan: Plan) -> tuple[Step, ...]:
    """The steps of input `i` (`value`) of `placed` whose gradient reductions go in
    buckets: a parameter's that needs a gradient, has elements, reaches it by
    ``grad_all_reduce`` steps only, and that no node updates in place (an embedding
    with `max_norm` renormalizes its rows: a bucket, made before, would hand on a view
    of it that the update invalidates)."""
    steps = placed.input_steps[i]
    if value.op != "get_attr" or not placed.input_needs_grad[i] or not steps:
        return ()
    bucketed = all(step.kind == "grad_all_reduce" and step.nbytes for step in steps)
    return steps if bucketed and not updated_in_place(value, plan) else ()


def dtype_name(value: fx.Node) -> str:
    return str(value.meta["val"].dtype).removeprefix("torch.")
