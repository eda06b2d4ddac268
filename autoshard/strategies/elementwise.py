"""More pointwise ops, with scalar or broadcast operands: they follow their largest
input like the ones in `pointwise.py` (every argument acts element by element)."""

from torch.ops import aten

from autoshard.strategies.pointwise import follow
from autoshard.strategies.registry import keeps_input, register

ELEMENTWISE = (
    aten.where.Scalar,
    aten.min.other,
    aten.max.other,
    aten.pow.Tensor_Tensor,
    aten.pow.Scalar,
    aten.multiply.Tensor,
    aten.softplus.default,
    aten.erf.default,
    aten.log1p.default,
    aten.expm1.default,
)

register(*ELEMENTWISE)(follow)
# The gradient of the tensor operand is where(condition, grad, 0): the condition is kept.
register(aten.where.ScalarOther, aten.where.ScalarSelf, saved=keeps_input)(follow)
