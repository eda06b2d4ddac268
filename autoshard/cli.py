"""The `autoshard` command: look at a plan without running anything, measure hardware.

    autoshard show examples/mlp.py:mlp --mesh 2x2x2
    autoshard show examples/mlp.py:mlp --mesh 1x2x4 --strategy 3d-allreduce --rank 5
    autoshard show examples/mlp.py:mlp --mesh 2x2x2 --strategy '{"layers.*.fc1": "replicated"}'
    autoshard calibrate --mesh 2x2x2 --out profile.json
    autoshard ops
    autoshard ops layer_norm

`show` traces the model that a factory in a Python file builds, plans it for
the mesh (no processes, no devices) and prints, with rich: a header (model,
mesh, strategy, how much of the parameters each rank holds), the plan (one
row per node: strategy, shapes, stored layout, collectives), the predicted
communication per collective kind, axis and phase, the planner's warnings,
and the program one rank runs, with the parameter shards that rank holds.

`ops` lists every op autoshard has a registry entry for and what the entry
provides: the rule that lays it out on the mesh, how its compute is priced
(FLOPs and backward), what autograd keeps for its backward, and the lowerings
its strategies may take (`autoshard.strategies.registry`).

`calibrate` measures α and β per mesh axis and the matmul rate on a live
mesh (local gloo ranks, or the ranks of a `torchrun` launch), prints them and
writes a hardware profile (`autoshard.runtime.calibrate`).

Bad input (a malformed MODEL or --mesh, a missing file, anything autoshard
refuses with an `AutoshardError`) prints one red line and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
import warnings
from collections import Counter, defaultdict
from pathlib import Path

import torch
from rich import box
from rich.console import Console
from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text

from autoshard.errors import AutoshardError, human_bytes
from autoshard.layout import Layout, Step
from autoshard.mesh import Mesh
from autoshard.planning.plan import NodePlan, Plan
from autoshard.planning.planner import default_split
from autoshard.sizes import memory_budget
from autoshard.strategies import FAMILIES, OpEntry, Strategy, entries

EXIT_USAGE = 2
_FAMILY_STYLE = {
    "3d": "green",
    "3d-allreduce": "cyan",
    "replicated": "yellow",
    "megatron": "magenta",
    "dp": "blue",
}
_FREES = re.compile(r";  (?:\w+ = )+None$", re.MULTILINE)  # fx's `x = None` after last use


class UsageError(Exception):
    """Bad command-line input; the message is printed as is."""


# ---------------------------------------------------------------------------- parsing


def parse_mesh(text: str) -> tuple[int, ...]:
    """``"2x2x2"`` (or ``2×2×2``, ``2,2,2``) → ``(2, 2, 2)``; 1 to 3 positive sizes."""
    parts = text.replace("×", "x").replace(",", "x").lower().split("x")
    if not 1 <= len(parts) <= 3 or not all(p.strip().isdigit() for p in parts):
        raise UsageError(
            f"--mesh {text!r} is not a mesh shape: give 1 to 3 positive sizes joined by 'x', "
            "e.g. 2x2x2 or 1x2x4"
        )
    shape = tuple(int(p) for p in parts)
    if any(s < 1 for s in shape):
        raise UsageError(f"--mesh {text!r} has an axis of size 0: every size must be at least 1")
    return shape


def parse_strategy(text: str):
    """A family name, or a JSON object from module-path patterns to family names."""
    if not text.lstrip().startswith("{"):
        if text not in FAMILIES:
            raise UsageError(
                f"--strategy {text!r} is not a strategy: choose one of {', '.join(FAMILIES)} "
                'or give a JSON object such as \'{"layers.*.fc1": "replicated"}\''
            )
        return text
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"--strategy is not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise UsageError(
            "--strategy JSON must be an object from module patterns to family names, "
            'e.g. \'{"layers.*.fc1": "replicated", "*": "3d"}\''
        )
    unknown = sorted({v for v in value.values() if v not in FAMILIES})
    if unknown:
        raise UsageError(
            f"--strategy names unknown families {', '.join(map(repr, unknown))}: "
            f"choose from {', '.join(FAMILIES)}"
        )
    return value


def load_model(spec: str):
    """``path/to/file.py:factory`` → ``(model, example_inputs)`` from calling the factory."""
    from autoshard.factory import load_factory

    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name.isidentifier():
        raise UsageError(f"MODEL {spec!r} is not of the form path/to/file.py:factory")
    if not Path(path).is_file():
        raise UsageError(f"MODEL {spec!r}: no file at {path!r}")
    try:
        factory = load_factory(spec)
    except AttributeError:
        raise UsageError(f"MODEL {spec!r}: {path} defines no {name!r}") from None
    if not callable(factory):
        raise UsageError(f"MODEL {spec!r}: {name!r} in {path} is not callable")
    built = factory()
    if (
        not isinstance(built, tuple)
        or len(built) != 2
        or not isinstance(built[0], torch.nn.Module)
        or not isinstance(built[1], tuple)
    ):
        raise UsageError(
            f"MODEL {spec!r}: {name}() must return (model, example_inputs) with an nn.Module "
            f"and a tuple of tensors, not {type(built).__name__}"
        )
    return built


# ---------------------------------------------------------------------------- formatting


def short_op(op: str) -> str:
    """``aten.linear.default`` → ``aten.linear``: the overload name adds nothing here."""
    parts = op.split(".")
    return ".".join(parts[:2]) if len(parts) == 3 and parts[0] == "aten" else op


def shape_text(shape) -> str:
    return "×".join(map(str, shape)) if len(shape) else "scalar"


def steps_text(steps: list[tuple[Step, bool]], buckets: list[str | None] | None = None) -> Text:
    """One line per distinct step: ``all_gather(b) 2.0 KiB ↔ reduce_scatter``.

    Repeated identical steps in one node (a norm's weight and bias) are counted
    (``2×``). Steps free in forward (a split, a gradient-only all-reduce) are
    dim; the backward is left off where no gradient flows. `buckets` names, per
    step, the bucket whose call runs it, if any: such a step reads ``in bucket``
    (``all_gather(a) 1.0 KiB in bucket``); its calls are the bucket's, which the
    calls table names.
    """
    counts: dict[tuple[Step, bool, str | None], int] = {}
    for (step, grad), bucket in zip(steps, buckets or [None] * len(steps)):
        counts[step, grad, bucket] = counts.get((step, grad, bucket), 0) + 1
    text = Text()
    for i, ((step, grad, bucket), count) in enumerate(counts.items()):
        if i:
            text.append("\n")
        if count > 1:
            text.append(f"{count}× ", style="bold")
        free = step.forward_collective == "none"
        text.append(f"{step.kind}({step.axis}) ", style="dim" if free else "cyan")
        text.append(human_bytes(step.nbytes), style="dim" if free else None)
        if bucket:
            text.append(" in bucket", style="magenta")
        elif grad:
            back = step.backward_collective != "none"
            text.append(" ↔ ", style="dim")
            text.append(step.backward, style="magenta" if back else "dim")
    return text


def node_steps_text(node: NodePlan, in_bucket: dict[tuple[str, int, str], str]) -> Text:
    """`steps_text` of a node's steps, each run by a bucket named as such (`in_bucket`:
    (node, input, axis) → the bucket's name)."""
    steps = node.steps_with_grad()  # its inputs' steps first, then its own
    buckets = [
        in_bucket.get((node.name, i, step.axis))
        for i, inputs in enumerate(node.input_steps)
        for step in inputs
    ]
    return steps_text(steps, buckets + [None] * (len(steps) - len(buckets)))


def strategy_text(strategy: Strategy, recomputed: bool = False) -> Text:
    """The family, the roles of the axes, any knob turned from the family's default."""
    text = Text(strategy.family, style=_FAMILY_STYLE.get(strategy.family, "dim"))
    if strategy.detail:
        text.append(" " + strategy.detail)
    if strategy.split_weight not in (None, default_split(strategy.family)):
        text.append(" W split over M" if strategy.split_weight else " W whole over M", style="cyan")
    if strategy.regather:
        text.append(" input kept as shard", style="cyan")
    if recomputed:
        text.append(" ↺ recomputed", style="magenta")
    return text


def rank_coordinate(mesh: Mesh, rank: int) -> dict[str, int]:
    """Rank → coordinate on the mesh, row-major over its axes (the last axis varies fastest)."""
    coord = {}
    for name, size in reversed(list(zip(mesh.names, mesh.sizes))):
        coord[name] = rank % size
        rank //= size
    return {name: coord[name] for name in mesh.names}


def slice_text(shape, slices) -> str:
    """``rows 16:32, cols 8:16``; ``all`` when the rank holds the whole tensor."""
    if all(start == 0 and stop == size for size, (start, stop) in zip(shape, slices)):
        return "all"
    names = ["rows", "cols"] if len(shape) == 2 else [f"dim{d}" for d in range(len(shape))]
    if len(shape) == 1:
        names = [""]
    parts = [
        f"{name} {start}:{stop}".strip()
        for name, size, (start, stop) in zip(names, shape, slices)
        if (start, stop) != (0, size)
    ]
    return ", ".join(parts)


# ---------------------------------------------------------------------------- sections


def _plain(cell) -> Text:
    """A table cell as literal text: model names may hold brackets rich would read as markup."""
    return cell if isinstance(cell, Text) else Text(cell)


def _layout(plan: Plan, name: str, tensor: torch.Tensor) -> Layout:
    """How a parameter or buffer is stored (replicated where the plan does not say)."""
    return plan.storage.get(name) or Layout.replicated(tensor.ndim)


def _header(console: Console, model, plan: Plan, strategy, parameters: dict) -> None:
    params = {n: t for n, t in parameters.items() if isinstance(t, torch.nn.Parameter)}
    total = sum(t.numel() for t in params.values())
    local = sum(
        math.prod(_layout(plan, n, t).local_shape(t.shape, plan.mesh)) for n, t in params.items()
    )
    mesh = plan.mesh
    axes = ", ".join(f"{n}={s}" for n, s in zip(mesh.names, mesh.sizes))
    fraction = f"{local / total:.1%}" if total else "—"
    ratio = f", 1/{total / local:.3g}" if local and total != local else ""
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    grid.add_row("model", Text(type(model).__name__, style="bold"))
    grid.add_row("mesh", f"{'×'.join(map(str, mesh.sizes))} ({axes}), {mesh.world_size} ranks")
    if strategy is None or plan.choices:
        chosen = Counter(plan.choices.values())
        described = ", ".join(f"{option} ×{n}" if n > 1 else option for option, n in chosen.items())
        grid.add_row("strategy", _plain(f"solved per block: {described}"))
    else:
        grid.add_row(
            "strategy", _plain(json.dumps(strategy) if isinstance(strategy, dict) else strategy)
        )
    for c in plan.chunked:
        grid.add_row("loss", f"{c.loss} and its head {c.head} over the tokens in {c.chunks} chunks")
    grid.add_row("nodes", str(len(plan.nodes)))
    grid.add_row(
        "parameters",
        f"{total:,} elements in {len(params)} tensors; per rank {local:,} ({fraction}{ratio})",
    )
    console.print(grid)


def _plan_table(plan: Plan, input_shapes: dict[str, tuple[int, ...]], width: int) -> Table:
    """One row per node, inputs first and the output last. The fixed-format columns
    never wrap; module and strategy fold. Narrow consoles lose the op column (below
    140 columns), then see module and strategy under the node's name (below 120)."""
    with_op, wide = width >= 140, width >= 120
    table = Table(
        title="plan",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        padding=(0, 1),
        pad_edge=False,
        leading=0 if wide else 1,
    )
    table.add_column("node", style="bold", overflow="fold", max_width=24)
    if with_op:
        table.add_column("op", no_wrap=True, max_width=22, overflow="ellipsis")
    if wide:
        table.add_column("module", overflow="fold", min_width=12)
        table.add_column("strategy", overflow="fold", min_width=22)
    table.add_column("shape → local", no_wrap=True)
    table.add_column("stored", no_wrap=True)
    table.add_column("collectives (fwd ↔ bwd)", no_wrap=True)

    def row(name, op, module, strategy, shapes, stored, steps) -> None:
        if wide:
            cells = [name, *[op] * with_op, module, strategy]
        else:
            parts = [name, *[Text(module, "dim")] * bool(module), strategy]
            cells = [Text("\n").join(map(_plain, parts))]
        table.add_row(*map(_plain, [*cells, shapes, stored, steps]))

    mesh = plan.mesh
    for name, steps in plan.entry_steps.items():
        layout = plan.storage.get(name)
        shape = input_shapes.get(name)
        row(
            Text(name, style="dim"),
            Text("input", style="dim"),
            "",
            Text("split on entry" if steps else "whole on every rank", style="dim"),
            f"{shape_text(shape)} → {shape_text(layout.local_shape(shape, mesh))}"
            if shape is not None and layout is not None
            else "",
            str(layout) if layout is not None else "",
            steps_text([(s, False) for s in steps]),
        )
    in_bucket = {
        (name, i, b.axis): b.name for b in (*plan.buckets, *plan.gathers) for name, i in b.serves
    }
    for node in plan.nodes.values():
        local = node.strategy.stored.local_shape(node.shape, mesh)
        row(
            node.name,
            short_op(node.op),
            node.module,
            strategy_text(node.strategy, node.name in plan.regions),
            f"{shape_text(node.shape)} → {shape_text(local)}",
            str(node.strategy.stored),
            node_steps_text(node, in_bucket),
        )
    out_steps = [(s, True) for steps in plan.output_steps for s in steps]
    row(
        Text("output", style="dim"),
        "",
        "",
        Text("gathered on exit" if out_steps else "returned as is", style="dim"),
        "",
        "R",
        steps_text(out_steps),
    )
    return table


def predicted(plan: Plan) -> dict[tuple[str, str, str], tuple[int, int, float]]:
    """(kind, axis, phase) → (calls, buffer bytes, bytes each rank sends on a ring),
    from `plan.predicted_calls()` (shared conversions once, a bucket one call)."""
    out: dict[tuple[str, str, str], list] = defaultdict(lambda: [0, 0, 0.0])
    for call in plan.predicted_calls():
        entry = out[call.kind, call.axis, call.phase]
        entry[0] += 1
        entry[1] += call.nbytes
        entry[2] += call.ring_bytes
    order = sorted(out, key=lambda key: (key[2] != "forward", key))
    return {key: tuple(out[key]) for key in order}


def _comm_table(plan: Plan) -> Table | Text:
    rows = predicted(plan)
    if not rows:
        return Text("predicted communication: none (no collectives in this plan)", style="green")
    table = Table(
        title="predicted communication per training step (one rank)",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        padding=(0, 1),
        pad_edge=False,
        show_footer=True,
    )
    totals = defaultdict(lambda: [0, 0, 0.0])
    for (_, _, phase), (calls, nbytes, ring) in rows.items():
        for key in (phase, "total"):
            totals[key][0] += calls
            totals[key][1] += nbytes
            totals[key][2] += ring
    keys = [k for k in ("forward", "backward", "total") if k in totals]

    def foot(i, fmt) -> str:
        return "\n".join(fmt(totals[k][i]) for k in keys)

    table.add_column("collective", footer=Text("\n".join(keys), style="bold"))
    table.add_column("axis")
    table.add_column("phase")
    table.add_column("calls", justify="right", footer=foot(0, str))
    table.add_column("buffer bytes", justify="right", footer=foot(1, human_bytes))
    table.add_column("sent per rank (ring)", justify="right", footer=foot(2, human_bytes))
    for (kind, axis, phase), (calls, nbytes, ring) in rows.items():
        table.add_row(
            kind,
            f"{axis} ({plan.mesh.size(axis)})",
            phase,
            str(calls),
            human_bytes(nbytes),
            human_bytes(ring),
        )
    return table


def _shards_table(plan: Plan, parameters: dict, coord: dict[str, int]) -> Table:
    table = Table(box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False)
    table.add_column("parameter", style="bold", no_wrap=True)
    table.add_column("global", no_wrap=True)
    table.add_column("local", no_wrap=True)
    table.add_column("layout", no_wrap=True)
    table.add_column("holds", no_wrap=True)
    for name, tensor in parameters.items():
        layout = _layout(plan, name, tensor)
        shape = tuple(tensor.shape)
        slices = layout.shard_slices(shape, plan.mesh, coord)
        cells = [
            name if isinstance(tensor, torch.nn.Parameter) else f"{name} (buffer)",
            str(list(shape)),
            str(list(layout.local_shape(shape, plan.mesh))),
            str(layout),
            slice_text(shape, slices),
        ]
        table.add_row(*map(_plain, cells))
    return table


def _cost_table(plan: Plan, hardware: str, budget: float | None) -> Table:
    """The predicted cost of one training step on one rank."""
    cost = plan.cost
    table = Table(
        title=f"predicted cost per rank and step (hardware {hardware})", title_justify="left"
    )
    table.add_column("")
    table.add_column("value", justify="right")
    table.add_row("step time", f"{cost.step_time * 1e3:.3f} ms")
    table.add_row("  compute", f"{cost.compute * 1e3:.3f} ms")
    table.add_row("  recompute", f"{cost.recompute * 1e3:.3f} ms")
    for axis, seconds in cost.communication.items():
        table.add_row(f"  communication over {axis}", f"{seconds * 1e3:.3f} ms")
    if cost.overlapped:  # what of it runs while backward computes (`Plan.overlap`)
        table.add_row("  of which overlapped", f"−{cost.overlapped * 1e3:.3f} ms")
    limit = f" (budget {human_bytes(budget)})" if budget else ""
    table.add_row("peak memory", f"{human_bytes(cost.peak_memory)}{limit}")
    return table


# ---------------------------------------------------------------------------- show


def show(args, console: Console) -> None:
    from autoshard.api import trace_and_plan
    from autoshard.planning.options import PlanOptions
    from passes import emit

    shape = parse_mesh(args.mesh)
    mesh = Mesh.from_shape(shape)
    strategy = parse_strategy(args.strategy) if args.strategy else None
    options = PlanOptions.from_user(
        strategy=strategy,
        memory_budget=memory_budget(args.budget),
        hardware=args.hardware,
        strategy_space=args.space,
        loss_chunks=args.loss_chunks,
        overlap=False if args.no_overlap else None,
    )
    budget, hardware = options.memory_budget, options.hardware
    if not 0 <= args.rank < mesh.world_size:
        raise UsageError(
            f"--rank {args.rank} is not on the mesh: it has ranks 0..{mesh.world_size - 1}"
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the plan keeps the warnings that matter; printed below
        model, inputs = load_model(args.model)
        traced, plan = trace_and_plan(model, shape, inputs, options)
        program = None if args.no_code else emit(traced, plan)

    _header(console, model, plan, strategy, traced.parameters)
    console.print()
    console.print(_cost_table(plan, hardware.name, budget))
    console.print()
    for unit, reason in plan.reasons.items():  # the solver's word on what it left replicated
        console.print(Text(f"{unit}: {reason}", style="yellow"))
    if plan.reasons:
        console.print()
    inputs = dict(zip(plan.entry_steps, traced.input_shapes))  # both in placeholder order
    console.print(_plan_table(plan, inputs, console.width))
    console.print(_comm_table(plan))
    if plan.warnings:
        console.print()
        console.print(Text(f"warnings ({len(plan.warnings)})", style="bold yellow"))
        for message in plan.warnings:
            console.print(Text("  ! " + message, style="yellow"))
    if program is None:
        return
    coord = rank_coordinate(mesh, args.rank)
    where = ", ".join(f"{a}={i}" for a, i in coord.items())
    console.print()
    console.rule(
        Text(f"rank {args.rank}'s program (mesh coordinate {where})", style="bold"), align="left"
    )
    console.print(
        Text(
            f"rank {args.rank} holds these shards of the parameters; every rank runs the "
            "same code on its own shards (fx's `x = None` frees after last use left out):",
            style="dim",
        )
    )
    console.print(_shards_table(plan, traced.parameters, coord))
    code = _FREES.sub("", program.code).strip("\n") + "\n"
    console.print(Syntax(code, "python", word_wrap=True, background_color="default"))


# ---------------------------------------------------------------------------- ops


def _callable_text(fn, module: bool = False) -> str:
    """A rule's or cost function's name (after its module's: `module`)."""
    owner = getattr(fn, "__self__", None)
    if owner is not None:  # a method of a parametrized cost: Product(left=1).flops
        return f"{owner!r}.{fn.__name__}"
    return f"{fn.__module__.rsplit('.', 1)[-1]}.{fn.__qualname__}" if module else fn.__qualname__


def _op_text(op) -> str:
    """An overload as torch prints it, without ``aten.``; a Python operator by its module."""
    if hasattr(op, "_schema"):
        return str(op).removeprefix("aten.")
    return f"{op.__module__.lstrip('_')}.{op.__name__}"


def entry_cells(entry: OpEntry) -> list[str]:
    """One row of `autoshard ops`: op, rule, FLOPs, backward, saved, lowerings."""
    rule = _callable_text(entry.rule, module=True) if entry.rule else "—"
    if entry.free:
        flops = backward = "free (a view)"
    else:
        flops = _callable_text(entry.flops) if entry.flops else "1 per element"
        backward = _callable_text(entry.backward) if entry.backward else "2× forward"
    saved = _callable_text(entry.saved) if entry.saved else "—"
    lowerings = "\n".join(lowering.name for lowering in entry.lowerings) or "—"  # one a line
    return [_op_text(entry.op), rule, flops, backward, saved, lowerings]


def ops(args, console: Console) -> None:
    chosen = [e for e in entries() if args.filter in str(e.op) or args.filter in _op_text(e.op)]
    if not chosen:
        raise UsageError(f"no op with an entry matches {args.filter!r}: try `autoshard ops`")
    table = Table(
        title=f"ops with a registry entry ({len(chosen)} of {len(entries())}; aten. left out)",
        title_justify="left",
        box=box.SIMPLE_HEAD,
    )
    table.add_column("op", no_wrap=True)
    for column in ("rule", "FLOPs", "backward", "saved for backward", "lowerings"):
        table.add_column(column, overflow="fold")
    for entry in sorted(chosen, key=lambda e: _op_text(e.op)):
        table.add_row(*map(_plain, entry_cells(entry)))
    console.print(table)
    counts = [
        sum(e.rule is not None for e in chosen),
        sum(e.saved is not None for e in chosen),
        sum(bool(e.lowerings) for e in chosen),
    ]
    console.print(
        "{} with a rule (an op without one runs replicated, with a warning), {} keeping "
        "something for backward, {} with a lowering".format(*counts)
    )


# ---------------------------------------------------------------------------- calibrate


def _link_cells(link) -> list[str]:
    return [f"{link.alpha * 1e6:.1f} µs", f"{link.beta / 1e9:.2f} GB/s"]


def calibrate(args, console: Console) -> None:
    import torch.distributed as dist

    from autoshard.cost.hardware import Hardware
    from autoshard.runtime import calibrate as calibration

    shape = parse_mesh(args.mesh)
    base = Hardware.load(args.base)  # an unknown base fails before any process starts
    joined = "RANK" in os.environ and not dist.is_initialized()  # launched by torchrun
    if joined:
        dist.init_process_group()
    try:
        measured = calibration.calibrate(shape, base=base)
    finally:
        if joined:
            dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) != 0:  # every rank has the same profile; one writes it
        return
    mesh = Mesh.from_shape(shape)
    table = Table(
        title=f"measured on mesh {mesh} (base profile {base.name!r})",
        box=box.SIMPLE_HEAD,
        title_justify="left",
    )
    for column in ("axis", "size", "α measured", "β measured", "α base", "β base"):
        table.add_column(column, justify="left" if column == "axis" else "right")
    for name, size, link, before in zip(mesh.names, mesh.sizes, measured.axes, base.axes):
        cells = _link_cells(link) if size > 1 else ["—", "—"]  # a size-1 axis keeps the base's
        table.add_row(name, str(size), *cells, *_link_cells(before))
    console.print(table)
    rate = measured.peak("float32") * measured.efficiency
    console.print(
        f"float32 matmul: {rate / 1e9:.1f} GFLOP/s per rank "
        f"(peak {measured.peak('float32') / 1e9:.1f} GFLOP/s at efficiency {measured.efficiency})"
    )
    measured.save(args.out)
    console.print(f"wrote {args.out}")


# ---------------------------------------------------------------------------- entry point


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autoshard", description="Plan PyTorch models for 3D tensor parallelism."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    show_parser = commands.add_parser(
        "show",
        help="trace and plan a model, print the plan and one rank's program",
        description="Trace and plan MODEL for a mesh (no processes needed) and print the plan, "
        "its predicted communication, and the program one rank runs.",
    )
    show_parser.add_argument(
        "model",
        metavar="MODEL",
        help="path/to/file.py:factory, a function returning (model, example_inputs)",
    )
    show_parser.add_argument("--mesh", required=True, help="mesh shape, e.g. 2x2x2 (axes a, b, c)")
    show_parser.add_argument(
        "--strategy",
        default=None,
        help=f"force one of {', '.join(FAMILIES)}, or a JSON object from module patterns to "
        'families, e.g. \'{"layers.*.fc1": "replicated"}\' (default: the solver chooses)',
    )
    show_parser.add_argument(
        "--budget",
        help="memory per rank the plan must fit, e.g. 80GiB (default: the hardware's memory)",
    )
    show_parser.add_argument(
        "--space",
        default="3d",
        choices=("3d", "all"),
        help="what the solver chooses from: the 3D families and replicated (3d), or also every "
        "role assignment and the named megatron and dp layouts (all) (default: 3d)",
    )
    show_parser.add_argument(
        "--loss-chunks",
        type=int,
        default=None,
        help="run the loss over its tokens in this many pieces (1: never; default: the "
        "solver chooses)",
    )
    show_parser.add_argument(
        "--no-overlap",
        action="store_true",
        help="run each gradient bucket's reduction to its end where backward launches it, "
        "and price it so (default: overlapped with the rest of backward)",
    )
    show_parser.add_argument(
        "--hardware",
        default=None,
        help="hardware preset (nvlink-8, ib-cluster, cpu-gloo) or a profile written by "
        "`autoshard calibrate` (default: nvlink-8)",
    )
    show_parser.add_argument(
        "--rank", type=int, default=0, help="whose program and shards to print (default: 0)"
    )
    show_parser.add_argument("--no-code", action="store_true", help="leave out the program")
    ops_parser = commands.add_parser(
        "ops",
        help="list the ops autoshard knows and what it knows of each",
        description="List every op with a registry entry: its rule, how its compute is "
        "priced, what it saves for backward, and its lowerings.",
    )
    ops_parser.add_argument(
        "filter", nargs="?", default="", help="only the ops whose name contains this"
    )
    calibrate_parser = commands.add_parser(
        "calibrate",
        help="measure alpha and beta per mesh axis and write a hardware profile",
        description="Time collectives over each axis of a live mesh and a matmul on every rank, "
        "fit alpha and beta per axis, print them and write a hardware profile (JSON) that "
        "--hardware accepts. Without torchrun it spawns the ranks locally (gloo on CPU); under "
        "torchrun every rank runs it and rank 0 prints and writes.",
    )
    calibrate_parser.add_argument(
        "--mesh", required=True, help="mesh shape, e.g. 2x2x2 (axes a, b, c)"
    )
    calibrate_parser.add_argument(
        "--out", default="profile.json", help="where to write the profile (default: profile.json)"
    )
    calibrate_parser.add_argument(
        "--base",
        default="cpu-gloo",
        help="preset or profile for what is not measured (default: cpu-gloo)",
    )
    return parser


def _console(stream) -> Console:
    if stream.isatty():
        return Console(file=stream, width=shutil.get_terminal_size().columns)
    return Console(file=stream, width=160)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    console = _console(sys.stdout)
    try:
        if args.command == "show":
            show(args, console)
        elif args.command == "calibrate":
            calibrate(args, console)
        elif args.command == "ops":
            ops(args, console)
    except (UsageError, AutoshardError) as e:
        message = " ".join(str(e).split())
        prefix = "" if isinstance(e, UsageError) else f"{type(e).__name__}: "
        errors = _console(sys.stderr)
        errors.print(
            Text(f"autoshard: error: {prefix}{message}", style="bold red"),
            soft_wrap=True,
            highlight=False,
        )
        sys.exit(EXIT_USAGE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
