"""Give a rank's program its mesh: every call of a runtime function that reads the
mesh (`autoshard.runtime.comm.ON_MESH`) gets it as `mesh=`, from an attribute of the
program read once per run, so a call reads no global state (what `torch.compile`
needs to trace the program whole):

    mesh = self.mesh
    all_gather = autoshard.runtime.comm.all_gather(x, axis='b', dim=0, ..., mesh=mesh)

Each checkpointed region (a submodule) reads its own `mesh` attribute, the same object."""

from __future__ import annotations

import warnings

from torch import fx

from autoshard.runtime.comm import ON_MESH, BoundMesh


class BindMesh:
    def __init__(self, mesh: BoundMesh):
        self.mesh = mesh

    def __call__(self, gm: fx.GraphModule) -> fx.GraphModule:
        for program in gm.modules():  # the program and its checkpoint regions
            if isinstance(program, fx.GraphModule):
                self._bind(program)
        return gm

    def _bind(self, program: fx.GraphModule) -> None:
        graph = program.graph
        readers = [n for n in graph.nodes if n.op == "call_function" and n.target in ON_MESH]
        if not readers:
            return
        program.mesh = self.mesh
        first = next(n for n in graph.nodes if n.op != "placeholder")
        with graph.inserting_before(first), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # fx warns of get_attr on a plain object
            mesh = graph.get_attr("mesh")
        for node in readers:
            node.kwargs = {**node.kwargs, "mesh": mesh}
        program.recompile()
