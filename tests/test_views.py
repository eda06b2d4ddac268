"""Every view rule against every nesting order: random chains of views, permutations,
slices and joins on an input split in a random layout, run on real gloo meshes and
compared with the serial ops, values and gradients (of the input and of a weight).

A case is an input shape, its layout (axes on random dims in a random nesting order)
and a chain of ops; the graph is built by hand (no export), planned with the input in
that layout, emitted and run by the ordinary pipeline. All cases of a mesh run in one
rank-pool job.
"""

from __future__ import annotations

import math
import operator
import random

import torch
from torch import fx
from torch.ops import aten
from torch.utils import _pytree as pytree

from autoshard.api import Compiled, ParallelModule
from autoshard.layout import Layout
from autoshard.mesh import Mesh
from autoshard.planning.planner import plan_graph
from autoshard.runtime import comm
from autoshard.tracing.trace import InputSpec, Traced
from passes import BindMesh, ShardParameters

CASES_PER_MESH = 200
MESHES = [(2, 2, 2), (1, 2, 4)]
SIZES = (1, 2, 3, 4, 6, 8)


def _random_layout(rng: random.Random, shape, mesh: Mesh) -> Layout:
    """Each axis of the mesh on a random dim it divides (or none), in a random order."""
    dims: list[list[str]] = [[] for _ in shape]
    axes = [a for a in mesh.names if mesh.size(a) > 1]
    rng.shuffle(axes)
    for axis in axes:
        fits = [
            d for d in range(len(shape)) if shape[d] % (mesh.count(dims[d]) * mesh.size(axis)) == 0
        ]
        if fits and rng.random() < 0.85:
            dims[rng.choice(fits)].append(axis)
    return Layout(tuple(tuple(d) for d in dims))


def _refactor(rng: random.Random, shape) -> list[int]:
    """`shape` with a run of adjacent dims merged and split again differently."""
    i = rng.randrange(len(shape))
    j = rng.randrange(i, min(len(shape), i + 3))
    total = math.prod(shape[i : j + 1])
    pieces = []
    for _ in range(rng.randint(1, 3)):
        divisors = [k for k in range(1, total + 1) if total % k == 0]
        piece = rng.choice(divisors)
        pieces.append(piece)
        total //= piece
    pieces.append(total)
    rng.shuffle(pieces)
    return list(shape[:i]) + pieces + list(shape[j + 1 :])


