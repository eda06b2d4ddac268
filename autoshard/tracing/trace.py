"""Trace a model into an ATen-level fx graph with global shapes.

`torch.export.export(strict=False)` handles the models `symbolic_trace`
cannot (Hugging Face transformers among them). Its graph takes parameters
and buffers as inputs; we turn those back into `get_attr` nodes named by
their original FQNs, so the graph reads like the model and the emitted
program keeps the model's parameter names.

    >>> traced = trace(torch.nn.Linear(4, 2), (torch.randn(3, 4),))
    >>> [n.op for n in traced.graph_module.graph.nodes]
    ['get_attr', 'get_attr', 'placeholder', 'call_function', 'output']
"""

from __future__ import annotations

import inspect
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property

import torch
from torch import fx
from torch.nn.modules import transformer as transformer_module
from torch.utils import _pytree as pytree

from autoshard.errors import InputError, TraceError
from autoshard.tracing.canonical import canonicalize
from autoshard.tracing.regions import (
    check_custom_functions,
    custom_functions_recorded,
    inline_regions,
)


@dataclass(frozen=True)
class InputSpec:
    """One example input: the forward parameter it binds to, and what it was."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


@dataclass
class Traced:
    graph_module: fx.GraphModule
    input_shapes: tuple[tuple[int, ...], ...]
    out_spec: pytree.TreeSpec
    parameters: dict[str, torch.Tensor]  # FQN → tensor (parameters and buffers)
    aliases: dict[str, tuple[str, ...]]  # FQN → every name the model knows it by (tied weights)
    transient: frozenset[str] = frozenset()  # FQNs not in the model's state_dict (non-persistent)
    training: bool = True  # the mode a ParallelModule starts in (`autoshard.tracing.modes`)
    refused_modes: dict[bool, str] = field(default_factory=dict)  # mode → why not
    inputs: tuple[InputSpec, ...] = ()  # what each example input was, in placeholder order
    signature: inspect.Signature | None = field(default=None, repr=False)  # of model.forward

    @cached_property
    def nodes(self) -> dict[str, fx.Node]:
        """The graph's nodes by name (plans name nodes, passes and costs look them up)."""
        return {n.name: n for n in self.graph_module.graph.nodes}


def _built_on_meta(model: torch.nn.Module) -> bool:
    tensors = [*model.parameters(), *model.buffers()]
    return bool(tensors) and all(t.device.type == "meta" for t in tensors)


def trace(model: torch.nn.Module, example_inputs: tuple) -> Traced:
    if not isinstance(example_inputs, tuple) or not all(
        isinstance(t, torch.Tensor) for t in example_inputs
    ):
        raise TraceError("example_inputs must be a tuple of tensors with global shapes")
    if _built_on_meta(model):  # traced where its tensors are: real inputs would mix devices
        example_inputs = tuple(
            t.detach().to("meta").requires_grad_(t.requires_grad) for t in example_inputs
        )
    forward_signature, names, args, kwargs = _bound(model, _unaliased(example_inputs))
    try:
        with (
            custom_functions_recorded() as custom_functions,
            _masks_applied_as_given(),
            _scalar_tensors_traced(),
        ):
            exported = torch.export.export(model, args, kwargs, strict=False)
    except Exception as e:  # torch raises many kinds; all mean the same to the user
        raise TraceError(_export_failed(model, e)) from e

    _check_no_objects(exported, model)
    check_custom_functions(model, custom_functions)
    inline_regions(exported.graph_module)
    _check_static_shapes(exported.graph, model)
    signature = exported.graph_signature
    if signature.buffers_to_mutate or signature.user_inputs_to_mutate:
        raise TraceError(
            f"{type(model).__name__} mutates buffers or inputs in forward "
            f"({sorted(signature.buffers_to_mutate.values())}); autoshard plans pure forward passes"
        )
    state = dict(exported.state_dict)
    state.update(exported.constants)
    fqn_of = {**signature.inputs_to_parameters, **signature.inputs_to_buffers}
    fqn_of.update(signature.inputs_to_lifted_tensor_constants)

    # Tied weights reach the graph once per name: give them one node, named as the model
    # first names the tensor, so that they stay one parameter with one gradient.
    aliases = tied_names(model, [fqn_of[name] for name in fqn_of])
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    attrs: dict[str, fx.Node] = {}
    for node in exported.graph.nodes:
        if node.op == "placeholder" and node.name in fqn_of:
            fqn = aliases[fqn_of[node.name]][0]
            if fqn not in attrs:
                attrs[fqn] = graph.get_attr(fqn)
                attrs[fqn].meta = dict(node.meta)
            env[node] = attrs[fqn]
        else:
            env[node] = graph.node_copy(node, lambda n: env[n])
    canonicalize(graph)
    graph.lint()
    parameters = {
        fqn: state[fqn] if fqn in state else state[_first_in(aliases[fqn], state)] for fqn in attrs
    }
    graph_module = fx.GraphModule(parameters, graph)
    out_spec = exported.call_spec.out_spec
    shapes = tuple(tuple(t.shape) for t in example_inputs)
    transient = frozenset(signature.non_persistent_buffers) | frozenset(
        signature.inputs_to_lifted_tensor_constants.values()
    )
    specs = tuple(
        InputSpec(name, tuple(t.shape), t.dtype, t.device) for name, t in zip(names, example_inputs)
    )
    return Traced(
        graph_module,
        shapes,
        out_spec,
        parameters,
        {f: aliases[f] for f in attrs},
        transient,
        inputs=specs,
        signature=forward_signature,
    )


