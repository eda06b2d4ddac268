"""How long autoshard takes to trace, plan and rewrite GPT models.

    python benchmarks/run.py                 # both tables below
    python benchmarks/run.py --quick         # 12 layers only

1. Trace and rewrite, strategy "3d" forced: torch.export, the policy planner,
   and the passes that write the per-rank program (12 and 48 layers, 2×2×2).
2. Export against solving: the solver's whole planning (a plan per family and
   order of the axes, the cost model with every layer's knobs, the HiGHS
   program, the final plan and its cost) for 12, 48 and 96 layers on virtual
   2×2×2, 4×4×4 and 8×8×8 meshes.

Models (d_model 1024, 16 heads, seq 128, batch 8) are built on the meta
device, so no weights are allocated. Wall-clock seconds on whatever machine
runs this; compare columns within one run.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from autoshard.cost.hardware import Hardware
from autoshard.mesh import Mesh
from autoshard.planning.options import PlanOptions
from autoshard.planning.planner import plan_graph
from autoshard.planning.solver import plan_model
from autoshard.tracing.trace import trace
from passes import emit

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
from gpt import gpt_layers  # noqa: E402


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - start


def traced_gpt(layers: int):
    with torch.device("meta"):
        model, inputs = gpt_layers(n_layer=layers)
    return timed(trace, model, inputs)


def rewrite_table(layer_counts) -> Table:
    table = Table(title='Trace and rewrite, strategy "3d", mesh 2×2×2')
    for column in ("layers", "nodes", "export s", "plan s", "rewrite s"):
        table.add_column(column, justify="right")
    mesh = Mesh.from_shape((2, 2, 2))
    for layers in layer_counts:
        traced, export_s = traced_gpt(layers)
        plan, plan_s = timed(plan_graph, traced, mesh, "3d")
        _, emit_s = timed(emit, traced, plan)
        row = (layers, len(plan.nodes), f"{export_s:.2f}", f"{plan_s:.2f}", f"{emit_s:.2f}")
        table.add_row(*map(str, row))
    return table


def solver_table(layer_counts, meshes) -> Table:
    table = Table(
        title="Export against planning with the solver (hardware nvlink-8, budget 80 GiB)"
    )
    for column in ("layers", "mesh", "export s", "planning s", "planning/export", "families"):
        table.add_column(column, justify="right")
    hardware = Hardware.load("nvlink-8")
    for layers in layer_counts:
        traced, export_s = traced_gpt(layers)
        for shape in meshes:
            mesh = Mesh.from_shape(tuple(int(s) for s in shape.split("x")))
            plan, plan_s = timed(plan_model, traced, mesh, PlanOptions(hardware=hardware))
            chosen = ", ".join(sorted({c.split(" + ")[0] for c in plan.choices.values()}))
            row = (layers, shape, f"{export_s:.2f}", f"{plan_s:.2f}", f"{plan_s / export_s:.2f}")
            table.add_row(*map(str, row), chosen)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="12 layers, 2×2×2 only")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    console = Console()
    layers = [12] if args.quick else [12, 48]
    console.print(rewrite_table(layers))
    solver_layers = [12] if args.quick else [12, 48, 96]
    meshes = ["2x2x2"] if args.quick else ["2x2x2", "4x4x4", "8x8x8"]
    console.print(solver_table(solver_layers, meshes))


if __name__ == "__main__":
    main()
