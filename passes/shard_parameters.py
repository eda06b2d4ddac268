"""Give the program this rank's shards of the parameters and buffers, under their
original FQNs, so `named_parameters()` reads like the serial model's.

A tensor of a model built on the meta device has no values to cut: its shard is
allocated, unfilled, on the mesh's device (`autoshard.checkpoint.load_hf` or
`autoshard.checkpoint.load` fill it), and the ops traced with ``device=meta``
(factories such as ``arange`` for positions, torch.export's metadata checks)
run on that device instead."""

from __future__ import annotations

import torch
from torch import fx
from torch.utils import _pytree as pytree

from autoshard.layout import Layout
from autoshard.planning.plan import Plan
from autoshard.runtime.comm import current_mesh, local_part


class ShardParameters:
    """Needs the mesh bound (`autoshard.runtime.comm.bound`): each rank keeps its own part."""

    def __init__(self, plan: Plan, parameters: dict[str, torch.Tensor]):
        self.plan = plan
        self.parameters = parameters

    def __call__(self, gm: fx.GraphModule) -> fx.GraphModule:
        root = torch.nn.Module()
        device = current_mesh().device_mesh.device_type
        for fqn, full in self.parameters.items():
            layout = self.plan.storage.get(fqn) or Layout.replicated(full.ndim)
            if full.is_meta:
                shape = layout.local_shape(full.shape, self.plan.mesh)
                local = torch.empty(shape, dtype=full.dtype, device=device)
            else:
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
        for program in gm.modules():  # the program and its checkpoint regions
            if isinstance(program, fx.GraphModule) and _off_meta(program.graph, device):
                if program is not gm:  # gm's graph is compiled again below
                    program.recompile()
        for node in gm.graph.nodes:  # checkpoint regions and what they call
            if node.op == "get_attr" and node.target not in self.parameters:
                value = getattr(gm, node.target)
                if isinstance(value, torch.nn.Module):
                    root.add_module(node.target, value)
                else:
                    setattr(root, node.target, value)
        return fx.GraphModule(root, gm.graph, class_name="ParallelProgram")


def _off_meta(graph: fx.Graph, device: str) -> bool:
    """Run on `device` the ops `graph` calls with ``device=meta``; whether there were any."""
    meta, changed = torch.device("meta"), False
    for node in graph.nodes:
        moved = pytree.tree_map(
            lambda a: torch.device(device) if a == meta else a, (node.args, node.kwargs)
        )
        if moved != (node.args, node.kwargs):
            node.args, node.kwargs = moved
            changed = True
    return changed
