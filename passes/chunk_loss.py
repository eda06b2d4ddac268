"""Run each loss the plan chunks (`Plan.chunked`) over its tokens in pieces.

After `InsertCollectives` and `Localize`, the head, its output collectives, the views
and casts between and the vocabulary-parallel loss become one call of
`autoshard.runtime.losses.chunked_cross_entropy`, which runs them piece by piece:

    # before                                        # after (4 chunks)
    linear_12 = aten.linear(split, all_gather_24)   cross_entropy_loss = autoshard.runtime.
    reduce_scatter_16 = ...reduce_scatter(            losses.chunked_cross_entropy(
        linear_12, axis='c', dim=0, ...)                  split, all_gather_24, split_2, None,
    view_8 = aten.reshape(reduce_scatter_16, ...)         chunks=4, dim=1, steps=((
    cross_entropy_loss = ...cross_entropy(                'reduce_scatter', {'axis': 'c',
        view_8, split_2, None, ...)                       'dim': 0, ...}),), ...)
"""

from __future__ import annotations

from torch import fx

from autoshard.planning.plan import ChunkedLoss, Plan
from autoshard.runtime import losses
from passes.insert_collectives import _step_kwargs


class ChunkLoss:
    def __init__(self, plan: Plan):
        self.plan = plan

    def __call__(self, gm: fx.GraphModule) -> fx.GraphModule:
        nodes = {n.name: n for n in gm.graph.nodes}
        for chunked in self.plan.chunked:
            self._rewrite(gm.graph, nodes, chunked)
        gm.graph.lint()
        gm.recompile()
        return gm

    def _rewrite(self, graph: fx.Graph, nodes: dict, chunked: ChunkedLoss) -> None:
        head, loss = nodes[chunked.head], nodes[chunked.loss]
        placed = self.plan.nodes[chunked.head]
        logits = loss.args[0]
        steps = tuple((s.kind, _step_kwargs(s)) for s in placed.output_steps)
        loss.target = losses.chunked_cross_entropy  # in place: its name and readers stay
        loss.args = (*head.args[:2], *loss.args[1:])  # target, class weight
        loss.kwargs = {
            "chunks": chunked.chunks,
            "dim": chunked.dim,
            "steps": steps,
            "head": head.name,
            "dtype": logits.meta["val"].dtype,
            **loss.kwargs,
        }
        # the chain from the head to the logits (its collectives, views and casts), and
        # the trace's checks of their metadata, all read by nothing now
        value = logits
        while value is not head:
            source = value.args[0]
            for user in list(value.users):
                graph.erase_node(user)
            graph.erase_node(value)
            value = source
        for user in list(head.users):
            graph.erase_node(user)
        graph.erase_node(head)
