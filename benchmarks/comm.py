"""CPU time per step of autoshard's program against the same program with plain c10d
collectives, and against PyTorch's DTensor tensor parallelism, on 8 gloo ranks.

    flock /tmp/autoshard-ranks.lock python benchmarks/comm.py            # 5 repeats
    flock /tmp/autoshard-ranks.lock python benchmarks/comm.py --repeats 3 --steps 5
    flock /tmp/autoshard-ranks.lock python benchmarks/comm.py --compile --models gpt

- "autoshard": `autoshard.parallelize(model, mesh, inputs, strategy="3d")` on 2×2×2.
- "hand-written 3D": that very program with every collective call of the emitted code
  (all-gathers, reduce-scatters, all-reduces, splits, gradient buckets) replaced by a
  bare autograd pair around the c10d call, its process group resolved once (a gather
  bucket runs autoshard's packing, called straight on its group): the
  collectives a hand-written 3D program makes, without autoshard's wrapper (the
  collectives inside layer norm and the loss stay autoshard's in both).
- "DTensor TP": `parallelize_module` with the Megatron layout (first linear of each
  MLP column-wise, second row-wise) over all 8 ranks; for the MLP stack only (the
  GPT example's attention reshapes by its global head count).
- "autoshard Megatron": `autoshard.parallelize(..., strategy="megatron")` on the same
  flat mesh of 8 (MLP stack only): DTensor's layout planned and emitted by autoshard,
  so that the two runtimes' overheads compare like for like.
- "torch.compile" (`--compile`): `torch.compile(parallel)` with inductor, compiled
  before the timing starts; forward+backward only (a forward under no_grad would
  compile a second program).

The variants run alternating, `--repeats` times, `--steps` steps each; a ratio is
taken per repeat on rank 0's process CPU time (gloo ranks on shared cores make
wall time noise), and the table shows the minimum and the median. It also prints
the collective calls per step, from autoshard's comm log, with and without shared
conversions, gradient buckets and gather buckets.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import fx
from torch.distributed.device_mesh import init_device_mesh

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT))

import autoshard  # noqa: E402
from autoshard.runtime import comm  # noqa: E402
from autoshard.runtime.ranks import RankPool, shared_pool  # noqa: E402
from autoshard.testing import load_factory  # noqa: E402

MODELS = {
    "MLP stack": (
        f"{ROOT}/examples/mlp.py:mlp",
        dict(batch=8, seq=8, hidden=64, layers=4, dropout=0.0),
    ),
    "GPT example": (f"{ROOT}/examples/gpt.py:gpt", {}),
}
# (numerator, denominator) of each ratio printed
COMPARED = (
    ("autoshard", "hand-written 3D"),
    ("autoshard", "DTensor TP"),
    ("autoshard Megatron", "DTensor TP"),
    ("autoshard", "torch.compile"),
)
COMPILE_TIMEOUT_S = 1800  # 8 inductor compiles at once on a small machine


class _Bare(torch.autograd.Function):
    """A forward collective and its backward, straight on the group."""

    @staticmethod
    def forward(ctx, x, forward, backward, group, dim):
        ctx.backward, ctx.group, ctx.dim = backward, group, dim
        return forward(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward(grad, ctx.group, ctx.dim), None, None, None, None


def _gather(x, g, dim):
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((moved.shape[0] * g.size, *moved.shape[1:]))
    dist.all_gather_single(out, moved, group=g.group)
    return out.movedim(0, dim)


def _scatter(x, g, dim):
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((moved.shape[0] // g.size, *moved.shape[1:]))
    dist.reduce_scatter_single(out, moved, group=g.group)
    return out.movedim(0, dim)


def _reduce(x, g, dim):
    out = x.contiguous().clone()
    dist.all_reduce(out, group=g.group)
    return out


BARE = {
    "all_gather": _gather,
    "reduce_scatter": _scatter,
    "all_reduce": _reduce,
    "split": lambda x, g, dim: x.chunk(g.size, dim)[g.coordinate].clone(),
    "identity": lambda x, g, dim: x.clone(),
    "mask": lambda x, g, dim: x.clone() if g.coordinate == 0 else torch.zeros_like(x),
}
FORWARD = {
    comm.all_gather: "all_gather",
    comm.reduce_scatter: "reduce_scatter",
    comm.all_reduce: "all_reduce",
    comm.split: "split",
    comm.grad_all_reduce: "identity",
    comm.to_partial: "mask",
}


class _BareBucket(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, *tensors):
        ctx.group = group
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=ctx.group)
        parts = flat.split([g.numel() for g in grads])
        return None, *(p.view_as(g) for p, g in zip(parts, grads))


_WIRED: list[tuple] = []  # what each bare call runs: the generated code names it by index


def bare_pair(x, wired: int):
    forward, backward, group, dim = _WIRED[wired]
    return _Bare.apply(x, forward, backward, group, dim)


def bare_bucket(tensors, wired: int):
    return _BareBucket.apply(_WIRED[wired], *tensors)


def bare_gather(tensors, wired: int):
    return comm._GatherBucket.apply(*_WIRED[wired], *tensors)


def hand_written(parallel) -> fx.GraphModule:
    """`parallel`'s program with each emitted collective a bare c10d pair."""
    gm = fx.GraphModule(parallel.program, copy.deepcopy(parallel.program.graph))
    axes = parallel._mesh.axes
    for node in gm.graph.nodes:
        if node.target in FORWARD:
            kwargs = node.kwargs
            forward = BARE[FORWARD[node.target]]
            backward = BARE[kwargs["backward"]]
            group = axes[kwargs["axis"]]
            _WIRED.append((forward, backward, group, kwargs.get("dim")))
            node.target, node.args, node.kwargs = bare_pair, (node.args[0], len(_WIRED) - 1), {}
        elif node.target is comm.grad_bucket:
            _WIRED.append(axes[node.kwargs["axis"]].group)
            node.target, node.args, node.kwargs = bare_bucket, (node.args[0], len(_WIRED) - 1), {}
        elif node.target is comm.gather_bucket:
            kwargs = node.kwargs
            wired = (kwargs["node"], kwargs["serves"], kwargs["dims"], kwargs.get("overlap", False))
            _WIRED.append((axes[kwargs["axis"]], *wired))
            node.target, node.args, node.kwargs = bare_gather, (node.args[0], len(_WIRED) - 1), {}
    gm.recompile()
    return gm


