"""Losses over scores whose class dim is split across ranks, computed without gathering
it: per row, the maximum, the sum of exponentials and the target's score (with its
class weight, and the sums label smoothing needs) are reduced over the class axes, a
few numbers per row; a mean or sum over the rows is reduced over the axes that split
them. Scores are [rows, classes] or torch's other forms ([classes]; [N, classes,
d1, ...]), targets class indices, `ignore_index` rows count for nothing.

    loss = F.cross_entropy(logits, target)     # logits [tokens, vocab], vocab over b
    # each rank: its vocabulary's sum of exponentials and target logit, all-reduced
    # over b; the sum of the losses with the token count, all-reduced over the token axes
"""

from __future__ import annotations

import math

import torch

from autoshard.runtime import comm
from autoshard.runtime.ops import chunk_start

MEAN, SUM = 1, 2  # ATen's reduction codes (0: none)


def _rows(scores: torch.Tensor, class_dim: int) -> torch.Tensor:
    """`scores` as [rows, classes]: the class dim last, the others flattened."""
    if class_dim != scores.dim() - 1:
        scores = scores.movedim(class_dim, -1)
    return scores.reshape(-1, scores.shape[-1])


def _held(target: torch.Tensor, start: int, length: int):
    """Per row, the target's index among this rank's classes (0 where another rank holds
    it), as a [rows, 1] index, and whether this rank holds it."""
    local = target - start
    held = (local >= 0) & (local < length)
    return (local * held).unsqueeze(-1), held


def _reduced(total, count, reduction: int, groups, node: str):
    """The sum of every rank's `total`, or for a mean its quotient by the sum of every
    rank's `count` (which travels with it, in one call per axis)."""
    if reduction == SUM:
        return comm.summed(total, groups, node)
    total, count = comm.summed(torch.stack([total, count]), groups, node).unbind(0)
    return total / count.detach()


def _per_row(loss, row_weight, shape, reduction: int, groups, node: str):
    """The rows' losses as `shape` (reduction "none"), or their sum or mean: each row
    weighs `row_weight` in a mean."""
    if reduction not in (MEAN, SUM):
        return loss.reshape(shape)
    return _reduced(loss.sum(), row_weight.sum(), reduction, groups, node)


def _shifted(logits, groups, node: str):
    """The logits less each row's maximum over every rank's classes (no gradient: it only
    keeps the exponentials finite), and their exponentials."""
    row_max = logits.max(dim=-1).values
    for group in groups:
        row_max = comm.all_reduce_max(row_max, group, node)
    shifted = logits - row_max.unsqueeze(-1)
    return shifted, shifted.exp()


def _total(sums, groups, node: str):
    """The sum of every rank's `sums` over `groups`, outside autograd (a Function's own
    backward needs no collective)."""
    for group in groups:
        sums = comm.collective("all_reduce", sums, group, node)
    return sums


class _CrossEntropyRows(torch.autograd.Function):
    """Per row of [rows, classes] logits whose classes are split over `groups` (this
    rank's `length` classes start at `start`, of `classes`), torch's cross-entropy of
    the target class, weighted by the class `weight` and smoothed by `smoothing`; and
    the row's weight in a mean (its target's class weight, or 1; 0 for ignored rows).
    Backward needs no collective, and keeps the local softmax and a few values per row."""

    @staticmethod
    def forward(
        ctx, logits, target, weight, start, length, classes, smoothing, ignore, groups, node
    ):
        shifted, probs = _shifted(logits, groups, node)
        index, held = _held(target, start, length)
        parts = {"exp": probs.sum(-1), "target": shifted.gather(-1, index).squeeze(-1) * held}
        if weight is not None:
            parts["weight"] = weight.gather(0, index.squeeze(-1)) * held
        if smoothing:  # the sum over classes of (weighted) shifted logits, and of weights
            parts["smooth"] = shifted.sum(-1) if weight is None else shifted @ weight
            if weight is not None:
                parts["weights"] = weight.sum().expand(len(target))
        sums = torch.stack(list(parts.values()))
        sums = _total(sums, groups, node)
        sums = dict(zip(parts, sums.unbind(0)))
        valid = target != ignore
        row_weight = sums["weight"] * valid if weight is not None else valid.to(logits.dtype)
        log_sum = sums["exp"].log()
        loss = row_weight * (log_sum - sums["target"])
        coefficient = None  # of the softmax in the gradient, where not the row weight
        if smoothing:
            weights = sums["weights"] if weight is not None else classes
            uniform = (weights * log_sum - sums["smooth"]) * valid
            loss = (1 - smoothing) * loss + smoothing / classes * uniform
            if weight is not None:
                coefficient = (1 - smoothing) * row_weight + smoothing / classes * weights * valid
        probs /= sums["exp"].unsqueeze(-1)  # the softmax of this rank's classes
        ctx.save_for_backward(
            probs,
            index,
            held,
            valid,
            row_weight if weight is not None else None,
            coefficient,
            weight if smoothing else None,
        )
        ctx.smoothing, ctx.classes = smoothing, classes
        ctx.mark_non_differentiable(row_weight)
        return loss, row_weight

    @staticmethod
    def backward(ctx, grad, _):
        probs, index, held, valid, row_weight, coefficient, weight = ctx.saved_tensors
        smoothing = ctx.smoothing
        if row_weight is None:
            row_weight = valid.to(probs.dtype)
        if coefficient is None:  # (1 - s) w + s w: the row weight
            coefficient = row_weight
        out = probs * (grad * coefficient).unsqueeze(-1)
        out.scatter_add_(-1, index, -(grad * (1 - smoothing) * row_weight * held).unsqueeze(-1))
        if smoothing:
            spread = (grad * valid * (smoothing / ctx.classes)).unsqueeze(-1)
            out -= spread if weight is None else spread * weight
        return out, *([None] * 9)


