"""Gradient clipping by the global norm over every rank's shards.

`torch.nn.utils.clip_grad_norm_` on a rank's shards would see only part of each
gradient, and a replicated gradient once per rank that holds it. Here each rank
adds up its shards' |g|^p, dividing each by how many ranks hold a copy of that
shard, so one all-reduce over the world gives exactly the serial model's sum:

    loss = parallel(idx, targets)
    loss.backward()
    norm = autoshard.clip_grad_norm_(parallel, max_norm=1.0)   # the serial model's norm
    optimizer.step()

The scale applied to every shard is the one the serial model's clipping applies.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from autoshard.layout import Layout


def clip_grad_norm_(
    module, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
) -> torch.Tensor:
    """Scale the gradients of `module` (a ParallelModule) so that their global
    `norm_type`-norm is at most `max_norm`; return that norm before clipping (the
    same on every rank). A collective: call it on every rank."""
    norm_type = float(norm_type)
    if norm_type <= 0 and not math.isinf(norm_type):
        raise ValueError(f"norm_type must be positive or inf, got {norm_type}")
    mesh = module.plan.mesh
    grads, copies = [], []  # copies: how many ranks hold the same shard
    for fqn, param in module.program.named_parameters():
        if param.grad is not None:
            layout = module.plan.storage.get(fqn) or Layout.replicated(param.ndim)
            grads.append(param.grad)
            copies.append(mesh.world_size // mesh.count(layout.sharded_axes))
    device = grads[0].device if grads else torch.device("cpu")
    if math.isinf(norm_type):
        local = max((g.detach().abs().max().double() for g in grads if g.numel()), default=None)
        total = torch.zeros((), dtype=torch.float64, device=device) if local is None else local
        dist.all_reduce(total, op=dist.ReduceOp.MAX)
        norm = total
    else:
        total = torch.zeros((), dtype=torch.float64, device=device)
        for g, n in zip(grads, copies):
            total += g.detach().double().abs().pow(norm_type).sum() / n
        dist.all_reduce(total)
        norm = total.pow(1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(norm):
        raise RuntimeError(
            f"the total {norm_type}-norm of the gradients is {norm.item()}: set "
            "error_if_nonfinite=False to clip anyway"
        )
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(scale.to(g.dtype))
    dtype = grads[0].dtype if grads else torch.float32
    return norm.to(dtype)
