"""Candidate strategies per ATen op: how a node may run on the mesh.

A rule receives a `Context` (the node, the mesh, the layouts its inputs are
stored in, the family the user asked for) and returns candidate
`Strategy`s; the planner picks one. A strategy carries everything the
passes need: the layout each tensor input must arrive in, the layout the
local op computes (possibly a pending sum), the layout the node stores
after its own collectives, where the gradients of replicated inputs come
back partial, and how parameters the node owns are stored.

Everything autoshard knows about one ATen op is its one registry entry
(`registry.OpEntry`): the rule, its FLOPs and backward, what autograd keeps for
it, and the `Lowering`s its strategies may name (how the node runs on shards,
with the kernel it calls). Each module registers its ops next to their rule; a
second registration of an op is an error; `autoshard ops` lists them all:

    @register(aten.relu.default, aten.tanh.default, saved=keeps_output)
    def pointwise(ctx): ...

An op with no rule runs replicated (`replicated_fallback`), with a warning. So
does a call its rule does not claim: a rule handles every argument of its op
or raises `Unclaimed` naming the argument value it has no sharded form for:

    if argument(ctx.node, "scale_grad_by_freq"):
        raise Unclaimed("scale_grad_by_freq=True")
"""

from autoshard.strategies import (  # noqa: F401  (each module registers its rules)
    along,
    attention,
    baddbmm,
    conv,
    elementwise,
    embedding,
    experts,
    inplace,
    linear,
    loss,
    norm,
    pointwise,
    pointwise_loss,
    pooling,
    reduction,
    repeat,
    replicated,
    stack,
    views,
)
from autoshard.strategies.base import (  # noqa: F401  (the rules' vocabulary)
    FAMILIES,
    NAMED,
    Context,
    Lowering,
    Saved,
    Strategy,
    Unclaimed,
    all_reduces,
    batch_dims,
    is_tensor,
    make,
    parallel_axes,
    replicated_fallback,
)
from autoshard.strategies.registry import (  # noqa: F401  (one entry per op)
    OpEntry,
    entries,
    entry_for,
    lowering_named,
    register,
    rule_for,
)
