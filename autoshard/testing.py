"""Prove a parallel program equal to the serial model by running both.

    from autoshard.testing import assert_equivalent

    def mlp():                      # a module-level factory: (model, example_inputs)
        return MyModel(), (torch.randn(8, 16),)

    assert_equivalent(mlp, (2, 2, 2), strategy="3d")

Every rank of a real gloo mesh builds the model from the factory (same
seed), runs the serial copy and the parallel program side by side for
`steps` optimizer steps (`torch_optimizer`, SGD by default), and compares the
outputs, every parameter gradient (gathered with `full_grads`), the gradient
of every example input that requires grad, and the parameters after the steps. The loss
is a fixed random weighting of the outputs, so every output element
matters. Dropout draws the same masks in both (same seed before each step).

`measure_memory` measures what one process's training step holds in
activations (saved for backward, and the peak), to compare with the plan's
prediction.
"""

from __future__ import annotations

import copy
import importlib.util
import math
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

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


def _equivalence_job(
    mesh, factory, planning: dict, steps: int, lr: float, torch_optimizer=torch.optim.SGD
) -> list[Mismatch]:
    if isinstance(factory, str):
        factory = load_factory(factory)
    torch.manual_seed(0)
    model, inputs = factory()
    serial = copy.deepcopy(model)
    serial_inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    parallel = parallelize(model, mesh, inputs, **planning)
    serial_opt = torch_optimizer(serial.parameters(), lr=lr)
    parallel_opt = torch_optimizer(parallel.parameters(), lr=lr)
    found: list[Mismatch] = []
    for step in range(steps):
        torch.manual_seed(100 + step)
        want = serial(*serial_inputs)
        torch.manual_seed(100 + step)
        got = parallel(*inputs)
        for i, (g, w) in enumerate(zip(pytree.tree_leaves(got), pytree.tree_leaves(want))):
            found.append(_compare("output", str(i), step, g, w))
        _loss(want).backward()
        _loss(got).backward()
        grads = parallel.full_grads()
        for name, param in serial.named_parameters():
            found.append(_compare("grad", name, step, grads.get(name), param.grad))
        for i, (t, reference) in enumerate(zip(inputs, serial_inputs)):
            if reference.requires_grad:
                found.append(_compare("grad", f"input {i}", step, t.grad, reference.grad))
                t.grad = reference.grad = None
        serial_opt.step()
        parallel_opt.step()
        serial_opt.zero_grad()
        parallel_opt.zero_grad()
    full = parallel.full_state_dict()
    for name, tensor in serial.state_dict().items():
        found.append(_compare("param", name, steps, full.get(name), tensor))
    return found


