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

Hugging Face weights load the same way, each rank reading only its slices of
each tensor from the safetensors files of a ``save_pretrained`` directory
(`load_hf`), and are written back, one tensor in flight, by rank 0 (`save_hf`).

The optimizer's state is kept per parameter name: every state tensor shaped
like its parameter (Adam's moments, SGD's momentum) is sharded like it, and
scalars (step counts) are replicated. Everything is checked against the
checkpoint before anything is read.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

from autoshard.errors import CheckpointError
from autoshard.layout import Layout
from autoshard.tracing.trace import tied_names

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
    checkpoint at `path`, resharded for this module's mesh and plan. Buffers the
    model computes at construction and does not save (rotary tables) are recomputed
    for a model built on meta."""
    if not Path(path).is_dir():
        raise CheckpointError(f"no checkpoint at {str(path)!r}: give the directory save wrote")
    stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    state = {MODEL: _model_state(module)}
    if optimizer is not None:
        state[OPTIMIZER] = _optimizer_state(module, optimizer, stored)
    _check(state, stored, path)
    dcp.load(state, checkpoint_id=str(path))
    _recompute_buffers(module)  # not saved: a model built on meta must compute them
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


HF_INDEX, HF_SINGLE = "model.safetensors.index.json", "model.safetensors"


def load_hf(module: torch.nn.Module, directory, prefix: str = "") -> None:
    """Fill `module` from a Hugging Face ``save_pretrained`` directory (one
    safetensors file or a sharded index), each rank reading only the slices its
    shards cover. `prefix` is where the Hugging Face model sits in the module that
    was parallelized (``"model."`` for a wrapper holding it as ``self.model``).
    Every tensor is checked (present, same shape) before any is read; tensors
    outside `prefix` are left as they are. Buffers the model computes at
    construction (rotary tables) are recomputed for a model built on meta."""
    files = _hf_files(Path(directory))
    targets = {
        fqn: (next((n for n in names if n in files), names[0]), local)
        for fqn, (names, local) in _hf_tensors(module, prefix).items()
    }
    shapes = {}
    for fqn, (name, local) in targets.items():
        if name not in files:
            raise CheckpointError(
                f"{name!r} (for {fqn!r}) is not in the Hugging Face weights at "
                f"{str(directory)!r}: is prefix={prefix!r} right, and is it the same model?"
            )
        with safe_open(files[name], framework="pt") as f:
            shapes[fqn] = tuple(f.get_slice(name).get_shape())
        want = _full_shape(module, fqn, local)
        if shapes[fqn] != want:
            raise CheckpointError(
                f"{name!r} has shape {list(shapes[fqn])} in {str(directory)!r} but "
                f"{list(want)} in this module"
            )
    with torch.no_grad():
        for fqn, (name, local) in targets.items():
            with safe_open(files[name], framework="pt") as f:
                piece = f.get_slice(name)[local_slices(module, fqn, shapes[fqn])]
            local.copy_(piece.reshape(local.shape))
    _recompute_buffers(module)


def save_hf(module: torch.nn.Module, directory, prefix: str = "", max_shard_bytes=2**30) -> None:
    """Write the Hugging Face model at `prefix` of `module` as a ``save_pretrained``
    directory that ``from_pretrained`` reads: safetensors shards of at most
    `max_shard_bytes`, an index, and the model's config. Tensors are gathered one at
    a time and written by rank 0, which never holds more than one shard. A
    collective for a ParallelModule."""
    directory = Path(directory)
    writer = _rank0()
    if writer:
        directory.mkdir(parents=True, exist_ok=True)
    shard: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    total = 0

    def flush():
        name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(shard, str(directory / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        shard.clear()

    for fqn, (names, local) in _hf_tensors(module, prefix).items():
        full = _gathered(module, fqn, local)
        if writer:
            # tied names (an lm-head and its embedding) hold one tensor: written once,
            # under the model's first name for it, as save_pretrained writes it and
            # from_pretrained ties it again (safetensors refuses a tensor twice)
            shard[names[0]] = full.contiguous()
            total += full.numel() * full.element_size()
        if writer and sum(t.numel() * t.element_size() for t in shard.values()) >= max_shard_bytes:
            flush()
    if not writer:
        return
    if shard or not weight_map:
        flush()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / HF_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True))
    config = _hf_config(module, prefix)
    if config is not None:
        config.save_pretrained(directory)


def _hf_files(directory: Path) -> dict[str, Path]:
    """Tensor name → the safetensors file that holds it."""
    if (directory / HF_INDEX).is_file():
        weight_map = json.loads((directory / HF_INDEX).read_text())["weight_map"]
        return {name: directory / file for name, file in weight_map.items()}
    if (directory / HF_SINGLE).is_file():
        with safe_open(directory / HF_SINGLE, framework="pt") as f:
            return dict.fromkeys(f.keys(), directory / HF_SINGLE)
    raise CheckpointError(
        f"no Hugging Face weights at {str(directory)!r}: expected {HF_SINGLE} or {HF_INDEX} "
        "(a save_pretrained directory with safetensors)"
    )


def _hf_tensors(module, prefix: str) -> dict[str, tuple[str, torch.Tensor]]:
    """Each tensor of `module` named under `prefix` (tied ones once), by its FQN: the
    names the model gives it there, without the prefix, and this rank's part of it."""
    if _is_parallel(module):
        local = module.local_state_dict()
        names = {fqn: module._aliases.get(fqn, (fqn,)) for fqn in local}
    else:  # a plain model's state_dict names a tied tensor once per name
        state = module.state_dict(keep_vars=True)
        names = tied_names(module, state)
        local = {fqn: tensor for fqn, tensor in state.items() if names[fqn][0] == fqn}
    out = {}
    for fqn, tensor in local.items():
        under = [n[len(prefix) :] for n in names[fqn] if n.startswith(prefix)]
        if under:
            out[fqn] = (under, tensor)
    return out


