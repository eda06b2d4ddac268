"""Small factory and mask ops (arange, full, tril, cumsum on ids, index, comparisons,
the outer product that builds rotary tables):
they run replicated, on purpose and without a warning; their consumers take the
part they need for free."""

from torch.ops import aten

from autoshard.strategies.base import replicated_fallback
from autoshard.strategies.registry import register

REPLICATED = (
    aten.arange.default,
    aten.arange.start,
    aten.arange.start_step,
    aten.full.default,
    aten.ones.default,
    aten.zeros.default,
    aten.empty.memory_format,
    aten.scalar_tensor.default,
    aten.lift_fresh_copy.default,  # a constant made in forward: torch.tensor(...)
    aten.new_ones.default,
    aten.new_zeros.default,
    aten.new_full.default,
    aten.new_empty.default,
    aten.ones_like.default,
    aten.zeros_like.default,
    aten.full_like.default,
    aten.tril.default,
    aten.triu.default,
    aten.cumsum.default,
    aten.outer.default,
    aten.diff.default,
    aten.index.Tensor,
    aten.gather.default,
    aten.pad.default,
    aten.constant_pad_nd.default,
    aten.eq.Tensor,
    aten.eq.Scalar,
    aten.ne.Tensor,
    aten.ne.Scalar,
    aten.le.Tensor,
    aten.le.Scalar,
    aten.lt.Tensor,
    aten.lt.Scalar,
    aten.ge.Tensor,
    aten.ge.Scalar,
    aten.gt.Tensor,
    aten.gt.Scalar,
    aten.__and__.Tensor,
    aten.__or__.Tensor,
    aten.bitwise_and.Tensor,
    aten.bitwise_or.Tensor,
    aten.logical_not.default,
    aten.bitwise_not.default,
)

register(*REPLICATED)(replicated_fallback)
