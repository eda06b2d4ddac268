"""The plan: one strategy per node, the steps between them, and what they cost.

The planner writes a `Plan`; the passes read it and nothing else.
"""

from __future__ import annotations

import dataclasses
import json
import math
import operator
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path

from autoshard.cost.model import Cost
from autoshard.errors import PlanError
from autoshard.layout import Layout, Step
from autoshard.mesh import Mesh
from autoshard.strategies import Lowering, Strategy, lowering_named
from autoshard.strategies.loss import class_dim


@dataclass
class NodePlan:
    name: str
    op: str
    module: str
    shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    strategy: Strategy
    input_steps: tuple[tuple[Step, ...], ...]  # per tensor input, in argument order
    output_steps: tuple[Step, ...]
    input_needs_grad: tuple[bool, ...]
    needs_grad: bool

    def renamed(self, name: str, module: str) -> NodePlan:
        """This plan for another node placed alike: the same strategy and steps, shared."""
        # Not copy.copy, which goes through __reduce_ex__: the planner renames a plan for
        # every node of every identical block, in every variant it plans.
        placed = object.__new__(NodePlan)
        placed.__dict__.update(self.__dict__)
        placed.name, placed.module = name, module
        return placed

    def steps_with_grad(self) -> list[tuple[Step, bool]]:
        """Every step of this node, with whether its backward runs."""
        out = [
            (step, grad)
            for steps, grad in zip(self.input_steps, self.input_needs_grad)
            for step in steps
        ]
        own = list(self.strategy.internal) + list(self.output_steps)
        return out + [(step, self.needs_grad) for step in own]

    def regathered_steps(self) -> list[Step]:
        """The collectives backward runs again to rebuild inputs saved as shards."""
        return [
            step
            for i in self.strategy.regather
            for step in self.input_steps[i]
            if step.forward_collective != "none"
        ]


@dataclass(frozen=True)
class SharedInput:
    """Input `input` of `node` is converted exactly as input `source_input` of the earlier
    `source` (the same value, the same steps, the same unit of the step): it reads that
    conversion instead of running its own, and backward reduces their gradients once."""

    node: str
    input: int
    source: str
    source_input: int


BUCKET_BYTES = 25 << 20  # DDP's default bucket cap: the most one gradient call reduces


def bucket_calls(nbytes: int) -> int:
    """The calls a bucket of `nbytes` takes: ⌈nbytes / BUCKET_BYTES⌉."""
    return math.ceil(nbytes / BUCKET_BYTES)


@dataclass(frozen=True)
class Packed:
    """Parameters of one dtype whose collectives over `axis` run as one flat buffer of
    `nbytes`: each (node, input) it serves is a parameter that node reads."""

    name: str
    axis: str
    group_size: int
    dtype: str
    nbytes: int
    serves: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class Bucket(Packed):
    """The parameter gradients all-reduced over `axis` together: each parameter it
    serves has steps that include a ``grad_all_reduce`` over `axis`. When the last of
    them is ready, backward reduces their `nbytes` as one flat buffer, in calls of at
    most `BUCKET_BYTES` (`calls`): ⌈nbytes / BUCKET_BYTES⌉ of them, which is what the
    solver prices."""

    @property
    def calls(self) -> tuple[tuple[str, int], ...]:
        """(name, bytes) of each call: the buffer cut every `BUCKET_BYTES`."""
        count = bucket_calls(self.nbytes)
        if count == 1:
            return ((self.name, self.nbytes),)
        sizes = [BUCKET_BYTES] * (count - 1) + [self.nbytes - BUCKET_BYTES * (count - 1)]
        return tuple((f"{self.name}#{k}", nbytes) for k, nbytes in enumerate(sizes))