@contextmanager
def _masks_applied_as_given():
    """While tracing, an attention mask given to `nn.Transformer`'s layers without an
    ``is_causal`` hint is applied as it is.

    Those layers ask whether such a mask is causal by comparing its values with a
    causal mask (``_detect_is_causal_mask``), which torch.export cannot trace: a
    branch on data. The answer only chooses how the mask is applied (as a causal
    kernel's flag, or as the mask itself), not what the layer computes: torch's own
    documentation of that function says so, and so the traced graph applies it."""
    detect = transformer_module._detect_is_causal_mask
    transformer_module._detect_is_causal_mask = _causal_only_if_said
    try:
        yield
    finally:
        transformer_module._detect_is_causal_mask = detect


def _causal_only_if_said(mask, is_causal=None, size=None) -> bool:
    return is_causal is True


@contextmanager
def _scalar_tensors_traced():
    """While tracing, ``torch.tensor`` of one Python number made on the meta device is
    ``torch.full`` of it.

    torch.export keeps a tensor that forward makes from Python data as a constant of
    the program, with the values it had while tracing; a model built on the meta
    device makes it on meta (Hugging Face's GPT-Neo: ``torch.tensor(finfo.min,
    device=attn_weights.device)``), where it has none. As ``full``, it is an op of
    the graph with its value as an argument, made on each rank's device when the
    program runs. The two make the same tensor (dtype as inferred from the number).
    Off meta the constant keeps its value, and torch.export can branch on it (``if
    torch.tensor(2.0) > 1``), which it cannot on an op's result: left as it is."""
    tensor = torch.tensor
    tracing_thread = threading.get_ident()  # the patch is process-wide; others pass through

    def traced(data, *, dtype=None, device=None, requires_grad=False, pin_memory=False):
        target = torch.device(torch.get_default_device() if device is None else device)
        number = type(data) in (bool, int, float) and not pin_memory
        if number and target.type == "meta" and threading.get_ident() == tracing_thread:
            return torch.full((), data, dtype=dtype, device=device, requires_grad=requires_grad)
        return tensor(
            data, dtype=dtype, device=device, requires_grad=requires_grad, pin_memory=pin_memory
        )

    torch.tensor = traced
    try:
        yield
    finally:
        torch.tensor = tensor


def _export_failed(model: torch.nn.Module, error: Exception) -> str:
    """What torch.export said (its first line, and the call in forward it names),
    and what the user can do; no guess at the cause: its reasons are many."""
    lines = [line.strip() for line in str(error).splitlines()]
    said = next((line for line in lines if line), "")
    message = f"torch.export could not trace {type(model).__name__}: {type(error).__name__}: {said}"
    if "The following call raised this error:" in lines:
        start = lines.index("The following call raised this error:") + 1
        call = [line for line in lines[start : start + 3] if line][:2]
        message += "\n  raised by: " + " | ".join(call)
    return (
        message + "\nautoshard plans the graph torch.export makes of forward on the example "
        "inputs, and its whole message is this error's cause. To see it alone, run "
        "torch.export.export(model, example_inputs, strict=False) (a smaller example "
        "traces faster); if that traces the model, report it to autoshard with the model."
    )


