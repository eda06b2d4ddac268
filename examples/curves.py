"""Print loss curves side by side: the serial run's and the parallel runs' (JSON from
train.py --curve), and the largest difference.

    python examples/curves.py runs/serial.json runs/part1.json runs/part2.json
"""

import json
import sys

from rich.console import Console
from rich.table import Table


def main(serial_path: str, *parallel_paths: str) -> None:
    serial = json.load(open(serial_path))["losses"]
    runs = [json.load(open(path)) for path in parallel_paths]
    table = Table(title="loss per step: serial, and parallel (resumed on another mesh)")
    for column in ("step", "serial", "parallel", "on", "|difference|"):
        table.add_column(column, justify="right")
    worst = 0.0
    for run in runs:
        for step, loss in run["losses"].items():
            want = serial[step]
            worst = max(worst, abs(loss - want))
            table.add_row(
                step, f"{want:.6f}", f"{loss:.6f}", run["where"], f"{abs(loss - want):.1e}"
            )
    console = Console()
    console.print(table)
    console.print(f"largest difference from the serial curve: {worst:.2e}")


if __name__ == "__main__":
    main(*sys.argv[1:])
