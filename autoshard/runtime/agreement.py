"""Do all ranks hold the same thing? Exact checksums of tensors, compared across ranks.

autoshard's contract is that every rank passes the same full global inputs and
holds the same weights; a rank that does not (a per-rank batch from a
DistributedSampler, a model built under another seed) would silently compute a
mixture. `disagreements` all-gathers one small record per rank (the plan's
hash and a checksum per tensor) in one collective and names what differs.

    >>> checksum(torch.arange(4.0)) == checksum(torch.arange(4.0))
    True
    >>> checksum(torch.arange(4.0)) == checksum(torch.arange(4.0).flip(0))
    False
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 1 << 22  # elements per pass: bounds the int64 copy a checksum makes
_MASK = (1 << 64) - 1


def checksum(tensor: torch.Tensor) -> tuple:
    """(shape, dtype, a 64-bit sum of the element bits times odd position weights).

    Equal tensors give equal checksums on any device; changing any one element (or
    moving it) changes the sum, since an odd weight is invertible modulo 2⁶⁴. Meta
    tensors have no values and checksum to 0."""
    described = (tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))
    flat = tensor.detach().reshape(-1)
    if flat.device.type == "meta" or not flat.numel():
        return (*described, 0)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    bits = flat.contiguous().view(_BITS[flat.element_size()])
    total = 0
    for start in range(0, bits.numel(), _CHUNK):
        chunk = bits[start : start + _CHUNK].to(torch.int64)
        weights = torch.arange(start, start + chunk.numel(), device=chunk.device) * 2 + 1
        total = (total + int((chunk * weights).sum())) & _MASK  # int64 sums wrap: exact mod 2⁶⁴
    return (*described, total)


def gathered(record) -> list:
    """`record` from every rank of the default process group, by rank (one collective)."""
    records = [None] * dist.get_world_size()
    dist.all_gather_object(records, record)
    return records


def differing(records: list, key: int) -> dict[str, list[int]]:
    """Per tensor name in `records[r][key]` (a dict name → checksum), the ranks whose
    value differs from rank 0's, for the names where any does."""
    out = {}
    for name, mine in records[0][key].items():
        ranks = [r for r, record in enumerate(records) if record[key].get(name) != mine]
        if ranks:
            out[name] = ranks
    return out


def ranks_text(ranks: list[int]) -> str:
    return "rank " + str(ranks[0]) if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
