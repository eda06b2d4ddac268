"""Compile the zoo (`hf_zoo.py`) once in this process, for the equivalence tests and the
coverage table.

Tracing, planning and emitting a model on 8 ranks costs 8 times doing it here; the
rank processes apply the program compiled here (`parallelize(..., compiled=...)`).
Each case traces its model once, whatever it plans.

    >>> compiled = compile_model("bert", (2, 2, 2), "budget")   # "3d", ..., "budget"

Compiling takes one core while the ranks of the case before take both when they run:
`compiling_ahead` compiles the cases a test session will run in another process, in
order, so that each is ready when its ranks are free (`compiled` waits for it).
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import warnings
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path

import torch

from autoshard.api import Compiled, plan_traced
from autoshard.cost.hardware import Hardware
from autoshard.factory import load_factory
from autoshard.mesh import Mesh
from autoshard.planning.options import PlanOptions
from autoshard.planning.plan import Plan
from autoshard.planning.solver import build_problem, smallest_peak, solve
from autoshard.planning.verify import check_plan
from autoshard.tracing.modes import trace_modes
from autoshard.tracing.trace import Traced

ZOO = Path(__file__).with_name("hf_zoo.py")
HARDWARE = "nvlink-8"
SOLVED = ("3d", "3d-allreduce", "replicated")  # the solver's default space
TIGHT = 0.25  # a tight budget: this far from the smallest peak to the unconstrained one


def factory(name: str) -> str:
    return f"{ZOO}:{name}"


def build(name: str):
    torch.manual_seed(0)  # as the rank processes do before calling the factory
    return load_factory(factory(name))()


def tight_budget(traced: Traced, mesh: Mesh) -> float:
    """A budget between the smallest peak any plan reaches and the unconstrained plan's."""
    problem = build_problem(traced, mesh, Hardware.load(HARDWARE), SOLVED, 2.0)
    floor = smallest_peak(problem)
    free = problem.evaluate(solve(problem, None))[1]
    return floor + TIGHT * (free - floor)


@functools.cache
def traced_model(name: str) -> tuple[torch.nn.Module, Traced]:
    """Zoo model `name` and its trace, made once per process for every setting."""
    model, inputs = build(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model, trace_modes(model, inputs)


@functools.cache
def plan_model(name: str, mesh_shape, setting) -> Plan:
    """Zoo model `name` planned under a strategy, or under "budget": solved within a
    tight budget. Warnings (ops with no rule) are left to `Plan.warnings`. Made once
    per process: the hash-seed test compares these plans with another process's."""
    _, traced = traced_model(name)
    mesh = Mesh.from_shape(mesh_shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if setting == "budget":
            options = PlanOptions.from_user(
                memory_budget=tight_budget(traced, mesh), hardware=HARDWARE
            )
        else:
            options = PlanOptions.from_user(strategy=setting, hardware=HARDWARE)
        return plan_traced(traced, mesh, options)


@functools.cache
def compile_model(name: str, mesh_shape, setting) -> Compiled:
    """`plan_model`'s plan, emitted: what every rank applies. The plan must pass the
    check a saved plan gets before it is applied (`check_plan`: BART's was refused)."""
    model, traced = traced_model(name)
    plan = plan_model(name, mesh_shape, setting)
    check_plan(plan, traced)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Compiled.emitted(traced, plan, model)


Case = tuple[str, tuple[int, ...], str]  # (model name, mesh shape, setting)
_ahead: dict[Case, Future] = {}


@contextlib.contextmanager
def compiling_ahead(cases: list[Case]) -> Iterator[None]:
    """Compile `cases`, in this order, in one other process while the block runs."""
    worker = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    try:
        for case in dict.fromkeys(cases):
            _ahead[case] = worker.submit(compile_model, *case)
        yield
    finally:
        _ahead.clear()
        worker.shutdown(cancel_futures=True)


def compiled(name: str, mesh_shape, setting: str) -> Compiled:
    """`compile_model(name, mesh_shape, setting)`, from `compiling_ahead` if it has it."""
    ahead = _ahead.get((name, tuple(mesh_shape), setting))
    return ahead.result() if ahead is not None else compile_model(name, mesh_shape, setting)
