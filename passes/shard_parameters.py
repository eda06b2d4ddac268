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

from autoshard.layout import Layout
from autoshard.planning.plan import Plan
from autoshard.runtime.comm import BoundMesh, local_part


class ShardParameters:
    """Each rank keeps its own part on `mesh`.

    Swaps, in place, each of the program's global tensors for this rank's part (a
    Parameter stays a Parameter, with its ``requires_grad``; a buffer a buffer), and
    compiles again only the graphs that ran ops on the meta device."""

    def __init__(self, plan: Plan, parameters: dict[str, torch.Tensor], mesh: BoundMesh):
        self.plan = plan
        self.parameters = parameters
        self.mesh = mesh

    def __call__(self, gm: fx.GraphModule) -> fx.GraphModule:
        device = self.mesh.device_mesh.device_type
        for fqn, full in self.parameters.items():
            layout = self.plan.storage.get(fqn) or Layout.replicated(full.ndim)
            if full.is_meta:
                shape = layout.local_shape(full.shape, self.plan.mesh)
                local = torch.empty(shape, dtype=full.dtype, device=device)
            else:
                local = local_part(full.detach(), layout.dims, self.mesh).clone()
            path, _, name = fqn.rpartition(".")
            owner = gm.get_submodule(path)
            if isinstance(full, torch.nn.Parameter):
                owner.register_parameter(
                    name, torch.nn.Parameter(local, requires_grad=full.requires_grad)
                )
            else:
                owner.register_buffer(name, local)
        for program in gm.modules():  # the program and its checkpoint regions
            if isinstance(program, fx.GraphModule) and _off_meta(program.graph, device):
                program.recompile()
        return gm


def _off_meta(graph: fx.Graph, device: str) -> bool:
    """Run on `device` the ops `graph` calls with ``device=meta``; whether there were any.
    (An op takes a device as an argument of its own, never inside a list.)"""
    meta = torch.device("meta")

    def moved(a):
        return torch.device(device) if isinstance(a, torch.device) and a == meta else a

    changed = False
    for node in graph.nodes:
        args = tuple(moved(a) for a in node.args)
        kwargs = {k: moved(v) for k, v in node.kwargs.items()}
        if args != node.args or kwargs != node.kwargs:
            node.args, node.kwargs = args, kwargs
            changed = True
    return changed