@dataclass(frozen=True)
class GatherBucket(Packed):
    """Parameters of one unit of the step gathered over `axis` together, as FSDP gathers
    a layer's: each parameter it serves, in graph order, has one step, an all-gather
    over `axis` that backward reduce-scatters. Before `place`, the unit's first node,
    the program gathers their shards as one flat buffer (one call of `nbytes`, the
    gathered size), and once the last of their gradients is ready, backward
    reduce-scatters them as one. Gathered early and reduced late, they
    are held longer than one at a time: `pending` lists, per node of the program from
    `place` on, the bytes it holds for later readers (their gathered parameters in
    forward, their gradients in backward; at `place` also the flat buffers: the
    gathered one, and this rank's shards, or its part of the gradients)."""

    place: str
    pending: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class ChunkedLoss:
    """The loss `loss` and the product `head` that makes its logits (through `between`,
    views and casts) run over the tokens in `chunks` pieces, one after the other: only a
    piece of the logits-sized buffers (the head's local product before its output
    collectives, the loss's gradient) lives at a time. The tokens are cut along dim
    `dim` of the head's output. Each piece runs the head's output collectives and the
    loss's reductions over the vocabulary on its own share of the bytes (`chunks` calls
    where one would do); the gathered operands and the reduction over tokens run once."""

    head: str
    between: tuple[str, ...]
    loss: str
    chunks: int
    dim: int

    @property
    def nodes(self) -> tuple[str, ...]:
        return (self.head, *self.between, self.loss)


@dataclass(frozen=True)
class Call:
    """One collective a step runs (`Plan.predicted_calls`)."""

    node: str  # the node it serves, or a bucket's name
    kind: str
    axis: str
    phase: str  # forward | backward | recompute
    nbytes: int
    group_size: int

    @property
    def ring_bytes(self) -> float:
        """Bytes a rank sends on a ring: (n−1)/n of the buffer, twice for all-reduce."""
        n = self.group_size
        return (2 if self.kind == "all_reduce" else 1) * (n - 1) / n * self.nbytes


