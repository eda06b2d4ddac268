"""Local implementations of ops whose sharded form is not the ATen op on shards.

The emitted program calls these where a node's strategy names a lowering;
their collectives go through `autoshard.runtime.comm`, so they are logged and
differentiable like any other.
"""

from __future__ import annotations

import math
from functools import partial

import torch
from torch.utils import _pytree as pytree

from autoshard.layout import Layout
from autoshard.runtime import comm


@comm.on_mesh
def layer_norm(
    x,
    weight,
    bias,
    eps,
    *,
    normalized_ndim: int,
    axes: tuple[str, ...],
    node: str,
    mesh: comm.BoundMesh,
):
    """Layer norm over features split across `axes`, in one collective per axis each way
    (`_ShardedNorm`)."""
    groups = mesh.groups(axes)
    dims = tuple(range(-normalized_ndim, 0))
    return _ShardedNorm.apply(x, weight, bias, eps, dims, groups, node)[0]


def batch_norm_from_running(*args):
    """Batch norm from running statistics (eval) on this rank's samples: the ATen op, its
    backward given a contiguous gradient. torch 2.13's CPU kernel computes wrong
    gradients for a batch of one sample whose gradient has channels-last strides (a
    token mean after it: ``y.flatten(2).transpose(1, 2).mean(1)``), which a batch split
    down to one sample per rank meets where the serial batch does not."""
    return _ContiguousGradient.apply(torch.ops.aten.batch_norm.default(*args))


class _ContiguousGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


@comm.on_mesh
def batch_norm(
    x,
    weight,
    bias,
    running_mean,
    running_var,
    momentum: float,
    eps: float,
    *,
    axes: tuple[str, ...],
    node: str,
    mesh: comm.BoundMesh,
):
    """Batch norm from the batch's statistics, the batch (or space) split across `axes`:
    per channel, every rank's statistics combined (`_ShardedNorm`), and the running
    statistics, where it has them, updated from the combined ones as the serial op
    does (the variance unbiased over the whole batch)."""
    groups = mesh.groups(axes)
    dims = (0, *range(2, x.dim()))
    channels = (1, -1) + (1,) * (x.dim() - 2)
    weight = weight.view(channels) if weight is not None else None
    bias = bias.view(channels) if bias is not None else None
    out, mean, m2 = _ShardedNorm.apply(x, weight, bias, eps, dims, groups, node)
    if running_mean is not None:
        count = math.prod([x.shape[d] for d in dims] + [g.size for g in groups])
        with torch.no_grad():
            running_mean.mul_(1 - momentum).add_(mean.flatten(), alpha=momentum)
            running_var.mul_(1 - momentum).add_(m2.flatten() / (count - 1), alpha=momentum)
    return out


