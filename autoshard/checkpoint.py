"""Distributed checkpoints: a model's and its optimizer's state, resharded on load.

A ParallelModule's shards are written as DTensors (`Layout.placements` gives
each its exact placements) through `torch.distributed.checkpoint`, under the
model's own names: each rank writes its own shards, a replicated tensor is
written once, and loading reads for every rank just the slices its shards
cover, whatever mesh and plan saved them. A plain `nn.Module` (one process,
no process group) saves and loads the same format, so a serial run can start
a parallel one and the other way round:

    autoshard.checkpoint.save(parallel, "ckpt/step-100", optimizer)     # on 2×2×2
    ...
    parallel = autoshard.parallelize(model, mesh_1x2x4, inputs)      # another plan
    optimizer = torch.optim.AdamW(parallel.parameters())
    autoshard.checkpoint.load(parallel, "ckpt/step-100", optimizer)

The optimizer's state is kept per parameter name: every state tensor shaped
like its parameter (Adam's moments, SGD's momentum) is sharded like it, and
scalars (step counts) are replicated. Everything is checked against the
checkpoint before anything is read.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

from autoshard.errors import CheckpointError
from autoshard.layout import Layout

MODEL, OPTIMIZER = "model", "optimizer"


def save(module: torch.nn.Module, path, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Write `module`'s state (and `optimizer`'s) to the directory `path`; a
    collective when `module` is a ParallelModule."""
    state = {MODEL: _model_state(module)}
    if optimizer is not None:
        state[OPTIMIZER] = _optimizer_state(module, optimizer, None)
    dcp.save(state, checkpoint_id=str(path))


def load(module: torch.nn.Module, path, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Fill `module`'s parameters and buffers (and `optimizer`'s state) from the
    checkpoint at `path`, resharded for this module's mesh and plan."""
    if not Path(path).is_dir():
        raise CheckpointError(f"no checkpoint at {str(path)!r}: give the directory save wrote")
    stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    state = {MODEL: _model_state(module)}
    if optimizer is not None:
        state[OPTIMIZER] = _optimizer_state(module, optimizer, stored)
    _check(state, stored, path)
    dcp.load(state, checkpoint_id=str(path))
    if optimizer is not None:
        _restore_hyperparameters(optimizer, state[OPTIMIZER]["param_groups"])


def _model_state(module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer under each name the model knows it by."""
    if not _is_parallel(module):
        return dict(module.state_dict(keep_vars=False))
    out = {}
    for fqn, local in module.local_state_dict().items():
        tensor = _sharded(module, fqn, local.detach())
        for name in module._aliases.get(fqn, (fqn,)):
            out[name] = tensor
    return out


def _optimizer_state(module, optimizer, stored) -> dict:
    """{"state": {parameter name: {key: tensor}}, "param_groups": [...]} with names for
    parameters. When loading (`stored` given), state the optimizer has not created yet
    is allocated from the checkpoint's description, sharded like its parameter."""
    names = {id(p): n for n, p in _named_parameters(module)}
    groups, state = [], {}
    for group in optimizer.param_groups:
        fqns = [names[id(p)] for p in group["params"]]
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": fqns})
        for fqn, param in zip(fqns, group["params"]):
            if stored is not None and not optimizer.state.get(param):
                optimizer.state[param] = _allocated(module, fqn, param, stored)
            state[fqn] = {
                key: _sharded(module, fqn, value) if _like(value, param) else value
                for key, value in optimizer.state.get(param, {}).items()
            }
    return {"state": state, "param_groups": groups}


def _allocated(module, fqn: str, param: torch.Tensor, stored) -> dict[str, torch.Tensor]:
    prefix = f"{OPTIMIZER}.state.{fqn}."
    full_shape = _full_shape(module, fqn, param)
    out = {}
    for key, meta in stored.items():
        if not key.startswith(prefix) or not isinstance(meta, TensorStorageMetadata):
            continue
        name, shape = key[len(prefix) :], tuple(meta.size)
        if shape == full_shape:
            out[name] = torch.zeros_like(param, dtype=meta.properties.dtype)
        elif not shape:
            out[name] = torch.zeros((), dtype=meta.properties.dtype, device=param.device)
        else:
            raise CheckpointError(
                f"optimizer state {name!r} of {fqn!r} has shape {list(shape)}, neither the "
                f"parameter's {list(full_shape)} nor a scalar: it cannot be resharded"
            )
    return out


def _check(state: dict, stored, path) -> None:
    """Every tensor the module expects is in the checkpoint at the same global shape,
    and the checkpoint holds no model tensor the module lacks."""
    expected = {}
    for key, value in _flatten(state):
        if isinstance(value, torch.Tensor):
            expected[key] = tuple(value.shape)
    missing = sorted(k for k in expected if k not in stored)
    if missing:
        raise CheckpointError(
            f"the checkpoint at {str(path)!r} lacks {len(missing)} tensors this module has, "
            f"first {missing[:3]}: was it saved from another model?"
        )
    for key, shape in expected.items():
        meta = stored[key]
        saved = tuple(meta.size) if isinstance(meta, TensorStorageMetadata) else None
        if saved != shape:
            raise CheckpointError(
                f"{key!r} has shape {list(saved) if saved is not None else 'none'} in the "
                f"checkpoint at {str(path)!r} but {list(shape)} in this module"
            )
    extra = sorted(k for k in stored if k.startswith(f"{MODEL}.") and k not in expected)
    if extra:
        raise CheckpointError(
            f"the checkpoint at {str(path)!r} holds {len(extra)} model tensors this module "
            f"lacks, first {extra[:3]}: was it saved from another model?"
        )


def _flatten(state: dict, prefix: str = ""):
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _flatten(value, f"{name}.")
        elif not isinstance(value, list):
            yield name, value


def _restore_hyperparameters(optimizer, groups: list[dict]) -> None:
    if len(groups) != len(optimizer.param_groups):
        raise CheckpointError(
            f"the checkpoint's optimizer has {len(groups)} parameter groups, this one "
            f"{len(optimizer.param_groups)}"
        )
    for mine, saved in zip(optimizer.param_groups, groups):
        mine.update({k: v for k, v in saved.items() if k != "params"})


def _is_parallel(module) -> bool:
    return hasattr(module, "program") and hasattr(module, "plan")


def _named_parameters(module):
    return module.program.named_parameters() if _is_parallel(module) else module.named_parameters()


def _like(value, param: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.shape == param.shape and value.ndim > 0


def _full_shape(module, fqn: str, local: torch.Tensor) -> tuple[int, ...]:
    if not _is_parallel(module):
        return tuple(local.shape)
    layout = module.plan.storage.get(fqn) or Layout.replicated(local.ndim)
    return tuple(s * c for s, c in zip(local.shape, layout.shard_counts(module.plan.mesh)))


def _sharded(module, fqn: str, local: torch.Tensor) -> torch.Tensor:
    """`local` (this rank's shard of `fqn`, or a tensor shaped like it) as a DTensor
    on the module's mesh; plain modules keep plain tensors."""
    if not _is_parallel(module):
        return local
    device_mesh = module._mesh.device_mesh
    layout = module.plan.storage.get(fqn) or Layout.replicated(local.ndim)
    placements = layout.placements(module.plan.mesh)[: device_mesh.ndim]
    shape = _full_shape(module, fqn, local)
    stride = tuple(math.prod(shape[d + 1 :]) for d in range(len(shape)))
    return DTensor.from_local(
        local, device_mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride
    )
