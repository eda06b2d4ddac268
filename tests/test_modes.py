"""`ParallelModule.train()` and `.eval()` are honoured: a model with dropout planned in
either mode runs exactly like the serial model in both (outputs and gradients), and a
model whose train and eval graphs differ beyond dropout (batch norm) refuses the mode
it was not planned in, naming the node."""

import copy
from pathlib import Path

import torch
from torch.utils import _pytree as pytree

from autoshard.api import parallelize
from autoshard.errors import InputError
from autoshard.testing import load_factory

MODELS = str(Path(__file__).parent / "views_models.py")
CASES = [
    ("dropout_mlp_train", "3d"),
    ("dropout_mlp_eval", "3d-allreduce"),
    ("dropout_transposed_train", "3d"),
    ("dropout_attention_train", "3d-allreduce"),
    ("dropout_attention_eval", "3d"),
]


def _differs(got, want) -> bool:
    # Judged against the tensor's scale: the parallel program sums in another order, so an
    # element far below the largest one may differ by a few of the largest one's ulps.
    if got is None or got.shape != want.shape:
        return True
    return (got - want).abs().max() > 1e-5 * want.abs().max().clamp_min(1e-6)


def _run_modes(device_mesh, cases) -> list[str]:
    """Per case: the mode it was planned in, the other one, and back; each step
    compared with the serial model in the same mode."""
    failures = []
    for name, strategy in cases:
        torch.manual_seed(0)
        model, inputs = load_factory(f"{MODELS}:{name}")()
        serial = copy.deepcopy(model)
        parallel = parallelize(model, device_mesh, inputs, strategy=strategy)
        outputs = {}
        for step, training in enumerate([model.training, not model.training, model.training]):
            serial.train(training)
            parallel.train(training)
            torch.manual_seed(100 + step)
            want = pytree.tree_leaves(serial(*inputs))
            torch.manual_seed(100 + step)
            got = pytree.tree_leaves(parallel(*inputs))
            outputs[training] = want[0]
            mix = [
                torch.randn(w.shape, generator=torch.Generator().manual_seed(i))
                for i, w in enumerate(want)
            ]
            sum((w * m).sum() for w, m in zip(want, mix)).backward()
            sum((g * m).sum() for g, m in zip(got, mix)).backward()
            grads = parallel.full_grads()
            where = f"{name} ({strategy}) in {'train' if training else 'eval'} mode"
            failures += [
                f"output {i} of {where}"
                for i, (g, w) in enumerate(zip(got, want))
                if _differs(g, w)
            ]
            failures += [
                f"grad {fqn} of {where}"
                for fqn, p in serial.named_parameters()
                if _differs(grads[fqn], p.grad)
            ]
            serial.zero_grad()
            parallel.zero_grad()
        if torch.allclose(outputs[True], outputs[False]):
            failures.append(f"{name}: dropout changed nothing in train mode")
    return failures


def test_dropout_follows_train_and_eval(rank_pool):
    for failures in rank_pool.run(_run_modes, (2, 2, 2), CASES):
        assert failures == []


def _eval_after_batch_norm(device_mesh) -> str:
    model, inputs = load_factory(f"{MODELS}:batch_norm_mlp")()
    parallel = parallelize(model, device_mesh, inputs, strategy="3d")
    parallel(*inputs)  # planned in train mode: fine
    try:
        parallel.eval()(*inputs)
    except InputError as e:
        return str(e)
    return "no error"


def test_a_mode_whose_graph_differs_is_refused(rank_pool):
    for message in rank_pool.run(_eval_after_batch_norm, (2, 2, 2)):
        assert "cannot run in eval mode" in message and "batch_norm" in message, message
        assert "model.eval()" in message