def bind(
    signature: inspect.Signature | None, inputs: tuple[InputSpec, ...], args: tuple, kwargs: dict
) -> list:
    """Call-time arguments in the order of the example inputs `inputs`, bound by `forward`'s
    signature (so positional and keyword calls alike work); InputError if they
    do not bind, or give an argument the example inputs did not."""
    if not kwargs and len(args) == len(inputs):
        return list(args)
    if signature is None:
        raise InputError(
            f"this module takes its {len(inputs)} inputs positionally, as the example "
            f"inputs were given; it got {len(args)} positional and {sorted(kwargs)} by keyword"
        )
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as e:
        raise InputError(
            f"the call does not match forward{signature}: {e}; pass the inputs "
            f"{[spec.name for spec in inputs]} as the example inputs were passed"
        ) from None
    names = [spec.name for spec in inputs]
    extra = [  # an argument passed at its default (None, say) changes nothing traced
        n
        for n, value in bound.arguments.items()
        if n not in names and value is not signature.parameters[n].default
    ]
    if extra:
        raise InputError(
            f"argument(s) {extra} were not among the example inputs {names} this module "
            "was planned for; parallelize again with them in the example inputs"
        )
    missing = [n for n in names if n not in bound.arguments]
    if missing:
        raise InputError(f"input(s) {missing} are missing: this module was planned with {names}")
    return [bound.arguments[n] for n in names]


def _unaliased(example_inputs: tuple) -> tuple:
    """The example inputs with every one that shares memory with an earlier one copied.

    torch.export traces aliased inputs as one value: given ``(ids, ids)`` for
    ``(input_ids, labels)``, the graph would read ``input_ids`` for both, and a later
    call with other labels would silently compute with the ids. Traced apart, each
    input is its own placeholder, as the program must be for any call."""
    seen: set = set()
    distinct = []
    for t in example_inputs:
        key = id(t) if t.device.type == "meta" else t.untyped_storage().data_ptr()
        if key in seen:
            t = t.detach().clone().requires_grad_(t.requires_grad)
        seen.add(key)
        distinct.append(t)
    return tuple(distinct)


def forward_signature(model: torch.nn.Module) -> inspect.Signature | None:
    """`model.forward`'s signature, the one call-time arguments bind by; None where
    inputs go positionally, as given (a builtin or C forward, or ``*args``)."""
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None
    kinds = inspect.Parameter
    if any(p.kind == kinds.VAR_POSITIONAL for p in signature.parameters.values()):
        return None
    return signature


def _bound(model: torch.nn.Module, example_inputs: tuple):
    """(forward's signature, the parameter name of each example input, export's args
    and kwargs). The examples bind to forward's parameters in declaration order, the
    keyword-only ones too, so a forward(self, *, x) traces from (x,)."""
    signature = forward_signature(model)
    if signature is None:
        return None, [f"input {i}" for i in range(len(example_inputs))], example_inputs, {}
    kinds = inspect.Parameter
    params = list(signature.parameters.values())
    positional = [
        p.name for p in params if p.kind != kinds.KEYWORD_ONLY and p.kind != kinds.VAR_KEYWORD
    ]
    keyword = [p.name for p in params if p.kind == kinds.KEYWORD_ONLY]
    names = (positional + keyword)[: len(example_inputs)]
    if len(names) < len(example_inputs):
        raise TraceError(
            f"{type(model).__name__}.forward{signature} takes {len(positional) + len(keyword)} "
            f"inputs but {len(example_inputs)} example inputs were given"
        )
    cut = min(len(positional), len(example_inputs))
    kwargs = dict(zip(names[cut:], example_inputs[cut:]))
    return signature, names, example_inputs[:cut], kwargs


def _check_no_objects(exported, model: torch.nn.Module) -> None:
    """An object made in forward that is no tensor (a `torch.Generator` seeded there)
    becomes an input of the exported graph that no layout describes: name its reader."""
    lifted = exported.graph_signature.inputs_to_lifted_custom_objs
    for node in exported.graph.nodes:
        if node.op == "placeholder" and node.name in lifted:
            kind = getattr(node.meta.get("val"), "class_fqn", "object")
            readers = ", ".join(f"'{u.name}' ({u.target})" for u in node.users) or "none"
            raise TraceError(
                f"{type(model).__name__}: forward makes a {kind} (read by {readers}), which "
                "autoshard cannot place on a mesh; draw from the default generator (seeded "
                "with torch.manual_seed), or make the tensor once in __init__ and register "
                "it as a buffer"
            )