def _random_op(rng: random.Random, t: torch.Tensor) -> tuple[str, tuple]:
    """One op on a tensor like `t` (a meta tensor): its name and non-tensor arguments."""
    shape, nd = list(t.shape), t.ndim
    choices = ["reshape", "reshape", "transpose", "permute", "flatten", "unflatten", "unsqueeze"]
    if t.is_contiguous():
        choices.append("view")
    if 1 in shape:
        choices += ["squeeze", "squeeze_all", "expand"]
    if max(shape) > 1:
        choices += ["slice", "chunk_cat"] + (["select"] if nd > 1 else [])
    name = rng.choice(choices)
    dim = rng.randrange(nd)
    if name in ("reshape", "view"):
        return name, (_refactor(rng, shape),)
    if name == "transpose":
        return name, (dim, rng.randrange(nd))
    if name == "permute":
        order = list(range(nd))
        rng.shuffle(order)
        return name, (order,)
    if name == "flatten":
        return name, (dim, rng.randrange(dim, nd))
    if name == "unflatten":
        size = shape[dim]
        first = rng.choice([k for k in range(1, size + 1) if size % k == 0])
        return name, (dim, [first, size // first])
    if name == "unsqueeze":
        return name, (rng.randrange(nd + 1),)
    if name == "squeeze":
        return name, (rng.choice([d for d in range(nd) if shape[d] == 1]),)
    if name == "squeeze_all":
        return name, ()
    if name == "expand":
        one = rng.choice([d for d in range(nd) if shape[d] == 1])
        return name, ([rng.choice((2, 4)) if d == one else -1 for d in range(nd)],)
    dim = rng.choice([d for d in range(nd) if shape[d] > 1])
    if name == "select":
        return name, (dim, rng.randrange(shape[dim]))
    if name == "slice":
        start = rng.randrange(shape[dim])
        return name, (dim, start, rng.randrange(start + 1, shape[dim] + 1))
    return name, (dim,)  # chunk_cat: two chunks, joined again the other way round


_OPS = {
    "reshape": aten.reshape.default,
    "view": aten.view.default,
    "transpose": aten.transpose.int,
    "permute": aten.permute.default,
    "flatten": aten.flatten.using_ints,
    "unflatten": aten.unflatten.int,
    "unsqueeze": aten.unsqueeze.default,
    "squeeze": aten.squeeze.dim,
    "squeeze_all": aten.squeeze.default,
    "expand": aten.expand.default,
    "select": aten.select.int,
    "slice": aten.slice.Tensor,
}


def _apply(name: str, args: tuple, x: torch.Tensor) -> torch.Tensor:
    if name == "chunk_cat":
        first, *rest = aten.chunk.default(x, 2, args[0])
        return aten.cat.default([*rest, first], args[0])
    return _OPS[name](x, *args)


def random_cases(seed: int, mesh: Mesh, count: int) -> list[tuple]:
    """`count` cases (shape, layout, chain of ops), the same for every seed and mesh."""
    rng = random.Random(seed)
    cases = []
    while len(cases) < count:
        shape = [rng.choice(SIZES) for _ in range(rng.randint(2, 4))]
        if not 16 <= math.prod(shape) <= 384:
            continue
        layout = _random_layout(rng, shape, mesh)
        if not layout.sharded_axes:
            continue
        t, chain = torch.empty(shape, device="meta"), []
        for _ in range(rng.randint(1, 4)):
            if not t.ndim:
                break
            name, args = _random_op(rng, t)
            t = _apply(name, args, t)
            chain.append((name, args))
        if t.ndim and t.numel():
            cases.append((tuple(shape), layout, chain))
    return cases


def _build(shape, chain, seed: int) -> Traced:
    """The graph of ``chain(x * w)``, with global values in every node's meta."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.nn.Parameter(torch.randn(shape, generator=generator))
    graph = fx.Graph()
    w = graph.get_attr("w")
    x = graph.placeholder("x")
    w.meta["val"] = weight
    x.meta["val"] = torch.empty(shape, requires_grad=True)

    def call(target, *args):
        node = graph.call_function(target, args)
        values = pytree.tree_map(lambda a: a.meta["val"] if isinstance(a, fx.Node) else a, args)
        node.meta["val"] = target(*values)
        return node

    out = call(aten.mul.Tensor, x, w)
    for name, args in chain:
        if name == "chunk_cat":
            pieces = call(aten.chunk.default, out, 2, args[0])
            parts = [call(operator.getitem, pieces, i) for i in range(len(pieces.meta["val"]))]
            out = call(aten.cat.default, [*parts[1:], parts[0]], args[0])
        else:
            out = call(_OPS[name], out, *args)
    graph.output((out,))
    gm = fx.GraphModule({"w": weight}, graph)
    spec = pytree.tree_flatten(out.meta["val"])[1]
    example = InputSpec("x", tuple(shape), torch.float32, torch.device("cpu"))
    return Traced(gm, (tuple(shape),), spec, {"w": weight}, {"w": ("w",)}, inputs=(example,))


def _serial(shape, chain, x, weight):
    out = x * weight
    for name, args in chain:
        out = _apply(name, args, out)
    return out


def _compiled(cases, mesh: Mesh) -> list[Compiled]:
    """Each case's program, planned with its input in the case's layout: here, once."""
    out = []
    for index, (shape, layout, chain) in enumerate(cases):
        traced = _build(shape, chain, seed=index)
        out.append(Compiled.emitted(traced, plan_graph(traced, mesh, "3d", inputs={"x": layout})))
    return out


def _check_cases(device_mesh, cases, programs: list[Compiled]) -> list[str]:
    bound = comm.BoundMesh(device_mesh, Mesh.from_device_mesh(device_mesh))
    failures = []
    for index, ((shape, layout, chain), compiled) in enumerate(zip(cases, programs)):
        parameters = compiled.constants  # the weight: no model holds it
        program = compiled.program.build(parameters)
        program = ShardParameters(compiled.plan, parameters, bound)(program)
        program = BindMesh(bound)(program)
        parallel = ParallelModule(program, compiled, bound)
        generator = torch.Generator().manual_seed(10_000 + index)
        x = torch.randn(shape, generator=generator, requires_grad=True)
        x_serial = x.detach().clone().requires_grad_(True)
        weight = parameters["w"].detach().clone().requires_grad_(True)
        want = _serial(shape, chain, x_serial, weight)
        got = parallel(x)
        mix = torch.randn(want.shape, generator=generator)
        (want * mix).sum().backward()
        (got * mix).sum().backward()
        compared = {
            "output": (got, want),
            "input grad": (x.grad, x_serial.grad),
            "weight grad": (parallel.full_grads()["w"], weight.grad),
        }
        for what, (g, w) in compared.items():
            if g is None or g.shape != w.shape or not torch.allclose(g, w, rtol=1e-6, atol=1e-6):
                steps = " → ".join(f"{n}{a}" for n, a in chain)
                failures.append(f"{what} of case {index}: {list(shape)} {layout} → {steps}")
    return failures


def _run(rank_pool, mesh_shape):
    mesh = Mesh.from_shape(mesh_shape)
    cases = random_cases(seed=sum(mesh_shape), mesh=mesh, count=CASES_PER_MESH)
    per_rank = rank_pool.run(_check_cases, mesh_shape, cases, _compiled(cases, mesh))
    failures = sorted({f for found in per_rank for f in found})
    assert not failures, f"{len(failures)} of {len(cases)} cases differ:\n" + "\n".join(
        failures[:20]
    )


def test_random_views_on_a_cube(rank_pool):
    _run(rank_pool, (2, 2, 2))


def test_random_views_on_a_flat_mesh(rank_pool):
    _run(rank_pool, (1, 2, 4))


def test_cases_cover_every_op_and_nesting():
    """The generator really draws merges behind unsharded dims, every op and nested axes."""
    for shape in MESHES:
        cases = random_cases(seed=sum(shape), mesh=Mesh.from_shape(shape), count=CASES_PER_MESH)
        names = {name for _, _, chain in cases for name, _ in chain}
        assert names == set(_OPS) | {"chunk_cat"}
        assert sum(any(len(axes) > 1 for axes in lay.dims) for _, lay, _ in cases) > 20
