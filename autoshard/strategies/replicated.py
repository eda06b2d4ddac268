"""Small factory and mask ops (arange, full, tril, cumsum on ids, index, the outer
product that builds rotary tables):
they run replicated, on purpose and without a warning; their consumers take the
part they need for free. (Comparisons and logical ops, which build masks from
these, are pointwise: they follow their inputs, so a mask whose readers all
slice it is built as that slice, `autoshard.planning.planner`.)"""

from torch.ops import aten

from autoshard.strategies.base import Saved, replicated_fallback
from autoshard.strategies.registry import itemsize, numel, register
from autoshard.tracing.trace import tensor_inputs

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
    aten.pad.default,
    aten.constant_pad_nd.default,
)


def _keeps_indices(node, in_shapes, out_shape, needs_grad, mask_itemsize) -> Saved:
    """x[i, j, ...] keeps its index tensors, to put the gradient back where they read."""
    return Saved(tuple(range(1, len(in_shapes))))


def _keeps_input_and_index(node, in_shapes, out_shape, needs_grad, mask_itemsize) -> Saved:
    """gather(x, dim, index) keeps the index and x itself (its backward reads x's sizes
    through the tensor)."""
    return Saved((0, 1))


register(*REPLICATED)(replicated_fallback)
register(aten.index.Tensor, saved=_keeps_indices)(replicated_fallback)
register(aten.gather.default, saved=_keeps_input_and_index)(replicated_fallback)
# No rule (they run replicated, with a warning): what they keep.
# index_fill(x, dim, index, value) keeps the index (grad.index_fill(dim, index, 0)).
register(
    aten.index_fill.int_Scalar,
    aten.index_fill_.int_Scalar,
    aten.index_fill.int_Tensor,
    aten.index_fill_.int_Tensor,
    saved=_keeps_indices,
)()


def _keeps_norms(node, in_shapes, out_shape, needs_grad, mask_itemsize) -> Saved:
    """_weight_norm(v, g) = v · g / ‖v‖ (a weight-norm parametrization) keeps v and g
    (parameters) and a new tensor of g's size: the norms (CUDA's fused kernel) or
    g / ‖v‖ (the CPU's composite)."""
    return Saved((0, 1), extra_bytes=numel(in_shapes[1]) * itemsize(node))


register(aten._weight_norm.default, saved=_keeps_norms)()


def _keeps_real_input(node, in_shapes, out_shape, needs_grad, mask_itemsize) -> Saved:
    """A transform of a real input over one set of dims as one real-to-complex FFT keeps
    that input (its backward reads it); of a complex input, it keeps nothing (fft2 and
    fftn of a real input convert it to complex first: not listed)."""
    return Saved() if tensor_inputs(node)[0].meta["val"].is_complex() else Saved((0,))


register(
    aten.fft_fft.default,
    aten.fft_ifft.default,
    aten.fft_rfft.default,
    aten.fft_rfft2.default,
    aten.fft_rfftn.default,
    aten.fft_ihfft.default,
    saved=_keeps_real_input,
)()
