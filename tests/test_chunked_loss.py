"""A loss run over its tokens in pieces (`autoshard.planning.chunking`): the program
equals the serial model's, logs the calls its plan predicts, and holds less at its peak,
as the cost model says; the solver takes it where the budget needs it."""

import dataclasses
from collections import Counter
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autoshard
from autoshard.cost.hardware import Hardware
from autoshard.cost.model import node_costs
from autoshard.errors import PlanError, StrategyError
from autoshard.mesh import Mesh
from autoshard.planning.estimate import first_users, totals
from autoshard.planning.solver import REGATHER, SPACES, build_problem, smallest_peak, solve
from autoshard.planning.units import EPILOGUE
from autoshard.runtime.ranks import shared_pool
from autoshard.testing import assert_equivalent, load_factory, measure_memory
from autoshard.tracing.trace import trace

ROOT = Path(__file__).parents[1]
GPT = f"{ROOT}/examples/gpt.py:gpt"
MESH = (2, 2, 2)


def wide_gpt():
    """A GPT whose logits dominate its activations: vocabulary 512, 8 × 32 tokens."""
    return load_factory(GPT)(batch=8, seq=32, vocab=512, d_model=32, n_layer=1)


def llama_ignoring_padding():
    """Hugging Face LLaMA (tiny) whose labels mark the padding with ignore_index -100."""
    model, (ids, labels) = load_factory(f"{ROOT}/tests/hf_zoo.py:llama")(seq=16)
    labels[labels == model.model.config.pad_token_id] = -100
    return model, (ids, labels)


class _Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, x):
        return x + self.fc(self.norm(x))


