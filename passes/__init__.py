"""Rewriting passes: each takes a GraphModule and the Plan, and returns a GraphModule.

A pass never decides: what to do is in the plan. `emit` runs them in order:

    insert collectives → localize → chunk losses → outline checkpoints → (per rank)
    shard parameters, bind the mesh
"""

from __future__ import annotations

import copy

from torch import fx

from autoshard.planning.plan import Plan
from autoshard.tracing.trace import Traced
from passes.bind_mesh import BindMesh
from passes.chunk_loss import ChunkLoss
from passes.insert_collectives import InsertCollectives
from passes.localize import Localize
from passes.outline_checkpoints import OutlineCheckpoints
from passes.shard_parameters import ShardParameters


def emit(traced: Traced, plan: Plan) -> fx.GraphModule:
    """The rank-independent program: collectives inserted, ops localized.
    Its attributes are still the global parameters; `ShardParameters` swaps
    in each rank's shards, and `BindMesh` gives it the rank's mesh."""
    gm = fx.GraphModule(traced.graph_module, copy.deepcopy(traced.graph_module.graph))
    rewrites = (InsertCollectives(plan), Localize(plan), ChunkLoss(plan), OutlineCheckpoints(plan))
    for rewrite in rewrites:
        gm = rewrite(gm)
    return gm


__all__ = [
    "BindMesh",
    "ChunkLoss",
    "InsertCollectives",
    "Localize",
    "OutlineCheckpoints",
    "ShardParameters",
    "emit",
]
