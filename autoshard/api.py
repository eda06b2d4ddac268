"""The pipeline: trace → plan → emit → shard parameters.

plan = autoshard.plan(model, (2, 2, 2), (x,))          # no processes needed
parallel = autoshard.parallelize(model, mesh, (x,))     # on every rank of `mesh`

With many ranks, trace, plan and emit once and send the result to every rank:

compiled = autoshard.compile(model, (2, 2, 2), (x,))   # picklable, no weights inside
parallel = autoshard.parallelize(model, mesh, (x,), compiled=compiled)
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import fx
from torch.utils import _pytree as pytree

from autoshard import checkpoint, initialize
from autoshard.cost.hardware import Hardware
from autoshard.errors import InputError, MeshError, StrategyError
from autoshard.layout import Layout
from autoshard.mesh import Mesh
from autoshard.planning.options import PlanOptions
from autoshard.planning.plan import Plan
from autoshard.planning.planner import inputs_planned_with_grad
from autoshard.planning.solver import plan_model
from autoshard.planning.verify import check_plan, fingerprint
from autoshard.runtime import agreement, comm
from autoshard.runtime.agreement import checksum, ranks_text
from autoshard.strategies.inplace import check_updates_reach
from autoshard.tracing.modes import trace_modes
from autoshard.tracing.portable import Portable
from autoshard.tracing.trace import InputSpec, Traced, bind, forward_signature
from passes import BindMesh, ShardParameters, emit


def plan(
    model: torch.nn.Module,
    mesh_shape,
    example_inputs: tuple,
    *,
    strategy=None,
    memory_budget: float | None = None,
    hardware: Hardware | str | None = None,
    strategy_space: str = "3d",
    optimizer: str | float = "adam",
    overlap: bool | None = None,
    loss_chunks: int | None = None,
) -> Plan:
    """Plan `model` for a mesh of `mesh_shape` without any process group.

    With no `strategy`, the solver chooses per block a family and whether to
    recompute it, for the least predicted step time on `hardware` (a preset
    name, a profile path, or a Hardware; nvlink-8 by default) within
    `memory_budget` bytes per rank (by default the hardware's memory per
    device). `strategy` forces a family ("3d", "3d-allreduce", "replicated",
    "megatron", "dp", …: `autoshard.strategies.FAMILIES`) or
    a dict from module-path patterns (``"layers.*.fc1"``) to families; a
    single family with a budget only chooses where to recompute. `optimizer`
    sets the optimizer-state bytes per parameter byte ("adam", "sgd", … or a
    number). `overlap` (None, the default: on, or as a saved `plan` says) has
    backward launch the gradient buckets' reductions and go on computing, waiting
    for them only at its end, and prices them so; False runs each to completion
    where it is launched (`Plan.overlap`).
    `loss_chunks` runs the loss over its tokens in that many pieces (1:
    never; None, the default: the solver chooses, pricing the memory each count saves
    against its collectives' latency; `autoshard.planning.chunking`).
    """
    return trace_and_plan(
        model,
        mesh_shape,
        example_inputs,
        PlanOptions.from_user(
            strategy=strategy,
            memory_budget=memory_budget,
            hardware=hardware,
            strategy_space=strategy_space,
            optimizer=optimizer,
            overlap=overlap,
            loss_chunks=loss_chunks,
        ),
    )[1]


def trace_and_plan(
    model: torch.nn.Module, mesh_shape, example_inputs: tuple, options: PlanOptions
) -> tuple[Traced, Plan]:
    """`plan`, keeping the traced graph the plan is for (what `passes.emit` needs to
    write a rank's program, as `autoshard show` does)."""
    traced = trace_modes(model, example_inputs)
    return traced, plan_traced(traced, Mesh.from_shape(mesh_shape), options)


@dataclass(frozen=True)
class Compiled:
    """A model traced, planned and emitted once, for every rank: what `parallelize`
    needs besides the model's own weights. It pickles (no weights inside), so one
    process can make it and send it to the others, which then only cut their shards:

        compiled = autoshard.compile(model, (2, 2, 2), (x,))   # once, anywhere
        parallel = autoshard.parallelize(model, mesh, (x,), compiled=compiled)  # every rank

    `program` is the rank-independent program (collectives inserted, ops localized),
    its parameters and buffers left out; `weights` holds what it expects of each of
    the model's tensors (by FQN: shape, dtype, whether a parameter), `constants` the
    tensors the trace made that the model does not hold (lifted constants)."""

    plan: Plan
    program: Portable
    weights: dict[str, tuple[tuple[int, ...], torch.dtype, bool]]
    constants: dict[str, torch.Tensor]
    inputs: tuple[InputSpec, ...]
    out_spec: pytree.TreeSpec
    aliases: dict[str, tuple[str, ...]]
    transient: frozenset[str]
    training: bool
    refused_modes: dict[bool, str]
    planned_with_grad: dict[str, bool]
    plan_digest: str  # the plan's hash, which every rank compares before it runs

    @classmethod
    def emitted(cls, traced: Traced, plan: Plan, model: torch.nn.Module | None = None) -> Compiled:
        """Emit `traced`'s program for `plan`. The tensors `model` holds (by FQN, the same
        objects the trace saw) are left out of the result; every other one is kept."""
        check_updates_reach(traced.graph_module.graph, plan)
        own = _model_tensors(model) if model is not None else {}
        held = {fqn for fqn, t in traced.parameters.items() if own.get(fqn) is t}
        return cls(
            plan=plan,
            program=Portable.of(emit(traced, plan), leave_out=set(traced.parameters)),
            weights={
                fqn: (tuple(t.shape), t.dtype, isinstance(t, torch.nn.Parameter))
                for fqn, t in traced.parameters.items()
                if fqn in held
            },
            constants={f: t for f, t in traced.parameters.items() if f not in held},
            inputs=traced.inputs,
            out_spec=traced.out_spec,
            aliases=traced.aliases,
            transient=traced.transient,
            training=traced.training,
            refused_modes=traced.refused_modes,
            planned_with_grad=inputs_planned_with_grad(traced, plan),
            plan_digest=hashlib.sha256(plan.to_json().encode()).hexdigest(),
        )

    def parameters(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Every tensor the program reads, by FQN: `model`'s own (InputError if it lacks
        one or holds it at another shape or dtype) and the constants."""
        own = _model_tensors(model)
        found = {}
        for fqn, (shape, dtype, is_parameter) in self.weights.items():
            tensor = own.get(fqn)
            kind = "parameter" if is_parameter else "buffer"
            if tensor is None:
                raise InputError(
                    f"the model has no {kind} {fqn!r}, which the compiled program reads: "
                    "compile from the same model (class and configuration) as the one you pass"
                )
            if (tuple(tensor.shape), tensor.dtype) != (shape, dtype):
                raise InputError(
                    f"{kind} {fqn!r} is {str(tensor.dtype).removeprefix('torch.')}"
                    f"{list(tensor.shape)}; the program was compiled for "
                    f"{str(dtype).removeprefix('torch.')}{list(shape)}: compile from the "
                    "same model (class, configuration and dtype) as the one you pass"
                )
            found[fqn] = tensor
        # (an empty one, as a Hugging Face cache starts from, has no values to lack)
        unknown = sorted(f for f, t in self.constants.items() if t.is_meta and t.numel())
        if unknown and "lifted_tensor" not in unknown[0]:
            raise InputError(
                f"the model holds tensor {unknown[0]!r} as a plain attribute (neither a "
                "parameter nor a buffer), built on the meta device: nothing fills it. "
                "Register it as a buffer (register_buffer, persistent=False if it is not "
                "saved), or build the model on a real device"
            )
        if unknown:
            raise InputError(
                f"forward makes a tensor from Python data (torch.tensor of a list, or an "
                f"array; {self.program.read_at(unknown[0])}), traced on the meta device: "
                "the program keeps it as a constant "
                f"({unknown[0]!r}) and has no values for it. Make it with a factory "
                "(torch.full, torch.arange, torch.zeros) or from the inputs, or compile "
                "from the model built on a real device"
            )
        return {**found, **self.constants}


def _model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    return tensors


def compile(
    model: torch.nn.Module,
    mesh_shape,
    example_inputs: tuple,
    *,
    strategy=None,
    memory_budget: float | None = None,
    hardware: Hardware | str | None = None,
    strategy_space: str = "3d",
    optimizer: str | float = "adam",
    overlap: bool | None = None,
    loss_chunks: int | None = None,
    plan: Plan | None = None,
) -> Compiled:
    """Trace, plan and emit `model` for a mesh of `mesh_shape`, with no process group:
    the picklable `Compiled` that `parallelize(..., compiled=...)` applies on every
    rank without tracing or planning there. The keywords are `autoshard.plan`'s;
    `plan` applies a saved plan instead (checked against this model)."""
    options = PlanOptions.from_user(
        strategy=strategy,
        memory_budget=memory_budget,
        hardware=hardware,
        strategy_space=strategy_space,
        optimizer=optimizer,
        overlap=overlap,
        loss_chunks=loss_chunks,
    )
    return _compiled(model, Mesh.from_shape(mesh_shape), example_inputs, options, plan)


def _compiled(
    model: torch.nn.Module, mesh: Mesh, example_inputs: tuple, options: PlanOptions, plan
) -> Compiled:
    """`model` traced, planned (or `plan` checked) and emitted for `mesh`."""
    traced = trace_modes(model, example_inputs)
    return Compiled.emitted(traced, _applied(plan, traced, mesh, options), model)


def _applied(plan: Plan | None, traced: Traced, mesh: Mesh, options: PlanOptions) -> Plan:
    """`plan` checked against `traced` and `mesh`, or a new one solved for them."""
    if plan is None:
        return plan_traced(traced, mesh, options)
    if options.overlap is not None and plan.overlap != options.overlap:
        plan = replace(plan, overlap=options.overlap)  # a runtime setting: layouts stand
    saved_chunks = max((c.chunks for c in plan.chunked), default=1)
    if options.loss_chunks is not None and options.loss_chunks != saved_chunks:
        raise StrategyError(
            f"loss_chunks={options.loss_chunks}, but the plan given runs its loss in "
            f"{saved_chunks} piece(s): it is part of the plan, so plan again with it"
        )
    if plan.mesh != mesh:
        raise MeshError(f"the plan is for mesh {plan.mesh}, not {mesh}; plan again")
    check_plan(plan, traced)
    return plan


def parallelize(
    model: torch.nn.Module,
    mesh,
    example_inputs: tuple,
    *,
    strategy=None,
    memory_budget: float | None = None,
    hardware: Hardware | str | None = None,
    strategy_space: str = "3d",
    optimizer: str | float = "adam",
    overlap: bool | None = None,
    loss_chunks: int | None = None,
    plan: Plan | None = None,
    compiled: Compiled | None = None,
    check: bool | str = True,
) -> ParallelModule:
    """Rewrite `model` into the program this rank runs on `mesh` (a DeviceMesh).

    Call it on every rank with the same model, weights and full global inputs.
    The keywords are `autoshard.plan`'s; `plan` applies a saved plan
    (`Plan.load`) without solving again, once it is checked against this model
    and mesh. `compiled` (from `autoshard.compile`, made once and sent to every
    rank) applies a program already traced, planned and emitted: this rank only
    checks the model's weights against it (names, shapes, dtypes) and cuts its
    shards, so the model's code must be what it was compiled from. `check`
    compares, across ranks, a checksum of every example input and every weight
    together with the plan's hash, in one collective, and names the ranks and
    tensors that differ (True, the default); ``"always"`` also compares every
    call's inputs (one small collective per call); False compares the plan's
    hash only.
    """
    if check not in (True, False, "always"):
        raise StrategyError(f"check={check!r}: give True (the default), False or 'always'")
    _check_mesh(mesh)
    layout = Mesh.from_device_mesh(mesh)
    if compiled is None:
        options = PlanOptions.from_user(
            strategy=strategy,
            memory_budget=memory_budget,
            hardware=hardware,
            strategy_space=strategy_space,
            optimizer=optimizer,
            overlap=overlap,
            loss_chunks=loss_chunks,
        )
        compiled = _compiled(model, layout, example_inputs, options, plan)
    elif compiled.plan.mesh != layout:
        raise MeshError(
            f"the program was compiled for mesh {compiled.plan.mesh}, not {layout}; compile again"
        )
    parameters = compiled.parameters(model)
    _check_same_on_every_rank(compiled, parameters, example_inputs if check else None)
    bound = comm.BoundMesh(mesh, layout)
    program = ShardParameters(compiled.plan, parameters, bound)(compiled.program.build(parameters))
    program = BindMesh(bound)(program)
    return ParallelModule(program, compiled, bound, model, check_calls=check == "always")


def plan_traced(traced: Traced, mesh: Mesh, options: PlanOptions) -> Plan:
    """The plan for a model already traced (`trace_modes`), stamped with what the graph
    is made of: `plan` without tracing again, to plan one trace under several settings
    and compile it with `Compiled.emitted`."""
    plan = plan_model(traced, mesh, options)
    plan.graph = fingerprint(traced)
    return plan


def _check_same_on_every_rank(
    compiled: Compiled, parameters: dict[str, torch.Tensor], example_inputs
) -> None:
    """Every rank must run the same plan on the same inputs and weights: compare the
    plan's hash and, unless `example_inputs` is None, a checksum of every example
    input and weight (`parameters`) across the world, in one collective."""
    digest = compiled.plan_digest
    inputs, weights = {}, {}
    if example_inputs is not None:
        inputs = {spec.name: checksum(t) for spec, t in zip(compiled.inputs, example_inputs)}
        weights = {fqn: checksum(t) for fqn, t in parameters.items()}
    records = agreement.gathered((digest, inputs, weights))
    for name, ranks in agreement.differing(records, 1).items():
        raise InputError(
            f"example input {name!r} differs on {ranks_text(ranks)} from rank 0 "
            f"({_difference(records, 1, name, ranks[0])}): every rank must pass the same full "
            "global batch (autoshard splits it itself), not a per-rank shard such as a "
            "DistributedSampler gives; build the batch from the same seed or data on every rank"
        )
    for name, ranks in agreement.differing(records, 2).items():
        raise InputError(
            f"weight {name!r} differs on {ranks_text(ranks)} from rank 0 "
            f"({_difference(records, 2, name, ranks[0])}): every rank must hold the same "
            "model: build it after the same torch.manual_seed on every rank, or load the "
            "same checkpoint everywhere, before parallelize"
        )
    ranks = [r for r, record in enumerate(records) if record[0] != digest]
    if ranks:
        raise MeshError(
            f"{ranks_text(ranks)} planned differently from rank 0: give every rank the same "
            "model, example inputs and settings, or pass plan=Plan.load(...) everywhere"
        )


def _difference(records: list, key: int, name: str, rank: int) -> str:
    """How tensor `name` on `rank` differs from rank 0's: its shape, dtype or values."""
    shape, dtype, _ = records[0][key][name]
    theirs = records[rank][key].get(name)
    if theirs is None:
        return f"rank {rank} has no such tensor"
    if theirs[:2] != (shape, dtype):
        return f"{theirs[1]}{list(theirs[0])} on rank {rank}, {dtype}{list(shape)} on rank 0"
    return "same shape, other values"


def _check_mesh(mesh) -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise MeshError(
            "parallelize needs an initialized torch.distributed process group "
            "(torchrun, or init_process_group); use autoshard.plan to plan without one"
        )
    world = dist.get_world_size()
    if mesh.size() != world:
        raise MeshError(
            f"the mesh has {mesh.size()} devices ({tuple(mesh.mesh.shape)}) but the process "
            f"group has {world} ranks; build the mesh over all ranks, e.g. "
            f"init_device_mesh(device_type, shape) with prod(shape) == {world}"
        )


class ParallelModule(torch.nn.Module):
    """The program one rank runs. Parameters are this rank's shards under the
    model's FQNs; call it with the full global inputs on every rank and get
    the full outputs back on every rank."""

    def __init__(
        self,
        program: fx.GraphModule,
        compiled: Compiled,
        mesh: comm.BoundMesh,
        model: torch.nn.Module | None = None,
        check_calls: bool = False,
    ):
        super().__init__()
        object.__setattr__(self, "program", program)  # not a child: its parameters are ours
        # a model built on meta is kept (it holds no memory) to recompute its buffers
        meta = model is not None and any(t.is_meta for t in _model_tensors(model).values())
        object.__setattr__(self, "_source", model if meta else None)
        self._configs = checkpoint.hf_configs(model) if model is not None else {}
        self.plan = compiled.plan
        self._mesh = mesh
        self._traced_inputs = compiled.inputs
        self._input_shapes = tuple(spec.shape for spec in compiled.inputs)
        self._signature = forward_signature(model) if model is not None else None
        self._check_calls = check_calls
        self._aliases = compiled.aliases
        self._transient = compiled.transient
        self._out_spec = compiled.out_spec
        self._planned_with_grad = compiled.planned_with_grad
        self._refused_modes = compiled.refused_modes
        for name, child in program.named_children():
            self.add_module(name, child)
        for name, param in program.named_parameters(recurse=False):
            self.register_parameter(name, param)
        for name, buf in program.named_buffers(recurse=False):
            self.register_buffer(name, buf)
        self.train(compiled.training)

    @property
    def code(self) -> str:
        return self.program.code

    def train(self, mode: bool = True) -> ParallelModule:
        """Dropouts that follow the mode read the program's `training` flag at run time."""
        super().train(mode)
        self.program.train(mode)
        return self

    def forward(self, *args, **kwargs):
        if self.training in self._refused_modes:
            raise InputError(
                f"this module cannot run in {'train' if self.training else 'eval'} mode: "
                f"{self._refused_modes[self.training]}; parallelize the model again in that "
                f"mode (model.{'train' if self.training else 'eval'}())"
            )
        inputs = bind(self._signature, self._traced_inputs, args, kwargs)
        self._check_inputs(inputs)
        self._check_input_grads(inputs)
        if self._check_calls:
            self._check_inputs_agree(inputs)
        outputs = self.program(*inputs)
        return pytree.tree_unflatten(list(outputs), self._out_spec)

    def _check_input_grads(self, inputs) -> None:
        """An input's gradient is exact only if the plan was made for one that needs it."""
        if not torch.is_grad_enabled():
            return
        for (name, planned), t in zip(self._planned_with_grad.items(), inputs):
            if isinstance(t, torch.Tensor) and t.requires_grad and not planned:
                raise InputError(
                    f"input '{name}' requires grad, but this module was planned for an example "
                    "input that does not, so its gradient would not be summed over the mesh; "
                    "give parallelize (and autoshard.plan) the example with requires_grad_(True)"
                )

    def _check_inputs(self, inputs: list) -> None:
        """Call-time inputs must be what the module was planned for: shapes, dtypes, devices."""
        specs = self._traced_inputs
        # lists, not generators: torch.compile traces these checks into its guards
        shapes = tuple([tuple(t.shape) if isinstance(t, torch.Tensor) else None for t in inputs])
        if shapes != self._input_shapes:
            batch = len(shapes) == len(specs) and all(
                s is not None and s[1:] == spec.shape[1:] for s, spec in zip(shapes, specs)
            )
            hint = (
                " (a smaller last batch: DataLoader(drop_last=True), or a second "
                "parallelize for that batch size)"
                if batch
                else ""
            )
            raise InputError(
                f"inputs of shapes {list(shapes)} differ from the example inputs "
                f"{[spec.shape for spec in specs]} this module was planned for; parallelize "
                f"again with examples of the new shapes{hint}"
            )
        for t, spec in zip(inputs, specs):
            planned_device = spec.device.type == "meta" or t.device == spec.device
            if t.dtype != spec.dtype or not planned_device:
                raise InputError(
                    f"input {spec.name!r} is {str(t.dtype).removeprefix('torch.')} on {t.device}; "
                    f"this module was planned for {str(spec.dtype).removeprefix('torch.')} on "
                    f"{spec.device}: convert it (x.to(dtype, device)) or parallelize with "
                    "examples like it"
                )

    def _check_inputs_agree(self, inputs: list) -> None:
        """check="always": every rank must call with the same inputs (one collective)."""
        names = [spec.name for spec in self._traced_inputs]
        records = agreement.gathered((None, dict(zip(names, map(checksum, inputs)))))
        for name, ranks in agreement.differing(records, 1).items():
            raise InputError(
                f"call-time input {name!r} differs on {ranks_text(ranks)} from rank 0: every "
                "rank must pass the same full global batch (autoshard splits it itself)"
            )

    def __deepcopy__(self, memo):
        """A copy with its own parameters on the same mesh: the process groups are
        shared, not copied (they cannot be; the copy runs on the same ranks)."""
        memo[id(self._mesh)] = self._mesh
        clone = type(self).__new__(type(self))
        memo[id(self)] = clone
        for key, value in self.__dict__.items():
            object.__setattr__(clone, key, copy.deepcopy(value, memo))
        return clone

    def _gathered(
        self, tensors: dict[str, torch.Tensor | None], rank0_only: bool = False
    ) -> dict[str, torch.Tensor | None]:
        keep = not rank0_only or dist.get_rank() == 0
        dims = {
            fqn: (self.plan.storage.get(fqn) or Layout.replicated(local.ndim)).dims
            for fqn, local in tensors.items()
            if local is not None
        }
        if rank0_only:  # one gathered tensor in flight at a time: to host on rank 0
            full = {}
            for fqn, d in dims.items():
                whole = comm.gather_full(tensors[fqn], d, self._mesh)
                if keep:
                    full[fqn] = whole.cpu()
        else:
            shards = {fqn: (tensors[fqn], d) for fqn, d in dims.items()}
            full = comm.gather_full_many(shards, self._mesh)
        if not keep:
            return {}
        # a tensor no axis splits comes back as the live one: copied, every tensor returned
        # is a snapshot alike, which a later optimizer step changes none of
        full = {
            fqn: whole.detach().clone() if whole is tensors[fqn] else whole
            for fqn, whole in full.items()
        }
        return {name: full.get(fqn) for fqn in tensors for name in self._aliases.get(fqn, (fqn,))}

    def init_weights(self, seed: int | None = None) -> None:
        """Fill the shards of a model built on meta with its serial initialization
        under `seed` (`autoshard.initialize`): the full model equals the serial
        model built after ``torch.manual_seed(seed)``. A collective."""
        initialize.init_weights(self, seed)

    def full_state_dict(self, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """Every parameter and buffer at its original shape and name (a collective), as
        copies: a snapshot, which training on does not change.

        With `rank0_only`, the tensors are gathered one at a time and kept, on the
        CPU, by rank 0 alone (the others get an empty dict): no rank ever holds
        more than its shards and one full tensor, so a model too big for one
        device can be exported from its shards."""
        return self._gathered(self.local_state_dict(), rank0_only)

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's shard of every tensor of the model's state_dict (parameters and
        persistent buffers), by FQN; `plan.storage` says how each is split."""
        state = self.program.state_dict(keep_vars=True)
        return {fqn: t for fqn, t in state.items() if fqn not in self._transient}

    def full_grads(self, rank0_only: bool = False) -> dict[str, torch.Tensor | None]:
        """Every parameter's gradient at its original shape and name (a collective), as
        copies; `rank0_only` as in `full_state_dict`."""
        return self._gathered({n: p.grad for n, p in self.program.named_parameters()}, rank0_only)
