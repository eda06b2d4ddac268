"""Where a loss may run over its tokens in pieces: the choice the solver prices for
the unit after the last block.

A language model's largest activation is often its logits: under a 3D plan the
lm-head's local product before its reduce-scatter holds T·V/d² values per rank, and
the loss's gradient as many again in backward. Run the head, the views between, and
the vocabulary-parallel loss over the tokens in k pieces, one after the other, and
only 1/k of those buffers lives at a time; what is kept for backward is the same, and
each piece pays the latency of its own collectives (`autoshard.planning.plan.ChunkedLoss`).

    >>> from pathlib import Path
    >>> from autoshard.mesh import Mesh
    >>> from autoshard.planning.planner import plan_graph
    >>> from autoshard.testing import load_factory
    >>> from autoshard.tracing.trace import trace
    >>> gpt = Path(__file__).parents[2] / "examples" / "gpt.py"
    >>> traced = trace(*load_factory(f"{gpt}:gpt")(seq=16))
    >>> plan = plan_graph(traced, Mesh.from_shape((2, 2, 2)), "3d")
    >>> [(c.head, c.loss, c.chunks, c.dim) for c in chunkings(traced, plan)]
    [('linear_12', 'cross_entropy_loss', 4, 1), ('linear_12', 'cross_entropy_loss', 16, 1)]
"""

from __future__ import annotations

import math

from torch.ops import aten

from autoshard.planning.plan import ChunkedLoss, NodePlan, Plan
from autoshard.runtime import losses
from autoshard.strategies.loss import CROSS_ENTROPY
from autoshard.tracing.canonical import TRACE_CHECK
from autoshard.tracing.schema import argument
from autoshard.tracing.trace import Traced, tensor_inputs

# The piece counts the solver chooses from: a ladder, since each count is an option of
# the unit after the blocks in every variant, and more options make the integer program
# harder near a tight budget (LLaMA-3 70B on 8×8×8 at 6.5 GiB: 42 s with these three,
# 90 s with 2, 4, …, 64).
CHUNKS = (4, 16, 64)
_BETWEEN = {  # what may stand between the head and the loss: views and casts
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.flatten.using_ints,
    aten.alias.default,
    aten.to.dtype,
    aten._to_copy.default,
    aten.permute.default,  # only the classes moved to dim 1 (`_moves_classes`)
}


def chunkings(traced: Traced, plan: Plan, counts=CHUNKS) -> list[ChunkedLoss]:
    """Every way `plan` allows of running a loss over its tokens in pieces: for each
    vocabulary-parallel cross-entropy of [tokens, classes] logits (or of logits whose
    classes were moved to dim 1), reduced to a sum or mean, whose logits a bias-free
    linear makes (through views, casts and that move only, read by nothing else), each
    of `counts` that some token dim of the head's product divides."""
    out = []
    for name, placed in plan.nodes.items():
        if placed.strategy.lowering is not CROSS_ENTROPY or not _summed_rows(traced.nodes[name]):
            continue
        found = _head(traced, plan, name)
        if found is None:
            continue
        head, between = found
        for chunks in counts:
            dim = _dim(traced, plan, plan.nodes[head], chunks)
            if dim is not None:
                out.append(ChunkedLoss(head, between, name, chunks, dim))
    return out


def _summed_rows(loss) -> bool:
    """Whether the loss sums (or averages) losses of [tokens, classes] rows against
    class indices, as the pieces' are added: logits [tokens, classes], or [N, classes,
    d1, …] that are [N, d1, …, classes] with the classes moved to dim 1."""
    logits, target = (v.meta["val"] for v in tensor_inputs(loss)[:2])
    summed = argument(loss, "reduction") in (losses.MEAN, losses.SUM)
    rows = logits.dim() == 2 or logits.dim() > 2 and logits.movedim(1, -1).is_contiguous()
    return rows and not target.is_floating_point() and summed


def _moves_classes(node) -> bool:
    """Whether `node` permutes [N, d1, …, classes] to [N, classes, d1, …]."""
    n = node.meta["val"].dim()
    return list(node.args[1]) == [0, n - 1, *range(1, n - 1)]


def _head(traced: Traced, plan: Plan, loss: str) -> tuple[str, tuple[str, ...]] | None:
    """The linear whose output reaches `loss`'s logits, and the nodes between, or None
    where anything else stands between or reads them."""
    between: list[str] = []
    value = tensor_inputs(traced.nodes[loss])[0]
    reader = loss
    if plan.nodes[loss].input_steps[0]:
        return None  # the logits are converted: the loss reads no head's product as it is
    while True:
        placed = plan.nodes.get(value.name)
        readers = [u for u in value.users if u.target != TRACE_CHECK]
        if placed is None or [u.name for u in readers] != [reader]:
            return None
        if value.target is aten.linear.default:
            break
        if value.target not in _BETWEEN or any(placed.input_steps) or placed.output_steps:
            return None
        if value.target is aten.permute.default and not _moves_classes(value):
            return None
        between.insert(0, value.name)
        reader, value = value.name, tensor_inputs(value)[0]
    strategy = placed.strategy  # the head's
    steps_ok = all(s.kind in ("reduce_scatter", "all_reduce") for s in placed.output_steps)
    alone = (value.name, 0) not in plan.conversions  # its gathered input is its own
    if strategy.epilogue or strategy.regather or not steps_ok or not alone:
        return None
    return value.name, tuple(between)


def _dim(traced: Traced, plan: Plan, head: NodePlan, chunks: int) -> int | None:
    """The token dim of the head's product to cut into `chunks` pieces: the first whose
    local size each block of its reduce-scatters divides into `chunks` (a piece is
    then that many rows of every block, so that the collectives leave each rank the
    rows it holds unchunked), preferring one where the pieces are views of the input;
    elsewhere they are copies, allowed only where the input is a gathered copy already."""
    x = tensor_inputs(traced.nodes[head.name])[0]
    local = head.strategy.inputs[0].local_shape(tuple(x.meta["val"].shape), plan.mesh)
    fits = []
    for dim in range(len(local) - 1):
        blocks = math.prod(
            s.group_size for s in head.output_steps if s.kind == "reduce_scatter" and s.dim == dim
        )
        if local[dim] % (blocks * chunks):
            continue
        copies = blocks > 1 or math.prod(local[:dim]) > 1
        if not copies:
            return dim
        if head.input_steps[0]:
            fits.append(dim)
    return fits[0] if fits else None
