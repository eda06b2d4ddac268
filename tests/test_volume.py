"""Communication volume of one linear X[T,H]·W[H,O] in the middle of three, logged on
a real 2×2×2 mesh (d = 2), against the closed forms per design.

Per rank, counting (n−1)/n of each collective's full buffer (twice for all-reduce):
- "3d" (all-gather / reduce-scatter): forward (d−1)/d³·(T·H + H·O + T·O), backward the same;
- "3d-allreduce": forward 2(d−1)/d³·T·O (output all-reduce over K), backward
  2(d−1)/d³·(T·H + H·O) (input gradient over N, weight gradient over M);
- "replicated": nothing.
"""

from pathlib import Path

import pytest
import torch

import autoshard
from autoshard.runtime.ranks import shared_pool
from autoshard.testing import load_factory

MODELS = str(Path(__file__).parent / "models.py")
d = 2
T, H, O = 16, 16, 32
E = 4  # fp32 bytes

FORMULAS = {
    "3d": ((d - 1) / d**3 * (T * H + H * O + T * O) * E,) * 2,
    "3d-allreduce": (
        2 * (d - 1) / d**3 * T * O * E,
        2 * (d - 1) / d**3 * (T * H + H * O) * E,
    ),
    "replicated": (0.0, 0.0),
}


def _logged_volume(mesh, strategy):
    model, inputs = load_factory(f"{MODELS}:three_linears")()
    parallel = autoshard.parallelize(model, mesh, inputs, strategy=strategy)
    node = next(n.name for n in parallel.plan.nodes.values() if n.module == "middle")
    with autoshard.comm_log() as log:
        parallel(*inputs).sum().backward()
    predicted = {k: v for k, v in parallel.plan.predicted_comm().items()}
    logged = {}
    for r in log.records:
        key = (r.node, r.kind, r.axis, r.phase)
        logged[key] = logged.get(key, 0) + r.bytes
    return log.ring_bytes(node, "forward"), log.ring_bytes(node, "backward"), logged, predicted


@pytest.mark.parametrize("strategy", sorted(FORMULAS))
def test_middle_linear_volume_matches_closed_form(strategy):
    for forward, backward, logged, predicted in shared_pool(8).run(
        _logged_volume, (d, d, d), strategy
    ):
        assert forward == pytest.approx(FORMULAS[strategy][0])
        assert backward == pytest.approx(FORMULAS[strategy][1])
        assert logged == predicted  # every collective of the step, exactly as planned


def _weight_shards(mesh):
    model, inputs = load_factory(f"{MODELS}:mlp")()
    parallel = autoshard.parallelize(model, mesh, inputs, strategy="3d")
    full = dict(model.named_parameters())
    return {
        name: (p.numel(), full[name].numel())
        for name, p in parallel.named_parameters()
        if name.endswith("weight") and full[name].ndim == 2
    }


def test_3d_stores_each_linear_weight_as_one_eighth_per_rank():
    for shards in shared_pool(8).run(_weight_shards, (2, 2, 2)):
        assert shards and all(local * 8 == total for local, total in shards.values())


def test_plan_volume_without_processes():
    model, inputs = load_factory(f"{MODELS}:three_linears")()
    plan = autoshard.plan(model, (d, d, d), inputs, strategy="3d")
    middle = next(n for n in plan.nodes.values() if n.module == "middle")
    assert middle.strategy.family == "3d"
    ring = sum(s.ring_bytes(s.forward_collective) for s, _ in middle.steps_with_grad())
    assert ring == pytest.approx(FORMULAS["3d"][0])
    assert torch.Size(middle.local_shape).numel() * d**3 == T * O
