"""Prove a parallel program equal to the serial model by running both.

    from autoshard.testing import assert_equivalent

    def mlp():                      # a module-level factory: (model, example_inputs)
        return MyModel(), (torch.randn(8, 16),)

    assert_equivalent(mlp, (2, 2, 2), strategy="3d")

The model is traced, planned and emitted once, here (`autoshard.compile`);
every rank of a real gloo mesh builds it from the factory (same seed), applies
that program (`parallelize(..., compiled=...)`) and trains it for `steps`
optimizer steps (`torch_optimizer`, SGD by default); this process trains the
serial model and a float64 copy alike, once, and compares each rank's outputs,
every parameter gradient (gathered with `full_grads`), the gradient of every
example input that requires grad, and the parameters after the steps: the
parallel program's error against the float64 copy must be of the size of the
serial program's own. The loss is
a fixed random weighting of the outputs, so every output element matters.
Dropout draws the same masks in all three (same seed before each step).

`measure_memory` measures what one process's training step holds in
activations (saved for backward, and the peak), to compare with the plan's
prediction.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from unittest import mock

import numpy as np
import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from autoshard.api import Compiled, parallelize
from autoshard.api import compile as compile_program
from autoshard.factory import load_factory
from autoshard.runtime.ranks import shared_pool

# A parallel tensor fails when its error against the float64 serial reference exceeds
# ERROR_FACTOR times the fp32 serial program's own error, plus the rounding floor (see
# assert_equivalent): a parallel program sums in another order (a contraction split over
# ranks), which rounds differently but no worse in kind; a wrong value is off by far more.
ERROR_FACTOR = 10.0
# The rounding floor, in machine epsilons of the largest value of a kind: one draw of
# the serial program's error can be zero (a loss that fp32 happens to round exactly),
# while another summation order is a few ulps off.
FLOOR_EPS = 8.0
# Where, at step 0, the serial program is itself further than this many machine
# epsilons (of the largest value of a kind) off its float64 reference, the reference
# computes something else (a model whose aliasing depends on the dtype: in float64,
# ``h.to(torch.float64)`` is ``h`` itself, and an update of the cast updates ``h``): a
# check scaled by that error could pass anything, so such a tensor is held to `rtol`
# against the serial program instead. Before any update both programs compute the same
# function of the same values; later, what the updates amplify (Adam's steps on
# gradients near its eps) is the serial program's own error too, and the reference
# judges as always.
UNRELIABLE_EPS = 1e4


@dataclass(frozen=True)
class Mismatch:
    """One comparison: parallel against the serial program (`max_abs`) and both against
    the float64 serial reference (`error`, `serial_error`; NaN where there is none)."""

    what: str  # output | grad | param
    name: str
    step: int
    max_abs: float  # max |parallel - serial|
    scale: float  # max |serial|
    rank: int = 0
    error: float = math.nan  # max |parallel - float64 reference|
    serial_error: float = math.nan  # max |serial - float64 reference|
    eps: float = 0.0  # the machine epsilon of the tensor's dtype (0 for integers)

    def reference_judges(self, largest: float) -> bool:
        """Whether the float64 reference judges this tensor: there is one and, at step 0,
        the serial program is within `UNRELIABLE_EPS` epsilons of it (`largest`: of the
        tensor's kind at its step)."""
        if math.isnan(self.serial_error):
            return False
        return self.step > 0 or self.serial_error <= UNRELIABLE_EPS * self.eps * largest

    @property
    def rel(self) -> float:
        return self.max_abs / self.scale if self.scale else self.max_abs

    def __str__(self) -> str:
        exact = (
            f"; against float64: parallel {self.error:.3e}, serial {self.serial_error:.3e}"
            if not math.isnan(self.error)
            else ""
        )
        return (
            f"{self.what} '{self.name}' at step {self.step} on rank {self.rank}: "
            f"max abs error {self.max_abs:.3e}, largest value {self.scale:.3e}{exact}"
        )


def _dense(t):
    return t.to_dense() if isinstance(t, torch.Tensor) and t.is_sparse else t


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference, where equal infinities and NaN against NaN are equal and
    a value against a NaN or another infinity is infinitely off (a NaN difference
    would pass every bound)."""
    a, b = a.detach().double(), b.detach().double()
    same = (a == b) | (a.isnan() & b.isnan())
    return torch.where(same, 0.0, (a - b).abs().nan_to_num(nan=math.inf)).max().item()


def _largest(t: torch.Tensor) -> float:
    """The largest finite magnitude (an infinity, a masked score, scales nothing)."""
    finite = t.detach().double().abs()
    finite = finite[finite.isfinite()]
    return finite.max().item() if finite.numel() else 0.0


def _compare(what: str, name: str, step: int, got, want, exact=None) -> Mismatch:
    """`got` (parallel) against `want` (serial fp32) and both against `exact` (the
    float64 reference, or None)."""
    got, want, exact = _dense(got), _dense(want), _dense(exact)
    if got is None or want is None:
        missing = math.inf if (got is None) != (want is None) else 0.0
        return Mismatch(what, name, step, missing, 1.0, error=missing, serial_error=0.0)
    if got.shape != want.shape:
        shapes = f"{name} (shape {tuple(got.shape)} ≠ {tuple(want.shape)})"
        return Mismatch(what, shapes, step, math.inf, 1.0, error=math.inf, serial_error=0.0)
    if not got.numel():
        return Mismatch(what, name, step, 0.0, 0.0)
    eps = torch.finfo(want.dtype).eps if want.is_floating_point() else 0.0
    found = Mismatch(what, name, step, _max_abs(got, want), _largest(want))
    if exact is None or exact.shape != want.shape:
        return dataclasses.replace(found, eps=eps)
    return dataclasses.replace(
        found, error=_max_abs(got, exact), serial_error=_max_abs(want, exact), eps=eps
    )


def _leaves(outputs) -> list:
    return [t for t in pytree.tree_leaves(outputs) if isinstance(t, torch.Tensor)]


def _loss(outputs) -> torch.Tensor:
    """Every floating output weighted by its own random weights, the same for every
    program: drawn in fp32 by numpy, whatever the dtype and the modes it runs under
    (under the float64 reference's, torch would draw other numbers in float64)."""
    leaves = [t for t in _leaves(outputs) if t.is_floating_point()]
    generator = np.random.default_rng(1234)
    total = 0
    for t in leaves:
        drawn = generator.standard_normal(tuple(t.shape), dtype=np.float32)
        total = total + (t * torch.from_numpy(drawn).to(t.dtype)).sum()
    return total


def _float64(model: torch.nn.Module, inputs: tuple):
    """A float64 copy of `model` and of its floating inputs: the serial reference the
    fp32 programs' rounding is measured against."""
    reference = copy.deepcopy(model).double()
    as_double = tuple(t.double() if t.is_floating_point() else t for t in inputs)
    return reference, as_double


@dataclass
class _Step:
    """What one program computed in one optimizer step: its output leaves, every
    parameter's gradient by name, and the gradient of each example input (None
    where it needs none)."""

    outputs: list
    grads: dict
    input_grads: list


class _Float64Kernels(TorchFunctionMode):
    """The float64 reference's forward: float64 the default dtype, so that a factory
    given no dtype makes what the model would make if it were built in float64
    (XGLM's ``torch.full(shape, torch.finfo(dtype).min)`` overflows float32 otherwise),
    and the ops that have no float64 CPU kernel computed exactly in float64 another
    way: ``torch._grouped_mm`` (Hugging Face's mixture-of-experts products), one
    matrix product per group. A cast to a floating dtype (``.float()``, ``.to(torch.bfloat16)``,
    ``softmax(x, dtype=torch.float32)``) is a cast to float64.

        with _Float64Kernels():
            reference(*inputs)   # a float64 Mixtral: no float64 kernel for its experts otherwise
    """

    def __enter__(self):
        self._default = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        self._casts = _WidenedCasts().__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        torch.set_default_dtype(self._default)
        self._casts.__exit__(*exc)
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch._grouped_mm and args[0].dtype == torch.float64:
            return _grouped_mm(*args, **kwargs)
        return func(*args, **kwargs)


class _WidenedCasts(TorchDispatchMode):
    """Every floating dtype an ATen call is given is float64 (a model that casts
    ``h.double().softmax(-1).float()`` would otherwise mix float32 into its float64
    layers), but a reinterpretation of bits (``x.view(dtype)``). At the ATen level,
    where backward's recomputation of a checkpointed block runs too, casting as
    its forward did."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.ops.aten.view.dtype:
            args, kwargs = pytree.tree_map_only(torch.dtype, _widened, (args, kwargs))
        return func(*args, **kwargs)


def _widened(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype.is_floating_point else dtype


def _grouped_mm(a, b, offs=None, bias=None, out_dtype=None) -> torch.Tensor:
    """Rows ``offs[g-1]:offs[g]`` of `a` [S, K] times ``b[g]`` [K, N], for every group g;
    rows past the last offset are zero."""
    if a.dim() != 2 or b.dim() != 3 or offs is None or bias is not None:
        raise NotImplementedError(
            f"the float64 reference computes torch._grouped_mm only for a 2-d input, 3-d "
            f"weights and offs, with no bias; got {a.dim()}-d × {b.dim()}-d "
            f"(offs {'given' if offs is not None else 'None'}, bias "
            f"{'given' if bias is not None else 'None'})"
        )
    ends = offs.tolist()
    pieces = [a[start:end] @ b[g] for g, (start, end) in enumerate(zip([0, *ends], ends))]
    pieces.append(a.new_zeros(a.shape[0] - ends[-1], b.shape[-1]))
    out = torch.cat(pieces)
    return out if out_dtype is None else out.to(out_dtype)


def _train(program, inputs: tuple, grads_of, steps: int, lr: float, torch_optimizer, mode=None):
    """`steps` optimizer steps of `program` on `inputs` (its forward and backward under
    the mode `mode`, if any): what each step computed, and the state after
    them. `grads_of()` gives the parameter gradients by name."""
    optimizer = torch_optimizer(program.parameters(), lr=lr)
    computed = []
    for step in range(steps):
        torch.manual_seed(100 + step)  # the same dropout masks in every program
        with mode if mode is not None else contextlib.nullcontext():
            result = program(*inputs)
            _loss(result).backward()  # where it recomputes (checkpointed blocks), as forward
        computed.append(_detached(_Step(_leaves(result), grads_of(), [t.grad for t in inputs])))
        for t in inputs:
            t.grad = None
        optimizer.step()
        optimizer.zero_grad()
    return computed


def _parallel_job(
    mesh, factory, compiled: Compiled, steps: int, lr: float, torch_optimizer=torch.optim.SGD
):
    """On each rank: the parallel program's steps (gradients gathered with `full_grads`)
    and its full state after them, for the parent to compare with the serial model."""
    if isinstance(factory, str):
        factory = load_factory(factory)
    torch.manual_seed(0)
    model, inputs = factory()
    parallel = parallelize(model, mesh, inputs, compiled=compiled)
    computed = _train(parallel, inputs, parallel.full_grads, steps, lr, torch_optimizer)
    return computed, parallel.full_state_dict()


def _detached(step: _Step) -> _Step:
    """`step` cut from autograd, and copied: an output may be a parameter itself
    (``return y, self.weight``), which the optimizer's step then updates in place."""

    def detach(t):
        return t.detach().clone() if isinstance(t, torch.Tensor) else t

    return _Step(
        [detach(t) for t in step.outputs],
        {name: detach(g) for name, g in step.grads.items()},
        [detach(g) for g in step.input_grads],
    )


def _serial_runs(model, inputs, steps: int, lr: float, torch_optimizer):
    """Copies of `model`, fp32 and float64, trained alike: (steps, state) of each. Copies,
    as the ranks' parallel program is of their own model (a model whose copy differs
    is then caught: tests/models.py `perturbed_mlp`)."""
    serial = copy.deepcopy(model)
    reference, reference_inputs = _float64(model, inputs)
    runs = []
    for program, args, mode in (
        (serial, inputs, None),
        (reference, reference_inputs, _Float64Kernels()),
    ):
        args = tuple(t.detach().clone().requires_grad_(t.requires_grad) for t in args)
        grads_of = lambda p=program: {n: q.grad for n, q in p.named_parameters()}
        computed = _train(program, args, grads_of, steps, lr, torch_optimizer, mode)
        runs.append((computed, program.state_dict()))
    return runs


def _compared(parallel, serial, exact, steps: int) -> list[Mismatch]:
    """One rank's (steps, state) against the serial program's and the float64 copy's."""
    found: list[Mismatch] = []
    for step, (got, want, ref) in enumerate(zip(parallel[0], serial[0], exact[0])):
        if len(got.outputs) != len(want.outputs):
            count = f"count (parallel {len(got.outputs)}, serial {len(want.outputs)})"
            found.append(Mismatch("output", count, step, math.inf, 1.0, error=math.inf))
        for i, (g, w, e) in enumerate(zip(got.outputs, want.outputs, ref.outputs)):
            found.append(_compare("output", str(i), step, g, w, e))
        for name, w in want.grads.items():
            found.append(_compare("grad", name, step, got.grads.get(name), w, ref.grads[name]))
        for i, (g, w, e) in enumerate(zip(got.input_grads, want.input_grads, ref.input_grads)):
            if w is not None:
                found.append(_compare("grad", f"input {i}", step, g, w, e))
    full, state, exact_state = parallel[1], serial[1], exact[1]
    for name, tensor in state.items():
        found.append(_compare("param", name, steps, full.get(name), tensor, exact_state[name]))
    return found


def _in_float64(model: torch.nn.Module, inputs: tuple) -> bool:
    """Whether every floating parameter, buffer and input is float64 (there is one)."""
    tensors = (*model.parameters(), *model.buffers(), *inputs)
    floating = [t for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return bool(floating) and all(t.dtype == torch.float64 for t in floating)


def _compiled_once(factory, mesh_shape, planning: dict):
    """The model built here as every rank builds it, and its program compiled here,
    once, for every rank (tracing, planning and emitting are most of a small job's
    time); the ranks only cut their shards and run it."""
    model_factory = load_factory(factory) if isinstance(factory, str) else factory
    torch.manual_seed(0)  # as every rank builds the model
    model, inputs = model_factory()
    if "compiled" in planning:
        return model, inputs, planning["compiled"]
    return model, inputs, compile_program(model, tuple(mesh_shape), inputs, **planning)


def equivalence_report(
    factory,
    mesh_shape,
    *,
    steps: int = 2,
    lr: float = 0.1,
    torch_optimizer=torch.optim.SGD,
    **planning,
) -> list[Mismatch]:
    """Every comparison from every rank (see `assert_equivalent`)."""
    pool = shared_pool(math.prod(mesh_shape))
    model, inputs, compiled = _compiled_once(factory, mesh_shape, planning)
    per_rank = pool.run(
        _parallel_job, tuple(mesh_shape), factory, compiled, steps, lr, torch_optimizer
    )
    serial, exact = _serial_runs(model, inputs, steps, lr, torch_optimizer)
    for name, _ in model.named_parameters():  # buffers may hold infinities: masks
        value = serial[1].get(name)  # a state dict may leave a parameter out
        if value is not None and not value.isfinite().all():
            raise ValueError(
                f"the serial model's '{name}' is not finite after {steps} steps at lr {lr}: "
                f"its training diverged, and two diverged runs have nothing to compare; "
                f"use a smaller lr or fewer steps"
            )
    # a float64 model is its own reference: no error of its own to scale, held to rtol
    unreferenced = dict(error=math.nan, serial_error=math.nan) if _in_float64(model, inputs) else {}
    # a bf16 model's fp32 loss carries bf16 rounding: the floor is in the coarser epsilon
    coarsest = max(
        (torch.finfo(p.dtype).eps for p in model.parameters() if p.is_floating_point()),
        default=0.0,
    )
    return [
        dataclasses.replace(
            m, rank=rank, eps=max(m.eps, coarsest) if m.eps else 0.0, **unreferenced
        )
        for rank, parallel in enumerate(per_rank)
        for m in _compared(parallel, serial, exact, steps)
    ]


def failures(report: list[Mismatch], *, rtol: float = 1e-5, atol: float = 0.0) -> list[Mismatch]:
    """The comparisons of `report` that fail `assert_equivalent`'s check."""
    largest: dict[tuple[str, int], float] = {}
    for m in report:
        largest[m.what, m.step] = max(largest.get((m.what, m.step), 0.0), m.scale)
    failed = []
    for m in report:
        floor = FLOOR_EPS * m.eps * largest[m.what, m.step] + atol
        if m.reference_judges(largest[m.what, m.step]):
            failing = m.error > ERROR_FACTOR * m.serial_error + floor
        else:  # against the fp32 serial program
            failing = m.max_abs > rtol * m.scale + floor
        if failing:
            failed.append(m)
    return failed


def assert_equivalent(
    factory,
    mesh_shape,
    *,
    steps: int = 2,
    rtol: float = 1e-5,
    atol: float = 0.0,
    lr: float = 0.1,
    torch_optimizer=torch.optim.SGD,
    **planning,
) -> list[Mismatch]:
    """Raise AssertionError naming the worst mismatch if the parallel program differs
    from the serial model; return every comparison otherwise.

    This process runs the serial model and a float64 copy of it (same inputs,
    floating ones cast to float64, same seeds, so the same dropout masks: CPU
    draws them alike in either dtype, and in any process), the reference both
    fp32 programs are measured against; every rank's results are compared.
    Tensor by tensor (each output, every gradient, every parameter after the
    steps), the parallel program's largest error against it must not exceed
    `ERROR_FACTOR` times the serial program's own, plus a rounding floor of
    `FLOOR_EPS` machine epsilons of the tensor's dtype (or of the model's parameters,
    if coarser: a bf16 model's fp32 loss) times the largest value of its kind
    (outputs, gradients or parameters) at that step, plus `atol`. The floor lets
    through what both programs compute for values that are zero in exact
    arithmetic (a key bias's gradient under softmax): rounding noise, of either
    size. A parallel program returning more or fewer outputs fails.

    `rtol` applies only to a tensor with no float64 reference (an integer one, any
    of a model built in float64, its own reference, or one of step 0 that the serial
    program is more than `UNRELIABLE_EPS` epsilons off: the reference computes
    something else there): it fails when its error against the serial program
    exceeds `rtol` times its largest value, plus the floor and `atol`.
    NaN against NaN and equal infinities are equal; anything against a NaN or
    another infinity fails. ValueError if the serial model's parameters are not
    finite after the steps (its training diverged: lower `lr`).

    `planning` goes to `autoshard.compile` (strategy, memory_budget, hardware…,
    or `plan=` to apply your own), once, in this process: the ranks apply the
    compiled program and trace nothing. Pass `compiled=` to apply your own.
    `torch_optimizer` is the optimizer class every copy trains with (``lr=lr``).
    `factory` is a module-level callable returning ``(model, example_inputs)``
    (or ``"path/to/file.py:name"``). It runs in the shared pool of as many
    ranks as the mesh has (started once per process).
    """
    report = equivalence_report(
        factory, mesh_shape, steps=steps, lr=lr, torch_optimizer=torch_optimizer, **planning
    )
    failed = failures(report, rtol=rtol, atol=atol)
    if failed:
        worst = max(failed, key=lambda m: m.error if not math.isnan(m.error) else m.rel)
        compiled = planning.get("compiled")
        how = planning if compiled is None else {"choices": compiled.plan.choices or "forced"}
        # every output and gradient equal, the parameters after the last update not
        only_updates = all(m.what == "param" for m in failed)
        optimizer = getattr(torch_optimizer, "__name__", "the optimizer")
        hint = (
            f"; every output and gradient of every step matches: only the parameters after "
            f"{optimizer}'s last update differ, which an optimizer that divides by the "
            f"gradient's size (Adam near its eps) makes of rounding; check with a smaller lr"
            if only_updates and torch_optimizer is not torch.optim.SGD
            else ""
        )
        raise AssertionError(
            f"parallel program differs from the serial model on mesh {tuple(mesh_shape)} "
            f"planned with {how}: {len(failed)} comparisons fail; worst: {worst}{hint}"
        )
    return report


@dataclass(frozen=True)
class MemoryMeasurement:
    """Activation bytes one process held during one training step (`measure_memory`)."""

    saved_bytes: int  # kept by autograd for backward at the end of forward
    peak_bytes: int  # most activation bytes alive at once, forward and backward


def _storage(t: torch.Tensor) -> tuple[int, int]:
    """(data pointer, bytes) of the storage under `t`; (0, 0) if it has none (a meta
    tensor's holds no memory)."""
    if t.device.type == "meta":
        return 0, 0
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
        if func.namespace == "c10d":
            return _on_copies(func, args, kwargs)
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


def _on_copies(func, args, kwargs):
    """Run the c10d collective `func` on copies of its tensors, wait for it, and write
    what it wrote (its first argument, c10d's outputs) back into the originals.

    gloo's worker thread lets go of a collective's tensors a moment after the
    collective completes. Where that is the last reference, the storage is freed on
    that thread, after the program dropped it, by a margin that differs between runs
    and ranks (up to Python's thread switch interval): the peak would move with it.
    Copies made here are not counted, so the originals live as long as the program
    holds them."""
    copies = pytree.tree_map_only(torch.Tensor, torch.clone, (args, kwargs))
    out = func(*copies[0], **copies[1])
    for work in pytree.tree_leaves(out):
        if isinstance(work, torch.ScriptObject):
            work.wait()
    for original, written in zip(pytree.tree_leaves(args[0]), pytree.tree_leaves(copies[0][0])):
        original.copy_(written)
    originals = {
        id(c): t
        for c, t in zip(pytree.tree_leaves(copies), pytree.tree_leaves((args, kwargs)))
        if isinstance(t, torch.Tensor)
    }
    return pytree.tree_map_only(torch.Tensor, lambda t: originals.get(id(t), t), out)


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
      step installs (a non-reentrant ``torch.utils.checkpoint`` region) would
      hide their saves from ours: while the step runs, their pack hooks are
      wrapped, and what counts is the tensors they return, which is what
      autograd keeps. A checkpoint's pack returns a holder with no tensor (the
      region's inputs count: the checkpoint saves them before installing its
      hooks).
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
    (autograd's own objects, allocator caching) is not measured, nor what a
    collective holds while it runs: c10d collectives run on copies (`_on_copies`),
    so that what they read and write is freed when the program drops it.
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


@dataclass(frozen=True)
class NodeSaved:
    """What one node of a traced graph kept for backward, measured and predicted
    (`saved_by_node`)."""

    node: str
    op: str
    measured: int  # bytes autograd packed while the node ran
    predicted: int  # bytes of what `autoshard.cost.model.saved` lists, at the serial shapes
    needs_grad: tuple[bool, ...]  # per tensor input, as it ran


def _tensor_key(t: torch.Tensor) -> tuple[int, int, int]:
    """(storage, offset, bytes): a tensor and its reshapes or transposes are one."""
    return _storage(t)[0], t.storage_offset(), t.numel() * t.element_size()


def saved_by_node(traced, inputs: tuple) -> list[NodeSaved]:
    """Run `traced`'s graph serially on `inputs` (an `fx.Interpreter`, node by node)
    and, for each ``call_function`` node that returns a tensor, compare what autograd
    packs for backward while it runs with what its op's registry entry says it keeps
    (`autoshard.cost.model.saved`, at the serial shapes, `needs_grad` as the inputs ran:
    a factory's result, ``full_like(x)``, needs none whatever x needs).

    Both count each distinct tensor once (`_tensor_key`: ``matmul(x, x.T)`` keeps one
    tensor) at its own bytes (an input that views a larger storage counts at its own
    size), as the cost model names a kept input by its storage, and leave out
    parameters, buffers and their views, which the cost model counts with the
    parameters (it holds a layer's transposed weight, `saved_bytes`'s `held`).
    Measured: the tensors a ``saved_tensors_hooks`` pack hook gets while the node runs,
    its decomposition's (a composite op's) included. Predicted: the kept inputs and
    output as they ran, and the op's `extra_bytes`."""
    from autoshard.cost.model import saved
    from autoshard.tracing.trace import tensor_inputs

    graph_module = traced.graph_module
    resident = {
        _storage(t)[0]
        for t in (*graph_module.parameters(), *graph_module.buffers(), *traced.parameters.values())
    }
    packed: dict[str, dict[tuple, int]] = {}
    values: dict[str, object] = {}
    running: list[str | None] = [None]

    def pack(t: torch.Tensor) -> torch.Tensor:
        if running[0] is not None and torch._C._current_graph_task_id() == -1:
            if _storage(t)[0] not in resident and not _is_parameter(t):
                key = _tensor_key(t)
                packed.setdefault(running[0], {})[key] = key[2]
        return t

    class _Run(torch.fx.Interpreter):
        def run_node(self, node):
            running[0] = node.name if node.op == "call_function" else None
            try:
                values[node.name] = result = super().run_node(node)
            finally:
                running[0] = None
            return result

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _Run(graph_module).run(*inputs)

    rows = []
    for node in graph_module.graph.nodes:
        result = values.get(node.name)
        out = result if isinstance(result, torch.Tensor) else next(iter(result or ()), None)
        if node.op != "call_function" or not isinstance(out, torch.Tensor):
            continue
        ran = [values[i.name] for i in tensor_inputs(node)]
        needs_grad = tuple(isinstance(t, torch.Tensor) and t.requires_grad for t in ran)
        kept = saved(node, [tuple(t.shape) for t in ran], tuple(out.shape), needs_grad=needs_grad)
        tensors = [ran[i] for i in kept.inputs] + ([out] if kept.output else [])
        predicted = {_tensor_key(t) for t in tensors if _storage(t)[0] not in resident}
        rows.append(
            NodeSaved(
                node.name,
                str(node.target),
                sum(packed.get(node.name, {}).values()),
                sum(key[2] for key in predicted) + kept.extra_bytes,
                needs_grad,
            )
        )
    return rows
