"""Write the plan's collectives into the graph, each a visible call naming its axis.

For every node the plan places, the steps on each tensor input go just
before it, and the node's own output steps (a 3D linear's reduce-scatter)
just after it, followed by any epilogue input (the linear's bias, added once
the partial sums are reduced). Model outputs are gathered to replicated.

    # before
    linear = aten.linear(x, w, b)
    # after
    all_gather = autoshard.runtime.comm.all_gather(x, axis='b', dim=0, backward=..., ...)
    (`BindMesh` adds each rank's ``mesh=`` later)
    linear = aten.linear(all_gather, w)
    reduce_scatter = autoshard.runtime.comm.reduce_scatter(linear, axis='c', dim=0, ...)
    add = aten.add(reduce_scatter, b)
"""

from __future__ import annotations

import operator

from torch import fx
from torch.ops import aten
from torch.utils import _pytree as pytree

from autoshard.layout import Step
from autoshard.planning.plan import Plan
from autoshard.runtime import ops
from autoshard.runtime.comm import STEP_FUNCTIONS, gather_bucket, grad_bucket, grad_wait
from autoshard.strategies.conv import CONVOLUTIONS
from autoshard.tracing.trace import tensor_inputs

# A layer whose bias is added after its output collectives runs without it first.
_WITHOUT_BIAS = {
    aten.linear.default: lambda x, w, b=None: (aten.linear.default, (x, w)),
    aten.addmm.default: lambda b, x, w: (aten.mm.default, (x, w)),
    **{
        conv: lambda x, w, b=None, *rest, conv=conv: (conv, (x, w, None, *rest))
        for conv in CONVOLUTIONS
    },
}


def _add_bias(graph: fx.Graph, out: fx.Node, bias: fx.Node, node: fx.Node, op) -> fx.Node:
    """`out + bias`, the bias [channels] broadcast over the space dims of a convolution
    (`op`: the node's op as traced, before it was rewritten)."""
    if op in CONVOLUTIONS:
        spatial = node.meta["val"].dim() - 2
        bias = graph.call_function(aten.view.default, (bias, [-1] + [1] * spatial))
        bias.meta["autoshard_serves"] = node.name
    added = graph.call_function(aten.add.Tensor, (out, bias))
    added.meta["val"] = node.meta["val"]
    added.meta["autoshard_serves"] = node.name
    return added


def _step_kwargs(step: Step) -> dict:
    kwargs = {"axis": step.axis}
    if step.dim is not None:
        kwargs["dim"] = step.dim
    kwargs["backward"] = step.backward
    return kwargs


def _apply_steps(graph: fx.Graph, value: fx.Node, steps: tuple[Step, ...], node: str) -> fx.Node:
    val = value.meta.get("val")
    for step in steps:
        kwargs = dict(_step_kwargs(step), node=node)
        value = graph.call_function(STEP_FUNCTIONS[step.kind], (value,), kwargs)
        value.meta["val"] = val  # the global value, so later passes still see a tensor here
        value.meta["autoshard_serves"] = node
    return value


def _replace_tensor_args(node: fx.Node, replacements: list[fx.Node]) -> None:
    tensor_args = iter(replacements)
    originals = set(tensor_inputs(node))

    def swap(a):
        return next(tensor_args) if isinstance(a, fx.Node) and a in originals else a

    node.args, node.kwargs = pytree.tree_map(swap, (node.args, node.kwargs))


