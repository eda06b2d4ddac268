"""Plan the zoo (`hf_zoo.py`) once in this process, for the equivalence tests and the
coverage table (`benchmarks/zoo.py`).

Planning a model on 8 ranks costs 8 times planning it here; the rank processes
apply the plan made here (`parallelize(..., plan=...)`).

    >>> plan = plan_model("bert", (2, 2, 2), "budget")   # "3d", "3d-allreduce", ..., "budget"
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

import autoshard
from autoshard.cost.hardware import Hardware
from autoshard.mesh import Mesh
from autoshard.planning.plan import Plan
from autoshard.planning.solver import build_problem, smallest_peak
from autoshard.testing import load_factory
from autoshard.tracing.trace import trace

ZOO = Path(__file__).with_name("hf_zoo.py")
HARDWARE = "nvlink-8"
SOLVED = ("3d", "3d-allreduce", "replicated")  # the solver's default space
TIGHT = 0.25  # a tight budget: this far from the smallest peak to the unconstrained one


def factory(name: str) -> str:
    return f"{ZOO}:{name}"


def build(name: str):
    torch.manual_seed(0)  # as the rank processes do before calling the factory
    return load_factory(factory(name))()


def tight_budget(model, inputs, mesh_shape) -> float:
    """A budget between the smallest peak any plan reaches and the unconstrained plan's."""
    traced = trace(model, inputs)
    problem = build_problem(
        traced, Mesh.from_shape(mesh_shape), Hardware.load(HARDWARE), SOLVED, 2.0
    )
    floor = smallest_peak(problem)
    free = autoshard.plan(model, mesh_shape, inputs, hardware=HARDWARE).cost.peak_memory
    return floor + TIGHT * (free - floor)


def plan_model(name: str, mesh_shape, setting) -> Plan:
    """The plan for zoo model `name` under a strategy, or under "budget": solved within a
    tight budget. Warnings (ops with no rule) are left to `Plan.warnings`."""
    model, inputs = build(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if setting == "budget":
            budget = tight_budget(model, inputs, mesh_shape)
            return autoshard.plan(
                model, mesh_shape, inputs, memory_budget=budget, hardware=HARDWARE
            )
        return autoshard.plan(model, mesh_shape, inputs, strategy=setting, hardware=HARDWARE)
