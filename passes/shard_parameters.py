"""Give the program this rank's shards of the parameters and buffers, under their
original FQNs, so `named_parameters()` reads like the serial model's."""

from __future__ import annotations

import torch
from torch import fx

from autoshard.comm import local_part
from autoshard.layout import Layout
from autoshard.plan import Plan


class ShardParameters:
    """Needs the mesh bound (`autoshard.comm.bound`): each rank keeps its own part."""

    def __init__(self, plan: Plan, parameters: dict[str, torch.Tensor]):
        self.plan = plan
        self.parameters = parameters

    def __call__(self, gm: fx.GraphModule) -> fx.GraphModule:
        root = torch.nn.Module()
        for fqn, full in self.parameters.items():
            layout = self.plan.storage.get(fqn) or Layout.replicated(full.ndim)
            local = local_part(full.detach(), layout.dims).clone()
            owner = root
            *path, name = fqn.split(".")
            for part in path:
                if not hasattr(owner, part):
                    owner.add_module(part, torch.nn.Module())
                owner = getattr(owner, part)
            if isinstance(full, torch.nn.Parameter):
                owner.register_parameter(
                    name, torch.nn.Parameter(local, requires_grad=full.requires_grad)
                )
            else:
                owner.register_buffer(name, local)
        for node in gm.graph.nodes:  # checkpoint regions and what they call
            if node.op == "get_attr" and node.target not in self.parameters:
                value = getattr(gm, node.target)
                if isinstance(value, torch.nn.Module):
                    root.add_module(node.target, value)
                else:
                    setattr(root, node.target, value)
        return fx.GraphModule(root, gm.graph, class_name="ParallelProgram")
