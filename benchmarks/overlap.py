"""Wall time per training step with the gradient buckets' reductions overlapped with
backward (`overlap=True`, the default) and without, on 8 gloo ranks (2×2×2, "3d").

    flock /tmp/autoshard-cpu.lock python benchmarks/overlap.py            # 7 repeats
    flock /tmp/autoshard-cpu.lock python benchmarks/overlap.py --repeats 3 --steps 5

Overlap saves waiting, not work, so this times wall clock (every rank starts a step
after a barrier; rank 0's time is reported), not CPU time as benchmarks/comm.py does.
The two programs run alternating, `--repeats` times, `--steps` forward+backward
steps each; the table shows the ratio on/off per repeat (minimum and median) and the
step time the cost model predicts for each on the nvlink-8 profile.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT))

from comm import MODELS  # noqa: E402  (benchmarks/comm.py: the same two models)

import autoshard  # noqa: E402
from autoshard.runtime.ranks import shared_pool  # noqa: E402
from autoshard.testing import load_factory  # noqa: E402


def _wall(run, inputs, steps: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        run(*inputs).sum().backward()
    return (time.perf_counter() - start) / steps


def _bench(device_mesh, spec, sizes, repeats, steps):
    programs = {}
    for overlap in (True, False):
        torch.manual_seed(0)
        model, inputs = load_factory(spec)(**sizes)
        programs[overlap] = autoshard.parallelize(
            model, device_mesh, inputs, strategy="3d", overlap=overlap
        )
        _wall(programs[overlap], inputs, 1)  # warm
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(repeats):
        for overlap, parallel in programs.items():
            times[overlap].append(_wall(parallel, inputs, steps))
    predicted = {overlap: p.plan.cost.step_time for overlap, p in programs.items()}
    return times, predicted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    pool = shared_pool(8)
    for title, (spec, sizes) in MODELS.items():
        times, predicted = pool.run(_bench, (2, 2, 2), spec, sizes, args.repeats, args.steps)[0]
        ratios = [on / off for on, off in zip(times[True], times[False])]
        print(f"\n{title}: wall time per step on rank 0, overlap on / off")
        print(
            f"  measured   min {min(ratios):.3f}  median {statistics.median(ratios):.3f}  "
            f"(on {statistics.median(times[True]) * 1e3:.2f} ms, "
            f"off {statistics.median(times[False]) * 1e3:.2f} ms)"
        )
        print(
            f"  predicted  {predicted[True] / predicted[False]:.3f}  "
            f"(nvlink-8: on {predicted[True] * 1e3:.3f} ms, off {predicted[False] * 1e3:.3f} ms)"
        )


if __name__ == "__main__":
    main()