def equivalence_report(
    factory,
    mesh_shape,
    *,
    steps: int = 3,
    lr: float = 0.1,
    torch_optimizer=torch.optim.SGD,
    **planning,
) -> list[Mismatch]:
    """Every comparison from every rank (see `assert_equivalent`)."""
    pool = shared_pool(math.prod(mesh_shape))
    per_rank = pool.run(
        _equivalence_job, tuple(mesh_shape), factory, planning, steps, lr, torch_optimizer
    )
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
    torch_optimizer=torch.optim.SGD,
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

    `planning` goes to `parallelize` (strategy, memory_budget, hardware, plan…);
    `torch_optimizer` is the optimizer class both copies train with (``lr=lr``).
    `factory` is a module-level callable returning ``(model, example_inputs)``
    (or ``"path/to/file.py:name"``). It runs in the shared pool of as many
    ranks as the mesh has (started once per process).
    """
    report = equivalence_report(
        factory, mesh_shape, steps=steps, lr=lr, torch_optimizer=torch_optimizer, **planning
    )
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


@dataclass(frozen=True)
class MemoryMeasurement:
    """Activation bytes one process held during one training step (`measure_memory`)."""

    saved_bytes: int  # kept by autograd for backward at the end of forward
    peak_bytes: int  # most activation bytes alive at once, forward and backward


def _storage(t: torch.Tensor) -> tuple[int, int]:
    """(data pointer, bytes) of the storage under `t`; (0, 0) if it has none."""
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return 0, 0
    return storage.data_ptr(), storage.nbytes()


def _is_parameter(t: torch.Tensor) -> bool:
    """A leaf that requires grad. A view made under no_grad of a tensor that requires
    grad (what a custom autograd Function's forward computes on) looks like a leaf
    that requires grad too, but has a base."""
    return t.is_leaf and t.requires_grad and t._base is None


class _Allocations(TorchDispatchMode):
    """Every storage an op allocates, on a timeline of (allocation, ±bytes) events.

    An output allocates when its storage is none of the op's inputs' (a view or
    an in-place result is its input's); a `weakref.finalize` on the storage logs
    its release. Parameters met as op inputs are remembered, with their storages."""

    def __init__(self, excluded: set[int]) -> None:
        super().__init__()
        self.parameters: list[weakref.ref] = []
        self.excluded = excluded  # storages of parameters and of `exclude`
        self.live: dict[int, tuple[int, int]] = {}  # data pointer → (allocation, bytes)
        self.events: list[tuple[int, int]] = []
        self._finalizers: list[weakref.finalize] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = set()
        for t in pytree.tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor):
                ptr, _ = _storage(t)
                inputs.add(ptr)
                if _is_parameter(t) and ptr not in self.excluded:
                    self.excluded.add(ptr)
                    self.parameters.append(weakref.ref(t))
        out = func(*args, **kwargs)
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                ptr, nbytes = _storage(t)
                if nbytes and ptr not in inputs and ptr not in self.live:
                    self._allocated(t.untyped_storage(), ptr, nbytes)
        return out

    def _allocated(self, storage, ptr: int, nbytes: int) -> None:
        serial = len(self._finalizers)
        self.live[ptr] = (serial, nbytes)
        self.events.append((serial, nbytes))
        self._finalizers.append(weakref.finalize(storage, self._freed, ptr, serial))

    def _freed(self, ptr: int, serial: int) -> None:
        if ptr in self.live and self.live[ptr][0] == serial:
            self.events.append((serial, -self.live.pop(ptr)[1]))

    def peak(self) -> int:
        """The most bytes alive at once, leaving out the storages that ended up as a
        parameter's ``.grad``. Ends the bookkeeping."""
        for finalizer in self._finalizers:
            finalizer.detach()
        grads = [p.grad for p in (ref() for ref in self.parameters) if p is not None]
        ptrs = {_storage(g)[0] for g in grads if g is not None}
        kept_as_grad = {self.live[ptr][0] for ptr in ptrs if ptr in self.live}
        alive = peak = 0
        for serial, delta in self.events:
            if serial not in kept_as_grad:
                alive += delta
                peak = max(peak, alive)
        return peak


def measure_memory(
    step: Callable[[], object], *, exclude: Iterable[torch.Tensor] = ()
) -> MemoryMeasurement:
    """Run `step`, a forward and backward on this process (for instance
    ``lambda: parallel(*inputs).backward()``), and measure its activation memory.

    Parameters (leaf tensors that require grad) and every storage they own
    (their views, such as a linear's transposed weight) never count, nor do the
    storages of the tensors in `exclude` (pass a module's buffers): the cost
    model counts those with the parameters.

    - ``saved_bytes``: what autograd keeps for backward at the end of forward:
      the tensors a ``saved_tensors_hooks`` pack hook gets during the forward,
      each distinct storage once (by data pointer) and whole (a saved view keeps
      its base's storage). Packs during a backward (recomputation, double
      backward) do not count. Only the innermost hooks see a pack, so hooks the
      step installs (a non-reentrant ``torch.utils.checkpoint`` region,
      ``autoshard.ops.keep_shard``) would hide their saves from ours: while the
      step runs, their pack hooks are wrapped, and what counts is the tensors
      they return, which is what autograd keeps. A checkpoint's pack returns a
      holder with no tensor (the region's inputs count: the checkpoint saves
      them before installing its hooks); keep_shard's returns the stored shard.
      A packed storage is counted even if it is freed before backward (only if
      part of the autograd graph is dropped).
    - ``peak_bytes``: the most bytes alive at once, from the forward to the end
      of the backward (recomputation included), of the storages ops allocate
      during the step, seen by a ``TorchDispatchMode`` (a view or an in-place
      result is its input's storage, not an allocation). Storages that existed
      before the step (parameters, inputs, buffers, gradients of an earlier
      step) never count, nor, at any time, do the storages that end the step as
      a parameter's ``.grad``: those are the gradient bytes the cost model
      counts with the parameters. A gradient accumulated into an existing
      ``.grad`` counts while it is a tensor of its own.

    Both are bytes of this process only; what PyTorch's ops do not allocate
    (autograd's own objects, allocator caching) is not measured.
    """
    excluded = {_storage(t)[0] for t in exclude}
    allocations = _Allocations(excluded)
    packed: dict[int, int] = {}

    def count(kept):
        if torch._C._current_graph_task_id() == -1:  # not in a backward
            for t in pytree.tree_leaves(kept):
                if isinstance(t, torch.Tensor) and not _is_parameter(t):
                    ptr, nbytes = _storage(t)
                    if ptr not in excluded:
                        packed[ptr] = nbytes
        return kept

    push = torch._C._autograd._push_saved_tensors_default_hooks  # saved_tensors_hooks.__enter__

    def push_counting(pack_hook, unpack_hook):
        return push(lambda t: count(pack_hook(t)), unpack_hook)

    with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t), allocations:
        with mock.patch.object(
            torch._C._autograd, "_push_saved_tensors_default_hooks", push_counting
        ):
            step()
    saved = sum(n for ptr, n in packed.items() if ptr not in excluded)
    return MemoryMeasurement(saved_bytes=saved, peak_bytes=allocations.peak())
