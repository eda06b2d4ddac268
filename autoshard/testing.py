"""Prove a parallel program equal to the serial model by running both.

    from autoshard.testing import assert_equivalent

    def mlp():                      # a module-level factory: (model, example_inputs)
        return MyModel(), (torch.randn(8, 16),)

    assert_equivalent(mlp, (2, 2, 2), strategy="3d")

Every rank of a real gloo mesh builds the model from the factory (same
seed), runs the serial copy and the parallel program side by side for
`steps` SGD steps, and compares the outputs, every parameter gradient
(gathered with `full_grads`) and the parameters after the steps. The loss
is a fixed random weighting of the outputs, so every output element
matters. Dropout draws the same masks in both (same seed before each step).
"""

from __future__ import annotations

import copy
import importlib.util
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils import _pytree as pytree

from autoshard.api import parallelize
from autoshard.ranks import shared_pool

NEGLIGIBLE = 1e-3


@dataclass(frozen=True)
class Mismatch:
    what: str  # output | grad | param
    name: str
    step: int
    max_abs: float
    scale: float  # max |serial|
    rank: int = 0

    @property
    def rel(self) -> float:
        return self.max_abs / self.scale if self.scale else self.max_abs

    def __str__(self) -> str:
        return (
            f"{self.what} '{self.name}' at step {self.step} on rank {self.rank}: "
            f"max abs error {self.max_abs:.3e}, largest value {self.scale:.3e}"
        )


def load_factory(spec: str):
    """`path/to/file.py:name` → the callable `name` defined in that file."""
    path, _, name = spec.rpartition(":")
    if not path or not name:
        raise ValueError(f"expected MODEL as path/to/file.py:factory, got {spec!r}")
    module_spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    if module_spec is None:
        raise FileNotFoundError(f"no Python file at {path!r}")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return getattr(module, name)


def _compare(what: str, name: str, step: int, got, want) -> Mismatch:
    if got is None or want is None:
        missing = math.inf if (got is None) != (want is None) else 0.0
        return Mismatch(what, name, step, missing, 1.0)
    if got.shape != want.shape:
        shapes = f"{name} (shape {tuple(got.shape)} ≠ {tuple(want.shape)})"
        return Mismatch(what, shapes, step, math.inf, 1.0)
    if not got.numel():
        return Mismatch(what, name, step, 0.0, 0.0)
    err = (got.detach().double() - want.detach().double()).abs().max().item()
    return Mismatch(what, name, step, err, want.detach().double().abs().max().item())


def _loss(outputs) -> torch.Tensor:
    leaves = [
        t
        for t in pytree.tree_leaves(outputs)
        if isinstance(t, torch.Tensor) and t.is_floating_point()
    ]
    generator = torch.Generator().manual_seed(1234)
    total = 0
    for t in leaves:
        total = total + (t * torch.randn(t.shape, generator=generator, dtype=t.dtype)).sum()
    return total


def _equivalence_job(mesh, factory, planning: dict, steps: int, lr: float) -> list[Mismatch]:
    if isinstance(factory, str):
        factory = load_factory(factory)
    torch.manual_seed(0)
    model, inputs = factory()
    serial = copy.deepcopy(model)
    parallel = parallelize(model, mesh, inputs, **planning)
    serial_opt = torch.optim.SGD(serial.parameters(), lr=lr)
    parallel_opt = torch.optim.SGD(parallel.parameters(), lr=lr)
    found: list[Mismatch] = []
    for step in range(steps):
        torch.manual_seed(100 + step)
        want = serial(*inputs)
        torch.manual_seed(100 + step)
        got = parallel(*inputs)
        for i, (g, w) in enumerate(zip(pytree.tree_leaves(got), pytree.tree_leaves(want))):
            found.append(_compare("output", str(i), step, g, w))
        _loss(want).backward()
        _loss(got).backward()
        grads = parallel.full_grads()
        for name, param in serial.named_parameters():
            found.append(_compare("grad", name, step, grads.get(name), param.grad))
        serial_opt.step()
        parallel_opt.step()
        serial_opt.zero_grad()
        parallel_opt.zero_grad()
    full = parallel.full_state_dict()
    for name, tensor in serial.state_dict().items():
        found.append(_compare("param", name, steps, full.get(name), tensor))
    return found


def equivalence_report(
    factory, mesh_shape, *, steps: int = 3, lr: float = 0.1, **planning
) -> list[Mismatch]:
    """Every comparison from every rank (see `assert_equivalent`)."""
    pool = shared_pool(math.prod(mesh_shape))
    per_rank = pool.run(_equivalence_job, tuple(mesh_shape), factory, planning, steps, lr)
    return [
        Mismatch(m.what, m.name, m.step, m.max_abs, m.scale, rank)
        for rank, found in enumerate(per_rank)
        for m in found
    ]


def assert_equivalent(
    factory,
    mesh_shape,
    *,
    steps: int = 3,
    rtol: float = 1e-5,
    atol: float = 0.0,
    lr: float = 0.1,
    **planning,
) -> list[Mismatch]:
    """Raise AssertionError naming the worst mismatch if the parallel program differs
    from the serial model; return every comparison otherwise.

    A comparison fails when its largest error exceeds `rtol` times the tensor's
    largest value, plus `atol`. Tensors whose values are all below
    `NEGLIGIBLE` times the largest of their kind (outputs, gradients or
    parameters) at that step are measured against that floor instead: their
    exact value is zero or nearly so (a key bias's gradient under softmax), and
    what both programs compute for them is rounding noise.

    `planning` goes to `parallelize` (strategy, memory_budget, hardware, plan…).
    `factory` is a module-level callable returning ``(model, example_inputs)``
    (or ``"path/to/file.py:name"``). It runs in the shared pool of as many
    ranks as the mesh has (started once per process).
    """
    report = equivalence_report(factory, mesh_shape, steps=steps, lr=lr, **planning)
    largest: dict[tuple[str, int], float] = {}
    for m in report:
        largest[m.what, m.step] = max(largest.get((m.what, m.step), 0.0), m.scale)
    failed = [
        m
        for m in report
        if m.max_abs > rtol * max(m.scale, NEGLIGIBLE * largest[m.what, m.step]) + atol
    ]
    if failed:
        worst = max(failed, key=lambda m: m.rel)
        raise AssertionError(
            f"parallel program differs from the serial model on mesh {tuple(mesh_shape)} "
            f"planned with {planning}: {len(failed)} comparisons fail; worst: {worst}"
        )
    return report
