"""How much of each zoo model (`tests/hf_zoo.py`) autoshard splits under "3d" on 2×2×2.

    python benchmarks/zoo.py              # the coverage table, planned in this process
    python benchmarks/zoo.py --check      # also runs every model against serial on 8 gloo ranks
    python benchmarks/zoo.py bert vit     # some models only

Columns, all for rank 0 of the plan:

- parameter share: the parameter elements the rank stores over the model's
  (1/8 = 0.125 is the ideal on 8 ranks);
- activation share: the bytes the cost model predicts the rank saves for
  backward, over what the serial model saves;
- ops left replicated: the ops the planner warned about (no rule, or a call a
  rule does not claim), with how many nodes each.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections import Counter
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))

import hf_zoo  # noqa: E402
import zoo_plans as zoo  # noqa: E402

from autoshard.cost.hardware import Hardware  # noqa: E402
from autoshard.cost.model import node_costs  # noqa: E402
from autoshard.mesh import Mesh  # noqa: E402
from autoshard.planning.planner import plan_graph  # noqa: E402
from autoshard.testing import assert_equivalent  # noqa: E402

MESH = (2, 2, 2)


def parameter_share(traced, plan, model) -> float:
    names = dict(model.named_parameters())
    local = total = 0
    for fqn, tensor in traced.parameters.items():
        if fqn in names:
            shape = tuple(tensor.shape)
            total += math.prod(shape)
            layout = plan.storage.get(fqn)  # none for a parameter forward never reads
            local += math.prod(layout.local_shape(shape, plan.mesh) if layout else shape)
    return local / total


def saved_bytes(traced, plan) -> int:
    """What every node saves for backward, with the values kept as stored counted once."""
    costs = node_costs(traced, plan, Hardware.load(zoo.HARDWARE))
    shared = {value: n for c in costs.values() for value, n in c.shared.items()}
    return sum(c.saved_bytes for c in costs.values()) + sum(shared.values())


def replicated_ops(plan) -> str:
    ops = Counter()
    for message in plan.warnings:
        found = re.search(r"(?:aten|transformers)\.\w+\.\w+", message)
        ops[found.group(0) if found else message[:40]] += 1
    return ", ".join(f"{op.removeprefix('aten.')} ×{n}" for op, n in sorted(ops.items()))


def row(name: str, check: bool) -> tuple[str, ...]:
    expected = hf_zoo.EXPECTED_ERRORS.get(name)
    if expected:
        return (name, f"refused: {expected[0]}", "", "", expected[1])
    model, traced = zoo.traced_model(name)
    plan = zoo.plan_model(name, MESH, "3d")
    serial = plan_graph(traced, Mesh.from_shape((1,)), "replicated")
    right = "—"
    if check:
        try:
            assert_equivalent(zoo.factory(name), MESH, steps=1, plan=plan)
            right = "yes"
        except AssertionError as e:
            right = f"NO: {str(e).split('worst: ')[-1][:60]}"
    params = parameter_share(traced, plan, model)
    activations = saved_bytes(traced, plan) / max(saved_bytes(traced, serial), 1)
    return (name, right, f"{params:.3f}", f"{activations:.3f}", replicated_ops(plan))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=hf_zoo.MODELS)
    parser.add_argument("--check", action="store_true", help="run each model against serial")
    args = parser.parse_args()
    table = Table(title=f'Zoo coverage under "3d" on {"×".join(map(str, MESH))}')
    for column in ("model", "right?", "parameter share", "activation share", "left replicated"):
        table.add_column(column)
    shares = []
    for name in args.models:
        cells = row(name, args.check)
        table.add_row(*cells)
        if cells[2]:
            shares.append(float(cells[2]))
    console = Console(width=160)
    console.print(table)
    console.print(
        f"mean parameter share over {len(shares)} models: {sum(shares) / len(shares):.3f}"
    )


if __name__ == "__main__":
    main()
