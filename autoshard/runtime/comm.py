"""Differentiable collectives over named mesh axes, and the per-rank log.

The emitted program calls these functions by name, so a reader of
`ParallelModule.code` sees every collective with its axis and its backward:

    all_gather = autoshard.runtime.comm.all_gather(x, axis='b', dim=0,
                                           backward='reduce_scatter', node='linear_1', mesh=mesh)

Each is a forward/backward pair (the README's table of conversions); `backward` names
what the gradient needs, which depends on who consumes the output. `mesh` is this
rank's `BoundMesh`, an attribute of the program (`passes.BindMesh` puts it there), so
a call reads no global state and `torch.compile` sees plain constants. The
collectives are c10d calls (`_gathered`, `_scattered`, `_reduce_`), which eager makes
on the axis's process group and torch.compile traces as its functional collectives
(inductor buckets, reorders and overlaps them); autograd keeps the axis each used, so
backward needs no mesh.

    with autoshard.comm_log() as log:
        model(x).sum().backward()
    log.records  # [CommRecord(kind='all_gather', axis='b', ...), ...]
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.overrides import has_torch_function
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from autoshard.layout import Layout
from autoshard.mesh import Mesh


@dataclass(frozen=True)
class AxisGroup:
    name: str
    group: dist.ProcessGroup
    size: int
    coordinate: int


class BoundMesh:
    """A DeviceMesh seen through autoshard's axis names."""

    def __init__(self, device_mesh, mesh: Mesh):
        self.device_mesh = device_mesh
        self.mesh = mesh
        self.axes = {}
        for i, name in enumerate(mesh.names):
            if mesh.sizes[i] > 1:
                self.axes[name] = AxisGroup(
                    name, device_mesh.get_group(i), mesh.sizes[i], device_mesh.get_local_rank(i)
                )

    def coordinate(self, axis: str) -> int:
        return self.axes[axis].coordinate if axis in self.axes else 0

    def groups(self, axes: tuple[str, ...]) -> tuple[AxisGroup, ...]:
        """The groups of `axes`, in order."""
        return tuple([self.axes[a] for a in axes])  # a list first: dynamo traces no generator


ON_MESH: set[Callable] = set()  # the functions the program calls with `mesh=`


def on_mesh(function: Callable) -> Callable:
    """Mark `function` as one the program calls with this rank's mesh (`passes.BindMesh`)."""
    ON_MESH.add(function)
    return function


@dataclass(frozen=True)
class CommRecord:
    kind: str  # all_gather | reduce_scatter | all_reduce | all_to_all
    axis: str
    group_size: int
    bytes: int  # the full buffer: gathered output, or unreduced input
    node: str  # the node it serves, or a gradient bucket's name
    phase: str  # forward | backward | recompute
    serves: tuple[tuple[str, int], ...] = ()  # a bucket's nodes, with their bytes in it


@dataclass
class CommLog:
    records: list[CommRecord] = field(default_factory=list)

    def bytes_by(self, *keys: str) -> dict[tuple, int]:
        """Total bytes grouped by record fields, e.g. ``bytes_by("kind", "axis", "phase")``."""
        out: dict[tuple, int] = defaultdict(int)
        for r in self.records:
            out[tuple(getattr(r, k) for k in keys)] += r.bytes
        return dict(out)

    def ring_bytes(self, node: str | None = None, phase: str | None = None) -> float:
        """Bytes this rank sends on a ring: (n−1)/n of the buffer, twice for all-reduce."""
        total = 0.0
        for r in self.records:
            if phase is not None and r.phase != phase:
                continue
            if node is None or r.node == node or r.node.startswith(f"{node}#"):
                nbytes = r.bytes  # a node's call, or one of a bucket's
            else:  # its share of a gradient bucket
                nbytes = sum(b for served, b in r.serves if served == node)
            total += (
                (2 if r.kind == "all_reduce" else 1) * (r.group_size - 1) / r.group_size * nbytes
            )
        return total


# The open logs: a plain list, so that a call with none open costs one truth test.
_OPEN_LOGS: list[CommLog] = []


