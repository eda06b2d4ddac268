"""`parallelize` at scale without devices: LLaMA-3 70B's first 8 layers (hidden 8192,
64 query and 8 key-value heads, intermediate 28672, vocabulary 128256), built on the
meta device, for 64 sequences of 4096 tokens on an 8×8×8 mesh of 512 ranks. One process
plays rank r of the 512 through torch's fake process group (its collectives move no
data: an all-gather copies this rank's part into every slot), so `parallelize` emits
and cuts shards exactly as that rank would, and the program runs on fake tensors.
`parallelize`'s cross-rank check runs as it does by default and passes: each record it
gathers is this rank's own.

What is checked, for each rank played ("the emitted program's shapes"):

- every parameter and buffer the program holds has exactly the shape
  `Layout.shard_slices` gives for this rank's mesh coordinate under `plan.storage`;
- interpreting the program node by node on fake tensors (into its recomputed regions),
  every value gets the local shape of the traced graph's global shape under the layout
  the plan gives it: a placed node its strategy's output layout, an input the whole
  shape, a parameter its storage, each collective the layout its step leaves (an
  all-gather takes its axis off a dim, a split or reduce-scatter puts it on), and a value
  taken out of a gradient bucket or a recomputed region the layout it went in with;
  the nodes not compared are those with no tensor value (shape asserts, the output);
- forward and backward run, every gradient has its parameter's shard shape, and the
  collectives log, per node, kind, axis and phase, exactly the bytes the plan predicts.

Two plans: the solver's under 80 GiB (`make scale`'s budget: `3d` and `3d-allreduce`
parts, weights whole over M) and `"3d"` under 4 GiB (7 block parts recomputed).
"""

from __future__ import annotations

import operator
import warnings
from pathlib import Path

import pytest
import torch
import torch.utils.checkpoint
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode

import autoshard
from autoshard.api import Compiled, plan_traced
from autoshard.factory import load_factory
from autoshard.layout import Layout
from autoshard.mesh import Mesh
from autoshard.planning.options import PlanOptions
from autoshard.runtime import comm
from autoshard.runtime.ranks import fake_rank
from autoshard.tracing.modes import trace_modes

ROOT = Path(__file__).parents[1]
MESH = (8, 8, 8)
LAYERS = 8
GiB = 2**30
PLANS = {  # name → planning settings, the ranks played under it, whether it recomputes
    "solved, 80 GiB": (dict(memory_budget=80 * GiB), (0, 300, 511), False),
    "3d, 4 GiB": (dict(strategy="3d", memory_budget=4 * GiB), (511,), True),
}
Shaped = tuple[tuple[int, ...], Layout]  # a value's global shape and its layout


@pytest.fixture(scope="module")
def traced():
    """The model and its trace, made once: global shapes for every node."""
    model, inputs = load_factory(f"{ROOT}/benchmarks/scale.py:meta_model")("llama3-70b", LAYERS)
    return model, inputs, trace_modes(model, inputs)


def _after(layout: Layout, kind: str, axis: str, dim: int | None) -> Layout:
    """The layout a collective step of `kind` leaves (`autoshard.runtime.comm`)."""
    dims, partial = [list(axes) for axes in layout.dims], set(layout.partial)
    if kind == "all_gather":
        dims[dim].remove(axis)
    elif kind in ("reduce_scatter", "split"):
        dims[dim].append(axis)
    if kind in ("reduce_scatter", "all_reduce"):
        partial.discard(axis)
    elif kind == "to_partial":
        partial.add(axis)
    return Layout(tuple(map(tuple, dims)), tuple(sorted(partial)))


_STEPS = {f: kind for kind, f in comm.STEP_FUNCTIONS.items()}