@dataclass
class Plan:
    mesh: Mesh
    nodes: dict[str, NodePlan]  # call_function nodes, in graph order
    storage: dict[str, Layout]  # parameters and buffers (by FQN) and inputs (by name)
    entry_steps: dict[str, tuple[Step, ...]]  # inputs, given whole, split on entry
    output_steps: tuple[tuple[Step, ...], ...]
    warnings: list[str] = field(default_factory=list)
    regions: dict[str, str] = field(default_factory=dict)  # node → checkpoint region it is in
    choices: dict[str, str] = field(default_factory=dict)  # unit → option the solver chose
    cost: Cost | None = None
    graph: list = field(default_factory=list)  # the graph it was made for (`fingerprint`)
    reasons: dict[str, str] = field(default_factory=dict)  # unit → why the solver chose so
    # node → why it left its family for the next (planner fallback); the solver's plan
    # copies the notes of the nodes it keeps into `warnings`, so this is not saved
    fallbacks: dict[str, str] = field(default_factory=dict, compare=False)
    shared: tuple[SharedInput, ...] = ()  # conversions read by several nodes, run once
    buckets: tuple[Bucket, ...] = ()  # parameter-gradient reductions packed together
    gathers: tuple[GatherBucket, ...] = ()  # parameter gathers packed together, per unit
    # backward launches the buckets' reductions and waits at its end: they run while
    # the ops above the first parameter a bucket serves compute their gradients
    overlap: bool = True
    # whether `share_collectives` packs parameter gathers (`gathers`): the solver plans
    # without them where the weights they hold early keep a budget from fitting
    gather_buckets: bool = field(default=True, compare=False)
    chunked: tuple[ChunkedLoss, ...] = ()  # losses run over their tokens in pieces

    def chunks(self, name: str) -> int:
        """In how many pieces node `name` runs (1 unless a `ChunkedLoss` cuts it)."""
        return next((c.chunks for c in self.chunked if name in c.nodes), 1)

    def _per_chunk(self, node: NodePlan) -> list[Step]:
        """`node`'s steps that each piece of a `ChunkedLoss` runs: a head's output
        collectives, a loss's reductions over the vocabulary."""
        for c in self.chunked:
            if node.name == c.head:
                return list(node.output_steps)
            if node.name == c.loss:
                scores = node.strategy.inputs[0].dims
                vocab = scores[class_dim(len(scores))]
                return [s for s in node.strategy.internal if s.axis in vocab]
        return []

    @cached_property
    def conversions(self) -> dict[tuple[str, int], str]:
        """(node, input) → the name of the conversion it reads, for every input of
        `shared` (the source's too): a conversion several nodes read is one tensor."""
        out = {}
        for s in self.shared:
            out[s.node, s.input] = out[s.source, s.source_input] = f"{s.source}:{s.source_input}"
        return out

    @cached_property
    def _skipped(self) -> frozenset[tuple[str, int]]:
        return frozenset((s.node, s.input) for s in self.shared)

    @cached_property
    def _bucketed(self) -> frozenset[tuple[str, int, str]]:
        return frozenset((n, i, b.axis) for b in self.buckets for n, i in b.serves)

    @cached_property
    def _bucketed_nodes(self) -> frozenset[str]:
        return frozenset(n for n, _, _ in self._bucketed)

    @cached_property
    def _gathered(self) -> dict[tuple[str, int], bool]:
        """(node, input) a gather bucket serves → whether it is the bucket's first."""
        return {served: k == 0 for b in self.gathers for k, served in enumerate(b.serves)}

    @cached_property
    def gather_pending(self) -> dict[str, int]:
        """Node → the bytes gather buckets hold while it runs for later readers
        (`GatherBucket.pending`)."""
        out: dict[str, int] = defaultdict(int)
        for b in self.gathers:
            for name, nbytes in b.pending:
                out[name] += nbytes
        return dict(out)

    def node_steps(self, node: NodePlan) -> list[tuple[Step, bool]]:
        """`node`'s steps that run as its own calls (with whether their backward runs):
        not the conversions it shares with an earlier node, nor the parameter gathers
        a gather bucket runs, and, for its parameters' gradients reduced in a bucket,
        the step without its backward."""
        out = []
        for i, (steps, grad) in enumerate(zip(node.input_steps, node.input_needs_grad)):
            if (node.name, i) not in self._skipped and (node.name, i) not in self._gathered:
                out += [(s, grad and (node.name, i, s.axis) not in self._bucketed) for s in steps]
        own = list(node.strategy.internal) + list(node.output_steps)
        out += [(step, node.needs_grad) for step in own]
        per_chunk, k = self._per_chunk(node), self.chunks(node.name)
        if not per_chunk:
            return out
        pieces = []  # each step of a piece: k calls of 1/k of the bytes
        for step, grad in out:
            if any(step is s for s in per_chunk):
                pieces += [(dataclasses.replace(step, nbytes=step.nbytes // k), grad)] * k
            else:
                pieces.append((step, grad))
        return pieces

    def gathered_steps(self, node: NodePlan) -> list[tuple[Step, bool]]:
        """`node`'s parameter gathers that a gather bucket runs, with whether the step
        is the bucket's first: the one whose cost carries the call's latency (the
        others only move their bytes in it)."""
        return [
            (step, self._gathered[node.name, i])
            for i, steps in enumerate(node.input_steps)
            if (node.name, i) in self._gathered
            for step in steps
        ]

    def bucketed_steps(self, node: NodePlan) -> list[tuple[int, Step]]:
        """`node`'s steps whose backward a bucket runs, with the input each serves."""
        if node.name not in self._bucketed_nodes:
            return []
        return [
            (i, s)
            for i, steps in enumerate(node.input_steps)
            for s in steps
            if (node.name, i, s.axis) in self._bucketed
        ]

    def bucket_places(self) -> dict[str, str]:
        """Bucket name → the node the program places it before: the first that reads a
        parameter it serves, or one that a bucket it shares a parameter with serves (a
        parameter reduced over two axes passes through a bucket of each, together).
        Its backward runs once backward is past that node: the reductions launch there."""
        order = {name: k for k, name in enumerate(self.nodes)}
        first = {b.name: min(order[n] for n, _ in b.serves) for b in self.buckets}
        sharing: dict[tuple[str, int], list[str]] = defaultdict(list)
        for b in self.buckets:
            for served in b.serves:
                sharing[served].append(b.name)
        changed = True
        while changed:  # the earliest place of each group that shares parameters
            changed = False
            for names in sharing.values():
                low = min(first[n] for n in names)
                changed |= any(first[n] != low for n in names)
                first.update(dict.fromkeys(names, low))
        names = list(self.nodes)
        return {bucket: names[k] for bucket, k in first.items()}

    def predicted_calls(self) -> list[Call]:
        """Every collective one training step runs, in no particular order."""
        out = []

        def call(name: str, kind: str, step: Step, phase: str) -> None:
            out.append(Call(name, kind, step.axis, phase, step.nbytes, step.group_size))

        served = [(node.name, self.node_steps(node)) for node in self.nodes.values()]
        served.append(("output", [(step, True) for steps in self.output_steps for step in steps]))
        for name, steps in served:
            for step, grad in steps:
                if step.forward_collective != "none":
                    call(name, step.forward_collective, step, "forward")
                    if name in self.regions:
                        call(name, step.forward_collective, step, "recompute")
                if step.backward_collective != "none" and grad:
                    call(name, step.backward_collective, step, "backward")
        for node in self.nodes.values():
            for step in node.regathered_steps():
                call(node.name, step.forward_collective, step, "backward")
        for b in self.buckets:
            for name, nbytes in b.calls:
                out.append(Call(name, "all_reduce", b.axis, "backward", nbytes, b.group_size))
        for g in self.gathers:
            replayed = g.place in self.regions
            for phase in ("forward", "backward", *(("recompute",) if replayed else ())):
                kind = "reduce_scatter" if phase == "backward" else "all_gather"
                out.append(Call(g.name, kind, g.axis, phase, g.nbytes, g.group_size))
        return out

    def stored_layout(self, node) -> Layout | None:
        """How the value of fx node `node` is stored: a placed node's output, one of the
        outputs of a node with several (a getitem), or an input or parameter from
        `storage` (None for what the plan does not lay out)."""
        placed = self.nodes.get(node.name)
        if placed is not None:
            return placed.strategy.stored if placed.shape else None
        if node.op == "call_function" and node.target is operator.getitem:
            parent, index = node.args
            outputs = self.nodes[parent.name].strategy.outputs if parent.name in self.nodes else ()
            return outputs[index] if isinstance(index, int) and index < len(outputs) else None
        return self.storage.get(node.target if node.op == "get_attr" else node.name)

    def to_json(self) -> str:
        return json.dumps(plan_to_dict(self), indent=1)

    @classmethod
    def from_json(cls, text: str, where: str = "text") -> Plan:
        """The plan `to_json` wrote; PlanError naming the field if anything is off."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError(
                f"plan {where} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); "
                "a truncated file reads so: save the plan again"
            ) from None
        return plan_from_dict(data)

    def save(self, path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path) -> Plan:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise PlanError(f"cannot read a plan from {str(path)!r}: {e.strerror}") from None
        return cls.from_json(text, repr(str(path)))

    def predicted_comm(self) -> dict[tuple[str, str, str, str], int]:
        """Bytes per (node, kind, axis, phase) that running one step will log."""
        out: dict[tuple[str, str, str, str], int] = defaultdict(int)
        for call in self.predicted_calls():
            out[call.node, call.kind, call.axis, call.phase] += call.nbytes
        return dict(out)


# JSON (no pickle): plans are saved, read by people, and applied without solving again.
# Reading checks every field and names the one at fault (``plan.nodes[3].strategy.stored``).

SCHEMA_VERSION = 5  # 2: the graph fingerprint; 3: shared conversions and gradient buckets;
# 4: chunked losses; 5: gather buckets


def _layout_dict(layout: Layout | None):
    return None if layout is None else {"dims": layout.dims, "partial": layout.partial}


def _strategy_dict(s: Strategy) -> dict:
    return {
        "family": s.family,
        "inputs": [_layout_dict(x) for x in s.inputs],
        "output": _layout_dict(s.output),
        "stored": _layout_dict(s.stored),
        "grad_partial": [sorted(g) for g in s.grad_partial],
        "storage": [_layout_dict(x) for x in s.storage],
        "epilogue": s.epilogue,
        "lowering": s.lowering.name if s.lowering is not None else None,
        "internal": [asdict(x) for x in s.internal],
        "outputs": [_layout_dict(x) for x in s.outputs],
        "detail": s.detail,
        "split_weight": s.split_weight,
        "regather": s.regather,
    }


def _node_dict(n: NodePlan) -> dict:
    return {
        "name": n.name,
        "op": n.op,
        "module": n.module,
        "shape": n.shape,
        "local_shape": n.local_shape,
        "strategy": _strategy_dict(n.strategy),
        "input_steps": [[asdict(s) for s in steps] for steps in n.input_steps],
        "output_steps": [asdict(s) for s in n.output_steps],
        "input_needs_grad": n.input_needs_grad,
        "needs_grad": n.needs_grad,
    }


def plan_to_dict(plan: Plan) -> dict:
    return {
        "version": SCHEMA_VERSION,
        "mesh": {"names": plan.mesh.names, "sizes": plan.mesh.sizes},
        "graph": plan.graph,
        "nodes": [_node_dict(n) for n in plan.nodes.values()],
        # by name: a model may meet its buffers in an order that differs between
        # processes (iterating a set), and every rank must hash the same text
        "storage": {k: _layout_dict(v) for k, v in sorted(plan.storage.items())},
        "entry_steps": {k: [asdict(s) for s in v] for k, v in plan.entry_steps.items()},
        "output_steps": [[asdict(s) for s in steps] for steps in plan.output_steps],
        "warnings": plan.warnings,
        "regions": plan.regions,
        "choices": plan.choices,
        "reasons": plan.reasons,
        "cost": plan.cost.to_dict() if plan.cost else None,
        "shared": [asdict(x) for x in plan.shared],
        "buckets": [asdict(b) for b in plan.buckets],
        "gathers": [asdict(g) for g in plan.gathers],
        "overlap": plan.overlap,
        "chunked": [asdict(c) for c in plan.chunked],
    }


def plan_from_dict(d) -> Plan:
    version = d.get("version") if isinstance(d, dict) else None
    if version != SCHEMA_VERSION:
        older = version is None or (isinstance(version, int) and version < SCHEMA_VERSION)
        raise PlanError(
            f"plan saved by an {'older' if older else 'other'} autoshard (schema version "
            f"{version or 1}, this one reads {SCHEMA_VERSION}): it cannot be checked against "
            "the model it was made for; plan again (autoshard.plan(...).save(path))"
        )
    r = _Reader()
    mesh_data = r.field(d, "mesh", "plan", dict)
    names = tuple(r.items(r.field(mesh_data, "names", "plan.mesh", list), "plan.mesh.names", str))
    sizes = tuple(
        r.items(r.field(mesh_data, "sizes", "plan.mesh.sizes", list), "plan.mesh.sizes", int)
    )
    if len(names) != 3 or len(sizes) != 3 or len(set(names)) != 3 or min(sizes) < 1:
        raise PlanError(
            f"plan.mesh must name three distinct axes of positive sizes, not {names} {sizes}"
        )
    r.mesh = Mesh(names, sizes)
    graph = r.field(d, "graph", "plan", list)
    if not graph:
        raise PlanError(
            "plan.graph is empty: the plan cannot be checked against a model; save plans "
            "made by autoshard.plan (which records the graph), or plan again"
        )
    shapes = _graph_shapes(graph)
    nodes = {}
    for i, node in enumerate(r.field(d, "nodes", "plan", list)):
        placed = r.node(node, f"plan.nodes[{i}]")
        nodes[placed.name] = placed
    storage = {}
    for name, layout in r.field(d, "storage", "plan", dict).items():
        path = f"plan.storage[{name!r}]"
        storage[name] = r.layout(layout, path)
        if graph and name not in shapes:
            raise PlanError(f"{path}: the plan's graph has no input or parameter {name!r}")
        r.divides(storage[name], shapes.get(name), path)
    entry = {
        name: tuple(r.steps(steps, f"plan.entry_steps[{name!r}]"))
        for name, steps in r.field(d, "entry_steps", "plan", dict).items()
    }
    outputs = tuple(
        tuple(r.steps(steps, f"plan.output_steps[{i}]"))
        for i, steps in enumerate(r.field(d, "output_steps", "plan", list))
    )
    regions = r.strings(r.field(d, "regions", "plan", dict), "plan.regions")
    unknown = sorted(set(regions) - set(nodes))
    if unknown:
        raise PlanError(f"plan.regions names nodes the plan does not have: {unknown[:5]}")
    cost = r.field(d, "cost", "plan", (dict, type(None)))
    try:
        cost = Cost.from_dict(cost) if cost is not None else None
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise PlanError(f"plan.cost is malformed ({type(e).__name__}: {e})") from None
    shared = r.field(d, "shared", "plan", list)
    buckets = r.field(d, "buckets", "plan", list)
    return Plan(
        mesh=r.mesh,
        nodes=nodes,
        storage=storage,
        entry_steps=entry,
        output_steps=outputs,
        warnings=r.items(r.field(d, "warnings", "plan", list), "plan.warnings", str),
        regions=regions,
        choices=r.strings(r.field(d, "choices", "plan", dict), "plan.choices"),
        cost=cost,
        graph=graph,
        reasons=r.strings(r.field(d, "reasons", "plan", dict), "plan.reasons"),
        shared=tuple(r.shared(x, f"plan.shared[{i}]", nodes) for i, x in enumerate(shared)),
        buckets=tuple(r.bucket(x, f"plan.buckets[{i}]", nodes) for i, x in enumerate(buckets)),
        gathers=tuple(
            r.gather(x, f"plan.gathers[{i}]", nodes)
            for i, x in enumerate(r.field(d, "gathers", "plan", list))
        ),
        overlap=r.field(d, "overlap", "plan", bool),
        chunked=tuple(
            r.chunked(x, f"plan.chunked[{i}]", nodes)
            for i, x in enumerate(r.field(d, "chunked", "plan", list))
        ),
    )


def _graph_shapes(graph: list) -> dict[str, tuple[int, ...]]:
    """Input and parameter name → shape, from a plan's graph fingerprint."""
    out = {}
    for i, entry in enumerate(graph):
        if not (isinstance(entry, list) and len(entry) == 5 and isinstance(entry[0], str)):
            raise PlanError(f"plan.graph[{i}] must be [name, op, arguments, dtype, shape]")
        name, op, _, _, shape = entry
        if op in ("input", "parameter"):
            if not (isinstance(shape, list) and all(isinstance(s, int) for s in shape)):
                raise PlanError(f"plan.graph[{i}] ({name!r}): its shape must be a list of sizes")
            out[name] = tuple(shape)
    return out


_STEP_KINDS = (
    "all_gather",
    "reduce_scatter",
    "all_reduce",
    "split",
    "grad_all_reduce",
    "to_partial",
)
_BACKWARDS = ("split", "reduce_scatter", "all_gather", "all_reduce", "identity")


class _Reader:
    """Typed reads of the plan's JSON: each names the field it reads when it fails."""

    mesh: Mesh

    @staticmethod
    def check(value, path: str, kind):
        kinds = kind if isinstance(kind, tuple) else (kind,)
        ok = isinstance(value, kinds) and (bool in kinds or not isinstance(value, bool))
        if not ok:
            names = {dict: "an object", list: "a list", str: "a string", int: "an integer"}
            want = " or ".join(names.get(k, k.__name__) for k in kinds)
            raise PlanError(f"{path} must be {want}, not {json.dumps(value)[:60]}")
        return value

    def field(self, data, key: str, path: str, kind):
        self.check(data, path, dict)
        if key not in data:
            raise PlanError(
                f"{path}.{key} is missing: the file is incomplete, or was saved before "
                "autoshard wrote that field; plan again (autoshard.plan(...).save(path))"
            )
        return self.check(data[key], f"{path}.{key}", kind)

    def items(self, values, path: str, kind) -> list:
        return [self.check(v, f"{path}[{i}]", kind) for i, v in enumerate(values)]

    def strings(self, data: dict, path: str) -> dict[str, str]:
        return {k: self.check(v, f"{path}[{k!r}]", str) for k, v in data.items()}

    @staticmethod
    def lowering(name: str | None, path: str) -> Lowering | None:
        if name is None:
            return None
        try:
            return lowering_named(name)
        except KeyError as e:
            raise PlanError(f"{path}.lowering: {e.args[0]}") from None

    def axis(self, value, path: str) -> str:
        if value not in self.mesh.names:
            raise PlanError(
                f"{path} names mesh axis {value!r}; the plan's mesh has {list(self.mesh.names)}"
            )
        return value

    def layout(self, data, path: str) -> Layout | None:
        if data is None:
            return None
        dims = self.field(data, "dims", path, list)
        axes = [
            tuple(
                self.axis(a, f"{path}.dims[{d}][{j}]")
                for j, a in enumerate(self.check(dim, f"{path}.dims[{d}]", list))
            )
            for d, dim in enumerate(dims)
        ]
        partial = self.field(data, "partial", path, list)
        partial = tuple(self.axis(a, f"{path}.partial[{j}]") for j, a in enumerate(partial))
        used = [a for dim in axes for a in dim] + list(partial)
        if len(used) != len(set(used)):
            raise PlanError(f"{path} uses a mesh axis twice ({used})")
        return Layout(tuple(axes), partial)

    def layouts(self, data, path: str) -> tuple:
        return tuple(
            self.layout(x, f"{path}[{i}]") for i, x in enumerate(self.check(data, path, list))
        )

    def step(self, data, path: str) -> Step:
        kind = self.field(data, "kind", path, str)
        if kind not in _STEP_KINDS:
            raise PlanError(f"{path}.kind {kind!r} is not one of {', '.join(_STEP_KINDS)}")
        axis = self.axis(self.field(data, "axis", path, str), f"{path}.axis")
        dim = self.field(data, "dim", path, (int, type(None)))
        backward = self.field(data, "backward", path, str)
        if backward not in _BACKWARDS:
            raise PlanError(f"{path}.backward {backward!r} is not one of {', '.join(_BACKWARDS)}")
        nbytes = self.field(data, "nbytes", path, int)
        group = self.field(data, "group_size", path, int)
        if group != self.mesh.size(axis):
            raise PlanError(
                f"{path}.group_size {group} is not the size {self.mesh.size(axis)} of axis {axis!r}"
            )
        extra = sorted(set(data) - {"kind", "axis", "dim", "backward", "nbytes", "group_size"})
        if extra:
            raise PlanError(f"{path} has unknown fields {extra}")
        return Step(kind, axis, dim, backward, nbytes, group)

    def served_input(self, node, index, path: str, nodes: dict) -> tuple[str, int]:
        self.check(node, path, str)
        self.check(index, path, int)
        if node not in nodes or not 0 <= index < len(nodes[node].input_steps):
            raise PlanError(f"{path} names input {index} of node {node!r}, which the plan lacks")
        return node, index

    def shared(self, data, path: str, nodes: dict) -> SharedInput:
        node, index = self.served_input(
            self.field(data, "node", path, str), self.field(data, "input", path, int), path, nodes
        )
        source, source_input = self.served_input(
            self.field(data, "source", path, str),
            self.field(data, "source_input", path, int),
            path,
            nodes,
        )
        if nodes[node].input_steps[index] != nodes[source].input_steps[source_input]:
            raise PlanError(f"{path}: {node!r} and {source!r} convert their inputs differently")
        return SharedInput(node, index, source, source_input)

    def bucket(self, data, path: str, nodes: dict) -> Bucket:
        return Bucket(*self._bucket_fields(data, path, nodes))

    def gather(self, data, path: str, nodes: dict) -> GatherBucket:
        pending = []
        for i, x in enumerate(self.field(data, "pending", path, list)):
            name, nbytes = self.check(x, f"{path}.pending[{i}]", list)[:2]
            if name not in nodes or not isinstance(nbytes, int):
                raise PlanError(f"{path}.pending[{i}] is not a node of the plan and its bytes")
            pending.append((name, nbytes))
        place = self.field(data, "place", path, str)
        if place not in nodes:
            raise PlanError(f"{path}.place: the plan has no node {place!r}")
        return GatherBucket(*self._bucket_fields(data, path, nodes), place, tuple(pending))

    def _bucket_fields(self, data, path: str, nodes: dict) -> tuple:
        axis = self.axis(self.field(data, "axis", path, str), f"{path}.axis")
        group = self.field(data, "group_size", path, int)
        if group != self.mesh.size(axis):
            raise PlanError(f"{path}.group_size {group} is not the size of axis {axis!r}")
        serves = tuple(
            self.served_input(*self.check(x, f"{path}.serves[{i}]", list)[:2], path, nodes)
            for i, x in enumerate(self.field(data, "serves", path, list))
        )
        name, dtype = self.field(data, "name", path, str), self.field(data, "dtype", path, str)
        return name, axis, group, dtype, self.field(data, "nbytes", path, int), serves

    def chunked(self, data, path: str, nodes: dict) -> ChunkedLoss:
        names = [self.field(data, key, path, str) for key in ("head", "loss")]
        between = self.items(self.field(data, "between", path, list), f"{path}.between", str)
        for name in [*names, *between]:
            if name not in nodes:
                raise PlanError(f"{path}: the plan has no node {name!r}")
        chunks, dim = self.field(data, "chunks", path, int), self.field(data, "dim", path, int)
        if chunks < 1 or not 0 <= dim < len(nodes[names[0]].shape) - 1:
            raise PlanError(f"{path}: {chunks} chunks along dim {dim} of {names[0]!r}")
        return ChunkedLoss(names[0], tuple(between), names[1], chunks, dim)

    def steps(self, data, path: str) -> list[Step]:
        return [self.step(x, f"{path}[{i}]") for i, x in enumerate(self.check(data, path, list))]

    def divides(self, layout: Layout | None, shape, path: str) -> None:
        if layout is None or shape is None:
            return
        if layout.ndim != len(shape):
            raise PlanError(
                f"{path} lays out {layout.ndim} dims, the tensor has shape {list(shape)}"
            )
        problem = layout.indivisible(shape, self.mesh)
        if problem:
            raise PlanError(f"{path} ({layout}) cannot split shape {list(shape)}: {problem}")

    def strategy(self, d, path: str) -> Strategy:
        family = self.field(d, "family", path, str)  # a rule's own name for it ("follow")
        grad = self.field(d, "grad_partial", path, list)
        return Strategy(
            family=family,
            inputs=self.layouts(self.field(d, "inputs", path, list), f"{path}.inputs"),
            output=self.layout(self.field(d, "output", path, (dict, type(None))), f"{path}.output"),
            stored=self.layout(self.field(d, "stored", path, (dict, type(None))), f"{path}.stored"),
            grad_partial=tuple(
                frozenset(
                    self.axis(a, f"{path}.grad_partial[{i}]")
                    for a in self.check(g, f"{path}.grad_partial[{i}]", list)
                )
                for i, g in enumerate(grad)
            ),
            storage=self.layouts(self.field(d, "storage", path, list), f"{path}.storage"),
            epilogue=tuple(
                self.items(self.field(d, "epilogue", path, list), f"{path}.epilogue", int)
            ),
            lowering=self.lowering(self.field(d, "lowering", path, (str, type(None))), path),
            internal=tuple(self.steps(self.field(d, "internal", path, list), f"{path}.internal")),
            outputs=self.layouts(self.field(d, "outputs", path, list), f"{path}.outputs"),
            detail=self.field(d, "detail", path, str),
            split_weight=self.field(d, "split_weight", path, (bool, type(None))),
            regather=tuple(
                self.items(self.field(d, "regather", path, list), f"{path}.regather", int)
            ),
        )

    def node(self, d, path: str) -> NodePlan:
        name = self.field(d, "name", path, str)
        path = f"{path} ({name!r})"
        strategy = self.strategy(self.field(d, "strategy", path, dict), f"{path}.strategy")
        shape = tuple(self.items(self.field(d, "shape", path, list), f"{path}.shape", int))
        local = tuple(
            self.items(self.field(d, "local_shape", path, list), f"{path}.local_shape", int)
        )
        input_steps = tuple(
            tuple(self.steps(steps, f"{path}.input_steps[{i}]"))
            for i, steps in enumerate(self.field(d, "input_steps", path, list))
        )
        needs = tuple(
            self.items(
                self.field(d, "input_needs_grad", path, list), f"{path}.input_needs_grad", bool
            )
        )
        n = len(strategy.inputs)
        if not len(input_steps) == len(needs) == len(strategy.grad_partial) == n:
            raise PlanError(
                f"{path}: strategy.inputs, grad_partial, input_steps and input_needs_grad must "
                f"have one entry per input ({n})"
            )
        if shape:
            self.divides(strategy.stored, shape, f"{path}.strategy.stored")
            if local != strategy.stored.local_shape(shape, self.mesh):
                raise PlanError(
                    f"{path}.local_shape {list(local)} is not shape {list(shape)} split as "
                    f"{strategy.stored}"
                )
        return NodePlan(
            name=name,
            op=self.field(d, "op", path, str),
            module=self.field(d, "module", path, str),
            shape=shape,
            local_shape=local,
            strategy=strategy,
            input_steps=input_steps,
            output_steps=tuple(
                self.steps(self.field(d, "output_steps", path, list), f"{path}.output_steps")
            ),
            input_needs_grad=needs,
            needs_grad=self.field(d, "needs_grad", path, bool),
        )
