"""How much of the gradient buckets' communication runs while other work does.

With `Plan.overlap` the program's backward launches each bucket's reductions and
goes on (`autoshard.runtime.comm.grad_bucket`, and a gather bucket's reduce-scatter:
`gather_bucket`); it waits for them at its end, before the gradients reach the
parameters. Autograd runs ready nodes latest-made first, on
one thread, so backward unfolds as follows, from the last node to the first:

- each node's backward computes, in turn;
- once backward is past the node a bucket is placed before (`Plan.bucket_places`:
  the first reader of what it serves; a gather bucket's `place`: the first node of
  its unit), the bucket launches its calls, after waiting
  for any bucket placed with it whose gradients it reduces further (a parameter
  replicated over two axes goes through a bucket per axis, in turn);
- the last wait ends when every node's backward and every launched reduction are
  done.

One axis reduces one call at a time; calls over different axes (different process
groups, different links) run side by side. With R the seconds of each bucket's
calls (`bucket_seconds`) and B those of backward's compute, backward ends at

    end = max(t, max over buckets of its finish)

where t is when its compute is done (waits included), and without overlap it is
``B + Σ R``. The difference is the communication hidden (`overlapped`), which
`estimate` takes off the step time: ``max`` where the serial program pays a sum.

For one bucket placed where `after` seconds of compute remain, ``end = B − after +
max(R, after)``: hidden ``min(R, after)``. Buckets are cut at units, so that those of
the last blocks launch while the first blocks still compute (`collectives._segments`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

from autoshard.cost.hardware import Hardware
from autoshard.cost.model import NodeCost, bucket_seconds, gather_seconds
from autoshard.planning.plan import Bucket, GatherBucket, Plan


def overlapped(plan: Plan, costs: Mapping[str, NodeCost], hardware: Hardware) -> float:
    """Seconds of the buckets' communication hidden behind other work (0 without
    `plan.overlap`); `costs` are the plan's node costs (`node_costs`)."""
    if not plan.overlap or not (plan.buckets or plan.gathers):
        return 0.0
    compute = {name: costs[name].backward_compute for name in plan.nodes}
    seconds = {b.name: bucket_seconds(b, plan.mesh, hardware) for b in plan.buckets}
    seconds.update({g.name: gather_seconds(g, plan.mesh, hardware) for g in plan.gathers})
    places = {**plan.bucket_places(), **{g.name: g.place for g in plan.gathers}}
    # placed with the gradient buckets, a gather bucket comes after them in the program
    end = backward_end((*plan.buckets, *plan.gathers), seconds, compute, places)
    return sum(seconds.values()) + sum(compute.values()) - end


def backward_end(
    buckets: tuple[Bucket | GatherBucket, ...],
    seconds: Mapping[str, float],
    compute: Mapping[str, float],
    places: Mapping[str, str],
) -> float:
    """When backward ends (see the module docstring): `buckets` in the program's order,
    `seconds` of each by name, `compute`: each node's backward seconds in graph order,
    `places`: the node each bucket is placed before."""
    placed: dict[str, list[int]] = defaultdict(list)
    for k, bucket in enumerate(buckets):
        placed[places[bucket.name]].append(k)
    t = 0.0  # autograd's thread
    finish: dict[str, float] = {}  # bucket → when its reductions are done
    free: dict[str, float] = {}  # axis → when it is free for the next call
    for name in reversed(list(compute)):
        t += compute[name]
        for k in reversed(placed.get(name, [])):  # placed together: latest-made first
            bucket = buckets[k]
            mine = set(bucket.serves)
            for later in buckets[k + 1 :]:  # whose gradients it reads: waited for
                if later.name in finish and mine & set(later.serves):
                    t = max(t, finish[later.name])
            start = max(t, free.get(bucket.axis, 0.0))
            finish[bucket.name] = free[bucket.axis] = start + seconds[bucket.name]
    return max(t, *finish.values())