def local_slices(module, fqn: str, shape) -> tuple[slice, ...]:
    """The part of the global tensor `fqn` this rank holds."""
    if not _is_parallel(module):
        return tuple(slice(0, s) for s in shape)
    mesh = module.plan.mesh
    layout = module.plan.storage.get(fqn) or Layout.replicated(len(shape))
    coord = {axis: module._mesh.coordinate(axis) for axis in mesh.names}
    return tuple(slice(a, b) for a, b in layout.shard_slices(shape, mesh, coord))


def _gathered(module, fqn: str, local: torch.Tensor) -> torch.Tensor:
    if not _is_parallel(module):
        return local.detach().cpu()
    return module._gathered({fqn: local}, rank0_only=True).get(fqn, local)


def _rank0() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _hf_config(module, prefix: str):
    configs = module._configs if _is_parallel(module) else hf_configs(module)
    return configs.get(prefix.removesuffix("."))


def hf_configs(model: torch.nn.Module) -> dict:
    """Module path → the Hugging Face config of each pretrained model inside `model`."""
    return {
        path: m.config
        for path, m in model.named_modules()
        if hasattr(getattr(m, "config", None), "save_pretrained")
    }


def _recompute_buffers(module) -> None:
    """A model built on meta has no values for the buffers it computes at construction
    and does not save (rotary tables): each owning module is materialized alone and
    initialized by its Hugging Face model's own `_init_weights`."""
    source = getattr(module, "_source", None)
    if source is None:
        return
    state = module.program.state_dict(keep_vars=True)
    built_on_meta = {n for n, b in source.named_buffers() if b.is_meta}
    for fqn in sorted(module._transient & built_on_meta):
        owner_path, _, name = fqn.rpartition(".")
        owner = source.get_submodule(owner_path)
        pretrained = _pretrained_owner(source, owner_path)
        if pretrained is None:
            raise CheckpointError(
                f"buffer {fqn!r} of a model built on meta is computed at construction and not "
                "saved: build the model on a real device, or set the buffer yourself"
            )
        owner.to_empty(device="cpu", recurse=False)
        pretrained._init_weights(owner)
        full = getattr(owner, name)
        with torch.no_grad():
            state[fqn].copy_(full[local_slices(module, fqn, tuple(full.shape))])
        owner.to_empty(device="meta", recurse=False)


def _pretrained_owner(model: torch.nn.Module, path: str):
    """The innermost Hugging Face pretrained model whose subtree holds module `path`."""
    best = None
    for prefix, m in model.named_modules():
        inside = not prefix or path == prefix or path.startswith(prefix + ".")
        if inside and hasattr(m, "_init_weights") and hasattr(m, "config"):
            best = m
    return best
