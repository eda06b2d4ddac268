"""Train and eval mode: one traced graph that is exact in both, or a clear refusal.

torch.export bakes the mode into the graph: a dropout's ``train`` flag, a
batch norm's ``training``, and any branch on ``self.training`` (an
`nn.MultiheadAttention` in eval mode has no attention dropout at all).
`trace_modes` traces the model in its own mode and in the other one. Where
the two graphs differ only in dropouts that are on in train mode and off or
absent in eval mode, it keeps the train graph and marks those dropouts
(``node.meta[FOLLOWS_MODE]``): the emitted program passes them the
`ParallelModule`'s own ``training`` flag at run time. Where the graphs differ
in anything else (a batch norm), it keeps the graph of the model's own mode
and records why the other mode is refused.

    >>> model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.1)).eval()
    >>> traced = trace_modes(model, (torch.randn(8, 16),))
    >>> traced.training, traced.refused_modes
    (False, {})
    >>> [n.name for n in traced.graph_module.graph.nodes if n.meta.get(FOLLOWS_MODE)]
    ['dropout']
"""

from __future__ import annotations

import torch
from torch import fx
from torch.ops import aten
from torch.utils import _pytree as pytree

from autoshard.errors import TraceError
from autoshard.tracing.trace import Traced, trace

FOLLOWS_MODE = "autoshard_dropout_follows_mode"


def trace_modes(model: torch.nn.Module, example_inputs: tuple) -> Traced:
    """`trace(model, example_inputs)`, with the modes it runs exactly in recorded:
    ``traced.training`` (the mode it starts in, the model's) and
    ``traced.refused_modes`` (mode → why it cannot run in it)."""
    own = model.training
    traced = trace(model, example_inputs)
    try:
        other = _traced_in(model, not own, example_inputs)
    except TraceError as e:
        refused = {not own: f"it does not trace in {_name(not own)} mode: {e}"}
        return _with_modes(traced, own, refused)
    train, evaluated = (traced, other) if own else (other, traced)
    following = _following_mode(train.graph_module.graph, evaluated.graph_module.graph)
    if isinstance(following, str):
        refused = {not own: f"its {_name(not own)}-mode graph differs: {following}"}
        return _with_modes(traced, own, refused)
    for node in following:
        node.meta[FOLLOWS_MODE] = True
    return _with_modes(train, own, {})


def _traced_in(model: torch.nn.Module, training: bool, example_inputs: tuple) -> Traced:
    modes = {module: module.training for module in model.modules()}
    model.train(training)
    try:
        return trace(model, example_inputs)
    finally:
        for module, mode in modes.items():
            module.training = mode


def _with_modes(traced: Traced, training: bool, refused: dict[bool, str]) -> Traced:
    traced.training, traced.refused_modes = training, refused
    return traced


def _name(training: bool) -> str:
    return "train" if training else "eval"


def _is_dropout(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target == aten.dropout.default


def _dropout_on(node: fx.Node) -> bool:
    return bool(node.args[2] if len(node.args) > 2 else node.kwargs.get("train"))


def _following_mode(train: fx.Graph, evaluated: fx.Graph) -> list[fx.Node] | str:
    """The train graph's dropouts that eval mode turns off, if that is the only
    difference between the graphs; otherwise the first difference, in words."""
    theirs = list(evaluated.nodes)
    env: dict[fx.Node, fx.Node] = {}  # train node → the eval node that computes the same
    following, j = [], 0
    for node in train.nodes:
        match = theirs[j] if j < len(theirs) else None
        if _is_dropout(node) and _dropout_on(node):
            if match is not None and _same(node, match, env):
                following += [] if _dropout_on(match) else [node]
            elif match is not None and _is_dropout(match):
                return f"{_show(node)} in train mode, {_show(match)} in eval mode"
            else:  # gone in eval mode: the identity
                env[node] = env[node.args[0]]
                following.append(node)
                continue
        elif match is None or not _same(node, match, env, flag=False):
            seen = _show(match) if match is not None else "nothing"
            return f"{_show(node)} in train mode, {seen} in eval mode"
        env[node] = match
        j += 1
    if j < len(theirs):
        return f"{_show(theirs[j])} only in eval mode"
    return following


def _same(node: fx.Node, match: fx.Node, env: dict, flag: bool = True) -> bool:
    """Whether `match` computes what `node` does from the matched inputs (for a dropout,
    `flag=True` ignores its train flag)."""
    if (node.op, node.target) != (match.op, match.target):
        return False
    ours = pytree.tree_map(lambda a: env.get(a, a) if isinstance(a, fx.Node) else a, _args(node))
    theirs = _args(match)
    if flag and _is_dropout(node):
        ours, theirs = ours[:2], theirs[:2]
    return ours == theirs


def _show(node: fx.Node) -> str:
    args = ", ".join(str(a) for a in node.args)
    return f"node '{node.name}' ({node.target}({args}))"


def _args(node: fx.Node) -> tuple:
    """The node's arguments, with an ATen op's defaults filled in (a graph may pass
    ``dropout_p=0.0`` where the other leaves it out)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return (node.args, node.kwargs)
    out = []
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args):
            out.append(node.args[i])
        else:
            out.append(node.kwargs.get(arg.name, arg.default_value))
    return tuple(out)