class _SoftCrossEntropyRows(torch.autograd.Function):
    """Per row of [rows, classes] logits whose classes are split over `groups`, torch's
    cross-entropy against class probabilities `target` (split alike), weighted by the
    class `weight` and smoothed by `smoothing`: ``lse·A - B`` with ``A = Σ w·t`` and
    ``B = Σ w·t·(logit - max)`` per row, reduced with the sum of exponentials."""

    @staticmethod
    def forward(ctx, logits, target, weight, classes, smoothing, groups, node):
        shifted, probs = _shifted(logits, groups, node)
        weighted = _smoothed_weighted(target, weight, classes, smoothing)
        sums = torch.stack([probs.sum(-1), weighted.sum(-1), (weighted * shifted).sum(-1)])
        sums = _total(sums, groups, node)
        sum_exp, target_weight, target_logit = sums.unbind(0)
        log_sum = sum_exp.log()
        probs /= sum_exp.unsqueeze(-1)
        # the target's gradient reads the log-softmax, kept only where it is needed
        log_probs = shifted - log_sum.unsqueeze(-1) if ctx.needs_input_grad[1] else None
        # a copy: a view would keep all three sums
        ctx.save_for_backward(probs, target, weight, target_weight.clone(), log_probs)
        ctx.smoothing, ctx.classes = smoothing, classes
        return log_sum * target_weight - target_logit

    @staticmethod
    def backward(ctx, grad):
        probs, target, weight, target_weight, log_probs = ctx.saved_tensors
        weighted = _smoothed_weighted(target, weight, ctx.classes, ctx.smoothing)
        grad = grad.unsqueeze(-1)
        grad_logits = grad * (probs * target_weight.unsqueeze(-1) - weighted)
        grad_target = None
        if log_probs is not None:
            grad_target = -(1 - ctx.smoothing) * grad * log_probs
            if weight is not None:
                grad_target = grad_target * weight
        return grad_logits, grad_target, *([None] * 5)


def _smoothed_weighted(target, weight, classes: int, smoothing: float):
    """The probabilities smoothed toward the uniform, times the class weights."""
    if smoothing:
        target = target * (1 - smoothing) + smoothing / classes
    return target if weight is None else target * weight


@comm.on_mesh
def cross_entropy(
    logits,
    target,
    class_weight,
    *,
    classes: int,
    class_dim: int,
    class_axes: tuple[str, ...],
    row_axes: tuple[str, ...],
    node: str,
    ignore_index: int = -100,
    reduction: int = MEAN,
    label_smoothing: float = 0.0,
    mesh: comm.BoundMesh,
):
    """torch's cross-entropy of logits whose class dim `class_dim` is split over
    `class_axes` and rows over `row_axes`, against class indices or probabilities (split
    as the logits)."""
    rows, row_groups = _rows(logits, class_dim), mesh.groups(row_axes)
    if target.is_floating_point():
        loss = _SoftCrossEntropyRows.apply(
            rows,
            _rows(target, class_dim),
            class_weight,
            classes,
            label_smoothing,
            mesh.groups(class_axes),
            node,
        )
        shape = target.shape[:class_dim] + target.shape[class_dim + 1 :]
        return _per_row(loss, torch.ones_like(loss), shape, reduction, row_groups, node)
    start, length = chunk_start(classes, class_axes, mesh)
    loss, row_weight = _CrossEntropyRows.apply(
        rows,
        target.reshape(-1),
        class_weight,
        start,
        length,
        classes,
        label_smoothing,
        ignore_index,
        mesh.groups(class_axes),
        node,
    )
    return _per_row(loss, row_weight, target.shape, reduction, row_groups, node)


