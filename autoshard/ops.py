"""Local implementations of ops whose sharded form is not the ATen op on shards.

The emitted program calls these where a node's strategy names a lowering;
their collectives go through `autoshard.comm`, so they are logged and
differentiable like any other.
"""

from __future__ import annotations

import math

import torch

from autoshard import comm


def layer_norm(x, weight, bias, eps, *, normalized_ndim: int, axes: tuple[str, ...], node: str):
    """Layer norm over features split across `axes`: the sums behind mean and variance
    are all-reduced over those axes (their gradients too, since every rank
    normalizes its own features with them)."""
    dims = tuple(range(-normalized_ndim, 0))
    count = math.prod(x.shape[d] for d in dims) * math.prod(
        comm.current_mesh().axes[a].size for a in axes
    )

    def total(t):
        for axis in axes:
            t = comm.all_reduce(t, axis=axis, backward="all_reduce", node=node)
        return t

    mean = total(x.sum(dims, keepdim=True)) / count
    centered = x - mean
    var = total((centered * centered).sum(dims, keepdim=True)) / count
    out = centered * torch.rsqrt(var + eps)
    if weight is not None:
        out = out * weight
    if bias is not None:
        out = out + bias
    return out


def dropout(x, p: float, train: bool, *, shape: tuple[int, ...], dims: tuple[tuple[str, ...], ...]):
    """Dropout whose mask is drawn for the global `shape` and cut to this rank's part,
    so the parallel program drops exactly what the serial one drops from the
    same random state (the same generator calls in the same order)."""
    if not train or p == 0:
        return x
    if p == 1:
        return x * torch.zeros_like(x)
    noise = torch.empty(shape, dtype=x.dtype, device=x.device).bernoulli_(1 - p).div_(1 - p)
    return x * comm.local_part(noise, dims)


def mean(x, dim=None, keepdim: bool = False, *, scale: float, **kwargs):
    """A mean over sharded dims as this rank's share of the global mean
    (local mean × local count / global count), to be all-reduced."""
    out = torch.mean(x, **kwargs) if dim is None else torch.mean(x, dim, keepdim, **kwargs)
    return out * scale
