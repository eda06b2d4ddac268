"""Measure a hardware profile on a live mesh: α and β per mesh axis, and matmul FLOP/s.

For each mesh axis of size n > 1, every rank times all-gathers and all-reduces
of several buffer sizes S over its axis group (all groups of the axis at once,
as in training), after a warm-up; the slowest rank's time counts, since a
collective ends when its last rank does. One least-squares fit per axis of

    all-gather:  t = (n−1)·α + (n−1)/n·S/β
    all-reduce:  t = 2·((n−1)·α + (n−1)/n·S/β)

(relative errors, non-negative α and 1/β) gives its `Link`. A matmul timed on
every rank at once gives the float32 FLOP/s the devices reach. Everything else
comes from a base profile.

    hw = calibrate((2, 2, 2))            # spawns 8 local gloo ranks (no process group yet)
    hw.save("profile.json")              # or: autoshard calibrate --mesh 2x2x2 --out profile.json

Inside an initialized process group (torchrun), every rank calls `calibrate`
and gets the same profile: rank 0's fit is broadcast. `measure` does the work
on a DeviceMesh you already have.
"""

from __future__ import annotations

import dataclasses
import math
import time
from functools import partial

import numpy as np
import torch
import torch.distributed as dist
from scipy.optimize import nnls

from autoshard.cost.hardware import Hardware, Link
from autoshard.errors import MeshError
from autoshard.mesh import DEFAULT_AXIS_NAMES, Mesh
from autoshard.runtime import comm

SIZES = (4 << 10, 32 << 10, 256 << 10, 1 << 20, 4 << 20)  # bytes of the full buffer
WARMUP = 2
REPEATS = 5


def calibrate(
    mesh_shape: tuple[int, ...],
    base: Hardware | str = "cpu-gloo",
    sizes: tuple[int, ...] = SIZES,
    repeats: int = REPEATS,
) -> Hardware:
    """A profile for `mesh_shape` measured on a live mesh, the rest taken from `base`.

    In an initialized process group, every rank must call it, with a mesh over
    the whole world; otherwise it runs on ``prod(mesh_shape)`` local gloo ranks
    (`autoshard.runtime.ranks.shared_pool`).
    """
    shape = tuple(int(s) for s in mesh_shape)
    base = base if isinstance(base, Hardware) else Hardware.load(base)
    if dist.is_available() and dist.is_initialized():
        if dist.get_world_size() != math.prod(shape):
            raise MeshError(
                f"calibrating a {shape} mesh needs {math.prod(shape)} ranks, but the process "
                f"group has {dist.get_world_size()}: launch that many, or give a mesh of "
                f"{dist.get_world_size()} devices"
            )
        from torch.distributed.device_mesh import init_device_mesh

        device = "cuda" if "nccl" in dist.get_backend() else "cpu"
        mesh = init_device_mesh(device, shape, mesh_dim_names=DEFAULT_AXIS_NAMES[: len(shape)])
        return measure(mesh, base, sizes, repeats)
    from autoshard.runtime.ranks import shared_pool

    return shared_pool(math.prod(shape)).run(measure, shape, base, sizes, repeats)[0]


