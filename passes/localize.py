"""Make every node compute on local shards.

ATen ops mostly work on shards unchanged. A node whose strategy names a
`Lowering` (its op's registry entry lists the ones it may take) is rewritten by
it: given its local shape arguments, or lowered to a kernel of
`autoshard.runtime.ops`:

    # before                                      # after (features split over c)
    layer_norm = aten.layer_norm(x, [16], w, b)   layer_norm = autoshard.runtime.ops.layer_norm(
                                                      x, w, b, 1e-05, normalized_ndim=1,
                                                      axes=('c',), node='layer_norm')
"""

from __future__ import annotations

from torch import fx

from autoshard.planning.plan import Plan


class Localize:
    def __init__(self, plan: Plan):
        self.plan = plan

    def __call__(self, gm: fx.GraphModule) -> fx.GraphModule:
        for node in gm.graph.nodes:
            placed = self.plan.nodes.get(node.name)
            if placed is not None and placed.strategy.lowering is not None:
                placed.strategy.lowering.rewrite(node, placed, self.plan.mesh)
        gm.recompile()
        return gm
