"""The plan: one strategy per node, the steps between them, and what they cost.

The planner writes a `Plan`; the passes read it and nothing else.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

from autoshard.cost import Cost
from autoshard.layout import Layout, Step
from autoshard.mesh import Mesh
from autoshard.strategies import Strategy


@dataclass
class NodePlan:
    name: str
    op: str
    module: str
    shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    strategy: Strategy
    input_steps: tuple[tuple[Step, ...], ...]  # per tensor input, in argument order
    output_steps: tuple[Step, ...]
    input_needs_grad: tuple[bool, ...]
    needs_grad: bool

    def steps_with_grad(self) -> list[tuple[Step, bool]]:
        """Every step of this node, with whether its backward runs."""
        out = [
            (step, grad)
            for steps, grad in zip(self.input_steps, self.input_needs_grad)
            for step in steps
        ]
        own = list(self.strategy.internal) + list(self.output_steps)
        return out + [(step, self.needs_grad) for step in own]

    def regathered_steps(self) -> list[Step]:
        """The collectives backward runs again to rebuild inputs saved as shards."""
        return [
            step
            for i in self.strategy.regather
            for step in self.input_steps[i]
            if step.forward_collective != "none"
        ]


@dataclass
class Plan:
    mesh: Mesh
    nodes: dict[str, NodePlan]  # call_function nodes, in graph order
    storage: dict[str, Layout]  # parameters and buffers (by FQN) and inputs (by name)
    entry_steps: dict[str, tuple[Step, ...]]  # inputs, given whole, split on entry
    output_steps: tuple[tuple[Step, ...], ...]
    warnings: list[str] = field(default_factory=list)
    regions: dict[str, str] = field(default_factory=dict)  # node → checkpoint region it is in
    choices: dict[str, str] = field(default_factory=dict)  # unit → option the solver chose
    cost: Cost | None = None

    def stored_layout(self, node) -> Layout | None:
        """How the value of fx node `node` is stored: a placed node's output, or an
        input or parameter from `storage` (None for what the plan does not lay out)."""
        placed = self.nodes.get(node.name)
        if placed is not None:
            return placed.strategy.stored if placed.shape else None
        return self.storage.get(node.target if node.op == "get_attr" else node.name)

    def to_json(self) -> str:
        return json.dumps(plan_to_dict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return plan_from_dict(json.loads(text))

    def save(self, path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path) -> Plan:
        return cls.from_json(Path(path).read_text())

    def predicted_comm(self) -> dict[tuple[str, str, str, str], int]:
        """Bytes per (node, kind, axis, phase) that running one step will log."""
        out: dict[tuple[str, str, str, str], int] = defaultdict(int)
        served = [(node.name, node.steps_with_grad()) for node in self.nodes.values()]
        served.append(("output", [(step, True) for steps in self.output_steps for step in steps]))
        for name, steps in served:
            for step, grad in steps:
                if step.forward_collective != "none":
                    out[name, step.forward_collective, step.axis, "forward"] += step.nbytes
                    if name in self.regions:
                        out[name, step.forward_collective, step.axis, "recompute"] += step.nbytes
                if step.backward_collective != "none" and grad:
                    out[name, step.backward_collective, step.axis, "backward"] += step.nbytes
        for node in self.nodes.values():
            for step in node.regathered_steps():
                out[node.name, step.forward_collective, step.axis, "backward"] += step.nbytes
        return dict(out)


# JSON (no pickle): plans are saved, read by people, and applied without solving again.


def _layout(data) -> Layout | None:
    if data is None:
        return None
    return Layout(tuple(tuple(d) for d in data["dims"]), tuple(data["partial"]))


def _layout_dict(layout: Layout | None):
    return None if layout is None else {"dims": layout.dims, "partial": layout.partial}


def _step(data) -> Step:
    return Step(**data)


def _strategy_dict(s: Strategy) -> dict:
    return {
        "family": s.family,
        "inputs": [_layout_dict(x) for x in s.inputs],
        "output": _layout_dict(s.output),
        "stored": _layout_dict(s.stored),
        "grad_partial": [sorted(g) for g in s.grad_partial],
        "storage": [_layout_dict(x) for x in s.storage],
        "epilogue": s.epilogue,
        "lowering": s.lowering,
        "internal": [asdict(x) for x in s.internal],
        "outputs": [_layout_dict(x) for x in s.outputs],
        "detail": s.detail,
        "split_weight": s.split_weight,
        "regather": s.regather,
    }


def _strategy(d: dict) -> Strategy:
    return Strategy(
        family=d["family"],
        inputs=tuple(_layout(x) for x in d["inputs"]),
        output=_layout(d["output"]),
        stored=_layout(d["stored"]),
        grad_partial=tuple(frozenset(g) for g in d["grad_partial"]),
        storage=tuple(_layout(x) for x in d["storage"]),
        epilogue=tuple(d["epilogue"]),
        lowering=d["lowering"],
        internal=tuple(_step(x) for x in d["internal"]),
        outputs=tuple(_layout(x) for x in d["outputs"]),
        detail=d["detail"],
        split_weight=d.get("split_weight"),  # plans saved before the knobs lack both
        regather=tuple(d.get("regather", ())),
    )


def _node_dict(n: NodePlan) -> dict:
    return {
        "name": n.name,
        "op": n.op,
        "module": n.module,
        "shape": n.shape,
        "local_shape": n.local_shape,
        "strategy": _strategy_dict(n.strategy),
        "input_steps": [[asdict(s) for s in steps] for steps in n.input_steps],
        "output_steps": [asdict(s) for s in n.output_steps],
        "input_needs_grad": n.input_needs_grad,
        "needs_grad": n.needs_grad,
    }


def _node(d: dict) -> NodePlan:
    return NodePlan(
        name=d["name"],
        op=d["op"],
        module=d["module"],
        shape=tuple(d["shape"]),
        local_shape=tuple(d["local_shape"]),
        strategy=_strategy(d["strategy"]),
        input_steps=tuple(tuple(_step(s) for s in steps) for steps in d["input_steps"]),
        output_steps=tuple(_step(s) for s in d["output_steps"]),
        input_needs_grad=tuple(d["input_needs_grad"]),
        needs_grad=d["needs_grad"],
    )


def plan_to_dict(plan: Plan) -> dict:
    return {
        "mesh": {"names": plan.mesh.names, "sizes": plan.mesh.sizes},
        "nodes": [_node_dict(n) for n in plan.nodes.values()],
        # by name: a model may meet its buffers in an order that differs between
        # processes (iterating a set), and every rank must hash the same text
        "storage": {k: _layout_dict(v) for k, v in sorted(plan.storage.items())},
        "entry_steps": {k: [asdict(s) for s in v] for k, v in plan.entry_steps.items()},
        "output_steps": [[asdict(s) for s in steps] for steps in plan.output_steps],
        "warnings": plan.warnings,
        "regions": plan.regions,
        "choices": plan.choices,
        "cost": plan.cost.to_dict() if plan.cost else None,
    }


def plan_from_dict(d: dict) -> Plan:
    return Plan(
        mesh=Mesh(tuple(d["mesh"]["names"]), tuple(d["mesh"]["sizes"])),
        nodes={n["name"]: _node(n) for n in d["nodes"]},
        storage={k: _layout(v) for k, v in d["storage"].items()},
        entry_steps={k: tuple(_step(s) for s in v) for k, v in d["entry_steps"].items()},
        output_steps=tuple(tuple(_step(s) for s in steps) for steps in d["output_steps"]),
        warnings=list(d["warnings"]),
        regions=dict(d["regions"]),
        choices=dict(d["choices"]),
        cost=Cost.from_dict(d["cost"]) if d["cost"] else None,
    )
