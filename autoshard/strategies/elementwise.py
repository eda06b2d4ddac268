"""More pointwise ops, with scalar or broadcast operands: they follow their largest
input like the ones in `pointwise.py` (every argument acts element by element)."""

from torch.ops import aten

from autoshard.strategies.base import Saved
from autoshard.strategies.pointwise import follow
from autoshard.strategies.registry import (
    keeps_input,
    keeps_inputs,
    keeps_operands,
    keeps_output,
    register,
)

# Grouped by what autograd keeps for their backward (as torch's derivatives.yaml).
OTHERS = (aten.where.Scalar,)  # the condition needs no gradient, nor do the numbers
KEEP_INPUT = (
    aten.softplus.default,
    aten.erf.default,
    aten.log1p.default,
)
KEEP_OUTPUT = (aten.expm1.default,)  # grad · (result + 1)
KEEP_INPUTS = (aten.min.other, aten.max.other)  # as maximum and minimum


def _keeps_base_and_exponent(node, in_shapes, out_shape, needs_grad, mask_itemsize) -> Saved:
    """pow(base, exponent) keeps both for either gradient, and its result for the
    exponent's (result · log(base))."""
    return Saved((0, 1), output=needs_grad[1])


def _keeps_exponent_and_result(node, in_shapes, out_shape, needs_grad, mask_itemsize) -> Saved:
    """pow(number, exponent) keeps the exponent and its result (result · log(number))."""
    return Saved((0,), output=True)


register(*OTHERS)(follow)
register(*KEEP_INPUT, saved=keeps_input)(follow)
register(*KEEP_OUTPUT, saved=keeps_output)(follow)
register(*KEEP_INPUTS, saved=keeps_inputs)(follow)
register(aten.multiply.Tensor, saved=keeps_operands)(follow)  # mul
register(aten.pow.Tensor_Tensor, saved=_keeps_base_and_exponent)(follow)
register(aten.pow.Scalar, saved=_keeps_exponent_and_result)(follow)
# The gradient of the tensor operand is where(condition, grad, 0): the condition is kept.
register(aten.where.ScalarOther, aten.where.ScalarSelf, saved=keeps_input)(follow)