@contextlib.contextmanager
def comm_log():
    """Record every collective this rank runs eagerly inside the block (a program run
    by torch.compile is not logged: its collectives are the compiled graph's)."""
    log = CommLog()
    _OPEN_LOGS.append(log)
    try:
        yield log
    finally:
        del _OPEN_LOGS[next(i for i, open_log in enumerate(_OPEN_LOGS) if open_log is log)]


def _logging() -> bool:
    # The open logs first: with none open (a training step) a call costs one truth test
    # and no function call. A compiled program does not log: dynamo guards on the logs'
    # being open (a log opened around a compiled call recompiles once) and traces no
    # record.
    return bool(_OPEN_LOGS) and not torch.compiler.is_compiling()


_PHASE: contextvars.ContextVar[str] = contextvars.ContextVar("autoshard_phase", default="forward")


def recompute_context():
    """For `torch.utils.checkpoint.checkpoint(context_fn=...)`: the replay in backward
    logs its collectives as "recompute". Under torch.compile (which takes only dispatch
    modes here, and logs nothing) every op of the region, collectives included, is
    marked to be recomputed in the compiled backward, as eager replays it."""
    if torch.compiler.is_compiling():
        return create_selective_checkpoint_contexts(_recomputed)
    return contextlib.nullcontext(), in_phase("recompute")


def _recomputed(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_RECOMPUTE


@contextlib.contextmanager
def in_phase(phase: str):
    """Log the collectives run inside the block under `phase` (a replay in backward)."""
    token = _PHASE.set(phase)
    try:
        yield
    finally:
        _PHASE.reset(token)


def _record(kind: str, axis: AxisGroup, nbytes: int, node: str, phase: str | None, serves=()):
    """Log one call in every open log; `phase` None is the current one (`in_phase`)."""
    record = CommRecord(kind, axis.name, axis.size, nbytes, node, phase or _PHASE.get(), serves)
    for log in _OPEN_LOGS:
        log.records.append(record)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# The c10d calls, each on a contiguous tensor. Eager makes them on the axis's process
# group itself, with options made once: `dist.all_gather_single` and its kin spend
# more of a small call's CPU than the call (about 2.5 µs of 4–7 µs) on checks that
# hold here by construction, and build their options anew each time. They are made
# through `dist` where its wrappers do something: compiled (dynamo traces them as
# torch's functional collectives, which inductor buckets, reorders and overlaps with
# compute), under a torch function mode or on a tensor subclass (which handle them),
# and on complex tensors (sent as real views).
_GATHER = c10d.AllgatherOptions()
_SCATTER = c10d.ReduceScatterOptions()
_REDUCE = {op: c10d.AllreduceOptions() for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX)}
for _options in (_GATHER, _SCATTER, *_REDUCE.values()):
    _options.asyncOp = False  # waited for at once, as `dist`'s blocking calls are
for _op, _options in _REDUCE.items():
    _options.reduceOp = _op
_SCATTER.reduceOp = dist.ReduceOp.SUM


def _through_dist(x: torch.Tensor) -> bool:
    return torch.compiler.is_compiling() or has_torch_function((x,)) or x.is_complex()


def _gathered(x: torch.Tensor, axis: AxisGroup) -> torch.Tensor:
    """Every rank's `x` stacked along dim 0."""
    out = x.new_empty((x.shape[0] * axis.size, *x.shape[1:]))
    if _through_dist(x):
        dist.all_gather_single(out, x, group=axis.group)
    else:
        axis.group.all_gather_single(out, x, _GATHER).wait()
    return out


