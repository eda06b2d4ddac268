"""Turn each checkpoint region of the plan into a submodule called through
`torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`.

The region's nodes (a block's ops and the collectives that serve them) move
into a GraphModule; in their place the program calls it, so backward replays
it, collectives included, from its inputs alone:

    checkpoint = torch.utils.checkpoint.checkpoint(recompute_blocks_1, add_4, ...,
        use_reentrant=False, context_fn=recompute_context, early_stop=False)

`recompute_context` (autoshard.runtime.comm) logs the replayed collectives as
"recompute".
    getitem = checkpoint[0]
"""

from __future__ import annotations

import operator
import re
import warnings

import torch.utils.checkpoint
from torch import fx

from autoshard.planning.plan import Plan
from autoshard.runtime.comm import recompute_context


def _members(graph: fx.Graph, region: str, plan: Plan) -> list[fx.Node]:
    members: list[fx.Node] = []
    inside = set()
    for node in graph.nodes:
        owner = node.meta.get("autoshard_serves", node.name)
        parent = node.args[0] if node.target is operator.getitem else None
        if plan.regions.get(owner) == region or parent in inside:
            members.append(node)
            inside.add(node)
    return members


class OutlineCheckpoints:
    def __init__(self, plan: Plan):
        self.plan = plan

    def __call__(self, gm: fx.GraphModule) -> fx.GraphModule:
        for region in dict.fromkeys(self.plan.regions.values()):
            self._outline(gm, region)
        gm.graph.lint()
        gm.recompile()
        return gm

    def _outline(self, gm: fx.GraphModule, region: str) -> None:
        graph = gm.graph
        members = _members(graph, region, self.plan)
        inside = set(members)
        inputs = list(
            dict.fromkeys(a for n in members for a in n.all_input_nodes if a not in inside)
        )
        outputs = [n for n in members if any(u not in inside for u in n.users)]

        body = fx.Graph()
        env = {a: body.placeholder(a.name) for a in inputs}
        for node in members:
            env[node] = body.node_copy(node, lambda a: env[a])
        body.output(tuple(env[n] for n in outputs))
        name = "recompute_" + re.sub(r"\W", "_", region)  # blocks.3#1 → recompute_blocks_3_1
        gm.add_submodule(name, fx.GraphModule(gm, body, class_name="Recomputed"))

        # Nodes outside the region that sit between its first and last node and read
        # it move after the call.
        after, moved = [], set()
        node = members[0]
        while node is not members[-1]:
            node = node.next
            if node not in inside and any(a in inside or a in moved for a in node.all_input_nodes):
                after.append(node)
                moved.add(node)
        gm.recompute_context = recompute_context
        with graph.inserting_before(members[-1].next), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # fx warns of get_attr on a plain function
            module = graph.get_attr(name)
            context = graph.get_attr("recompute_context")
            # The whole region replays (no early stop), so its collectives are predictable.
            call = graph.call_function(
                torch.utils.checkpoint.checkpoint,
                (module, *inputs),
                {"use_reentrant": False, "context_fn": context, "early_stop": False},
            )
            results = [
                graph.call_function(operator.getitem, (call, i)) for i in range(len(outputs))
            ]
        for old, new in zip(outputs, results):
            old.replace_all_uses_with(new, delete_user_cb=lambda user: user not in inside)
        anchor = results[-1] if results else call
        for node in after:
            anchor.append(node)
            anchor = node
        for node in reversed(members):
            graph.erase_node(node)