class InsertCollectives:
    def __init__(self, plan: Plan):
        self.plan = plan
        # (node, input index) → the value it computes on: a shared conversion, or a
        # parameter after its gradient buckets
        self.converted: dict[tuple[str, int], fx.Node] = {}
        self.shared = {(s.node, s.input): (s.source, s.source_input) for s in plan.shared}

    def __call__(self, gm: fx.GraphModule) -> fx.GraphModule:
        graph = gm.graph
        parameters = self._insert_wait(graph)
        self._insert_buckets(graph, parameters)
        self._insert_gathers(graph, parameters)
        for node in list(graph.nodes):
            if node.op == "placeholder":
                with graph.inserting_before(node.next):
                    entry = _apply_steps(graph, node, self.plan.entry_steps[node.name], node.name)
                self._replace_uses(node, entry)
            elif node.op == "call_function" and node.name in self.plan.nodes:
                self._rewrite(graph, node)
            elif node.op == "output":
                with graph.inserting_before(node):
                    outs = [
                        _apply_steps(graph, v, steps, "output")
                        for v, steps in zip(tensor_inputs(node), self.plan.output_steps)
                    ]
                _replace_tensor_args(node, outs)
        graph.lint()
        gm.recompile()
        return gm

    def _rewrite(self, graph: fx.Graph, node: fx.Node) -> None:
        placed = self.plan.nodes[node.name]
        inputs = tensor_inputs(node)
        regather = placed.strategy.regather
        with graph.inserting_before(node):
            converted = [
                self._converted(graph, node.name, i, v, steps, i in regather)
                for i, (v, steps) in enumerate(zip(inputs, placed.input_steps))
            ]
        _replace_tensor_args(node, converted)
        op = node.target
        epilogue = [converted[i] for i in placed.strategy.epilogue]
        if epilogue:
            node.target, node.args = _WITHOUT_BIAS[node.target](*node.args)
        for i in regather:  # the op gathers this input itself, and keeps only the shard
            steps = tuple((s.kind, _step_kwargs(s)) for s in placed.input_steps[i])
            index = node.args.index(converted[i])
            node.kwargs = dict(node.kwargs, index=index, steps=steps, node=node.name)
            node.target, node.args = ops.keep_shard, (str(node.target), *node.args)
        if not placed.output_steps and not epilogue:
            return
        with graph.inserting_before(node.next):
            out = _apply_steps(graph, node, placed.output_steps, node.name)
            for bias in epilogue:
                out = _add_bias(graph, out, bias, node, op)
        self._replace_uses(node, out)

    def _converted(self, graph, name: str, i: int, value, steps, regather: bool) -> fx.Node:
        if regather:
            return value
        key = self.shared.get((name, i), (name, i))
        if key not in self.converted:
            self.converted[key] = _apply_steps(graph, value, steps, name)
        return self.converted[key]

    def _insert_wait(self, graph: fx.Graph) -> dict[tuple[str, int], fx.Node]:
        """With `Plan.overlap`, one `grad_wait` before the first op, which autograd runs
        last: every parameter a bucket (of either kind) serves passes through it, so
        that backward waits there for the reductions the buckets launched. Returns
        (node, input) → the parameter the buckets take."""
        nodes = {n.name: n for n in graph.nodes}
        parameters = {
            (name, i): tensor_inputs(nodes[name])[i]
            for bucket in (*self.plan.buckets, *self.plan.gathers)
            for name, i in bucket.serves
        }
        if not self.plan.overlap or not parameters:
            return parameters
        first_op = next(n for n in graph.nodes if n.op == "call_function")
        with graph.inserting_before(first_op):
            return self._passed(graph, grad_wait, (tuple(parameters.values()),), {}, parameters)

    def _insert_buckets(self, graph: fx.Graph, parameters: dict) -> None:
        """One `grad_bucket` call per bucket, where the plan places it (`bucket_places`:
        before the first node that reads a parameter of one): the parameters it serves
        pass through it (and through the bucket of another axis placed with it).
        Autograd runs a bucket's backward once every reader's is done, and, as it
        takes ready nodes latest-made first, before the backward of the ops above it.
        With `Plan.overlap` that backward only launches the reductions, so they run
        while those ops' backward does, and the `grad_wait` waits for them."""
        if not self.plan.buckets:
            return
        nodes = {n.name: n for n in graph.nodes}
        places = self.plan.bucket_places()
        current = {served: parameters[served] for b in self.plan.buckets for served in b.serves}
        for bucket in self.plan.buckets:
            serves = tuple(name for name, _ in bucket.serves)
            kwargs = {"axis": bucket.axis, "node": bucket.name, "serves": serves}
            if len(bucket.calls) > 1:
                kwargs["calls"] = bucket.calls
            if self.plan.overlap:
                kwargs["overlap"] = True
            values = tuple(current[served] for served in bucket.serves)
            with graph.inserting_before(nodes[places[bucket.name]]):
                passed = {served: current[served] for served in bucket.serves}
                current.update(self._passed(graph, grad_bucket, (values,), kwargs, passed))
        self.converted.update(current)

    def _insert_gathers(self, graph: fx.Graph, parameters: dict) -> None:
        """One `gather_bucket` call per gather bucket, before the node the plan places it
        (in that node's checkpoint region: a replay gathers again); its outputs are
        what the readers compute on. With `Plan.overlap` its backward launches the
        reduce-scatter, as a gradient bucket's does."""
        nodes = {n.name: n for n in graph.nodes}
        for bucket in self.plan.gathers:
            first = bucket.place
            steps = [self.plan.nodes[name].input_steps[i][0] for name, i in bucket.serves]
            values = {served: parameters[served] for served in bucket.serves}
            kwargs = {
                "axis": bucket.axis,
                "dims": tuple(s.dim for s in steps),
                "node": bucket.name,
                "serves": tuple(name for name, _ in bucket.serves),
            }
            if self.plan.overlap:
                kwargs["overlap"] = True
            args = (tuple(values.values()),)
            with graph.inserting_before(nodes[first]):
                self.converted.update(
                    self._passed(graph, gather_bucket, args, kwargs, values, serves=first)
                )

    @staticmethod
    def _passed(graph: fx.Graph, function, args, kwargs, values: dict, serves=None) -> dict:
        """`values` (key → node) passed through one call of `function`, which returns
        them in order: key → the call's output for it (`serves`: the node the call
        counts as part of, by default itself)."""
        name = kwargs.get("node", function.__name__)
        call = graph.create_node("call_function", function, args, kwargs, name=name)
        call.meta["autoshard_serves"] = serves or name
        out = {}
        for k, (key, value) in enumerate(values.items()):
            out[key] = graph.call_function(operator.getitem, (call, k))
            out[key].meta["val"] = value.meta.get("val")
            out[key].meta["autoshard_serves"] = serves or name
        return out

    @staticmethod
    def _replace_uses(node: fx.Node, new: fx.Node) -> None:
        if new is not node:
            node.replace_all_uses_with(
                new, delete_user_cb=lambda user: user is not _first_user(new, node)
            )


def _first_user(last: fx.Node, origin: fx.Node) -> fx.Node:
    """The node of the chain `origin → … → last` that reads `origin` directly."""
    while last.args and last.args[0] is not origin:
        last = last.args[0]
    return last
