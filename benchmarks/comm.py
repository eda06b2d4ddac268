"""CPU time per step of autoshard's program against the same program with plain c10d
collectives, and against PyTorch's DTensor tensor parallelism, on 8 gloo ranks.

    flock /tmp/autoshard-ranks.lock python benchmarks/comm.py            # 5 repeats
    flock /tmp/autoshard-ranks.lock python benchmarks/comm.py --repeats 3 --steps 5
    flock /tmp/autoshard-ranks.lock python benchmarks/comm.py --compile --models gpt
    python benchmarks/comm.py --fake --repeats 15 --steps 20      # the runtime's own CPU

- "autoshard 3d": `autoshard.parallelize(model, mesh, inputs, strategy="3d")` on
  2×2×2: the paper's 3D linear, every activation and weight split over the three
  axes, all-gathers and reduce-scatters.
- "autoshard 3d-allreduce": the same with `strategy="3d-allreduce"`: weights split over
  two axes and kept whole over the third (data parallel there), each linear's partial
  sums all-reduced: fewer, larger calls.
- "hand-written …": that very program with every collective call of the emitted code
  (all-gathers, reduce-scatters, all-reduces, splits, gradient buckets) replaced by a
  bare autograd pair around the c10d call, its process group resolved once (a gather
  bucket runs autoshard's packing, called straight on its group; a gradient bucket is
  one all-reduce of the gradients packed flat, launched asynchronously where the plan
  overlaps, as autoshard's is, and waited for by the program's `grad_wait`): the
  collectives a hand-written 3D program makes, without autoshard's wrapper (the
  collectives inside layer norm and the loss stay autoshard's in both).
- "DTensor TP": `parallelize_module` with the Megatron layout (first linear of each
  MLP column-wise, second row-wise) over all 8 ranks; for the MLP stack only (the
  GPT example's attention reshapes by its global head count).
- "autoshard Megatron": `autoshard.parallelize(..., strategy="megatron")` on the same
  flat mesh of 8 (MLP stack only): DTensor's layout planned and emitted by autoshard,
  so that the two runtimes' overheads compare like for like.
- "torch.compile" (`--compile`): `torch.compile` of the "3d" program with inductor,
  compiled before the timing starts; forward+backward only (a forward under no_grad
  would compile a second program).

The variants run alternating, `--repeats` times, `--steps` steps each; a ratio is
taken per repeat on rank 0's process CPU time (gloo ranks on shared cores make
wall time noise), and the table shows the minimum and the median. It also prints
the collective calls per step of each autoshard program, from its comm log, and of
the "3d" program without shared conversions, gradient buckets and gather buckets.

With `--fake` one process plays rank 0 of the 8 on torch's fake process group, whose
collectives move nothing and take no time (`autoshard.runtime.ranks.fake_rank`): what
is left is the CPU each program spends on its own, around and between its
collectives: Python, dispatch, autograd, and the compute of rank 0's shards. On a GPU,
where a collective is launched on a stream and the CPU goes on, that is the CPU a step
costs. On 8 gloo ranks sharing 2 cores, each gloo call costs a rank about 0.45 ms of
CPU, and the call counts decide the ratios.
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
from autoshard.runtime.ranks import MESH_DIM_NAMES, RankPool, fake_rank, shared_pool  # noqa: E402
from autoshard.testing import load_factory  # noqa: E402

MODELS = {
    "MLP stack": (
        f"{ROOT}/examples/mlp.py:mlp",
        dict(batch=8, seq=8, hidden=64, layers=4, dropout=0.0),
    ),
    "GPT example": (f"{ROOT}/examples/gpt.py:gpt", {}),
}
# (numerator, denominator) of each ratio printed
STRATEGIES = ("3d", "3d-allreduce")  # autoshard's programs on 2×2×2
COMPARED = (
    ("autoshard 3d", "hand-written 3d"),
    ("autoshard 3d-allreduce", "hand-written 3d-allreduce"),
    ("autoshard 3d", "DTensor TP"),
    ("autoshard 3d-allreduce", "DTensor TP"),
    ("autoshard Megatron", "DTensor TP"),
    ("autoshard 3d", "torch.compile"),
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
    return out.movedim(0, dim).contiguous()  # row-major, as autoshard's (see its comm)


def _scatter(x, g, dim):
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((moved.shape[0] // g.size, *moved.shape[1:]))
    dist.reduce_scatter_single(out, moved, group=g.group)
    return out.movedim(0, dim).contiguous()


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
    """One all-reduce of the gradients packed flat; where the plan overlaps, launched
    and left to the program's `grad_wait`, as autoshard's bucket is."""

    @staticmethod
    def forward(ctx, wired, *tensors):
        ctx.group, ctx.overlap = wired
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        flat = torch.cat([g.reshape(-1) for g in grads])
        work = dist.all_reduce(flat, group=ctx.group, async_op=ctx.overlap)
        if ctx.overlap:
            comm._pending(flat, work)
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
            _WIRED.append((axes[node.kwargs["axis"]].group, node.kwargs.get("overlap", False)))
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
    variants, calls = {}, {}
    for strategy in STRATEGIES:
        parallel = autoshard.parallelize(model, device_mesh, inputs, strategy=strategy)
        bare = hand_written(parallel)
        variants[f"autoshard {strategy}"] = parallel
        variants[f"hand-written {strategy}"] = lambda *xs, bare=bare: bare(*xs)[0]
        calls[strategy] = _calls(parallel, inputs)
    three_d = variants["autoshard 3d"]
    plain = dataclasses.replace(three_d.plan, shared=(), buckets=(), gathers=())
    unshared = autoshard.parallelize(model, device_mesh, inputs, plan=plain)
    calls["3d without shared conversions and buckets"] = _calls(unshared, inputs)
    if "mlp" in spec:
        tp_model, _ = load_factory(spec)(**sizes)
        tp_model.load_state_dict(model.state_dict())
        variants["DTensor TP"] = dtensor_tp(tp_model, device_mesh)
        # the same layout as DTensor's, planned by autoshard: overhead like for like
        flat = init_device_mesh("cpu", (device_mesh.size(),), mesh_dim_names=MESH_DIM_NAMES[:1])
        megatron = autoshard.parallelize(model, flat, inputs, strategy="megatron")
        variants["autoshard Megatron"] = megatron
        calls["Megatron"] = _calls(megatron, inputs)
    if compiled:
        variants["torch.compile"] = torch.compile(three_d)
        _cpu(variants["torch.compile"], inputs, 2, True)  # compiles
    times: dict[str, dict[str, list[float]]] = {"forward": {}, "forward+backward": {}}
    for _ in range(repeats):
        for name, run in variants.items():
            for phase, backward in (("forward", False), ("forward+backward", True)):
                if name == "torch.compile" and not backward:
                    continue
                seconds = _cpu(run, inputs, steps, backward)
                times[phase].setdefault(name, []).append(seconds)
    return times, calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--compile", action="store_true", help="also time torch.compile")
    parser.add_argument("--models", choices=("all", "mlp", "gpt"), default="all")
    parser.add_argument(
        "--fake", action="store_true", help="collectives that cost nothing: the runtime's own CPU"
    )
    args = parser.parse_args()
    if args.fake and args.compile:
        parser.error("--fake times eager programs only: leave out --compile")
    if args.fake:
        torch.set_num_threads(1)  # as each of the 8 gloo ranks runs
    else:
        pool = RankPool(8, timeout_s=COMPILE_TIMEOUT_S) if args.compile else shared_pool(8)
    for title, (spec, sizes) in MODELS.items():
        if args.models != "all" and not spec.endswith(f":{args.models}"):
            continue
        bench = (spec, sizes, args.repeats, args.steps, args.compile)
        if args.fake:
            with fake_rank((2, 2, 2)) as device_mesh:
                times, calls = _bench(device_mesh, *bench)
        else:
            times, calls = pool.run(_bench, (2, 2, 2), *bench)[0]
        print(f"\n{title}: collective calls per step", end="")
        print("".join(f"; {program} {n}" for program, n in calls.items()))
        where = "rank 0, collectives that cost nothing" if args.fake else "rank 0 of 8 gloo ranks"
        print(f"CPU time per step ({where}):")
        for phase, by_variant in times.items():
            for mine, theirs in COMPARED:
                if mine not in by_variant or theirs not in by_variant:
                    continue
                ratios = [a / b for a, b in zip(by_variant[mine], by_variant[theirs])]
                print(
                    f"  {phase:17} {mine:22} / {theirs:25} min {min(ratios):.3f}  "
                    f"median {statistics.median(ratios):.3f}  "
                    f"({statistics.median(by_variant[mine]) * 1e3:.1f} / "
                    f"{statistics.median(by_variant[theirs]) * 1e3:.1f} ms)"
                )


if __name__ == "__main__":
    main()
