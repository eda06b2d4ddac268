"""nn.TransformerEncoder (batch-first and sequence-first) and nn.MultiheadAttention, as a
user writes them, train exactly like the serial model under both families and a solved
plan. Their batch-first transposes merge a sharded batch dim behind an unsharded
sequence dim (``x.transpose(0, 1).reshape(T * B, E)``): the reshape must gather it, not
label the result as if the shards stayed contiguous."""

import functools
from pathlib import Path

import pytest
import torch

import autoshard
from autoshard.planning.verify import check_plan
from autoshard.testing import assert_equivalent, load_factory
from autoshard.tracing.modes import trace_modes

MODELS = str(Path(__file__).parent / "views_models.py")
# The key part of an attention's input bias has no gradient but rounding noise (~1e-7),
# which Adam's default eps turns into steps of size lr, different in each program;
# eps=1e-2 keeps those negligible while the real, far larger gradients take Adam steps.
ADAMW = functools.partial(torch.optim.AdamW, eps=1e-2)
PLANS = {
    "3d": {"strategy": "3d"},
    "3d-allreduce": {"strategy": "3d-allreduce"},
    # tight enough that the solver mixes families and recomputes some blocks
    "solved": {"memory_budget": 100_000, "hardware": "cpu-gloo"},
}


@pytest.mark.parametrize("plan", PLANS)
def test_torch_attention_modules_train_like_serial(plan):
    assert_equivalent(
        f"{MODELS}:attention_stack",
        (2, 2, 2),
        steps=3,
        lr=0.01,
        torch_optimizer=ADAMW,
        **PLANS[plan],
    )


@pytest.mark.parametrize("mode", ["seq2seq", "seq2seq_eval"])
@pytest.mark.parametrize("plan", ["3d", "solved"])
def test_a_transformer_with_a_causal_mask_given_no_hint_and_padding_trains_like_serial(mode, plan):
    assert_equivalent(f"{MODELS}:{mode}", (2, 2, 2), steps=2, **PLANS[plan])


@pytest.mark.parametrize("mesh", [(2, 2, 2), (1, 2, 4)])
def test_transpose_reshape_linear_view(mesh):
    """The minimal form: x.transpose(0, 1).reshape(T·B, E) → Linear → view → transpose."""
    assert_equivalent(f"{MODELS}:transposed_linear", mesh, strategy="3d", steps=1)


@pytest.mark.parametrize(
    "name", ["fused_projections", "sliced_projections", "multi_query_projection"]
)
@pytest.mark.parametrize("plan", ["3d", "solved"])
def test_pieces_of_a_fused_projection_stay_split(name, plan):
    """A split of a dim that the projection before it splits gathers that dim, then
    cuts every piece to its shard: under "3d" attention runs on this rank's heads only
    and the gated MLP on its features (before, both ran whole on every rank of the
    axis the projection split its features over). Slices that cut the dim into
    consecutive pieces (Phi-3's) are that split; a piece that does not divide (one key
    head) stays whole, and the others are still cut."""
    if plan == "3d":
        model, inputs = load_factory(f"{MODELS}:{name}")()
        nodes = autoshard.plan(model, (2, 2, 2), inputs, strategy="3d").nodes.values()
        attention = next(n for n in nodes if "scaled_dot_product_attention" in n.op)
        product = next(n for n in nodes if n.op == "aten.mul.Tensor")
        assert attention.strategy.inputs[0].dims[1], "attention runs on every head"
        assert product.strategy.output.dims[-1], "the gated product runs on every feature"
    assert_equivalent(f"{MODELS}:{name}", (2, 2, 2), steps=2, **PLANS[plan])


@pytest.mark.parametrize("mode", ["few_sequences", "few_sequences_eval"])
@pytest.mark.parametrize("plan", ["3d", "solved"])
def test_attention_splits_its_queries_where_batch_and_heads_run_out(mode, plan):
    """Two sequences on 2×2×2: under "3d" the third axis stays on the query rows,
    causal attention included (each rank masks its rows from their place in the
    whole); before, it was gathered and attention ran whole over it. Padding in the
    masks, inputs that need gradients, train and eval; the plan saved and read back."""
    if plan == "3d":
        model, inputs = load_factory(f"{MODELS}:{mode}")()
        made = autoshard.plan(model, (2, 2, 2), inputs, strategy="3d")
        attentions = [n for n in made.nodes.values() if "scaled_dot_product_attention" in n.op]
        assert all(n.strategy.inputs[0].dims[2] for n in attentions), "queries gathered"
        assert [n.strategy.lowering is not None for n in attentions] == [True, False, False]
        check_plan(autoshard.Plan.from_json(made.to_json()), trace_modes(model, inputs))
    assert_equivalent(f"{MODELS}:{mode}", (2, 2, 2), steps=2, **PLANS[plan])


@pytest.mark.parametrize("plan", ["3d", "solved"])
def test_targets_flattened_from_more_dims_than_the_loss_reads(plan):
    # A value without gradient that its readers only slice is made sliced on each
    # rank; these targets are a view of a 3-D stack, not a broadcast of it: aligning
    # the two raised an IndexError while planning.
    assert_equivalent(f"{MODELS}:stacked_targets", (2, 2, 2), steps=2, **PLANS[plan])
