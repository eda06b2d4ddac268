"""An fx GraphModule as plain, picklable data, its weights left out.

fx graphs do not pickle (ATen op overloads and the fake tensors in ``node.meta``
cannot), and `GraphModule`'s own pickling re-traces the generated code, which
would run autoshard's collectives on proxies. `Portable` records each node's
op, name, target and arguments (an op overload by its qualified name) and the
attributes its ``get_attr`` nodes read, except the tensors named in `leave_out`;
`build` turns it back into a GraphModule with those tensors put in, and the
same nodes, names and code.

    >>> gm = torch.fx.symbolic_trace(torch.nn.Linear(4, 2))
    >>> portable = Portable.of(gm, leave_out={"weight", "bias"})
    >>> rebuilt = pickle.loads(pickle.dumps(portable)).build(dict(gm.named_parameters()))
    >>> rebuilt.code == gm.code
    True
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

# node.meta entries that hold fake tensors; nothing after emitting a program reads them
_TRACE_ONLY_META = frozenset({"val", "tensor_meta", "example_value", "unbacked_bindings"})


@dataclass(frozen=True)
class _NodeRef:
    name: str


@dataclass(frozen=True)
class _Op:
    """An ATen (or custom) op overload, by its qualified name."""

    namespace: str
    name: str
    overload: str

    def resolve(self):
        return getattr(getattr(getattr(torch.ops, self.namespace), self.name), self.overload)


@dataclass(frozen=True)
class _Node:
    op: str
    name: str
    target: Any
    args: tuple
    kwargs: dict
    meta: dict
    type: Any = None  # the node's type annotation


@dataclass(frozen=True)
class Portable:
    """A GraphModule's nodes and attributes, without the tensors it was told to leave out.

    `attributes` maps every other ``get_attr`` target to its value (a nested
    GraphModule as a Portable of its own)."""

    class_name: str
    nodes: tuple[_Node, ...]
    attributes: dict[str, Any]

    @classmethod
    def of(cls, gm: fx.GraphModule, leave_out: set[str] | frozenset[str]) -> Portable:
        nodes = tuple(_node(node) for node in gm.graph.nodes)
        attributes = {}
        for node in gm.graph.nodes:
            if node.op == "get_attr" and node.target not in leave_out:
                value = _attribute(gm, node.target)
                if isinstance(value, fx.GraphModule):
                    value = Portable.of(value, leave_out)
                attributes[node.target] = value
        return cls(type(gm).__name__, nodes, attributes)

    def build(self, tensors: dict[str, torch.Tensor]) -> fx.GraphModule:
        """The GraphModule again, reading `tensors` (the ones left out) by target."""
        graph = fx.Graph()
        env: dict[str, fx.Node] = {}
        for record in self.nodes:
            args, kwargs = fx.node.map_aggregate(
                (record.args, record.kwargs),
                lambda a: env[a.name] if isinstance(a, _NodeRef) else a,
            )
            target = record.target.resolve() if isinstance(record.target, _Op) else record.target
            node = graph.create_node(
                record.op, target, args, kwargs, name=record.name, type_expr=record.type
            )
            node.meta = dict(record.meta)
            env[record.name] = node
        root = {
            target: value.build(tensors) if isinstance(value, Portable) else value
            for target, value in self.attributes.items()
        }
        root.update(tensors)
        return fx.GraphModule(root, graph, class_name=self.class_name)

    def read_at(self, target: str) -> str:
        """Where forward first reads attribute `target`: the last frame of the stack
        torch.export recorded for its first reader that has one, or a reader's name."""
        attrs = {r.name for r in self.nodes if r.op == "get_attr" and r.target == target}

        def reads(record: _Node) -> bool:
            found = []
            fx.node.map_aggregate(
                (record.args, record.kwargs),
                lambda a: found.append(isinstance(a, _NodeRef) and a.name in attrs),
            )
            return any(found)

        readers = [record for record in self.nodes if reads(record)]
        for record in readers:  # the model's own first: autoshard's nodes have no stack
            stack = (record.meta.get("stack_trace") or "").strip().splitlines()
            if stack:
                return " ".join(line.strip() for line in stack[-2:])
        return f"node {readers[0].name!r}" if readers else "no node"


def _node(node: fx.Node) -> _Node:
    args, kwargs = fx.node.map_aggregate(
        (node.args, node.kwargs), lambda a: _NodeRef(a.name) if isinstance(a, fx.Node) else a
    )
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        target = _Op(target.namespace, target._opname, target._overloadname)
    meta = {k: v for k, v in node.meta.items() if k not in _TRACE_ONLY_META and _picklable(v)}
    annotation = node.type if _picklable(node.type) else None
    return _Node(node.op, node.name, target, args, kwargs, meta, annotation)


def _attribute(gm: fx.GraphModule, target: str):
    value = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _picklable(value) -> bool:
    try:
        pickle.dumps(value)
    except Exception:  # what does not pickle is the trace's bookkeeping, not the program's
        return False
    return True
