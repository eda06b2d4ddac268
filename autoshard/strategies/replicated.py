"""Small factory and mask ops (arange, full, tril, cumsum on ids, index, the outer
product that builds rotary tables):
they run replicated, on purpose and without a warning; their consumers take the
part they need for free. (Comparisons and logical ops, which build masks from
these, are pointwise: they follow their inputs, so a mask whose readers all
slice it is built as that slice, `autoshard.planning.planner`.)"""

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
)

register(*REPLICATED)(replicated_fallback)
