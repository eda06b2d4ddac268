"""Under "3d" no rank ever holds a tensor as large as the full logits or a full
[tokens, hidden] activation; an op without a rule still runs, replicated and named."""

import warnings
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import autoshard
from autoshard.runtime.ranks import shared_pool
from autoshard.testing import assert_equivalent, load_factory

ROOT = Path(__file__).parents[1]
BATCH, SEQ, VOCAB, HIDDEN = 8, 32, 64, 32


def gpt():
    return load_factory(f"{ROOT}/examples/gpt.py:gpt")(
        batch=BATCH, seq=SEQ, vocab=VOCAB, d_model=HIDDEN, n_head=4, n_layer=2
    )


class Shapes(TorchDispatchMode):
    """Every tensor shape any op produces, with the op."""

    def __init__(self):
        super().__init__()
        self.seen: dict[tuple[int, ...], str] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.seen.setdefault(tuple(t.shape), str(func))
        return out


def _shapes_in_a_training_step(mesh):
    model, inputs = gpt()
    parallel = autoshard.parallelize(model, mesh, inputs, strategy="3d")
    with Shapes() as shapes:
        parallel(*inputs).backward()
    return shapes.seen


def test_no_rank_holds_a_full_activation_or_the_full_logits():
    tokens_by_hidden, logits = BATCH * SEQ * HIDDEN, BATCH * SEQ * VOCAB
    full = {(BATCH, SEQ, HIDDEN), (BATCH * SEQ, HIDDEN), (BATCH, SEQ, VOCAB), (BATCH * SEQ, VOCAB)}
    model, _ = gpt()
    assert max(p.numel() for p in model.parameters()) < tokens_by_hidden  # so the test can fail
    for seen in shared_pool(8).run(_shapes_in_a_training_step, (2, 2, 2)):
        assert not full & set(seen), {s: seen[s] for s in full & set(seen)}
        largest = max(seen, key=lambda s: torch.Size(s).numel())
        # The largest is the 4h-wide MLP product before its reduce-scatter: 1/d² of
        # [tokens, 4·hidden], which on d = 2 has as many elements as [tokens, hidden].
        assert torch.Size(largest).numel() <= min(tokens_by_hidden, logits // 2), seen[largest]


def test_an_op_without_a_rule_runs_replicated_and_is_named():
    model, inputs = load_factory(f"{Path(__file__).parent}/models.py:cumulative_max")()
    with pytest.warns(UserWarning, match=r"aten\.cummax\.default.*runs replicated"):
        plan = autoshard.plan(model, (2, 2, 2), inputs)
    assert any("aten.cummax.default" in w for w in plan.warnings)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_equivalent(f"{Path(__file__).parent}/models.py:cumulative_max", (2, 2, 2))