def _check_static_shapes(graph: fx.Graph, model: torch.nn.Module) -> None:
    """A value whose size depends on tensor values (boolean-mask indexing, nonzero,
    unique) cannot be split ahead of time: name the op that makes it."""
    for node in graph.nodes:
        val = node.meta.get("val")
        sizes = tuple(val.shape) if isinstance(val, torch.Tensor) else ()
        if isinstance(val, torch.SymInt) or any(not isinstance(s, int) for s in sizes):
            path = module_path(node)
            where = f", module '{path}'" if path else ""
            shape = list(sizes) if sizes else val
            raise TraceError(
                f"{type(model).__name__}: node '{node.name}' ({node.target}{where}) has a "
                f"data-dependent shape {shape}: its size depends on tensor values (boolean-mask "
                "indexing x[mask], nonzero, unique), which autoshard cannot split ahead of time; "
                "keep the shape fixed, e.g. torch.where(mask, x, 0) or x * mask"
            )


def _first_in(names, state) -> str:
    return next(n for n in names if n in state)


def tied_names(model: torch.nn.Module, fqns) -> dict[str, tuple[str, ...]]:
    """Per FQN of `fqns`, every name `model` gives its tensor, in the model's order
    (tied weights: the embedding's name first, then the lm-head's)."""
    names: dict[int, list[str]] = {}
    for name, tensor in [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]:
        names.setdefault(id(tensor), []).append(name)
    out = {}
    for fqn in fqns:
        try:
            tensor = model.get_parameter(fqn)
        except AttributeError:
            tensor = model.get_buffer(fqn) if fqn in dict(model.named_buffers()) else None
        out[fqn] = tuple(names.get(id(tensor), [fqn]))
    return out


def differentiable(tensor: torch.Tensor) -> bool:
    """Whether a gradient can flow through `tensor`: floating point or complex (a
    model's FFT mixing carries the gradient through complex values)."""
    return tensor.is_floating_point() or tensor.is_complex()


def tensor_inputs(node: fx.Node) -> tuple[fx.Node, ...]:
    """The tensor-valued fx nodes among a node's arguments, in argument order.

    Remembered on the node until its arguments change (the planner and the cost
    model ask for every node many times)."""
    args, kwargs = node.args, node.kwargs
    known = node.meta.get("autoshard_tensor_inputs")
    if known is not None and known[0] is args and known[1] is kwargs:
        return known[2]
    leaves = pytree.tree_leaves((args, kwargs))
    found = tuple(
        a for a in leaves if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)
    )
    node.meta["autoshard_tensor_inputs"] = (args, kwargs, found)
    return found


def structure(node: fx.Node) -> int:
    """What an op computes, with no names: its target, its arguments (each tensor as
    its kind, shape and dtype; everything else as it is) and its result's shapes.
    Two nodes of equal structure, given inputs laid out alike, are planned and
    costed alike: the planner and the cost model reuse one's answers for the other,
    so the blocks of a deep model cost the time of one. A number, equal for nodes
    of equal structure; remembered on the node until its arguments change."""
    known = node.meta.get("autoshard_structure")
    if known is not None and known[0] is node.args and known[1] is node.kwargs:
        return known[2]
    described = (
        node.op,
        str(node.target),
        _described((node.args, node.kwargs)),
        _described(node.meta.get("val")),
    )
    found = _STRUCTURES.setdefault(described, len(_STRUCTURES))
    node.meta["autoshard_structure"] = (node.args, node.kwargs, found)
    return found


# Every structure seen, numbered: keys made of structures then hash as small ints.
_STRUCTURES: dict[tuple, int] = {}


def _described(value):
    if isinstance(value, fx.Node):
        return ("node", value.op, _described(value.meta.get("val")))
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.requires_grad)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_described(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((k, _described(v)) for k, v in value.items()))
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


def module_path(node: fx.Node) -> str:
    """The FQN of the innermost module the node was traced in ('' for the root)."""
    stack = node.meta.get("nn_module_stack") or {}
    return next(reversed(stack.values()))[0] if stack else ""