def _scattered(x: torch.Tensor, axis: AxisGroup) -> torch.Tensor:
    """This rank's part of dim 0 of the sum of every rank's `x`."""
    out = x.new_empty((x.shape[0] // axis.size, *x.shape[1:]))
    if _through_dist(x):
        dist.reduce_scatter_single(out, x, group=axis.group)
    else:
        axis.group.reduce_scatter_single(out, x, _SCATTER).wait()
    return out


def _reduce_(x: torch.Tensor, axis: AxisGroup, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """`x`, replaced in place by the elementwise `op` of every rank's `x`."""
    if _through_dist(x):
        dist.all_reduce(x, op=op, group=axis.group)
    else:
        axis.group.allreduce([x], _REDUCE[op]).wait()
    return x


# A collective runs along dim 0 of a contiguous buffer: `dim` is moved there first
# (no call for dim 0, the usual case), and the result moved back to `dim` in the
# row-major layout the serial program's tensor has: a view with `dim` outermost would
# have kernels that need a unit last stride (CPU flash attention) fall back to slower
# ones that keep more for backward (the math attention's probabilities).
def _all_gather(x, axis: AxisGroup, dim, node, phase):
    out = _gathered((x.movedim(dim, 0) if dim else x).contiguous(), axis)
    if _logging():
        _record("all_gather", axis, _nbytes(out), node, phase)
    return out.movedim(0, dim).contiguous() if dim else out


def _reduce_scatter(x, axis: AxisGroup, dim, node, phase):
    moved = (x.movedim(dim, 0) if dim else x).contiguous()
    out = _scattered(moved, axis)
    if _logging():
        _record("reduce_scatter", axis, _nbytes(moved), node, phase)
    return out.movedim(0, dim).contiguous() if dim else out


def _all_reduce(x, axis: AxisGroup, dim, node, phase):
    out = _reduce_(x.clone(memory_format=torch.contiguous_format), axis)
    if _logging():
        _record("all_reduce", axis, _nbytes(out), node, phase)
    return out


def _split(x, axis: AxisGroup, dim, node, phase):
    size = x.shape[dim] // axis.size  # one view, not one per rank as `chunk` makes
    return x.narrow(dim, axis.coordinate * size, size).clone()


def _identity(x, axis, dim, node, phase):
    return x.clone()


def _mask(x, axis: AxisGroup, dim, node, phase):
    return x.clone() if axis.coordinate == 0 else torch.zeros_like(x)


_OPS = {
    "all_gather": _all_gather,
    "reduce_scatter": _reduce_scatter,
    "all_reduce": _all_reduce,
    "split": _split,
    "identity": _identity,
    "mask": _mask,
}


class _Pair(torch.autograd.Function):
    """A forward op and the backward op that makes the pair exact."""

    @staticmethod
    def forward(ctx, x, forward, backward, axis, dim, node):
        ctx.backward, ctx.axis, ctx.dim, ctx.node = backward, axis, dim, node
        return _OPS[forward](x, axis, dim, node, None)

    @staticmethod
    def backward(ctx, grad):
        return (
            _OPS[ctx.backward](grad, ctx.axis, ctx.dim, ctx.node, "backward"),
            None,
            None,
            None,
            None,
            None,
        )


def collective(kind: str, x, group: AxisGroup, node: str, *, dim=None, phase: str | None = None):
    """One logged collective on `group`, outside autograd: for an op's own autograd
    Function. The phase is the current one (forward, or recompute in a replay) unless
    given."""
    return _OPS[kind](x, group, dim, node, phase)


def summed(x, groups: tuple[AxisGroup, ...], node: str):
    """The sum over each of `groups` of every rank's `x`, differentiable: each rank's
    `x` enters the sum once, so its gradient is the sum's (backward identity)."""
    for group in groups:
        x = _Pair.apply(x, "all_reduce", "identity", group, None, node)
    return x


@on_mesh
def all_gather(x, *, axis: str, dim: int, backward: str, node: str, mesh: BoundMesh):
    """Gather the shards of `dim` over `axis`; backward splits or reduce-scatters."""
    return _Pair.apply(x, "all_gather", backward, mesh.axes[axis], dim, node)


@on_mesh
def reduce_scatter(
    x, *, axis: str, dim: int, backward: str = "all_gather", node: str, mesh: BoundMesh
):
    """Sum the partial values over `axis`, keeping this rank's part of `dim`."""
    return _Pair.apply(x, "reduce_scatter", backward, mesh.axes[axis], dim, node)


@on_mesh
def all_reduce(x, *, axis: str, backward: str, node: str, mesh: BoundMesh):
    """Sum the partial values over `axis`; backward is identity or all-reduce."""
    return _Pair.apply(x, "all_reduce", backward, mesh.axes[axis], None, node)


@on_mesh
def split(x, *, axis: str, dim: int, backward: str = "all_gather", node: str, mesh: BoundMesh):
    """Keep this rank's part of a replicated `dim` (free); backward all-gathers."""
    return _Pair.apply(x, "split", backward, mesh.axes[axis], dim, node)


@on_mesh
def grad_all_reduce(x, *, axis: str, backward: str = "all_reduce", node: str, mesh: BoundMesh):
    """Identity whose backward all-reduces: a replicated value entering split work."""
    return _Pair.apply(x, "identity", backward, mesh.axes[axis], None, node)


@on_mesh
def to_partial(x, *, axis: str, backward: str = "identity", node: str, mesh: BoundMesh):
    """A replicated value as a pending sum: kept on coordinate 0, zero elsewhere."""
    return _Pair.apply(x, "mask", backward, mesh.axes[axis], None, node)


class _GradBucket(torch.autograd.Function):
    """Identity on several tensors whose backward all-reduces their gradients together:
    autograd calls it once every output's gradient is ready, and one flat buffer goes
    over the axis, in the calls the plan cut it into. With `overlap` the calls are
    launched and left running (`_PENDING`): the gradients it returns are views of the
    buffer still being reduced, which `_GradWait` (or the next bucket) waits for."""

    @staticmethod
    def forward(ctx, axis, node, serves, calls, overlap, *tensors):
        ctx.axis, ctx.node, ctx.serves, ctx.calls = axis, node, serves, calls
        # compiled, the collectives are inductor's to schedule (and overlap)
        ctx.overlap = overlap and not torch.compiler.is_compiling()
        ctx.like = [(t.shape, t.dtype) for t in tensors]
        # A tensor no output of the program reads gets no gradient (None, as in the
        # serial model, so that optimizers skip it), though it still fills its place in
        # the bucket: every rank sends the same buffer.
        ctx.set_materialize_grads(False)
        return tuple([t.view_as(t) for t in tensors])  # a list: dynamo traces no generator

    @staticmethod
    def backward(ctx, *given):
        unused = [g is None for g in given]
        if all(unused):
            return None, None, None, None, None, *given
        if ctx.overlap:  # a gradient of a later bucket over another axis, still running
            _wait_for(given)
        device = [g.device for g in given if g is not None][0]
        grads = [
            torch.zeros(shape, dtype=dtype, device=device) if g is None else g
            for g, (shape, dtype) in zip(given, ctx.like)
        ]
        flat = torch.cat([g.reshape(-1) for g in grads])
        calls = ctx.calls or ((ctx.node, _nbytes(flat)),)
        pieces = flat.split([nbytes // flat.element_size() for _, nbytes in calls])
        start = 0
        for (name, nbytes), piece in zip(calls, pieces):
            if ctx.overlap:
                _pending(flat, dist.all_reduce(piece, group=ctx.axis.group, async_op=True))
            else:
                _reduce_(piece, ctx.axis)
            if _logging():
                served = _served(ctx.serves, grads, start, start + nbytes)
                _record("all_reduce", ctx.axis, nbytes, name, "backward", served)
            start += nbytes
        parts = flat.split([g.numel() for g in grads])
        return (
            None,
            None,
            None,
            None,
            None,
            *[None if skip else p.view_as(g) for p, g, skip in zip(parts, grads, unused)],
        )


# Reductions launched by overlapped buckets and not yet waited for, by the storage of
# the flat buffer they reduce in place (the gradients handed on are views of it). Each
# entry holds its buffer: no other tensor takes that address while the entry lives.
_PENDING: dict[int, tuple[torch.Tensor, list]] = {}


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _pending(buffer: torch.Tensor, work) -> None:
    """Remember a reduction launched on `buffer`, for `_wait_for` to wait for."""
    _PENDING.setdefault(_storage(buffer), (buffer, []))[1].append(work)


def _wait_for(grads) -> None:
    """Wait for the reductions still running on the buffers `grads` are views of."""
    if not _PENDING:  # a bucket's backward before any other was launched: the usual case
        return
    for g in grads:
        if g is not None:
            _, works = _PENDING.pop(_storage(g), (None, ()))
            for work in works:
                work.wait()


def _settle_stale() -> None:
    """Wait for the reductions of a backward that never reached its `grad_wait` (it
    raised, or ran through part of the program only), and forget them: at a program's
    start, outside any backward, nothing launched is still to be waited for by it."""
    if torch._C._current_graph_task_id() != -1:
        return  # a region's forward replayed in backward: its program's wait is to come
    while _PENDING:
        _, (_, works) = _PENDING.popitem()
        for work in works:
            work.wait()


class _GradWait(torch.autograd.Function):
    """Identity whose backward waits for the overlapped bucket reductions of its
    outputs' gradients: the program's first call, so that autograd runs it last (it
    takes ready nodes latest-made first), after every other op's backward, and before
    the gradients reach the parameters (or anything else reads them)."""

    @staticmethod
    def forward(ctx, *tensors):
        ctx.set_materialize_grads(False)
        return tuple([t.view_as(t) for t in tensors])

    @staticmethod
    def backward(ctx, *given):
        _wait_for(given)
        return given


def grad_wait(tensors):
    """`tensors` unchanged; backward waits for the reductions overlapped buckets
    launched on their gradients (`grad_bucket(..., overlap=True)`). Compiled, the
    buckets reduce in place of launch (inductor schedules them), so nothing is waited."""
    if torch.compiler.is_compiling():
        return tuple(tensors)
    _settle_stale()  # the program's first call: its forward starts here
    return _GradWait.apply(*tensors)


def _served(serves, grads, start: int, stop: int) -> tuple[tuple[str, int], ...]:
    """Bytes of bytes [start, stop) of the flat buffer of `grads` per node it serves."""
    out: dict[str, int] = defaultdict(int)
    offset = 0
    for name, g in zip(serves, grads):
        end = offset + _nbytes(g)
        if min(end, stop) > max(offset, start):
            out[name] += min(end, stop) - max(offset, start)
        offset = end
    return tuple(out.items())


@on_mesh
def grad_bucket(
    tensors,
    *,
    axis: str,
    node: str,
    serves: tuple[str, ...],
    calls=None,
    overlap: bool = False,
    mesh: BoundMesh,
):
    """`tensors` unchanged; backward all-reduces their gradients over `axis` in one call
    (a bucket named `node`; ``serves[k]`` is the node that reads ``tensors[k]``), or,
    for a bucket larger than one call, in `calls`: (name, bytes) of each, in order.
    With `overlap` backward launches the calls and goes on; a `grad_wait` on the
    parameters waits for them."""
    return _GradBucket.apply(mesh.axes[axis], node, serves, calls, overlap, *tensors)


class _GatherBucket(torch.autograd.Function):
    """Several parameters' shards gathered over one axis in one call: each rank's
    shards flattened into one buffer, the buffers of every rank gathered, and each
    parameter cut out of them and laid out whole along its split dim. Backward packs
    the gradients the same way and reduce-scatters them in one call, each rank keeping
    its shards' part."""

    @staticmethod
    def forward(ctx, axis, node, serves, dims, overlap, *shards):
        ctx.axis, ctx.node, ctx.dims = axis, node, dims
        ctx.overlap = overlap and not torch.compiler.is_compiling()
        ctx.shapes = [s.shape for s in shards]
        ctx.dtype, ctx.device = shards[0].dtype, shards[0].device  # of a zero gradient
        ctx.set_materialize_grads(False)
        flat = torch.cat([s.reshape(-1) for s in shards])
        gathered = _gathered(flat, axis).view(axis.size, -1)
        pieces = gathered.split([s.numel() for s in shards], dim=1)
        whole = [
            piece.reshape(axis.size, *shape).movedim(0, dim).flatten(dim, dim + 1).contiguous()
            for piece, shape, dim in zip(pieces, ctx.shapes, dims)
        ]
        # the bytes of the gathered buffer (and of its gradient) each reader's part takes
        ctx.served = _served(serves, whole, 0, _nbytes(gathered))
        if _logging():
            _record("all_gather", axis, _nbytes(gathered), node, None, ctx.served)
        return tuple(whole)

    @staticmethod
    def backward(ctx, *given):
        if all(g is None for g in given):
            return None, None, None, None, None, *given
        size = ctx.axis.size
        rows = []  # each gradient as [size, its shard's elements]: row k is rank k's part
        for g, shape, dim in zip(given, ctx.shapes, ctx.dims):
            if g is None:  # a parameter no output reads: its place in the buffer is zeros
                rows.append(torch.zeros((size, shape.numel()), dtype=ctx.dtype, device=ctx.device))
            else:
                rows.append(g.unflatten(dim, (size, shape[dim])).movedim(dim, 0).reshape(size, -1))
        packed = torch.cat(rows, dim=1).reshape(-1)
        if ctx.overlap:  # launched; the parameters' `grad_wait` waits for it
            flat = packed.new_empty(packed.shape[0] // size)
            _pending(
                flat, dist.reduce_scatter_single(flat, packed, group=ctx.axis.group, async_op=True)
            )
        else:
            flat = _scattered(packed, ctx.axis)
        if _logging():
            _record("reduce_scatter", ctx.axis, _nbytes(packed), ctx.node, "backward", ctx.served)
        parts = flat.split([shape.numel() for shape in ctx.shapes])
        grads = [
            None if g is None else p.view(shape) for p, g, shape in zip(parts, given, ctx.shapes)
        ]
        return None, None, None, None, None, *grads


@on_mesh
def gather_bucket(
    shards,
    *,
    axis: str,
    dims: tuple[int, ...],
    node: str,
    serves: tuple[str, ...],
    overlap: bool = False,
    mesh: BoundMesh,
):
    """Each of `shards` gathered over `axis` along its dim in `dims`, in one call (a
    gather bucket named `node`; ``serves[k]`` is the node that reads ``shards[k]``);
    backward reduce-scatters their gradients in one. With `overlap` backward launches
    that call and goes on; a `grad_wait` on the shards waits for it."""
    return _GatherBucket.apply(mesh.axes[axis], node, serves, dims, overlap, *shards)


@torch.no_grad()
def all_reduce_max(x, group: AxisGroup, node: str):
    """Elementwise maximum over `group` (no gradient: used to stabilize exponentials)."""
    out = _reduce_(x.contiguous().clone(), group, dist.ReduceOp.MAX)
    if _logging():
        _record("all_reduce", group, _nbytes(out), node, None)
    return out


STEP_FUNCTIONS = {
    "all_gather": all_gather,
    "reduce_scatter": reduce_scatter,
    "all_reduce": all_reduce,
    "split": split,
    "grad_all_reduce": grad_all_reduce,
    "to_partial": to_partial,
}


def run_steps(x, steps: tuple[tuple[str, dict], ...], node: str, mesh: BoundMesh):
    """Apply `steps`, each (kind, keyword arguments of its function in STEP_FUNCTIONS)."""
    for kind, kwargs in steps:
        x = STEP_FUNCTIONS[kind](x, node=node, mesh=mesh, **kwargs)
    return x


# The op in `_OPS` each step function runs forward (its backward's is its `backward`)
_STEP_FORWARD = {
    "all_gather": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "all_reduce": "all_reduce",
    "split": "split",
    "grad_all_reduce": "identity",
    "to_partial": "mask",
}


def forward_steps(x, steps: tuple[tuple[str, dict], ...], node: str, mesh: BoundMesh, phase=None):
    """`run_steps` outside autograd, for an op's own autograd Function; logged in the
    current phase unless `phase` is given."""
    for kind, kwargs in steps:
        axis = mesh.axes[kwargs["axis"]]
        x = _OPS[_STEP_FORWARD[kind]](x, axis, kwargs.get("dim"), node, phase)
    return x


def backward_steps(grad, steps: tuple[tuple[str, dict], ...], node: str, mesh: BoundMesh):
    """The gradient of the input of `forward_steps(x, steps, …)` from its output's: each
    step's backward op, the last step first, logged as "backward"."""
    for _, kwargs in reversed(steps):
        axis = mesh.axes[kwargs["axis"]]
        grad = _OPS[kwargs["backward"]](grad, axis, kwargs.get("dim"), node, "backward")
    return grad


@torch.no_grad()
def gather_full(
    local: torch.Tensor, dims: tuple[tuple[str, ...], ...], mesh: BoundMesh
) -> torch.Tensor:
    """The global tensor from this rank's shard (a collective over the sharding axes)."""
    out = local
    for d in range(len(dims)):
        for axis in reversed(dims[d]):
            group = mesh.axes[axis]
            out = _gathered(out.movedim(d, 0).contiguous(), group).movedim(0, d)
    return out.contiguous()


GATHER_BYTES = 64 << 20  # the most bytes one `gather_full_many` collective brings in


@torch.no_grad()
def gather_full_many(
    shards: dict[str, tuple[torch.Tensor, tuple[tuple[str, ...], ...]]], mesh: BoundMesh
) -> dict[str, torch.Tensor]:
    """Each global tensor from this rank's shard of it (name → (shard, its split dims)),
    in as few all-gathers over the whole mesh as `GATHER_BYTES` allows: every rank
    sends its shards as one byte buffer, and each tensor is laid together from the
    pieces at the offsets each rank's coordinate gives (`Layout.shard_slices`), not
    one all-gather per tensor and axis. A tensor no axis splits is returned as it is."""
    world = mesh.device_mesh.mesh
    out, batch, size = {}, [], 0
    for name, (shard, dims) in shards.items():
        if not any(dims):
            out[name] = shard if shard.is_sparse else shard.contiguous()
            continue
        nbytes = shard.numel() * shard.element_size()
        if batch and (size + nbytes) * world.numel() > GATHER_BYTES:
            out.update(_gathered_batch(batch, mesh))
            batch, size = [], 0
        batch.append((name, shard, dims))
        size += nbytes
    if batch:
        out.update(_gathered_batch(batch, mesh))
    return {name: out[name] for name in shards}


def _gathered_batch(batch: list, mesh: BoundMesh) -> dict[str, torch.Tensor]:
    # a ParallelModule's mesh spans the whole process group: rank r's bytes are row r
    world = mesh.device_mesh.mesh
    sent = torch.cat([_as_bytes(shard) for _, shard, _ in batch])
    received = sent.new_empty(world.numel() * sent.numel())
    dist.all_gather_single(received, sent)
    received = received.view(world.numel(), sent.numel())
    coords = {
        int(world[index]): dict(zip(mesh.mesh.names, index))
        for index in itertools.product(*map(range, world.shape))
    }
    out, offset = {}, 0
    for name, shard, dims in batch:
        nbytes = shard.numel() * shard.element_size()
        layout = Layout(dims)
        counts = layout.shard_counts(mesh.mesh)
        shape = tuple(n * k for n, k in zip(shard.shape, counts))
        full = shard.new_empty(shape)
        for rank, coord in coords.items():
            piece = received[rank, offset : offset + nbytes].view(shard.dtype).view(shard.shape)
            where = tuple(slice(*s) for s in layout.shard_slices(shape, mesh.mesh, coord))
            full[where] = piece
        out[name] = full
        offset += nbytes
    return out


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(-1).view(torch.uint8)


def local_part(
    full: torch.Tensor, dims: tuple[tuple[str, ...], ...], mesh: BoundMesh
) -> torch.Tensor:
    """This rank's shard of a global tensor (no communication)."""
    out = full
    for d, axes in enumerate(dims):
        for axis in axes:
            out = out.chunk(mesh.axes[axis].size, d)[mesh.coordinate(axis)]
    return out