def dtensor_tp(model, device_mesh):
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    flat = init_device_mesh("cpu", (device_mesh.size(),))
    plan = {}
    for name, _ in model.named_modules():
        if name.endswith("fc1"):
            plan[name] = ColwiseParallel()
        elif name.endswith("fc2"):
            plan[name] = RowwiseParallel()
    return parallelize_module(model, flat, plan)


def _cpu(run, inputs, steps: int, backward: bool) -> float:
    start = time.process_time()
    for _ in range(steps):
        if backward:
            run(*inputs).sum().backward()
        else:
            with torch.no_grad():
                run(*inputs)
    return (time.process_time() - start) / steps


def _calls(parallel, inputs) -> int:
    with autoshard.comm_log() as log:
        parallel(*inputs).sum().backward()
    return len(log.records)


def _bench(device_mesh, spec, sizes, repeats, steps, compiled: bool):
    torch.manual_seed(0)
    model, inputs = load_factory(spec)(**sizes)
    parallel = autoshard.parallelize(model, device_mesh, inputs, strategy="3d")
    calls = _calls(parallel, inputs)
    plain = dataclasses.replace(parallel.plan, shared=(), buckets=(), gathers=())
    unshared = autoshard.parallelize(model, device_mesh, inputs, plan=plain)
    calls_unshared = _calls(unshared, inputs)
    bare = hand_written(parallel)
    variants = {
        "autoshard": lambda *xs: parallel(*xs),
        "hand-written 3D": lambda *xs: bare(*xs)[0],
    }
    if "mlp" in spec:
        tp_model, _ = load_factory(spec)(**sizes)
        tp_model.load_state_dict(model.state_dict())
        tp = dtensor_tp(tp_model, device_mesh)
        variants["DTensor TP"] = lambda *xs: tp(*xs)
        # the same layout as DTensor's, planned by autoshard: overhead like for like
        flat = init_device_mesh("cpu", (device_mesh.size(),), mesh_dim_names=("a",))
        megatron = autoshard.parallelize(model, flat, inputs, strategy="megatron")
        variants["autoshard Megatron"] = lambda *xs: megatron(*xs)
    if compiled:
        variants["torch.compile"] = torch.compile(parallel)
        _cpu(variants["torch.compile"], inputs, 2, True)  # compiles
    times: dict[str, dict[str, list[float]]] = {"forward": {}, "forward+backward": {}}
    for _ in range(repeats):
        for name, run in variants.items():
            for phase, backward in (("forward", False), ("forward+backward", True)):
                if name == "torch.compile" and not backward:
                    continue
                seconds = _cpu(run, inputs, steps, backward)
                times[phase].setdefault(name, []).append(seconds)
    return times, calls, calls_unshared


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--compile", action="store_true", help="also time torch.compile")
    parser.add_argument("--models", choices=("all", "mlp", "gpt"), default="all")
    args = parser.parse_args()
    pool = RankPool(8, timeout_s=COMPILE_TIMEOUT_S) if args.compile else shared_pool(8)
    for title, (spec, sizes) in MODELS.items():
        if args.models != "all" and not spec.endswith(f":{args.models}"):
            continue
        times, calls, before = pool.run(
            _bench, (2, 2, 2), spec, sizes, args.repeats, args.steps, args.compile
        )[0]
        print(f"\n{title}: {calls} collective calls per step ({before} without shared")
        print("conversions and buckets); CPU time per step on rank 0:")
        for phase, by_variant in times.items():
            own = statistics.median(by_variant["autoshard"])
            print(f"  {phase:17} autoshard {own * 1e3:8.2f} ms")
            for mine, theirs in COMPARED:
                if mine not in by_variant or theirs not in by_variant:
                    continue
                ratios = [a / b for a, b in zip(by_variant[mine], by_variant[theirs])]
                print(
                    f"  {phase:17} {mine} / {theirs:16} min {min(ratios):.3f}  "
                    f"median {statistics.median(ratios):.3f}  "
                    f"({theirs} {statistics.median(by_variant[theirs]) * 1e3:.2f} ms)"
                )


if __name__ == "__main__":
    main()