class _ShardedNorm(torch.autograd.Function):
    """Normalization over `dims`, split across `groups` (process groups, one per mesh
    axis): it returns the output and, for running statistics, the combined mean and
    sum of squared deviations (M2).

    Forward gathers every rank's mean and M2 of its own part and combines them as Chan
    et al.'s parallel variance does: exact, with none of the cancellation of
    E[x²] − mean² where the mean is large against the spread. Backward all-reduces,
    stacked, the two sums that the input's gradient needs. It keeps the normalized
    input and rstd (in the input's dtype), and the weight. The statistics are computed
    and gathered in fp32 at least."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, dims, groups, node):
        count = math.prod([x.shape[d] for d in dims])  # elements on this rank, then combined
        # statistics in fp32 at least, as ATen's kernels: a half-precision M2 over a
        # batch's N·H·W elements overflows
        wide = x.to(torch.promote_types(x.dtype, torch.float32))
        mean = wide.mean(dims, keepdim=True)
        m2 = (wide - mean).square().sum(dims, keepdim=True)
        for group in groups:
            stats = comm.collective("all_gather", torch.stack([mean, m2]), group, node, dim=0)
            means, m2s = stats.view(group.size, 2, *mean.shape).unbind(1)
            mean = means.mean(0)
            m2 = m2s.sum(0) + count * (means - mean).square().sum(0)
            count *= group.size
        rstd = torch.rsqrt(m2 / count + eps)
        normalized = ((wide - mean) * rstd).to(x.dtype)
        rstd = rstd.to(x.dtype)
        needs_x, needs_weight = ctx.needs_input_grad[:2]
        ctx.save_for_backward(
            normalized if needs_x or needs_weight else None,
            rstd if needs_x else None,
            weight if needs_x else None,
        )
        ctx.dims, ctx.count, ctx.groups, ctx.node, ctx.dtype = dims, count, groups, node, x.dtype
        ctx.affine_shapes = [None if t is None else t.shape for t in (weight, bias)]
        ctx.mark_non_differentiable(mean, m2)
        out = normalized if weight is None else normalized * weight
        out = out if bias is None else out + bias
        return out.to(x.dtype), mean, m2  # a bf16 input with fp32 weights: bf16, as ATen

    @staticmethod
    def backward(ctx, grad, _mean, _m2):
        normalized, rstd, weight = ctx.saved_tensors
        needs_x, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        grad_x = grad_weight = grad_bias = None
        if needs_x:
            g = grad if weight is None else grad * weight
            sums = torch.stack(
                [g.sum(ctx.dims, keepdim=True), (g * normalized).sum(ctx.dims, keepdim=True)]
            )
            for group in ctx.groups:
                sums = comm.collective("all_reduce", sums, group, ctx.node, phase="backward")
            mean_g, mean_gn = (sums / ctx.count).unbind(0)
            grad_x = (rstd * (g - mean_g - normalized * mean_gn)).to(ctx.dtype)
        if needs_weight:
            grad_weight = (grad * normalized).sum_to_size(ctx.affine_shapes[0])
        if needs_bias:
            grad_bias = grad.sum_to_size(ctx.affine_shapes[1])
        return grad_x, grad_weight, grad_bias, None, None, None, None


@comm.on_mesh
def dropout(
    x,
    p: float,
    train: bool,
    *,
    shape: tuple[int, ...],
    stride: tuple[int, ...],
    dims: tuple[tuple[str, ...], ...],
    mesh: comm.BoundMesh,
):
    """Dropout whose mask is drawn for the global `shape`, laid out as the serial input
    is (`stride`), and cut to this rank's part, so the parallel program drops exactly
    what the serial one drops from the same random state (the same generator calls in
    the same order, into memory in the same order)."""
    if not train or p == 0:
        return x
    if p == 1:
        return x * torch.zeros_like(x)
    noise = torch.empty_strided(shape, stride, dtype=x.dtype, device=x.device)  # as torch's
    noise.bernoulli_(1 - p).div_(1 - p)
    return x * comm.local_part(noise, dims, mesh).clone()  # keep only the local part alive


def on_serial_strides(op: str, *args, strides: tuple, **kwargs):
    """`op` (an ATen random op run replicated, by name) on its tensor arguments laid out
    with the strides they have in the serial program (`strides`, one per tensor
    argument in order): it draws its numbers into a tensor like its input
    (`empty_like`), in the input's memory order, so a gathered (contiguous) input in
    place of a transposed view would get the serial program's numbers in another
    order."""
    order = iter(strides)

    def restrided(a):
        if not isinstance(a, torch.Tensor):
            return a
        stride = next(order)
        if a.stride() == stride:
            return a
        return torch.empty_strided(a.shape, stride, dtype=a.dtype, device=a.device).copy_(a)

    args, kwargs = pytree.tree_map(restrided, (args, kwargs))
    return _aten(op)(*args, **kwargs)


def share_of_mean(op: str, *args, scale: float, **kwargs):
    """`op` (an ATen mean, or a loss averaged over its elements, by name) on this rank's
    part as its share of the global mean (its mean × local count / global count), to
    be all-reduced."""
    return _aten(op)(*args, **kwargs) * scale


@comm.on_mesh
def keep_shard(op: str, *args, index: int, steps: tuple, node: str, mesh: comm.BoundMesh):
    """`op(*args)` (an ATen product, by name) on `args[index]` gathered by `steps` (see
    `comm.run_steps`), where autograd keeps the stored shard instead of the gathered
    operand and backward gathers it again (its collectives log as "backward"): a layer
    that saves 1/d³ of its input instead of 1/d², for one more all-gather. An autograd
    Function with the product's own derivative, so that torch.compile traces it (dynamo
    traces no saved-tensor hooks)."""
    if op not in _PRODUCT_GRADS:
        raise NotImplementedError(
            f"node '{node}': keeping the stored shard of an input of {op} is not supported "
            f"(only of {', '.join(sorted(_PRODUCT_GRADS))}): leave its regather knob off"
        )
    return _KeepShard.apply(op, index, steps, node, mesh, *args)


class _KeepShard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, index, steps, node, mesh, *args):
        shard = args[index]
        gathered = comm.forward_steps(shard, steps, node, mesh)
        ctx.op, ctx.index, ctx.steps, ctx.node, ctx.mesh = op, index, steps, node, mesh
        ctx.is_tensor = [isinstance(a, torch.Tensor) for a in args]
        ctx.constants = [None if t else a for a, t in zip(args, ctx.is_tensor)]
        ctx.save_for_backward(*[a for a in args if isinstance(a, torch.Tensor)])  # the shard
        return _aten(op)(*args[:index], gathered, *args[index + 1 :])

    @staticmethod
    def backward(ctx, grad):
        saved = iter(ctx.saved_tensors)
        args = [next(saved) if t else c for t, c in zip(ctx.is_tensor, ctx.constants)]
        needs = ctx.needs_input_grad[5:]
        args[ctx.index] = comm.forward_steps(
            args[ctx.index], ctx.steps, ctx.node, ctx.mesh, "backward"
        )
        grads = list(_PRODUCT_GRADS[ctx.op](grad, args, needs))
        del args, grad  # the gathered operand is freed before the gradient goes back
        if grads[ctx.index] is not None:  # back through the gather, as its pair would go
            grads[ctx.index] = comm.backward_steps(grads[ctx.index], ctx.steps, ctx.node, ctx.mesh)
        return None, None, None, None, None, *grads


def _aten(op: str):
    namespace, name, overload = op.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), name), overload)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def _linear_grads(g, args, needs):
    x, w, *bias = args  # x [..., k], w [n, k], bias [n]
    return (
        g @ w if needs[0] else None,
        _flat(g).T @ _flat(x) if needs[1] else None,
        *([_flat(g).sum(0) if needs[2] else None] if bias else []),
    )


def _matmul_grads(g, args, needs):
    x, w = args  # x [..., k] @ w [k, n]
    return g @ w.T if needs[0] else None, _flat(x).T @ _flat(g) if needs[1] else None


def _addmm_grads(g, args, needs):
    bias, x, w = args  # bias + x @ w, beta and alpha 1 (the rule refuses others)
    grad_bias = g.sum_to_size(bias.shape) if needs[0] else None
    return grad_bias, *_matmul_grads(g, [x, w], needs[1:])


_CONV_ARGS = ("x", "w", "bias", "stride", "padding", "dilation", "groups")
_TRANSPOSED_ARGS = ("x", "w", "bias", "stride", "padding", "output_padding", "groups", "dilation")


def _conv_grads(transposed: bool, g, args, needs):
    # conv{1,2,3}d(x, w, bias, stride, padding, dilation, groups), w [out, in / groups, …];
    # conv_transpose{1,2,3}d(x, w, bias, stride, padding, output_padding, groups,
    # dilation), w [in, out / groups, …]
    names = _TRANSPOSED_ARGS if transposed else _CONV_ARGS
    given = dict(zip(names, args))
    x, w, bias = given["x"], given["w"], given.get("bias")
    stride, padding = given.get("stride", 1), given.get("padding", 0)
    dilation, groups = given.get("dilation", 1), given.get("groups", 1)
    output_padding = given.get("output_padding", 0)
    channels = w.shape[1] * groups if transposed else w.shape[0]
    spatial = x.dim() - 2

    def expanded(v) -> list[int]:  # an int, or a list of one, is every spatial dim's
        v = list(v) if isinstance(v, (list, tuple)) else [v]
        return v * spatial if len(v) == 1 else v

    grads = torch.ops.aten.convolution_backward.default(
        g,
        x,
        w,
        [channels] if bias is not None else None,
        expanded(stride),
        expanded(padding),
        expanded(dilation),
        transposed,
        expanded(output_padding),
        groups,
        [needs[0], needs[1], bias is not None and needs[2]],
    )
    return (*grads[: len(args)], *[None] * (len(args) - 3))


# The derivative of each product keep_shard takes, given the gradient of its output,
# its arguments (the kept input gathered again) and which inputs need a gradient.
_PRODUCT_GRADS = {
    "aten.linear.default": _linear_grads,
    "aten.matmul.default": _matmul_grads,
    "aten.mm.default": _matmul_grads,
    "aten.addmm.default": _addmm_grads,
    **{f"aten.conv{d}d.default": partial(_conv_grads, False) for d in (1, 2, 3)},
    "aten.conv_transpose1d.default": partial(_conv_grads, True),
    **{f"aten.conv_transpose{d}d.input": partial(_conv_grads, True) for d in (2, 3)},
}


@comm.on_mesh
def split_to_shards(
    op: str,
    *args,
    split_dim: int,
    axes: tuple[tuple[str, ...], ...],
    mesh: comm.BoundMesh,
    **kwargs,
):
    """`op` (a split or chunk, by name) of a tensor whole along `split_dim`, piece i cut
    to this rank's part of that dim over `axes[i]`: copies, so that the whole tensor
    is freed once split. A piece left whole (no axes: it does not divide) passes its
    gradient on the first rank of the cut pieces' axes only: the whole tensor's gradient
    is a share of a sum over those axes, as the cut pieces' are, and each rank's
    copy of a whole piece's gradient is the same."""
    cut = next(a for a in axes if a)
    first = all(mesh.coordinate(axis) == 0 for axis in cut)
    pieces = []
    for piece, piece_axes in zip(_aten(op)(*args, **kwargs), axes):
        if piece_axes:
            start, length = chunk_start(piece.shape[split_dim], piece_axes, mesh)
            piece = piece.narrow(split_dim, start, length)
        piece = piece.clone(memory_format=torch.contiguous_format)
        pieces.append(piece if piece_axes or first else _without_gradient(piece))
    return pieces


