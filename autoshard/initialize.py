"""Fill the shards of a model built on meta with what its serial construction gives.

    with torch.device("meta"):
        model = Model(cfg)
    parallel = autoshard.parallelize(model, mesh, inputs)
    parallel.init_weights(seed=0)  # == shards of Model(cfg) built after torch.manual_seed(0)

The model's construction is replayed one module at a time, each materialized
alone at full size on the CPU, in the order that draws from the random
generator as construction did (a module's children are built inside its
``__init__``, before its own initialization runs):

1. a module's ``reset_parameters()``, as every ``torch.nn`` module calls it at the
   end of its ``__init__`` (children first);
2. when a module that defines ``_init_weights(module)`` is complete (a Hugging
   Face model's ``post_init``, nanoGPT's ``self.apply(self._init_weights)``), that
   function over every module of its subtree not yet so initialized, children
   first, the innermost such module's function for each.

Each rank keeps its part of every tensor (`Layout.shard_slices`), so the peak is
two copies of one module's own tensors, never the model. A function that writes
its children's tensors (T5's, GPT-2's and Mamba's ``_init_weights`` of a block) is
refused, naming it, and so is a tensor neither step writes. What the replay cannot
see it cannot repeat: random draws in an ``__init__`` outside these two (a bare
``nn.Parameter(torch.randn(...))``, as Hugging Face's ViT draws its class token)
move every later draw, and the values differ from the serial construction's.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from autoshard.checkpoint import local_slices
from autoshard.errors import CheckpointError
from autoshard.runtime import agreement
from autoshard.tracing.storage import written_arguments


def init_weights(parallel, seed: int | None = None) -> None:
    """Fill `parallel` (a ParallelModule of a model built on meta) with its serial
    initialization under `seed` (or the random state every rank is in now)."""
    source = getattr(parallel, "_source", None)
    if source is None:
        raise CheckpointError(
            "init_weights fills a model built on the meta device; this one was given to "
            "parallelize with its weights, which the shards already hold"
        )
    if seed is not None:
        torch.manual_seed(seed)
    _check_same_generator()
    _Replay(parallel, source).run()


def _check_same_generator() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        return
    state = agreement.checksum(torch.get_rng_state())
    records = agreement.gathered((None, {"generator": state}))
    for _, ranks in agreement.differing(records, 1).items():
        raise CheckpointError(
            f"the random generator differs on {agreement.ranks_text(ranks)} from rank 0: "
            "call init_weights(seed=...) with the same seed on every rank"
        )


class _Replay:
    def __init__(self, parallel, source: torch.nn.Module):
        self.parallel = parallel
        self.source = source
        self.canonical = {a: fqn for fqn, names in parallel._aliases.items() for a in names}
        self.first_name: dict[str, str] = {}  # a tied tensor lives where it was first built
        for path, module in source.named_modules(remove_duplicate=False):
            for name in _direct_names(module):
                full = _join(path, name)
                self.first_name.setdefault(self.canonical.get(full, full), full)
        # canonical FQN → shard, of what the model holds (not the constants the trace made)
        self.targets = {
            fqn: t
            for fqn, t in parallel.program.state_dict(keep_vars=True).items()
            if fqn in self.first_name
        }
        self.reset_states: dict[str, torch.Tensor] = {}  # path → generator state at its reset
        self.initialized: set[str] = set()
        self.written: set[str] = set()

    def run(self) -> None:
        self._construct("", self.source, None)
        missing = sorted(fqn for fqn in self.targets if fqn not in self.written)
        if missing:
            fqn = missing[0]
            owner = self.source.get_submodule(self.first_name[fqn].rpartition(".")[0])
            raise CheckpointError(
                f"{len(missing)} tensors, first {fqn!r} of a {type(owner).__name__}, are "
                "initialized by neither a reset_parameters() nor a model's _init_weights: "
                f"init_weights cannot replay their construction; give {type(owner).__name__} "
                "a reset_parameters() that sets them, or load weights (checkpoint.load, load_hf)"
            )

    def _construct(self, path: str, module: torch.nn.Module, init_owner) -> None:
        owner = module if callable(getattr(module, "_init_weights", None)) else init_owner
        for name, child in module.named_children():
            self._construct(_join(path, name), child, owner)
        if callable(getattr(module, "reset_parameters", None)):
            self.reset_states[path] = torch.get_rng_state()
            twin = _materialized(module, fill=None)
            with _Writes(path, module, "reset_parameters()"):
                twin.reset_parameters()
            self._keep(path, twin, only_first=True)
        if owner is module:
            self._initialize_subtree(path, module, owner)

    def _initialize_subtree(self, path: str, module: torch.nn.Module, owner) -> None:
        for name, child in module.named_children():
            inner = child if callable(getattr(child, "_init_weights", None)) else owner
            self._initialize_subtree(_join(path, name), child, inner)
        if path in self.initialized:
            return
        self.initialized.add(path)
        twin = self._as_after_reset(path, module)
        before = {name: t.clone() for name, t in _direct(twin)}
        with torch.no_grad(), _Writes(path, module, f"{type(owner).__name__}._init_weights") as w:
            owner._init_weights(twin)
        # written, or changed: a tensor set to what NaN (or, for integers, 0) stood for
        # before (BERT's token type ids, zeroed) is written all the same
        changed = {
            name
            for name, t in _direct(twin)
            if _storage(t) in w.written or not _same(before[name], t)
        }
        self._keep(path, twin, names=changed, tied=_tied_names(owner, module, self.source))

    def _as_after_reset(self, path: str, module: torch.nn.Module) -> torch.nn.Module:
        """`module` at full size holding what its reset gave (NaN where none ran),
        redrawn from the generator state its reset started from."""
        if path not in self.reset_states:
            return _materialized(module, fill=float("nan"))
        now = torch.get_rng_state()
        torch.set_rng_state(self.reset_states[path])
        twin = _materialized(module, fill=None)
        twin.reset_parameters()
        torch.set_rng_state(now)
        return twin

    def _keep(self, path, twin, *, only_first=False, names=None, tied=frozenset()) -> None:
        """Copy this rank's slice of `twin`'s tensors into the shards."""
        for name, full in _direct(twin):
            fqn = _join(path, name)
            canonical = self.canonical.get(fqn, fqn)
            if (
                canonical not in self.targets
                or fqn in tied
                or (names is not None and name not in names)
            ):
                continue
            if only_first and self.first_name.get(canonical) != fqn:
                continue
            local = self.targets[canonical]
            piece = full.detach()[local_slices(self.parallel, canonical, tuple(full.shape))]
            with torch.no_grad():
                local.copy_(piece.reshape(local.shape))
            self.written.add(canonical)


class _Writes(TorchDispatchMode):
    """The storages a function writes while it initializes one module (`written`), and
    a refusal where it writes tensors still on meta: its submodules' (T5's
    `_init_weights` of an attention block draws its linears' weights), which the
    replay does not materialize with the module, so their values would be lost and the
    shards left as something else initialized them."""

    def __init__(self, path: str, module: torch.nn.Module, function: str) -> None:
        super().__init__()
        self.where = f"{function} of {type(module).__name__} {path or '(the model)'!r}"
        self.written: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for value in written_arguments(func, args, kwargs):
            if not isinstance(value, torch.Tensor):
                continue
            if value.device.type == "meta":
                raise CheckpointError(
                    f"init_weights cannot replay {self.where}: it writes tensors of the "
                    f"module's submodules ({func} on a {list(value.shape)} tensor), and each "
                    "module is replayed alone; load weights (checkpoint.load, load_hf), or "
                    "initialize the submodules in their own reset_parameters()"
                )
            self.written.add(_storage(value))
        return func(*args, **kwargs)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _materialized(module: torch.nn.Module, fill: float | None) -> torch.nn.Module:
    """A shallow twin of `module` whose own tensors are fresh full-size CPU tensors
    (its children and `module` itself untouched)."""
    twin = copy.copy(module)
    twin._parameters = dict(module._parameters)
    twin._buffers = dict(module._buffers)
    twin.to_empty(device="cpu", recurse=False)
    if fill is not None:
        with torch.no_grad():
            for _, t in _direct(twin):
                t.fill_(fill if t.is_floating_point() else 0)
    return twin


def _direct(module: torch.nn.Module):
    yield from ((n, t) for n, t in module._parameters.items() if t is not None)
    yield from ((n, t) for n, t in module._buffers.items() if t is not None)


def _direct_names(module: torch.nn.Module) -> list[str]:
    return [n for n, _ in _direct(module)]


def _tied_names(owner, module, source) -> frozenset[str]:
    """Full names in `module` that a Hugging Face model ties to another tensor after
    initializing them: the tensor keeps its source's values."""
    keys = getattr(owner, "all_tied_weights_keys", None) or {}
    owner_path = next((p for p, m in source.named_modules() if m is owner), "")
    return frozenset(_join(owner_path, k) for k in keys)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.is_floating_point():
        return torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)
    return torch.equal(a, b)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name
