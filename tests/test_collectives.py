"""Every conversion between layouts, run on a real 2×2×2 gloo mesh: the value arrives
as the destination layout says, and autograd brings back exactly the source's share
of the serial gradient (the table of forward/backward pairs in autoshard.runtime.comm)."""

import contextlib
import itertools
import math

import torch

from autoshard.layout import Layout, redistribute
from autoshard.mesh import Mesh
from autoshard.runtime import comm
from autoshard.runtime.ranks import shared_pool

SHAPE = (8, 4, 8)
LAYOUTS = [
    Layout.replicated(3),
    Layout((("a",), (), ())),
    Layout((("a", "b"), (), ())),
    Layout((("b", "a"), (), ())),
    Layout(((), (), ("c",))),
    Layout((("a", "b"), (), ("c",))),
    Layout((("a", "c"), (), ("b",))),
    Layout(((), ("b",), ("a", "c"))),
    Layout(((), (), ()), partial=("b",)),
    Layout((("a",), (), ()), partial=("c",)),
]


def _apply(x, steps, mesh):
    for step in steps:
        kwargs = {"axis": step.axis, "backward": step.backward, "node": "test", "mesh": mesh}
        if step.dim is not None:
            kwargs["dim"] = step.dim
        x = comm.STEP_FUNCTIONS[step.kind](x, **kwargs)
    return x


def _share(bound, layout):
    """This rank's weight in a pending sum over the layout's partial axes (they sum to 1)."""
    share = 1.0
    for axis in layout.partial:
        n, i = bound.axes[axis].size, bound.axes[axis].coordinate
        share *= (i + 1) / (n * (n + 1) / 2)
    return share


def _check_all_pairs(device_mesh):
    mesh = Mesh.from_device_mesh(device_mesh)
    bound = comm.BoundMesh(device_mesh, mesh)
    failures = []
    with comm.comm_log() as log:
        for src, dst in itertools.product(LAYOUTS, LAYOUTS):
            generator = torch.Generator().manual_seed(7)
            full = torch.randn(SHAPE, generator=generator)
            weight = torch.randn(SHAPE, generator=generator)
            share = _share(bound, src)
            local = (comm.local_part(full, src.dims, bound) * share).requires_grad_()
            moved = _apply(local, redistribute(src, dst, SHAPE, 4, mesh), bound)
            expected = comm.local_part(full, dst.dims, bound)
            whole = _apply(moved, redistribute(dst, Layout.replicated(3), SHAPE, 4, mesh), bound)
            (whole * weight).sum().backward()
            # a pending sum may split its parts any way; the round trip checks the total
            if not dst.partial and not torch.allclose(moved, expected, atol=1e-6):
                failures.append(f"forward {src} → {dst}")
            if not torch.allclose(whole, full, atol=1e-6):
                failures.append(f"round trip {src} → {dst}")
            if not torch.allclose(local.grad, comm.local_part(weight, src.dims, bound), atol=1e-6):
                failures.append(f"gradient {src} → {dst}")
    return failures, len(log.records)


def test_every_layout_pair_moves_values_and_gradients_exactly():
    results = shared_pool(8).run(_check_all_pairs, (2, 2, 2))
    for failures, collectives in results:
        assert failures == [], failures
        assert collectives > len(LAYOUTS) ** 2  # the conversions really communicated
    assert math.prod(SHAPE) == 256


class _SeenCalls(torch.overrides.TorchFunctionMode):
    """Records the `torch.distributed` calls made under it (a mode handles those)."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", "").startswith("torch.distributed"):
            self.seen.add(func.__name__)
        return func(*args, **(kwargs or {}))


def _check_through_dist(device_mesh):
    """Complex values and calls under a torch function mode go through `dist`'s own
    calls (which view complex as real, and hand the call to the mode): the values
    arrive as on the process groups' own calls."""
    mesh = Mesh.from_device_mesh(device_mesh)
    bound = comm.BoundMesh(device_mesh, mesh)
    src, dst = Layout((("a", "b"), (), ("c",))), Layout((("b",), ("a",), ()))
    failures, modes = [], _SeenCalls()
    for dtype, mode in ((torch.complex64, None), (torch.float32, modes)):
        full = torch.randn(SHAPE, dtype=dtype, generator=torch.Generator().manual_seed(3))
        with mode if mode is not None else contextlib.nullcontext():
            moved = _apply(
                comm.local_part(full, src.dims, bound),
                redistribute(src, dst, SHAPE, 4, mesh),
                bound,
            )
            summed = comm.summed(comm.local_part(full, dst.dims, bound), (bound.axes["c"],), "t")
        if not torch.allclose(moved, comm.local_part(full, dst.dims, bound)):
            failures.append(f"{dtype} moved")
        if not torch.allclose(summed, 2 * comm.local_part(full, dst.dims, bound)):
            failures.append(f"{dtype} summed")
    return failures, sorted(modes.seen)


def test_complex_values_and_torch_function_modes_go_through_dist():
    for failures, seen in shared_pool(8).run(_check_through_dist, (2, 2, 2)):
        assert failures == []
        assert {"all_gather_single", "all_reduce"} <= set(seen), seen
