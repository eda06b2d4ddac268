"""How long autoshard takes to trace, plan and rewrite GPT models.

    python benchmarks/run.py [--layers 12 48] [--meshes 2x2x2]

Models are built on the meta device (no weights are allocated), so the
figures are the compiler's own time: torch.export, planning, and the passes
that write the per-rank program. Timings are wall-clock on whatever machine
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

from autoshard.mesh import Mesh
from autoshard.planner import plan_graph
from autoshard.trace import trace
from passes import emit

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
from gpt import gpt_layers  # noqa: E402


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[12, 48])
    parser.add_argument("--meshes", nargs="+", default=["2x2x2"])
    parser.add_argument("--strategy", default="3d")
    args = parser.parse_args()
    warnings.simplefilter("ignore")

    table = Table(title=f"GPT (d_model 1024, 16 heads, seq 128, batch 8), strategy {args.strategy}")
    for column in ("layers", "mesh", "nodes", "export s", "plan s", "rewrite s", "plan/export"):
        table.add_column(column, justify="right")
    for layers in args.layers:
        with torch.device("meta"):
            model, inputs = gpt_layers(n_layer=layers)
        traced, export_s = _timed(lambda: trace(model, inputs))
        for shape in args.meshes:
            mesh = Mesh.from_shape(tuple(int(s) for s in shape.split("x")))
            plan, plan_s = _timed(lambda: plan_graph(traced, mesh, args.strategy))
            _, emit_s = _timed(lambda: emit(traced, plan))
            table.add_row(
                str(layers), shape, str(len(plan.nodes)), f"{export_s:.2f}", f"{plan_s:.2f}",
                f"{emit_s:.2f}", f"{plan_s / export_s:.2f}",
            )
    Console().print(table)


if __name__ == "__main__":
    main()
