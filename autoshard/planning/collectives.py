"""Which collectives a plan runs once for several nodes: conversions shared by the
readers of one value, and parameter-gradient reductions packed into buckets.

Both are read off a plan, so they change its calls, never its layouts:

- A value converted by the same steps for several readers in the same unit of the
  step (`autoshard.planning.units`: q, k and v all-gathering one layer-norm output
  over the same axis) is converted once (`SharedInput`); autograd sums the readers'
  gradients before the conversion's single backward.
- A parameter that enters split work replicated over an axis reaches it through a
  ``grad_all_reduce`` (identity forward, all-reduce backward). Those over one axis,
  of one dtype, are reduced together (`Bucket`), as DDP does: one flat buffer, in
  calls of at most `BUCKET_BYTES`, instead of one call per parameter.

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
from autoshard.planning.plan import BUCKET_BYTES, Bucket, NodePlan, Plan, SharedInput
from autoshard.strategies.inplace import updated_in_place
from autoshard.tracing.trace import Traced, tensor_inputs


def share_collectives(
    traced: Traced, plan: Plan, unit_of: Mapping[str, str], names: Iterable[str] | None = None
) -> Plan:
    """`plan` with its shared conversions and gradient buckets (`unit_of`: node name →
    its unit). With `names`, only among those nodes: what costing them needs."""
    # only nodes whose inputs take steps share a conversion or reduce in a bucket
    names = [n for n in (plan.nodes if names is None else names) if any(plan.nodes[n].input_steps)]
    bucketed = set()
    # per unit, in the order units first come: (axis, dtype) → what it reduces there
    per_unit: dict[str, dict[tuple[str, str], list]] = defaultdict(lambda: defaultdict(list))
    for name in names:
        placed = plan.nodes[name]
        for i, value in enumerate(tensor_inputs(traced.nodes[name])):
            for step in bucketed_steps(value, placed, i):
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
    for name in names:
        placed = plan.nodes[name]
        inputs = tensor_inputs(traced.nodes[name])
        for i, (value, steps) in enumerate(zip(inputs, placed.input_steps)):
            if not steps or i in placed.strategy.regather or (name, i) in bucketed:
                continue
            key = (value.name, steps, unit_of[name])
            if key not in first:
                first[key] = (name, i)
            elif not updated_in_place(value, plan):  # else a copy made before the update
                shared.append(SharedInput(name, i, *first[key]))
    return dataclasses.replace(plan, shared=tuple(shared), buckets=buckets)


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


def bucketed_steps(value: fx.Node, placed: NodePlan, i: int) -> tuple[Step, ...]:
    """The steps of input `i` (`value`) of `placed` whose gradient reductions go in
    buckets: a parameter's that needs a gradient, has elements, and reaches it by
    ``grad_all_reduce`` steps only."""
    steps = placed.input_steps[i]
    if value.op != "get_attr" or not placed.input_needs_grad[i] or not steps:
        return ()
    bucketed = all(step.kind == "grad_all_reduce" and step.nbytes for step in steps)
    return steps if bucketed else ()


def dtype_name(value: fx.Node) -> str:
    return str(value.meta["val"].dtype).removeprefix("torch.")
