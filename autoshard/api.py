"""The pipeline: trace → plan → emit → shard parameters.

plan = autoshard.plan(model, (2, 2, 2), (x,))          # no processes needed
parallel = autoshard.parallelize(model, mesh, (x,))     # on every rank of `mesh`
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
from torch import fx
from torch.utils import _pytree as pytree

from autoshard import checkpoint, comm
from autoshard.cost import OPTIMIZERS
from autoshard.errors import InputError, MeshError, StrategyError
from autoshard.hardware import DEFAULT, Hardware
from autoshard.layout import Layout
from autoshard.mesh import Mesh
from autoshard.plan import Plan
from autoshard.solver import plan_model
from autoshard.trace import Traced, trace
from passes import ShardParameters, emit


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
) -> Plan:
    """Plan `model` for a mesh of `mesh_shape` without any process group.

    With no `strategy`, the solver chooses per block a family and whether to
    recompute it, for the least predicted step time on `hardware` (a preset
    name, a profile path, or a Hardware; nvlink-8 by default) within
    `memory_budget` bytes per rank (by default the hardware's memory per
    device). `strategy` forces a family ("3d", "3d-allreduce", "replicated") or
    a dict from module-path patterns (``"layers.*.fc1"``) to families; a
    single family with a budget only chooses where to recompute. `optimizer`
    sets the optimizer-state bytes per parameter byte ("adam", "sgd", … or a
    number).
    """
    traced = trace(model, example_inputs)
    mesh = Mesh.from_shape(mesh_shape)
    return _solved(traced, mesh, strategy, memory_budget, hardware, strategy_space, optimizer)


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
    plan: Plan | None = None,
) -> ParallelModule:
    """Rewrite `model` into the program this rank runs on `mesh` (a DeviceMesh).

    Call it on every rank with the same model and inputs. The keywords are
    `autoshard.plan`'s; `plan` applies a saved plan (`Plan.load`) without
    solving again.
    """
    _check_mesh(mesh)
    layout = Mesh.from_device_mesh(mesh)
    traced = trace(model, example_inputs)
    if plan is None:
        plan = _solved(traced, layout, strategy, memory_budget, hardware, strategy_space, optimizer)
    elif plan.mesh != layout:
        raise MeshError(f"the plan is for mesh {plan.mesh}, not {layout}; plan again")
    _check_same_on_every_rank(plan)
    program = emit(traced, plan)
    bound = comm.BoundMesh(mesh, layout)
    with comm.bound(bound):
        program = ShardParameters(plan, traced.parameters)(program)
    return ParallelModule(program, plan, traced, bound, model)


def _solved(traced, mesh, strategy, memory_budget, hardware, strategy_space, optimizer) -> Plan:
    return plan_model(
        traced,
        mesh,
        strategy=strategy,
        memory_budget=memory_budget,
        hardware=_hardware(hardware),
        strategy_space=strategy_space,
        optimizer=_optimizer(optimizer),
    )


def _hardware(hardware) -> Hardware:
    return hardware if isinstance(hardware, Hardware) else Hardware.load(hardware or DEFAULT)


def _optimizer(optimizer) -> float:
    if isinstance(optimizer, str):
        if optimizer not in OPTIMIZERS:
            raise StrategyError(
                f"unknown optimizer {optimizer!r}: choose one of {sorted(OPTIMIZERS)}"
            )
        return OPTIMIZERS[optimizer]
    return float(optimizer)


def _check_same_on_every_rank(plan: Plan) -> None:
    """Every rank must run the same plan: compare a hash of it across the world."""
    digest = hashlib.sha256(plan.to_json().encode()).hexdigest()
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest)
    if len(set(digests)) != 1:
        ranks = [r for r, d in enumerate(digests) if d != digests[0]]
        raise MeshError(
            f"ranks {ranks} planned differently from rank 0: give every rank the same model, "
            "example inputs and settings, or pass plan=Plan.load(...) everywhere"
        )


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
        plan: Plan,
        traced: Traced,
        mesh: comm.BoundMesh,
        model: torch.nn.Module,
    ):
        super().__init__()
        object.__setattr__(self, "program", program)  # not a child: its parameters are ours
        # a model built on meta is kept (it holds no memory) to recompute its buffers
        meta = any(t.is_meta for t in traced.parameters.values())
        object.__setattr__(self, "_source", model if meta else None)
        self._configs = checkpoint.hf_configs(model)
        self.plan = plan
        self._mesh = mesh
        self._input_shapes = traced.input_shapes
        self._aliases = traced.aliases
        self._transient = traced.transient
        self._out_spec = traced.out_spec
        for name, child in program.named_children():
            self.add_module(name, child)
        for name, param in program.named_parameters(recurse=False):
            self.register_parameter(name, param)
        for name, buf in program.named_buffers(recurse=False):
            self.register_buffer(name, buf)

    @property
    def code(self) -> str:
        return self.program.code

    def forward(self, *inputs):
        shapes = tuple(tuple(t.shape) if isinstance(t, torch.Tensor) else None for t in inputs)
        if shapes != self._input_shapes:
            raise InputError(
                f"inputs of shapes {list(shapes)} differ from the example inputs "
                f"{list(self._input_shapes)} this module was planned for; parallelize again "
                "with examples of the new shapes"
            )
        with comm.bound(self._mesh):
            outputs = self.program(*inputs)
        return pytree.tree_unflatten(list(outputs), self._out_spec)

    def _gathered(
        self, tensors: dict[str, torch.Tensor | None], rank0_only: bool = False
    ) -> dict[str, torch.Tensor | None]:
        keep = not rank0_only or dist.get_rank() == 0
        out = {}
        with comm.bound(self._mesh):
            for fqn, local in tensors.items():
                full = None
                if local is not None:
                    layout = self.plan.storage.get(fqn) or Layout.replicated(local.ndim)
                    full = comm.gather_full(local, layout.dims)
                    # one gathered tensor in flight at a time: to host on rank 0, dropped elsewhere
                    full = full.cpu() if rank0_only and keep else full
                if keep:
                    for name in self._aliases.get(fqn, (fqn,)):
                        out[name] = full
        return out

    def full_state_dict(self, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """Every parameter and buffer at its original shape and name (a collective).

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
        """Every parameter's gradient at its original shape and name (a collective);
        `rank0_only` as in `full_state_dict`."""
        return self._gathered({n: p.grad for n, p in self.program.named_parameters()}, rank0_only)