@comm.on_mesh
def chunked_cross_entropy(
    x,
    weight,
    target,
    class_weight,
    *,
    chunks: int,
    dim: int,
    steps: tuple,
    head: str,
    dtype: torch.dtype,
    classes: int,
    class_dim: int,
    class_axes: tuple[str, ...],
    row_axes: tuple[str, ...],
    node: str,
    ignore_index: int = -100,
    reduction: int = MEAN,
    label_smoothing: float = 0.0,
    mesh: comm.BoundMesh,
):
    """`cross_entropy` of the [tokens, classes] logits ``linear(x, weight)`` after its
    output collectives `steps` (`comm.run_steps`, for the linear `head`), computed over
    the tokens in `chunks` pieces one after the other, so that only one piece of the
    logits-sized buffers lives at a time, in forward and in backward (autograd runs the
    pieces' backwards one after another, the last first). The pieces cut `x`'s dim
    `dim`: the same rows of each block its reduce-scatters over that dim scatter, so
    that the collectives leave each rank, piece by piece, the rows it holds unchunked;
    the target is cut alike. The sum over tokens is reduced once, over `row_axes`."""
    start, length = chunk_start(classes, class_axes, mesh)
    scattered = [kw["axis"] for kind, kw in steps if kind == "reduce_scatter" and kw["dim"] == dim]
    blocks = math.prod([mesh.axes[axis].size for axis in scattered])
    shape = x.shape
    pieces = x.reshape(*shape[:dim], blocks, chunks, -1, *shape[dim + 1 :])
    targets = None
    total = count = None
    for c in range(chunks):
        piece = pieces.select(dim + 1, c).reshape(*shape[:dim], -1, *shape[dim + 1 :])
        logits = comm.run_steps(torch.ops.aten.linear.default(piece, weight), steps, head, mesh)
        if targets is None:  # the target as the logits' rows, all pieces side by side
            rows = list(logits.shape[:-1])
            rows[dim] *= chunks
            targets = target.reshape(rows).chunk(chunks, dim)
        loss, row_weight = _CrossEntropyRows.apply(
            logits.reshape(-1, logits.shape[-1]).to(dtype),
            targets[c].reshape(-1),
            class_weight,
            start,
            length,
            classes,
            label_smoothing,
            ignore_index,
            mesh.groups(class_axes),
            node,
        )
        total = loss.sum() if total is None else total + loss.sum()
        count = row_weight.sum() if count is None else count + row_weight.sum()
    return _reduced(total, count, reduction, mesh.groups(row_axes), node)


def _nll_rows(scores, target, weight, start, length, ignore, groups, node):
    """Per row of [rows, classes] log-probabilities whose classes are split over
    `groups` (as `_CrossEntropyRows`), torch's negative log-likelihood of the target
    class, weighted by the class `weight`; and the row's weight in a mean."""
    index, held = _held(target, start, length)
    picked = scores.gather(-1, index).squeeze(-1) * held
    valid = target != ignore
    if weight is None:
        picked, row_weight = comm.summed(picked, groups, node), valid.to(picked.dtype)
    else:
        weights = weight.gather(0, index.squeeze(-1)) * held
        picked, weights = comm.summed(torch.stack([picked, weights]), groups, node).unbind(0)
        row_weight = weights.detach() * valid
    return -picked * row_weight, row_weight


@comm.on_mesh
def nll_loss(
    scores,
    target,
    class_weight,
    *,
    classes: int,
    class_dim: int,
    class_axes: tuple[str, ...],
    row_axes: tuple[str, ...],
    node: str,
    ignore_index: int = -100,
    reduction: int = MEAN,
    mesh: comm.BoundMesh,
):
    """torch's negative log-likelihood of log-probabilities whose class dim `class_dim`
    is split over `class_axes` and rows over `row_axes`: each row's target score (and
    class weight) picked by the rank that holds its class, summed over `class_axes`."""
    start, length = chunk_start(classes, class_axes, mesh)
    loss, row_weight = _nll_rows(
        _rows(scores, class_dim),
        target.reshape(-1),
        class_weight,
        start,
        length,
        ignore_index,
        mesh.groups(class_axes),
        node,
    )
    return _per_row(loss, row_weight, target.shape, reduction, mesh.groups(row_axes), node)