class TransformedHead(nn.Module):
    """Blocks, then a dense transform before a bias-free lm-head (as BERT's masked-LM
    head): the unit after the blocks has a layer besides the head."""

    def __init__(self, vocab: int = 256, d: int = 32, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(_Block(d) for _ in range(layers))
        self.transform, self.head = nn.Linear(d, d), nn.Linear(d, vocab, bias=False)

    def forward(self, ids, labels):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        logits = self.head(F.gelu(self.transform(x)))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


class WeighedHead(nn.Module):
    """A block and a bias-free head whose loss weighs its classes, smooths its labels,
    ignores padding (id 0) and sums."""

    def __init__(self, vocab: int = 64, d: int = 32):
        super().__init__()
        self.embed, self.block = nn.Embedding(vocab, d), _Block(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.register_buffer("class_weight", torch.linspace(0.5, 2.0, vocab))

    def forward(self, ids, labels):
        logits = self.head(self.block(self.embed(ids))).flatten(0, 1)
        weight = self.class_weight
        return F.cross_entropy(
            logits, labels.flatten(), weight, ignore_index=0, label_smoothing=0.1, reduction="sum"
        )


def weighed_head():
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (8, 16))
    labels = ids.roll(-1, dims=1)
    labels[:, -3:] = 0
    return WeighedHead(), (ids, labels)


def test_a_loss_in_pieces_keeps_the_other_layers_knobs():
    """With the loss in pieces, the head may not regather its input in backward (it
    keeps its pieces of it), while the transform before it still may."""
    torch.manual_seed(0)
    model = TransformedHead()
    traced = trace(model, (torch.randint(0, 256, (8, 16)), torch.randint(0, 256, (8, 16))))
    problem = build_problem(traced, Mesh.from_shape(MESH), Hardware.load("nvlink-8"), ("3d",), 2.0)
    regathering = {
        option.chunks: {k.node for k in problem.knobs[EPILOGUE, option] if k.kind == REGATHER}
        for option in problem.options[EPILOGUE]
    }
    chunked = problem.chunked[EPILOGUE, ("3d", ()), 4]
    assert regathering[1] == {chunked.head, "linear_2"}
    assert regathering[4] == regathering[16] == {"linear_2"}


@pytest.mark.parametrize(
    "factory,chunks",
    [
        (GPT, 4),
        (f"{__file__}:llama_ignoring_padding", 2),
        (f"{__file__}:wide_gpt", 8),
        (f"{__file__}:weighed_head", 4),
    ],
)
def test_a_loss_in_pieces_matches_serial(factory, chunks):
    model, inputs = load_factory(factory)()
    plan = autoshard.plan(model, MESH, inputs, strategy="3d", loss_chunks=chunks)
    assert [c.chunks for c in plan.chunked] == [chunks]
    assert autoshard.Plan.from_json(plan.to_json()).chunked == plan.chunked
    assert_equivalent(factory, MESH, plan=plan)


def _logged_and_measured(mesh, compiled: dict) -> dict:
    """Per program: the calls it logged, and `measure_memory` of one step."""
    out = {}
    for name, program in compiled.items():
        torch.manual_seed(0)  # as the test process built it
        model, inputs = wide_gpt()
        parallel = autoshard.parallelize(model, mesh, inputs, compiled=program)
        with autoshard.comm_log() as log:
            measured = measure_memory(lambda p=parallel, x=inputs: p(*x).backward())
        calls = Counter((r.node, r.kind, r.axis, r.phase, r.bytes) for r in log.records)
        out[name] = (calls, measured)
    return out


def test_the_pieces_log_the_predicted_calls_and_hold_less_as_predicted(capsys):
    torch.manual_seed(0)
    model, inputs = wide_gpt()
    compiled = {
        k: autoshard.compile(model, MESH, inputs, strategy="3d", loss_chunks=k) for k in (1, 8)
    }
    per_rank = shared_pool(8).run(_logged_and_measured, MESH, compiled)
    for k, program in compiled.items():
        predicted = Counter(
            (c.node, c.kind, c.axis, c.phase, c.nbytes) for c in program.plan.predicted_calls()
        )
        for rank in per_rank:
            assert rank[k][0] == predicted, k
    predicted = {k: _activation_peak(c.plan) for k, c in compiled.items()}
    measured = {k: per_rank[0][k][1].peak_bytes for k in compiled}
    with capsys.disabled():
        print(f"\nactivation peak, 1 and 8 pieces: measured {measured}, predicted {predicted}")
    for k in compiled:
        assert abs(predicted[k] / measured[k] - 1) <= 0.10, (k, measured, predicted)
    drop = {"measured": measured[1] - measured[8], "predicted": predicted[1] - predicted[8]}
    assert drop["measured"] > 0.2 * measured[1], drop
    assert abs(drop["predicted"] / drop["measured"] - 1) <= 0.25, drop


def _activation_peak(plan) -> int:
    """The plan's predicted peak less its parameters, gradients and optimizer state."""
    traced = trace(*wide_gpt())
    costs = node_costs(traced, plan, Hardware.load("nvlink-8"))
    whole = totals(traced, plan, costs, list(plan.nodes), 2.0, first_users(traced, plan))
    return plan.cost.peak_memory - whole.params


def test_the_solver_chunks_the_loss_where_the_budget_needs_it():
    model, inputs = wide_gpt()
    traced, mesh, hardware = trace(model, inputs), Mesh.from_shape(MESH), Hardware.load("nvlink-8")
    solved = partial(build_problem, traced, mesh, hardware, SPACES["3d"], 2.0)
    whole, free = solved(loss_chunks=1), solved()
    assert smallest_peak(free) < 0.8 * smallest_peak(whole)
    choice = solve(free, smallest_peak(whole) * 0.95)
    assert choice[EPILOGUE].chunks > 1
    assert solve(free, None)[EPILOGUE].chunks == 1  # unchunked where memory allows


def test_a_loss_that_cannot_run_in_pieces_is_refused_by_name():
    model, inputs = wide_gpt()
    with pytest.raises(
        StrategyError, match="loss_chunks=3: the loss's tokens do not divide into 3 pieces here"
    ):
        autoshard.plan(model, MESH, inputs, strategy="3d", loss_chunks=3)


def test_a_saved_plan_keeps_its_overlap_and_refuses_another_loss_chunking():
    model, inputs = wide_gpt()
    saved = autoshard.plan(model, MESH, inputs, strategy="3d", overlap=False, loss_chunks=4)
    again = autoshard.compile(model, MESH, inputs, plan=saved)
    assert not again.plan.overlap and again.plan.chunks(saved.chunked[0].head) == 4
    assert autoshard.compile(model, MESH, inputs, plan=saved, overlap=True).plan.overlap
    with pytest.raises(StrategyError, match="loss_chunks=2, but the plan given runs its loss in 4"):
        autoshard.compile(model, MESH, inputs, plan=saved, loss_chunks=2)


def test_the_solver_refuses_to_ignore_a_loss_chunking_it_cannot_offer():
    # one linear and its loss: no repeated block, so the loss is no epilogue's
    model = torch.nn.Sequential(torch.nn.Linear(16, 64, bias=False))
    inputs = (torch.randn(64, 16), torch.randint(0, 64, (64,)))

    class WithLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.head = model

        def forward(self, x, y):
            return torch.nn.functional.cross_entropy(self.head(x), y)

    refused = "loss_chunks=4: the solver runs in pieces only a loss read after"
    with pytest.raises(StrategyError, match=refused):
        autoshard.plan(WithLoss(), MESH, inputs, loss_chunks=4, memory_budget="1GiB")


def test_a_saved_plan_whose_pieces_do_not_fit_the_model_is_refused():
    model, inputs = wide_gpt()
    saved = autoshard.plan(model, MESH, inputs, strategy="3d", loss_chunks=4)
    edited = dataclasses.replace(saved.chunked[0], chunks=3)
    with pytest.raises(PlanError, match=r"plan.chunked\[0\] runs loss .* in 3 pieces"):
        autoshard.compile(model, MESH, inputs, plan=dataclasses.replace(saved, chunked=(edited,)))