def _without_gradient(x: torch.Tensor) -> torch.Tensor:
    """`x`'s values (a copy laid out as `x`), its gradient zero: still part of the
    autograd graph, so that the collectives of backward after it run on this rank as
    on the others."""
    return torch.where(torch.ones((), dtype=torch.bool, device=x.device), x.detach(), x)


@comm.on_mesh
def causal_rows(
    query, key, value, *, scale, enable_gqa, queries: int, query_axes, mesh: comm.BoundMesh
):
    """Causal attention of this rank's rows of the queries (of `queries`, split over
    `query_axes`) against every key: row i of the shard is row start + i of the whole,
    which sees keys 0 … start + i (torch's `is_causal` aligns its mask to the top left)."""
    start, rows = chunk_start(queries, query_axes, mesh)
    mask = torch.ones(rows, key.shape[-2], dtype=torch.bool, device=query.device).tril(start)
    return torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
    )


def chunk_start(size: int, axes: tuple[str, ...], mesh: comm.BoundMesh) -> tuple[int, int]:
    """(first index, length) of this rank's chunk of a dim of `size` split over `axes`
    (`Layout.shard_slices`, the one place that computes a rank's offsets)."""
    coord = {axis: mesh.coordinate(axis) for axis in axes}
    [(start, stop)] = Layout((axes,)).shard_slices((size,), mesh.mesh, coord)
    return start, stop - start


@comm.on_mesh
def vocab_embedding(
    weight,
    ids,
    *,
    vocab_size: int,
    vocab_axes: tuple[str, ...],
    padding_idx: int = -1,
    mesh: comm.BoundMesh,
):
    """Look up the ids in this rank's rows of the table; zeros for ids held elsewhere.
    The result is this rank's share of a sum over `vocab_axes`. Global row
    `padding_idx` (negative: none) gets no gradient: on the rank that holds it, it
    is the local padding row; ids held elsewhere read local row 0, masked to zero."""
    start, length = chunk_start(vocab_size, vocab_axes, mesh)
    local = ids - start
    held = (local >= 0) & (local < length)
    local_padding = padding_idx - start if 0 <= padding_idx - start < length else -1
    rows = torch.ops.aten.embedding.default(weight, local * held, local_padding)
    return rows * held.unsqueeze(-1).to(rows.dtype)
