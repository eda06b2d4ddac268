"""How much of the gradient buckets' communication runs while other work does.

With `Plan.overlap` the program's backward launches each bucket's reductions and
goes on (`autoshard.runtime.comm.grad_bucket`); it waits for them at its end, before
the gradients reach the parameters. Autograd runs ready nodes latest-made first, on
one thread, so backward unfolds as follows once the backward of the first node that
reads a bucketed parameter (`first reader`) is done:

- the buckets' nodes run, latest-made first: each launches its calls, after waiting
  for any later bucket whose gradients it reduces further (a parameter replicated
  over two axes goes through a bucket per axis, in turn);
- the backward of every node above the first reader computes, `after` seconds;
- the last wait ends when both that compute and every launched reduction are done.

One axis reduces one call at a time; calls over different axes (different process
groups, different links) run side by side. With R the seconds of each bucket's
calls (`bucket_seconds`), the end time of backward past the first reader is

    end = max(t + after, max over buckets of its finish)

where t is when the last bucket was launched, and without overlap it is
``Σ R + after``. The difference is the communication hidden (`overlapped`), which
`estimate` takes off the step time: ``max`` where the serial program pays a sum.

For one bucket launched at once, ``end = max(R, after)``: hidden ``min(R, after)``.
"""

from __future__ import annotations

from collections.abc import Mapping

from autoshard.cost.hardware import Hardware
from autoshard.cost.model import NodeCost, bucket_seconds
from autoshard.planning.plan import Bucket, Plan


def overlapped(plan: Plan, costs: Mapping[str, NodeCost], hardware: Hardware) -> float:
    """Seconds of the buckets' communication hidden behind other work (0 without
    `plan.overlap`); `costs` are the plan's node costs (`node_costs`)."""
    if not plan.overlap or not plan.buckets:
        return 0.0
    served = {name for bucket in plan.buckets for name, _ in bucket.serves}
    after = 0.0  # backward compute of the nodes above the first reader
    for name in plan.nodes:
        if name in served:
            break
        after += costs[name].backward_compute
    seconds = {b.name: bucket_seconds(b, plan.mesh, hardware) for b in plan.buckets}
    end = backward_end(plan.buckets, seconds, after)
    return sum(seconds.values()) + after - end


def backward_end(buckets: tuple[Bucket, ...], seconds: Mapping[str, float], after: float) -> float:
    """When backward ends, from the first reader's backward on (see the module
    docstring): `buckets` in the program's order, `seconds` of each by name."""
    t = 0.0  # autograd's thread
    finish: dict[str, float] = {}  # bucket → when its reductions are done
    free: dict[str, float] = {}  # axis → when it is free for the next call
    for k in reversed(range(len(buckets))):
        bucket = buckets[k]
        mine = set(bucket.serves)
        for later in buckets[k + 1 :]:  # whose gradients it reads: waited for
            if mine & set(later.serves):
                t = max(t, finish[later.name])
        start = max(t, free.get(bucket.axis, 0.0))
        finish[bucket.name] = free[bucket.axis] = start + seconds[bucket.name]
    return max(t + after, *finish.values())