def measure(
    mesh, base: Hardware, sizes: tuple[int, ...] = SIZES, repeats: int = REPEATS
) -> Hardware:
    """Calibrate on `mesh` (a DeviceMesh of up to 3 axes); call it on every rank."""
    device = mesh.device_type
    axis_sizes = Mesh.from_shape(mesh.mesh.shape).sizes  # padded to three axes with 1s
    groups = [mesh.get_group(i) if n > 1 else None for i, n in enumerate(axis_sizes)]
    live = [g for g in groups if g is not None]

    # Every rank times; the max over each axis in turn leaves the slowest rank's time everywhere.
    seconds = [t for group in live for t in _time_collectives(group, sizes, repeats, device)]
    seconds.append(_time_matmul(device, repeats, live))
    seconds = torch.tensor(seconds, dtype=torch.float64, device=device)
    for group in live:
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=group)

    # Rank 0 fits; its numbers reach every rank along each axis in turn.
    fit = torch.zeros(2 * len(groups) + 1, dtype=torch.float64, device=device)
    if not any(mesh.get_coordinate()):
        fit[:] = torch.tensor(_fit(seconds.tolist(), axis_sizes, sizes), dtype=torch.float64)
    for group in live:
        dist.broadcast(fit, group=group, group_src=0)

    fit = fit.tolist()
    axes = tuple(
        Link(fit[2 * i], 1 / fit[2 * i + 1]) if groups[i] is not None else link
        for i, link in enumerate(base.axes)
    )
    achieved = 2 * _matmul_side(device) ** 3 / fit[-1]
    shape = "x".join(str(s) for s in mesh.mesh.shape)
    return dataclasses.replace(
        base,
        name=f"calibrated-{shape}",
        # Compute time divides by peak·efficiency: store the matmul's rate over the efficiency.
        peak_flops={**base.peak_flops, "float32": achieved / base.efficiency},
        axes=axes,
        source=f"measured by `autoshard calibrate` on a {shape} {device} mesh "
        f"({time.strftime('%Y-%m-%d')}): alpha and beta per axis from all-gathers and "
        f"all-reduces of {sizes[0]} to {sizes[-1]} bytes; float32 peak = the rate of a "
        f"matmul ({achieved:.3g} FLOP/s) / efficiency; everything else from {base.name!r}",
    )


def _full_numel(size: int, n: int) -> int:
    """float32 elements of a buffer of about `size` bytes that divides over `n` ranks."""
    return max(1, size // 4 // n) * n


def _fit(seconds: list[float], axis_sizes, sizes) -> list[float]:
    """[α, 1/β] per mesh axis (zeros where the axis has size 1), then the matmul's seconds."""
    out, at = [], 0
    for n in axis_sizes:
        if n == 1:
            out += [0.0, 0.0]
            continue
        rows = [
            [factor * (n - 1), factor * (n - 1) / n * 4 * _full_numel(size, n)]
            for factor in (1, 2)  # all-gather, then all-reduce
            for size in sizes
        ]
        times = np.array(seconds[at : at + len(rows)])
        at += len(rows)
        # Relative errors, so that small buffers (α) weigh as much as large ones (β).
        (latency, inverse_bandwidth), _ = nnls(np.array(rows) / times[:, None], np.ones_like(times))
        out += [max(latency, 1e-9), max(inverse_bandwidth, 1e-15)]
    return out + [seconds[at]]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(fn, repeats: int, device: str, groups) -> float:
    """Median seconds of `fn()` after a warm-up; the ranks of `groups` start each run together."""
    for _ in range(WARMUP):
        fn()
    runs = []
    for _ in range(repeats):
        for group in groups:
            dist.barrier(group=group)
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        runs.append(time.perf_counter() - start)
    return float(np.median(runs))


def _time_collectives(group, sizes, repeats: int, device: str) -> list[float]:
    """Seconds of an all-gather per size, then of an all-reduce per size: the calls the
    emitted program makes."""
    n = dist.get_world_size(group)
    axis = comm.AxisGroup("timed", group, n, dist.get_rank(group))
    out = []
    for gather in (True, False):
        for size in sizes:
            full = torch.zeros(_full_numel(size, n), device=device)
            if gather:
                run = partial(comm._gathered, torch.zeros(full.numel() // n, device=device), axis)
            else:
                run = partial(comm._reduce_, full, axis)
            out.append(_timed(run, repeats, device, [group]))
    return out


def _matmul_side(device: str) -> int:
    return 512 if device == "cpu" else 4096


def _time_matmul(device: str, repeats: int, groups) -> float:
    """Seconds of a square float32 matmul, every rank of the mesh computing at once."""
    a = torch.randn(_matmul_side(device), _matmul_side(device), device=device)
    return _timed(lambda: a @ a, repeats, device, groups)
