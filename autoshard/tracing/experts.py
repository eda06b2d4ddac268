"""Mixture-of-experts products as autoshard plans them.

Hugging Face's experts (transformers ≥ 5) multiply tokens sorted by expert with
each expert's weight through ``torch.ops.transformers.grouped_mm_fallback(x [S, H],
w [E, H, O], offs [E])``, the weight a transpose of the parameter [E, O, H].
`grouped_mm_nt` (the op ``torch.ops.autoshard.grouped_mm_nt``, so that plans name
it the same in every process) is that product on the parameter itself, so that
the rule for it (`strategies/experts.py`) decides how the parameter is stored.
It is composite: autograd differentiates the product it is made of.

    grouped_mm_nt(x, weight, offs)   # == grouped_mm_fallback(x, weight.transpose(1, 2), offs)
"""

from __future__ import annotations

import torch

GROUPED_MM = "transformers.grouped_mm_fallback.default"


_LIBRARY = torch.library.Library("autoshard", "FRAGMENT")
_LIBRARY.define("grouped_mm_nt(Tensor x, Tensor weight, Tensor offs) -> Tensor")


def _grouped_mm_nt(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows ``offs[e-1]:offs[e]`` of `x` times ``weight[e]ᵀ``, for every expert e."""
    return torch.ops.transformers.grouped_mm_fallback(x, weight.transpose(1, 2), offs)


_LIBRARY.impl("grouped_mm_nt", _grouped_mm_nt, "CompositeImplicitAutograd")
grouped_mm_nt = torch.ops.autoshard.grouped_mm_nt.default
