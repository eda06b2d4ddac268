"""Training on shards equals training the serial model: optimizers with state (SGD
with momentum, Adam, AdamW), the global gradient norm and its clipping, and
exporting the full model from rank 0 alone."""

import copy
import math
from pathlib import Path

import torch

import autoshard
from autoshard.testing import load_factory

MODELS = str(Path(__file__).parent / "models.py")
GPT = str(Path(__file__).parents[1] / "examples" / "gpt.py")
LLAMA = str(Path(__file__).parents[1] / "examples" / "llama.py")

OPTIMIZERS = {
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-2),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
}
CASES = [  # (factory, strategy, optimizer, norm type)
    (f"{MODELS}:mlp", "3d", "adamw", 2.0),
    (f"{MODELS}:mlp", "3d-allreduce", "adam", math.inf),
    (f"{MODELS}:mlp", "3d", "sgd-momentum", 1.0),
    (f"{GPT}:gpt", "3d", "adamw", 2.0),
    (f"{LLAMA}:llama", "3d-allreduce", "adam", 2.0),
]


def _loss(outputs) -> torch.Tensor:
    out = outputs if isinstance(outputs, torch.Tensor) else outputs[0]
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    return (out * weights).sum()


def _compiled(factory, strategy) -> autoshard.Compiled:
    torch.manual_seed(0)
    model, inputs = load_factory(factory)()
    return autoshard.compile(model, (2, 2, 2), inputs, strategy=strategy)


def _train_both(mesh, factory, compiled, optimizer, norm_type, steps=3):
    """Train the serial model in fp32 and in fp64 and the parallel program side by side.

    Returns per step the serial and the parallel gradient norm, per parameter at the
    end (parallel error, serial fp32 error) against the fp64 run, whether the full
    state dict taken before training is unchanged by it (a snapshot), and whether
    rank 0's CPU export equals the gathered model (None on the other ranks, which get
    nothing).
    Adam divides by the gradient's own magnitude, so an element whose gradient is zero
    in exact arithmetic moves by rounding noise: errors are judged against what fp32
    rounding does to the serial program itself."""
    torch.manual_seed(0)
    model, inputs = load_factory(factory)()
    serial = copy.deepcopy(model)
    exact = copy.deepcopy(model).double()
    exact_inputs = tuple(t.double() if t.is_floating_point() else t for t in inputs)
    parallel = autoshard.parallelize(model, mesh, inputs, compiled=compiled)
    runs = [(serial, inputs), (exact, exact_inputs), (parallel, inputs)]
    opts = [OPTIMIZERS[optimizer](module.parameters()) for module, _ in runs]
    norms = []
    before = parallel.full_state_dict()
    kept = {n: t.clone() for n, t in before.items()}
    for step in range(steps):
        for module, args in runs:
            torch.manual_seed(100 + step)
            _loss(module(*args)).backward()
        # clip hard enough that every step is scaled: half the serial norm
        want = torch.nn.utils.get_total_norm([p.grad for p in serial.parameters()], norm_type)
        max_norm = 0.5 * want.item()
        torch.nn.utils.clip_grad_norm_(serial.parameters(), max_norm, norm_type)
        torch.nn.utils.clip_grad_norm_(exact.parameters(), max_norm, norm_type)
        got = autoshard.clip_grad_norm_(parallel, max_norm, norm_type)
        norms.append((want.item(), got.item()))
        for opt in opts:
            opt.step()
            opt.zero_grad()
    full = parallel.full_state_dict()
    errors = {
        n: (
            (full[n] - t).abs().max().item(),
            (serial.state_dict()[n] - t).abs().max().item(),
            t.abs().max().item(),
        )
        for n, t in exact.state_dict().items()
    }
    snapshot = all(torch.equal(before[n], kept[n]) for n in kept)
    exported = parallel.full_state_dict(rank0_only=True)
    if not exported:
        return norms, errors, snapshot, None
    same = set(exported) == set(full) and all(
        exported[n].device.type == "cpu" and torch.equal(exported[n], full[n].cpu()) for n in full
    )
    return norms, errors, snapshot, same


def _all_cases(mesh, cases):
    return [_train_both(mesh, *case) for case in cases]


def test_optimizers_and_clipping_match_serial(rank_pool):
    cases = [(factory, _compiled(factory, strategy), *rest) for factory, strategy, *rest in CASES]
    per_rank = rank_pool.run(_all_cases, (2, 2, 2), cases)
    for rank, results in enumerate(per_rank):
        for case, (norms, errors, snapshot, export_exact) in zip(CASES, results):
            assert snapshot, (case, rank)  # not the live tensors of those no axis splits
            for want, got in norms:
                assert math.isclose(got, want, rel_tol=1e-5), (case, rank, want, got)
            for name, (parallel_err, serial_err, scale) in errors.items():
                assert parallel_err <= 10 * serial_err + 1e-6 * scale, (case, rank, name, errors)
            # rank 0 holds the whole model on the CPU; every other rank holds nothing
            assert export_exact is (True if rank == 0 else None), (case, rank)
