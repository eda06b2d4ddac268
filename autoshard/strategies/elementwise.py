"""More pointwise ops, with scalar or broadcast operands: they follow their largest
input like the ones in `pointwise.py` (every argument acts element by element)."""

from torch.ops import aten

from autoshard.strategies.pointwise import follow
from autoshard.strategies.registry import register

ELEMENTWISE = (
    aten.where.ScalarOther,
    aten.where.ScalarSelf,
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
