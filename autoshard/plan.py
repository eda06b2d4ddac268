"""The plan: one strategy per node, the steps between them, and what they cost.

The planner writes a `Plan`; the passes read it and nothing else.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

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


@dataclass
class Plan:
    mesh: Mesh
    nodes: dict[str, NodePlan]  # call_function nodes, in graph order
    storage: dict[str, Layout]  # parameters and buffers (by FQN) and inputs (by name)
    entry_steps: dict[str, tuple[Step, ...]]  # inputs, given whole, split on entry
    output_steps: tuple[tuple[Step, ...], ...]
    warnings: list[str] = field(default_factory=list)

    def predicted_comm(self) -> dict[tuple[str, str, str, str], int]:
        """Bytes per (node, kind, axis, phase) that running one step will log."""
        out: dict[tuple[str, str, str, str], int] = defaultdict(int)
        served = [(node.name, node.steps_with_grad()) for node in self.nodes.values()]
        served.append(("output", [(step, True) for steps in self.output_steps for step in steps]))
        for name, steps in served:
            for step, grad in steps:
                if step.forward_collective != "none":
                    out[name, step.forward_collective, step.axis, "forward"] += step.nbytes
                if step.backward_collective != "none" and grad:
                    out[name, step.backward_collective, step.axis, "backward"] += step.nbytes
        return dict(out)
