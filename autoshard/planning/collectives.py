"""Which collectives a plan runs once for several nodes: conversions shared by the
readers of one value, and parameter-gradient reductions packed into buckets.

Both are read off a plan the solver made, so they change its calls, never its layouts:

- A value converted by the same steps for several readers in the same checkpoint
  region (q, k and v all-gathering one layer-norm output over the same axis) is
  converted once (`SharedInput`); autograd sums the readers' gradients before the
  conversion's single backward.
- A parameter that enters split work replicated over an axis reaches it through a
  ``grad_all_reduce`` (identity forward, all-reduce backward). Those over one axis,
  of one dtype, are reduced together (`Bucket`, at most `BUCKET_BYTES` each): one
  call per bucket instead of one per parameter, as DDP does.

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

from autoshard.planning.plan import Bucket, Plan, SharedInput
from autoshard.tracing.trace import Traced, tensor_inputs

BUCKET_BYTES = 25 << 20  # DDP's default bucket cap


def share_collectives(traced: Traced, plan: Plan) -> Plan:
    """`plan` with its shared conversions and gradient buckets."""
    buckets = _buckets(traced, plan)
    bucketed = {(n, i) for b in buckets for n, i in b.serves}
    return dataclasses.replace(plan, shared=_shared(traced, plan, bucketed), buckets=buckets)


def _shared(traced: Traced, plan: Plan, bucketed: set) -> tuple[SharedInput, ...]:
    first: dict[tuple, tuple[str, int]] = {}
    out = []
    for name, placed in plan.nodes.items():
        inputs = tensor_inputs(traced.nodes[name])
        for i, (value, steps) in enumerate(zip(inputs, placed.input_steps)):
            if not steps or i in placed.strategy.regather or (name, i) in bucketed:
                continue
            key = (value.name, steps, plan.regions.get(name))
            if key in first:
                out.append(SharedInput(name, i, *first[key]))
            else:
                first[key] = (name, i)
    return tuple(out)


def _buckets(traced: Traced, plan: Plan) -> tuple[Bucket, ...]:
    """Per (axis, dtype), in graph order, the parameter inputs whose gradient a
    ``grad_all_reduce`` over that axis reduces, cut at `BUCKET_BYTES`."""
    groups: dict[tuple[str, str], list[list]] = defaultdict(lambda: [[]])
    sizes: dict[tuple[str, str], int] = defaultdict(int)
    for name, placed in plan.nodes.items():
        inputs = tensor_inputs(traced.nodes[name])
        for i, (value, steps) in enumerate(zip(inputs, placed.input_steps)):
            if value.op != "get_attr" or not placed.input_needs_grad[i] or not steps:
                continue
            if any(step.kind != "grad_all_reduce" for step in steps):
                continue
            dtype = str(value.meta["val"].dtype).removeprefix("torch.")
            for step in steps:
                key = (step.axis, dtype)
                if sizes[key] + step.nbytes > BUCKET_BYTES and groups[key][-1]:
                    groups[key].append([])
                    sizes[key] = 0
                groups[key][-1].append((name, i, step))
                sizes[key] += step.nbytes
    out = []
    dtypes = {dtype for _, dtype in groups}
    for (axis, dtype), parts in sorted(groups.items()):
        for k, part in enumerate(parts):
            suffix = (f"_{dtype}" if len(dtypes) > 1 else "") + (f"_{k}" if len(parts) > 1 else "")
            out.append(
                Bucket(
                    name=f"grad_bucket_{axis}{suffix}",
                    axis=axis,
                    group_size=part[0][2].group_size,
                    dtype=dtype,
                    nbytes=sum(step.nbytes for _, _, step in part),
                    serves=tuple((name, i) for name, i, _ in part),
                )
            )
    return tuple(out)