class _Shapes(fx.Interpreter):
    """Runs a program node by node, a recomputed region as a nested interpreter, and
    checks each value's shape against the one the plan implies (`checked`: the names)."""

    def __init__(self, gm, plan, global_shapes, checked, expected=None):
        super().__init__(gm)
        self.plan, self.global_shapes, self.checked = plan, global_shapes, checked
        self.expected: dict[str, Shaped | list[Shaped]] = {} if expected is None else expected

    def run_node(self, node):
        if node.target is torch.utils.checkpoint.checkpoint:
            region, *inputs = self.map_nodes_to_values(node.args, node)
            nested = _Shapes(region, self.plan, self.global_shapes, self.checked, self.expected)
            value = nested.run(*inputs)  # a region's placeholders bear its inputs' names
            (outputs,) = [n.args[0] for n in region.graph.nodes if n.op == "output"]
            self.expected[node.name] = [self.expected.get(o.name) for o in outputs]
            return value
        value = super().run_node(node)
        want = self._expected(node)
        if want is not None:
            self.expected[node.name] = want
            single = isinstance(want, tuple)
            if single or node.name in self.plan.nodes:  # a split's pieces: each of them
                pairs = [(value, want)] if single else zip(value, want, strict=True)
                for piece, (shape, layout) in pairs:  # at once: the first wrong one is named
                    local = layout.local_shape(shape, self.plan.mesh)
                    assert piece.shape == local, (node.name, tuple(piece.shape), local, layout)
                self.checked.add(node.name)
        return value

    def _expected(self, node) -> Shaped | list[Shaped] | None:
        placed = self.plan.nodes.get(node.name)
        if placed is not None:
            shape = self.global_shapes[node.name]
            if placed.strategy.outputs:  # several results (a split's pieces), a layout each
                return list(zip(shape, placed.strategy.outputs, strict=True))
            assert placed.shape == shape, node.name
            return placed.shape, placed.strategy.output
        if node.op == "placeholder":  # a model input, or a region's input (its name)
            shape = self.global_shapes.get(node.name)
            whole = None if shape is None else (shape, Layout.replicated(len(shape)))
            return self.expected.get(node.name, whole)
        if node.op == "get_attr" and node.target in self.global_shapes:
            shape = self.global_shapes[node.target]
            return shape, self.plan.storage.get(node.target) or Layout.replicated(len(shape))
        if node.target is operator.getitem:  # a value through a bucket or region
            return self.expected[node.args[0].name][node.args[1]]
        kind = _STEPS.get(node.target)
        if kind is not None:
            shape, layout = self.expected[node.args[0].name]
            return shape, _after(layout, kind, node.kwargs["axis"], node.kwargs.get("dim"))
        if node.target in (comm.grad_bucket, comm.grad_wait):  # parameters pass through
            return [self.expected[a.name] for a in node.args[0]]
        if node.target is comm.gather_bucket:  # each parameter gathered along its dim
            axis = node.kwargs["axis"]
            return [
                (shape, _after(layout, "all_gather", axis, dim))
                for (shape, layout), dim in zip(
                    (self.expected[a.name] for a in node.args[0]), node.kwargs["dims"]
                )
            ]
        return None


def _global_shapes(traced) -> dict[str, tuple[int, ...]]:
    """Every traced tensor's global shape: nodes by name, parameters by FQN."""
    out = {fqn: tuple(t.shape) for fqn, t in traced.parameters.items()}
    for node in traced.graph_module.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            out[node.name] = tuple(val.shape)
        elif isinstance(val, (tuple, list)) and all(isinstance(v, torch.Tensor) for v in val):
            out[node.name] = [tuple(v.shape) for v in val]
    return out


def _check_rank(rank: int, model, inputs, compiled: Compiled, global_shapes) -> None:
    """Play rank `rank` of the 512: parallelize, then check its shards and what its
    program computes, on fake tensors."""
    with fake_rank(MESH, rank) as mesh:
        parallel = autoshard.parallelize(model, mesh, inputs, compiled=compiled)
        plan = compiled.plan
        coord = dict(zip(plan.mesh.names, mesh.get_coordinate()))
        held = dict(parallel.program.named_parameters()) | dict(parallel.program.named_buffers())
        assert set(held) == set(compiled.weights) | set(compiled.constants)
        for fqn, shard in held.items():
            layout = plan.storage.get(fqn) or Layout.replicated(shard.ndim)
            slices = layout.shard_slices(global_shapes[fqn], plan.mesh, coord)
            want = tuple(stop - start for start, stop in slices)
            assert tuple(shard.shape) == want, (fqn, tuple(shard.shape), want)

        checked = set()
        with FakeTensorMode(allow_non_fake_inputs=True):
            fake = [torch.empty(spec.shape, dtype=spec.dtype) for spec in compiled.inputs]
            with torch.no_grad():
                _Shapes(parallel.program, plan, global_shapes, checked).run(*fake)
            with autoshard.comm_log() as log:
                loss = parallel(*fake)
                loss.backward()
        # every node the plan places is compared, and every collective in and out of
        # regions; a loss run in pieces holds its head and the views between (`ChunkLoss`)
        folded = {name for c in plan.chunked for name in (c.head, *c.between)}
        assert set(plan.nodes) - folded <= checked, set(plan.nodes) - folded - checked
        assert loss.shape == ()
        for name, p in parallel.named_parameters():
            assert p.grad.shape == p.shape, (name, p.grad.shape, p.shape)
        assert log.bytes_by("node", "kind", "axis", "phase") == plan.predicted_comm()


@pytest.fixture(scope="module")
def programs(traced):
    """Plan name → the program compiled for it (once, for every rank played)."""
    model, _, graph = traced
    made = {}

    def program(name: str) -> Compiled:
        if name not in made:
            settings, _, recomputes = PLANS[name]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # fallbacks to another family are in the plan
                options = PlanOptions.from_user(hardware="ib-cluster", **settings)
                plan = plan_traced(graph, Mesh.from_shape(MESH), options)
            assert bool(plan.regions) == recomputes
            made[name] = Compiled.emitted(graph, plan, model)
        return made[name]

    return program


@pytest.mark.parametrize(
    "name, rank",
    [(name, rank) for name, (_, ranks, _) in PLANS.items() for rank in ranks],
    ids=str,
)
def test_a_rank_of_512_emits_the_shapes_it_planned(traced, programs, name, rank):
    model, inputs, graph = traced
    _check_rank(rank, model, inputs, programs(name), _global_shapes(graph))
