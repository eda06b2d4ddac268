"""Linear layers: the 3D families (M, K, N over the mesh axes), and replicated.

For ``Y = X·Wᵀ + b`` with X [*tokens, H] and W [O, H], each mesh axis takes
one role: M splits a token dim, K splits H (the contraction), N splits O.
The local product is a pending sum over K.

- ``"3d"`` (all-gather / reduce-scatter): X is stored with tokens split over
  M and N and gathered over N before the product; the output is
  reduce-scattered over K onto a token dim, so every activation holds 1/N of
  the tensor. W is stored split over K, N and M and gathered over M.
- ``"3d-allreduce"``: X is stored tokens over M, features over K,
  replicated over N; the output is all-reduced over K. W is stored split
  over K and N; its gradient is all-reduced over M.

Either family may store its weights the other way (the weight knob,
`Strategy.split_weight`): a candidate exists for each, the family's own
first; the planner takes the one the solver asks for.
- ``"replicated"``: every rank computes the whole layer.
- ``"dp"``: M is every axis (the batch split everywhere, weights whole).
- ``"megatron"``: M is the data-parallel axes, and the tensor-parallel axis is N
  (column-parallel) for a layer whose input arrives whole over it, K (row-parallel)
  for one whose input arrives with its features split over it: q, k, v, fc1, gate
  and up are column-parallel, the output projection, fc2 and down row-parallel, and
  the row-parallel output is all-reduced back to whole (Megatron's g; the f, the
  column-parallel input's gradient all-reduced, is the gradient of an input that
  feeds split work). Both the "dp" and "megatron" layers all-reduce like
  ``"3d-allreduce"``, and split the batch over their M axes outer dims first.

Which axis takes which role is left to the planner: each permutation is a
candidate, so consecutive linears swap K and N where that saves a collective.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from itertools import permutations, product

import sympy
from torch.ops import aten

from autoshard.formula import Formula
from autoshard.layout import Layout
from autoshard.strategies.base import (
    NAMED,
    Context,
    Saved,
    Strategy,
    Unclaimed,
    all_reduces,
    batch_dims,
    make,
    parallel_axes,
    replicated_fallback,
)
from autoshard.strategies.pointwise import aligned
from autoshard.strategies.registry import keeps_operands, numel, register
from autoshard.tracing.schema import argument

M, K, N = sympy.symbols("M K N", positive=True, integer=True)
MATMUL_FLOPS = Formula(2 * M * K * N, M, K, N)


@dataclass(frozen=True)
class Product:
    """The cost of a matrix product whose left operand is tensor input `left` and
    right operand the next one (addmm(bias, x, w): left = 1)."""

    left: int

    def flops(self, node, in_shapes, out_shape) -> float:
        """2·M·K·N on the local shapes."""
        k = in_shapes[self.left][-1]
        cols = out_shape[-1] if out_shape else 1
        return MATMUL_FLOPS(numel(out_shape) // cols, k, cols)

    def backward(self, node, needs_grad) -> float:
        """One gradient product per matrix operand that needs a gradient (a linear: 2×
        with the input's gradient, 1× for a first layer whose input needs none)."""
        return float(sum(needs_grad[self.left : self.left + 2]))

    def saved(self, node, in_shapes, out_shape, needs_grad, mask_itemsize) -> Saved:
        """Each matrix operand, if the other one needs a gradient (a linear keeps its
        input for the weight's gradient and its weight for the input's)."""
        pairs = ((self.left, self.left + 1), (self.left + 1, self.left))
        return Saved(tuple(i for i, other in pairs if needs_grad[other]))

    def facts(self) -> dict:
        """The registry's keywords for such a product."""
        return {"flops": self.flops, "backward": self.backward, "saved": self.saved}


def _layout(ndim: int, placed: list[tuple[int, tuple[str, ...]]], partial=()) -> Layout:
    dims = [()] * ndim
    for d, axes in placed:
        dims[d] = dims[d] + tuple(axes)
    return Layout(tuple(dims), tuple(partial))


def matmul_candidates(
    ctx: Context, x: int, w: int, bias: int | None, w_out_dim: int, w_in_dim: int
) -> list[Strategy]:
    """Candidates for ``X @ W`` with X = input `x`, weight input `w` (its output dim
    `w_out_dim`, contraction dim `w_in_dim`) and an optional bias input: one row,
    broadcast over the others (not a bias per row, ``addmm(b[M, N], x, w)``)."""
    shapes = tuple(ctx.shape(i) for i in range(len(ctx.inputs)))
    columns = ctx.out_shape[-1]
    if bias is not None and (shapes[bias][-1:] != (columns,) or numel(shapes[bias]) != columns):
        raise Unclaimed(f"a bias of shape {list(shapes[bias])}")
    return list(
        _candidates(
            ctx.family,
            ctx.mesh,
            shapes,
            ctx.out_shape,
            ctx.layout(x),
            x,
            w,
            bias,
            w_out_dim,
            w_in_dim,
        )
    )


@functools.lru_cache(maxsize=4096)  # identical blocks ask for identical layers
def _candidates(family, mesh, shapes, out_shape, incoming, x, w, bias, w_out_dim, w_in_dim):
    x_nd = len(shapes[x])
    out_nd = len(out_shape)
    feat = x_nd - 1
    n_inputs = len(shapes)
    bias_nd = len(shapes[bias]) if bias is not None else 1  # [N], or one row [1, N]

    def assemble(family, x_in, w_in, w_store, out, stored, bias_in, detail, split_weight=None):
        inputs = [None] * n_inputs
        storage = [None] * n_inputs
        inputs[x], inputs[w] = x_in, w_in
        storage[w] = w_store
        if bias is not None:
            inputs[bias] = storage[bias] = bias_in
        return make(
            family,
            [lay.normalized(mesh) for lay in inputs],
            out.normalized(mesh),
            stored.normalized(mesh),
            relative_to={bias: stored.normalized(mesh)} if bias is not None else None,
            storage=tuple(s.normalized(mesh) if s else None for s in storage),
            epilogue=(bias,) if bias is not None else (),
            detail=detail,
            split_weight=split_weight,
        )

    if family == "replicated":
        rep = Layout.replicated
        return [
            assemble(
                "replicated", rep(x_nd), rep(2), rep(2), rep(out_nd), rep(out_nd), rep(bias_nd), "R"
            )
        ]

    groups = []
    allreduce = all_reduces(family)
    for m, k, n in _roles(family, mesh, incoming.dims[-1] if incoming.ndim else ()):
        candidates = []
        # Token dims for M (all of M on one dim, or for the named families also spread
        # over the batch dims first), then for the K scatter: the dim the incoming N
        # shard sits on first, so that the next layer gathers where this one scattered.
        token_dims = list(range(feat))
        placements = [[(dm, m)] for dm in token_dims]
        if family in NAMED:
            spread = batch_dims(shapes[x][:feat], m, mesh)
            placements.insert(0, [(d, axes) for d, axes in enumerate(spread) if axes])
        n_dim = incoming.dim_of(n[0]) if n else None
        scatter_dims = [None] if allreduce else sorted(token_dims, key=lambda d: d != n_dim)
        w_in = _layout(2, [(w_out_dim, n), (w_in_dim, k)])
        # The weight knob: split over M too (1/N, gathered before use) or kept whole
        # over M (gradient all-reduced). The family's own default comes first.
        split = next(
            (
                w_store
                for w_store in (
                    _layout(2, [(w_out_dim, n + m), (w_in_dim, k)]),
                    _layout(2, [(w_out_dim, n), (w_in_dim, k + m)]),
                )
                if not w_store.normalized(mesh).indivisible(shapes[w], mesh)
            ),
            None,
        )
        storages = [(w_in, False)] + ([(split, True)] if split else [])
        if not allreduce:
            storages.reverse()
        roles = " ".join(f"{r}={','.join(axes) or '-'}" for r, axes in zip("MKN", (m, k, n)))
        for tokens, dk, (w_store, split_weight) in product(placements, scatter_dims, storages):
            x_in = _layout(x_nd, tokens + [(feat, k)])
            out = _layout(out_nd, tokens + [(out_nd - 1, n)], partial=k)
            bias_in = _layout(bias_nd, [(bias_nd - 1, n)])
            stored = _layout(
                out_nd, tokens + [(out_nd - 1, n)] + ([(dk, k)] if dk is not None else [])
            )
            candidates.append(
                assemble(family, x_in, w_in, w_store, out, stored, bias_in, roles, split_weight)
            )
        groups.append(candidates)
    if family == "megatron":  # the first roles that divide: Megatron's own, if they do
        valid = (_valid(shapes, out_shape, mesh, group) for group in groups)
        return tuple(next((group for group in valid if group), ()))
    return tuple(_valid(shapes, out_shape, mesh, [c for group in groups for c in group]))


def _roles(family: str, mesh, features=()) -> list[tuple[tuple[str, ...], ...]]:
    """(M axes, K axes, N axes) per candidate: one axis each, in every order, for the 3D
    families; for "any" and "any-allreduce" every assignment of the axes that split
    anything to M, K and N, from which data parallel (M on every axis) and Megatron's
    1D and 2D layouts fall out. None is left without a role: its ranks would repeat
    the layer's work, and the per-node choice, which counts bytes moved, would take
    that every time (on a 1×1×8 mesh, every layer replicated). "dp": M is every
    axis. "megatron": column-parallel, or first row-parallel where the input's
    features arrive split over the tensor-parallel axis (`features`: the axes that
    split them)."""
    if family == "dp":
        return [(mesh.names, (), ())]
    if family == "megatron":
        data, tp = parallel_axes(family, mesh)
        column, row = (data, (), tp), (data, tp, ())
        return [row, column] if set(tp) & set(features) else [column, row]
    if family.startswith("3d"):
        return [((m,), (k,), (n,)) for m, k, n in permutations(mesh.names)]
    wide = [a for a in mesh.names if mesh.size(a) > 1]
    return [
        tuple(tuple(a for a, r in zip(wide, roles) if r == role) for role in "MKN")
        for roles in product("MKN", repeat=len(wide))
    ]


def _valid(shapes, out_shape, mesh, candidates: list[Strategy]) -> list[Strategy]:
    """Drop candidates whose shards do not divide, and duplicates (size-1 axes)."""
    seen, out = set(), []
    for c in candidates:
        layouts = list(c.inputs) + [c.storage_for(i) for i in range(len(c.inputs))]
        fits = all(
            not lay.indivisible(shape, mesh) for lay, shape in zip(layouts, shapes + shapes)
        ) and not c.stored.indivisible(out_shape, mesh)
        key = (c.inputs, c.stored, tuple(c.storage_for(i) for i in range(len(c.inputs))))
        if fits and key not in seen:
            seen.add(key)
            out.append(c)
    return out


@register(aten.linear.default, regathers=True, **Product(0).facts())
def linear(ctx: Context) -> list[Strategy]:
    bias = 2 if len(ctx.inputs) == 3 else None
    return matmul_candidates(ctx, x=0, w=1, bias=bias, w_out_dim=0, w_in_dim=1)


@register(aten.addmm.default, regathers=True, **Product(1).facts())
def addmm(ctx: Context) -> list[Strategy]:
    # addmm(bias, x, w): GPT-2's Conv1D, W stored [H, O]
    if ctx.inputs[2].op != "get_attr":
        raise Unclaimed("a product of activations")
    for name in ("beta", "alpha"):  # the bias is added after the collectives, unscaled
        if argument(ctx.node, name) != 1:
            raise Unclaimed(f"{name}={argument(ctx.node, name)}")
    return matmul_candidates(ctx, x=1, w=2, bias=0, w_out_dim=1, w_in_dim=0)


@register(aten.mm.default, aten.matmul.default, regathers=True, **Product(0).facts())
@register(aten.bmm.default, **Product(0).facts())  # batched: never a layer's weight
def matmul(ctx: Context) -> list[Strategy]:
    """``X @ W`` with W a 2-D parameter is a layer; any other product is of two
    activations (`activation_product`)."""
    if len(ctx.shape(1)) == 2 and ctx.inputs[1].op == "get_attr":
        return matmul_candidates(ctx, x=0, w=1, bias=None, w_out_dim=1, w_in_dim=0)
    return activation_product(ctx)


def activation_product(ctx: Context) -> list[Strategy]:
    """A product of two activations, [..., m, k] @ [..., k, n] (attention's q @ kᵀ and
    p @ v): batch dims and the rows m stay split as the left operand has them; k and
    n are gathered, so the contraction is never split."""
    a_shape, b_shape, out_shape = ctx.shape(0), ctx.shape(1), ctx.out_shape
    if min(len(a_shape), len(b_shape)) < 2:
        return replicated_fallback(ctx)
    a = ctx.layout(0)
    batch_shape = out_shape[:-2]
    offset = len(batch_shape) - (len(a_shape) - 2)  # a's batch dims are right-aligned
    out_batch = tuple(
        a.dims[d - offset] if d >= offset and a_shape[d - offset] == batch_shape[d] else ()
        for d in range(len(batch_shape))
    )
    out = Layout(out_batch + (a.dims[-2], ()))
    a_need = Layout(aligned(Layout(out_batch), a_shape[:-2], batch_shape).dims + (a.dims[-2], ()))
    b_need = Layout(aligned(Layout(out_batch), b_shape[:-2], batch_shape).dims + ((), ()))
    return [make("follow", [a_need, b_need], out)]


# Products with no rule (they run replicated, with a warning): each operand is kept
# for the other's gradient.
register(aten.mv.default, aten.vdot.default, aten.dot.default, saved=keeps_operands)()
