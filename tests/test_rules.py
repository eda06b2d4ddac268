"""The rules the zoo needs (convolutions, pools, in-place ops, stack, repeats, ops along a dim,
baddbmm, experts' grouped products, more pointwise ops) shard their op and match the
serial model, values and gradients, on real gloo ranks."""

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.ops import aten

import autoshard
from autoshard.errors import StrategyError, TraceError
from autoshard.testing import assert_equivalent, load_factory
from autoshard.tracing.trace import trace

OPS = Path(__file__).with_name("op_models.py")
# The nodes each model exists for, and the ops they must be planned as (not replicated).
SHARDED = {
    "conv2d": {"conv2d": "aten.conv2d.default", "conv2d_1": "aten.conv2d.default"},
    "conv1d": {"conv1d": "aten.conv1d.default", "conv1d_1": "aten.conv1d.default"},
    "up_and_down": {
        "conv_transpose2d": "aten.conv_transpose2d.input",
        "conv_transpose2d_1": "aten.conv_transpose2d.input",
        "conv_transpose2d_2": "aten.conv_transpose2d.input",
        "conv_transpose1d": "aten.conv_transpose1d.default",
    },
    "named_padding": {
        "conv2d": "aten.conv2d.default",
        "conv2d_1": "aten.conv2d.default",
        "conv1d": "aten.conv1d.default",
    },
    "pools": {
        "max_pool2d": "aten.max_pool2d.default",
        "avg_pool2d": "aten.avg_pool2d.default",
        "adaptive_avg_pool2d": "aten.adaptive_avg_pool2d.default",
        "adaptive_avg_pool1d": "aten.adaptive_avg_pool1d.default",
    },
    "transposed_weights": {
        "matmul": "aten.linear.default",
        "add_": "aten.add_.Tensor",
        "reshape_as": "aten.reshape.default",
    },
    "in_place_activations": {
        "relu_": "aten.relu_.default",
        "clamp_": "aten.clamp_.default",
        "add_": "aten.add_.Tensor",
        "mul_": "aten.mul_.Tensor",
        "sigmoid_": "aten.sigmoid_.default",
    },
    "updated_copies": {
        "mul_": "aten.mul_.Tensor",
        "add_": "aten.add_.Tensor",
        "sub_": "aten.sub_.Tensor",
    },
    "updated_view": {"mul_": "aten.mul_.Tensor"},
    "elementwise": {
        "stack": "aten.stack.default",
        "repeat_interleave": "aten.repeat_interleave.self_int",
        "repeat": "aten.repeat.default",
        "roll": "aten.roll.default",
        "pow_1": "aten.pow.Tensor_Tensor",
        "softplus": "aten.softplus.default",
        "multiply": "aten.multiply.Tensor",
    },
    "alibi": {"baddbmm": "aten.baddbmm.default"},
    "norms": {
        "rms_norm": "aten.rms_norm.default",
        "rms_norm_1": "aten.rms_norm.default",
        "group_norm": "aten.group_norm.default",
        "instance_norm": "aten.instance_norm.default",
    },
    "norms_eval": {"instance_norm_1": "aten.instance_norm.default"},
    "attention_of_any_rank": {
        "scaled_dot_product_attention": "aten.scaled_dot_product_attention.default",
        "scaled_dot_product_attention_1": "aten.scaled_dot_product_attention.default",
    },
    "norm_over_every_dim": {"layer_norm": "aten.layer_norm.default"},
    "tensor_splits": {"mul": "aten.mul.Tensor", "cat": "aten.cat.default"},
    "activations": {
        "elu": "aten.elu.default",
        "leaky_relu": "aten.leaky_relu.default",
        "hardtanh_1": "aten.hardtanh.default",
        "log_sigmoid": "aten.log_sigmoid.default",
        "threshold": "aten.threshold.default",
        "prelu": "aten.prelu.default",
        "prelu_1": "aten.prelu.default",
        "prelu_2": "aten.prelu.default",
        "glu": "aten.glu.default",
    },
    "resizes": {
        "upsample_nearest2d": "aten.upsample_nearest2d.vec",
        "upsample_bilinear2d": "aten.upsample_bilinear2d.vec",
        "upsample_bicubic2d": "aten.upsample_bicubic2d.vec",
        "_upsample_nearest_exact2d": "aten._upsample_nearest_exact2d.vec",
        "upsample_linear1d": "aten.upsample_linear1d.vec",
    },
    "other_spellings": {
        "m_t": "aten.transpose.int",
        "movedim": "aten.permute.default",
        "tile": "aten.repeat.default",
        "view_as": "aten.view.default",
        "div": "aten.div.Tensor_mode",
        "clamp": "aten.clamp.Tensor",
        "addcmul": "aten.addcmul.default",
        "lerp_1": "aten.lerp.Tensor",
        "nansum": "aten.nansum.default",
    },
    "batch_norms": {
        "batch_norm": "aten.batch_norm.default",
        "batch_norm_1": "aten.batch_norm.default",
        "batch_norm_2": "aten.batch_norm.default",
    },
    "batch_norms_eval": {
        "batch_norm": "aten.batch_norm.default",
        "batch_norm_1": "aten.batch_norm.default",
        "batch_norm_2": "aten.batch_norm.default",
    },
    "along": {
        "var": "aten.var.correction",
        "amax": "aten.amax.default",
        "std": "aten.std.dim",
        "logsumexp": "aten.logsumexp.default",
        "cumprod": "aten.cumprod.default",
        "logcumsumexp": "aten.logcumsumexp.default",
        "flip": "aten.flip.default",
        "prod": "aten.prod.dim_int",
        "all_1": "aten.all.dim",
        "any_1": "aten.any.dim",
        "amin": "aten.amin.default",
        "index_select": "aten.index_select.default",
    },
    "einsums": {
        "einsum_matmul": "aten.matmul.default",
        "einsum_2_matmul": "aten.matmul.default",
        "einsum_3_matmul": "aten.matmul.default",
        "einsum_5_linear": "aten.linear.default",
    },
    "experts": {
        "grouped_mm_fallback": "autoshard.grouped_mm_nt.default",
        "grouped_mm_fallback_1": "autoshard.grouped_mm_nt.default",
    },
}


def _plan(name, strategy="3d"):
    model, inputs = load_factory(f"{OPS}:{name}")()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = autoshard.plan(model, (2, 2, 2), inputs, strategy=strategy)
    return plan, [str(w.message) for w in caught if "no rule" in str(w.message)]


@pytest.mark.parametrize("name", sorted(SHARDED))
def test_the_rule_splits_its_op(name):
    plan, no_rule = _plan(name)
    assert not no_rule
    for node, op in SHARDED[name].items():
        placed = plan.nodes[node]
        assert placed.op == op
        assert placed.strategy.family != "replicated"
        assert placed.local_shape != placed.shape, f"{node} is not split"


@pytest.mark.parametrize("strategy", ["3d", "3d-allreduce"])
@pytest.mark.parametrize("name", sorted(SHARDED))
def test_the_rule_matches_serial(name, strategy):
    assert_equivalent(f"{OPS}:{name}", (2, 2, 2), strategy=strategy, steps=2)


class _Einsum(nn.Module):
    """``einsum(equation, x, y)``, where `y` is the module's parameter if `operand` says
    so ("weight", or "weight first": ``einsum(equation, weight, x)``)."""

    def __init__(self, equation, operand, weight_shape):
        super().__init__()
        self.equation, self.operand = equation, operand
        by_weight = operand != "input"
        self.weight = nn.Parameter(torch.randn(weight_shape)) if by_weight else None

    def forward(self, x, y):
        if self.weight is None:
            return torch.einsum(self.equation, x, y)
        if self.operand == "weight first":
            return torch.einsum(self.equation, self.weight, x)
        return torch.einsum(self.equation, x, self.weight)


@pytest.mark.parametrize(
    "equation, shapes, operand, rewritten",
    [
        ("bld,hd->blh", [(2, 3, 4), (5, 4)], "weight", "linear"),
        ("hd,bld->bhl", [(2, 3, 4), (5, 4)], "weight first", "linear"),
        ("bld,dh->blh", [(2, 3, 4), (4, 5)], "weight", "matmul"),
        ("ij,ij->", [(2, 3), (2, 3)], "weight", "matmul"),  # over both of its dims
        ("ibh,hnd->ibnd", [(3, 2, 4), (4, 2, 3)], "weight", "matmul"),
        ("bld,dh->blh", [(2, 3, 4), (4, 5)], "input", "matmul"),
        ("bind,bjnd->bnij", [(2, 3, 4, 5), (2, 6, 4, 5)], "input", "matmul"),
        ("bnij,jbnd->ibnd", [(2, 4, 3, 6), (6, 2, 4, 5)], "input", "matmul"),
        ("abcd,acde->abe", [(2, 3, 4, 5), (2, 4, 5, 6)], "input", "matmul"),
        ("bi,bj->bij", [(2, 3), (2, 4)], "input", "matmul"),
        ("ij,jk", [(2, 3), (3, 4)], "input", "matmul"),  # implicit output: "ik"
        ("ii,ij->j", [(3, 3), (3, 4)], "input", None),  # a diagonal
        ("ij,jk->i", [(2, 3), (3, 4)], "input", None),  # k summed within one operand
        ("bij,bjk->bik", [(1, 2, 3), (4, 3, 5)], "input", None),  # b broadcast
        ("...ij,...jk->...ik", [(2, 2, 3), (2, 3, 4)], "input", None),  # an ellipsis
    ],
)
def test_two_operand_einsums_trace_as_products_equal_to_einsum(
    equation, shapes, operand, rewritten
):
    x_shape, y_shape = shapes
    model = _Einsum(equation, operand, y_shape)
    x, y = torch.randn(x_shape), torch.randn(y_shape)
    graph_module = trace(model, (x, y)).graph_module
    ops = {n.target._opname for n in graph_module.graph.nodes if n.op == "call_function"}
    assert ("einsum" in ops) == (rewritten is None)
    if rewritten is not None:
        assert rewritten in ops
    torch.testing.assert_close(graph_module(x, y)[0], model(x, y), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("strategy", ["3d", "megatron", None])
def test_a_buffer_made_in_forward_and_filled_from_layers_sends_their_gradient_back(strategy):
    assert_equivalent(f"{OPS}:filled_from_layers", (2, 2, 2), strategy=strategy, steps=2)


@pytest.mark.parametrize("mesh", [(1, 2, 4), (2, 2, 2)])
@pytest.mark.parametrize("strategy", ["3d", "megatron"])
def test_grouped_query_attention_splits_query_heads_only_as_key_heads_split(mesh, strategy):
    assert_equivalent(f"{OPS}:grouped_query_attention", mesh, strategy=strategy, steps=2)


def test_an_update_in_place_of_an_input_split_on_entry_is_refused_by_name():
    with pytest.raises(StrategyError, match="node 'mul_' .* updates the model's input 'x'"):
        assert_equivalent(f"{OPS}:updates_its_input", (2, 2, 2), strategy="3d")
    # taken whole, the update reaches the caller's tensor, as in the serial model
    assert_equivalent(f"{OPS}:updates_its_input", (2, 2, 2), strategy="replicated", steps=3)


@pytest.mark.parametrize("strategy", ["3d", "dp", None])
def test_a_buffer_counted_up_in_place_and_saved_by_a_product_trains_like_serial(strategy):
    report = assert_equivalent(f"{OPS}:counts_steps", (2, 2, 2), strategy=strategy, steps=3)
    assert "steps" in {m.name for m in report if m.what == "param"}


def test_an_image_convolution_splits_no_input_channel():
    # 3 colour channels divide no mesh axis: that axis splits the batch instead.
    model = nn.Conv2d(3, 16, kernel_size=4, stride=4)
    plan = autoshard.plan(model, (2, 2, 2), (torch.randn(8, 3, 16, 16),), strategy="3d")
    strategy = plan.nodes["conv2d"].strategy
    assert strategy.inputs[0].dims[1] == () and len(strategy.inputs[0].dims[0]) == 2


def test_a_depthwise_convolution_convolves_its_own_groups():
    model = nn.Conv1d(16, 16, kernel_size=3, groups=16)
    x = torch.randn(2, 16, 8)
    plan = autoshard.plan(model, (2, 2, 2), (x,), strategy="3d")
    # the batch of 2 splits over one axis at most: the channels take the others
    assert plan.nodes["conv1d"].local_shape[1] < 16


def test_a_convolution_padding_one_side_more_keeps_its_named_padding():
    # an even kernel's "same" pads the input first (in ATen): no numeric padding says that
    model = nn.Conv2d(4, 8, kernel_size=2, padding="same")
    plan = autoshard.plan(model, (2, 2, 2), (torch.randn(8, 4, 6, 6),), strategy="3d")
    assert plan.nodes["conv2d"].op == "aten.conv2d.padding"


class UpdatesAView(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        h = self.proj(x)
        h[:, :4].mul_(2.0)  # reaches h through a view: not claimed
        return h


def test_an_in_place_update_of_a_view_is_refused_by_name():
    with pytest.raises(
        StrategyError, match=r"'mul_' .* updates 'slice_\d*', a view .* out of place"
    ):
        autoshard.plan(UpdatesAView(), (2, 2, 2), (torch.randn(8, 8),), strategy="3d")


class NormalizesItsWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        with torch.no_grad():
            self.proj.weight.div_(self.proj.weight.norm())
        return self.proj(x)


def test_a_parameter_updated_in_place_in_forward_is_refused_naming_it():
    with pytest.raises(StrategyError, match=r"updates parameter 'proj.weight' in place"):
        autoshard.plan(NormalizesItsWeight(), (2, 2, 2), (torch.randn(8, 16),), strategy="3d")


class FillsABuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.register_buffer("cache", torch.zeros(8, 32))

    def forward(self, x):
        self.cache[:, :16] = self.proj(x)
        return self.cache * 2


def test_a_buffer_written_in_place_with_a_value_that_needs_grad_is_refused_naming_it():
    with pytest.raises(StrategyError, match=r"into buffer 'cache' in place"):
        autoshard.plan(FillsABuffer(), (2, 2, 2), (torch.randn(8, 16),), strategy="3d")


class UpdatesOneOfTwoSplits(nn.Module):
    def forward(self, x):
        h = x * 2
        first, _ = h.split(4, dim=-1)
        first.mul_(2.0)  # h is read after it (torch allows it where nothing needs a gradient)
        return h


def test_an_in_place_update_of_a_view_of_storage_read_after_it_another_way_is_refused():
    with pytest.raises(StrategyError, match=r"'mul_' .* updates 'getitem', a view"):
        autoshard.plan(UpdatesOneOfTwoSplits(), (2, 2, 2), (torch.randn(8, 8),), strategy="3d")


class AssignsIntoASlice(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        h = self.up(x)
        h[:, 0] = 0.0  # a fill_ of a view of h, which no rule claims: it runs replicated
        return self.down(h)


def test_an_update_in_place_that_would_land_on_a_gathered_copy_is_refused_by_name():
    # Run replicated, the fill_ would update a gathered copy of h's shards, and `down`
    # would read h unchanged: silently wrong before.
    with pytest.raises(StrategyError, match=r"'fill_' .* updates 'select' in place, but"):
        autoshard.compile(AssignsIntoASlice(), (2, 2, 2), (torch.randn(8, 4, 16),), strategy="3d")


class ReadsRunningStatisticsFirst(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 16), nn.Linear(16, 16)
        self.norm = nn.BatchNorm1d(16)

    def forward(self, x):
        h = self.down(self.up(x) * self.norm.running_var.sqrt())  # stored as this reads it
        return self.norm(h.t().contiguous().t())


def test_a_batch_norm_given_a_converted_copy_of_its_running_statistics_is_refused_by_name():
    # its update in place would land on the copy: the buffer would never change
    with pytest.raises(StrategyError, match=r"'batch_norm' .* updates 'norm_running_var' in"):
        autoshard.compile(
            ReadsRunningStatisticsFirst(), (2, 2, 2), (torch.randn(8, 16),), strategy="3d"
        )


@pytest.mark.parametrize("strategy", ["3d", None])
def test_an_index_made_of_no_input_and_updated_through_views_is_built_in_place(strategy):
    assert_equivalent(f"{OPS}:index_built_in_place", (2, 2, 2), strategy=strategy, steps=2)


def test_buffers_updated_in_forward_keep_every_update():
    # The second of two updates in a row ran out of place: the buffer missed it, and
    # the next step differed (up.weight's gradient off by 0.41). Under no_grad the
    # update reaches the buffer through a detach, which was refused.
    assert_equivalent(f"{OPS}:averaged_buffers", (2, 2, 2), strategy="3d", steps=3)


def test_an_update_in_place_read_only_through_its_result_runs_on_a_gathered_copy():
    assert_equivalent(f"{OPS}:filled_in_place", (2, 2, 2), strategy="3d", steps=2)


class UpdatesWhatToReturnsItself(nn.Module):
    def forward(self, x):
        same = x.to(torch.float32)  # converts nothing: `same` is `x`
        same.mul_(2)
        return x


def test_an_in_place_update_of_what_to_returns_itself_is_refused_by_name():
    with pytest.raises(StrategyError, match=r"'mul_' .* updates 'to', a view .* out of place"):
        autoshard.plan(UpdatesWhatToReturnsItself(), (2, 2, 2), (torch.randn(8, 8),), strategy="3d")


def test_no_grad_and_disabled_autocast_regions_are_inlined_and_match_serial():
    plan, no_rule = _plan("regions")
    assert not no_rule and "detach_default" in plan.nodes  # what leaves no_grad is detached
    assert_equivalent(f"{OPS}:regions", (2, 2, 2), strategy="3d", steps=2)


def test_a_no_grad_region_writing_into_buffers_from_a_weight_matches_serial():
    # spectral norm: its power iteration's ``div(..., out=buffer)`` reads the weight
    assert_equivalent(f"{OPS}:spectral_norm", (2, 2, 2), strategy="3d", steps=2)


def test_a_tensor_made_in_forward_on_the_input_device_matches_serial():
    # torch.tensor(data, device=...) traces as a copy and an in-place detach_ of it
    assert_equivalent(f"{OPS}:tensor_in_forward", (2, 2, 2), strategy="3d", steps=2)


def test_torch_cond_is_refused_and_so_is_a_custom_function_whose_backward_is_not_exact():
    model, inputs = load_factory(f"{OPS}:cond_branch")()
    with pytest.raises(TraceError, match="node 'cond'.*torch.where"):
        autoshard.plan(model, (2, 2, 2), inputs, strategy="3d")
    model, inputs = load_factory(f"{OPS}:straight_through")()
    with pytest.raises(TraceError, match="Function .*_StraightThrough, whose backward is not"):
        autoshard.plan(model, (2, 2, 2), inputs, strategy="3d")


def test_a_custom_function_whose_backward_is_the_derivative_runs_as_its_ops():
    model, inputs = load_factory(f"{OPS}:exact_function")()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # checked exact: nothing to warn of
        autoshard.plan(model, (2, 2, 2), inputs, strategy="3d")
    assert_equivalent(f"{OPS}:exact_function", (2, 2, 2), strategy="3d", steps=2)


@pytest.mark.parametrize("strategy", ["3d", "megatron", None])
def test_a_product_with_a_bias_per_row_runs_replicated_naming_it(strategy):
    # a bias per row was laid out as a row's: ranks added shapes that do not broadcast
    model, inputs = load_factory(f"{OPS}:biases_per_row")()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = autoshard.plan(model, (2, 2, 2), inputs, strategy=strategy)
    unclaimed = {str(w.message) for w in caught if "does not handle a" in str(w.message)}
    assert len(unclaimed) == 4, unclaimed  # the per-row biases, the number, the activations
    if strategy:  # one row ([1, N]) is split as a bias [N] is
        assert plan.nodes["addmm_1"].local_shape != plan.nodes["addmm_1"].shape
    assert_equivalent(f"{OPS}:biases_per_row", (2, 2, 2), strategy=strategy, steps=2)


def test_losses_computed_element_by_element_reduce_their_split_parts():
    # they ran replicated, on gathered logits and targets
    plan, no_rule = _plan("pointwise_losses")
    assert not no_rule
    names = ("loss.default", "kl_div.default", "entropy.default", "with_logits.default")
    losses = [n for n in plan.nodes.values() if n.op.endswith(names)]
    assert len(losses) == 8
    for loss in losses:
        assert any(axes for layout in loss.strategy.inputs for axes in layout.dims), loss.name
        assert loss.strategy.output.partial or loss.name == "huber_loss", loss.name
    assert plan.nodes["huber_loss"].local_shape != plan.nodes["huber_loss"].shape


@pytest.mark.parametrize("mesh", [(2, 2, 2), (1, 2, 4)])
@pytest.mark.parametrize("strategy", ["3d", "megatron", "3d-allreduce", None])
def test_losses_computed_element_by_element_match_serial(strategy, mesh):
    assert_equivalent(f"{OPS}:pointwise_losses", mesh, strategy=strategy, steps=2)


def test_losses_over_classes_keep_their_classes_split():
    # weighted, smoothed, per-row, [N, classes, d] cross-entropies and those against
    # probabilities, and every nll_loss, ran replicated on gathered scores
    plan, no_rule = _plan("class_losses")
    assert not no_rule
    ops = ("aten.cross_entropy_loss.default", "aten.nll_loss_nd.default")
    losses = [n for n in plan.nodes.values() if n.op in ops]
    assert len(losses) == 12 and {n.strategy.family for n in losses} == {"vocab-parallel"}
    dims = [n.strategy.inputs[0].dims for n in losses]
    classes = [d[1] if len(d) > 1 else d[0] for d in dims]
    assert sum(bool(axes) for axes in classes) == 11  # all but the log-softmax's, whole


@pytest.mark.parametrize("mesh", [(2, 2, 2), (1, 2, 4)])
@pytest.mark.parametrize("strategy", ["3d", "megatron", "3d-allreduce", None])
def test_losses_over_classes_match_serial(strategy, mesh):
    assert_equivalent(f"{OPS}:class_losses", mesh, strategy=strategy, steps=2)


@pytest.mark.parametrize(
    "mesh, strategy", [((1, 1, 2), "3d"), ((2, 2, 2), "3d"), ((2, 2, 2), None)]
)
def test_a_gradient_through_complex_values_is_reduced_like_any_other(mesh, strategy):
    # complex values were taken for values no gradient flows through: the layer after
    # the FFTs sent back its input's gradient unreduced (wrong gradients upstream)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the FFTs run replicated, with a warning
        assert_equivalent(f"{OPS}:fourier_mixing", mesh, strategy=strategy, steps=2)


@pytest.mark.parametrize("strategy", ["3d", "megatron", None])
def test_random_ops_on_transposed_activations_draw_what_serial_draws(strategy):
    # they drew into a gathered, row-major operand: the serial numbers, permuted
    # (outputs off by their own size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # they run replicated, with a warning
        assert_equivalent(f"{OPS}:random_on_transposed", (2, 2, 2), strategy=strategy)


@pytest.mark.parametrize("strategy", ["dp", "3d", "megatron"])
def test_an_embedding_renormalizing_its_rows_in_place_matches_serial(strategy):
    # under "dp" its weight went through a gradient bucket, a view of which the
    # renormalization then changed in place: every rank raised
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the renormalization runs replicated
        assert_equivalent(f"{OPS}:renormed_embedding", (2, 2, 2), strategy=strategy)


@pytest.mark.parametrize("strategy", ["3d", "megatron"])
def test_an_eval_batch_norm_of_one_sample_per_rank_matches_serial(strategy):
    # torch's CPU kernel gets a single sample's gradients wrong when they arrive with
    # channels-last strides; the serial batch of 4 never meets it, a rank's 1 did
    assert_equivalent(f"{OPS}:norm_then_token_mean_eval", (2, 2, 2), strategy=strategy)


@pytest.mark.parametrize("mesh, strategy", [((2, 2, 2), "3d"), ((8,), "megatron")])
def test_a_mean_of_every_dim_kept_keeps_its_dims(mesh, strategy):
    # each rank's share dropped keepdim: a 0-d result where serial has [1, 1, 1]
    assert_equivalent(f"{OPS}:mean_kept_whole", mesh, strategy=strategy, steps=2)


def test_values_with_their_indices_and_norms_keep_their_other_dims_split():
    # max/min along a dim, topk, sort, median, kthvalue, mode and vector norms ran
    # replicated, on gathered inputs
    plan, no_rule = _plan("ranked")
    assert not no_rule
    ops = ("max.dim", "min.dim", "topk", "sort", "argsort", "median", "kthvalue", "mode")
    ops += ("linalg_vector_norm",)
    along = [n for n in plan.nodes.values() if n.op.startswith(tuple(f"aten.{o}" for o in ops))]
    assert len(along) == 11
    for node in along:
        assert node.strategy.family != "replicated" and any(node.strategy.inputs[0].dims)


@pytest.mark.parametrize("mesh", [(2, 2, 2), (1, 2, 4)])
@pytest.mark.parametrize("strategy", ["3d", "megatron"])
def test_values_with_their_indices_and_norms_match_serial(strategy, mesh):
    assert_equivalent(f"{OPS}:ranked", mesh, strategy=strategy, steps=2)


@pytest.mark.parametrize("name", ["dropout_in_place", "dropout_in_place_eval"])
def test_a_dropout_in_place_on_a_new_tensor_runs_as_a_split_dropout(name):
    # it ran replicated, on a gathered copy
    plan, no_rule = _plan(name)
    dropout = plan.nodes["dropout_"]
    assert dropout.op == "aten.dropout.default" and dropout.local_shape != dropout.shape
    in_place = [w for w in no_rule if "dropout_" in w]  # the view's, left as it is
    assert len(in_place) == 1 and "'dropout__1'" in in_place[0]
    assert_equivalent(f"{OPS}:{name}", (2, 2, 2), strategy="3d", steps=2)


def test_a_sharded_norm_computes_its_statistics_in_fp32():
    # a half-precision M2 over a batch's N·H·W elements overflowed: rstd 0, the output
    # the bias (the review found it); ATen's kernel accumulates in fp32
    from autoshard.runtime.ops import _ShardedNorm

    torch.manual_seed(0)
    x = (torch.randn(64, 4, 32, 32) * 0.5 + 20).half()
    out, _, m2 = _ShardedNorm.apply(x, None, None, 1e-5, (0, 2, 3), (), "norm")
    exact = F.batch_norm(x.double(), None, None, training=True)
    assert out.dtype == torch.float16 and m2.isfinite().all()
    assert (out.double() - exact).abs().max() < 0.01


def test_values_with_their_indices_of_a_0d_tensor_are_laid_out_each():
    # the 0-d branch gave no layout per result: planning raised IndexError at the getitem
    assert_equivalent(f"{OPS}:maximum_of_a_scalar", (2, 2, 2), strategy="3d", steps=2)


def test_layers_on_flattened_tokens_run_on_the_tokens_unflattened():
    """``addmm(b, x.view(-1, K), w).view(B, S, N)`` is traced as the product on x itself
    (and ``mm``, and ``linear`` on flattened tokens): six sequences on 2×2×2, three a
    rank after the first axis, which a flat dim of tokens could not split over the
    next one, are split over the sequence instead of gathered whole."""
    model, inputs = load_factory(f"{OPS}:flattened_layers")()
    graph_module = trace(model, inputs).graph_module
    ops = [n.target._opname for n in graph_module.graph.nodes if n.op == "call_function"]
    assert "addmm" not in ops and "mm" not in ops and "view" not in ops, ops
    torch.testing.assert_close(graph_module(*inputs)[0], model(*inputs), rtol=1e-6, atol=1e-6)
    plan = autoshard.plan(model, (2, 2, 2), inputs, strategy="3d")
    activation = plan.nodes["gelu"].strategy.output
    assert activation.dims[0] and activation.dims[1], activation  # batch and sequence
    assert_equivalent(f"{OPS}:flattened_layers", (2, 2, 2), strategy="3d", steps=2)
    assert_equivalent(f"{OPS}:flattened_layers", (1, 2, 4), steps=2, memory_budget=60_000)


def test_slices_that_cut_a_tensor_into_pieces_are_a_split():
    """Phi-3's ``qkv[..., :q]``, ``qkv[..., q:q + kv]``, ``qkv[..., q + kv:]`` are traced as
    one split (whose rule keeps the pieces split where the projection splits its
    features); slices that overlap, step or leave a gap stay slices."""
    model, inputs = load_factory(f"{OPS}:slices")()
    graph_module = trace(model, inputs).graph_module
    splits = [n for n in graph_module.graph.nodes if n.target == aten.split_with_sizes.default]
    assert [(n.args[0].name, n.args[1]) for n in splits] == [("linear", [16, 8, 8])]
    slices = [n for n in graph_module.graph.nodes if n.target == aten.slice.Tensor]
    assert {n.args[0].name for n in slices} == {"linear_1", "mul"}, slices
    torch.testing.assert_close(graph_module(*inputs)[0], model(*inputs), rtol=0, atol=0)
    assert_equivalent(f"{OPS}:slices", (2, 2, 2), strategy="3d", steps=2)


class _PieceUpdatedInPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.fused = nn.Linear(16, 16)

    def forward(self, x):
        h = self.fused(x)
        q, k = h[..., :8], h[..., 8:]
        q.mul_(2)  # autograd refuses this on one of the views a split returns
        return q * k


def test_slices_of_a_tensor_updated_in_place_stay_slices():
    x = torch.randn(4, 8, 16, requires_grad=True)
    graph_module = trace(_PieceUpdatedInPlace(), (x,)).graph_module
    assert not [n for n in graph_module.graph.nodes if n.target == aten.split_with_sizes.default]
    graph_module(x)[0].sum().backward()


def test_a_loss_on_flattened_tokens_runs_on_the_tokens_unflattened():
    """``cross_entropy(logits.view(-1, V), labels.view(-1))`` (casts after either view
    too) is traced as the loss over the tokens themselves, its classes moved to dim 1:
    on 2×2×2 the logits of six sequences stay split over the sequence (a flat dim of
    tokens could not split over the next axis, and the largest activation of a
    language model was gathered over it); padding ids ignored, mean and sum, both
    losses reading one cast of the logits."""
    model, inputs = load_factory(f"{OPS}:flattened_loss")()
    graph_module = trace(model, inputs).graph_module
    losses = [n for n in graph_module.graph.nodes if n.target == aten.cross_entropy_loss.default]
    assert [n.args[0].meta["val"].dim() for n in losses] == [3, 3]
    assert len({n.args[0] for n in losses}) == 1, "the logits cast to fp32 twice"
    torch.testing.assert_close(graph_module(*inputs)[0], model(*inputs), rtol=1e-6, atol=1e-6)
    plan = autoshard.plan(model, (2, 2, 2), inputs, strategy="3d")
    for loss in losses:
        logits = plan.nodes[loss.name].strategy.inputs[0]
        assert logits.dims[0] and logits.dims[2], logits  # batch and sequence
    assert_equivalent(f"{OPS}:flattened_loss", (2, 2, 2), strategy="3d", steps=2)
    assert_equivalent(f"{OPS}:flattened_loss", (1, 2, 4), steps=2, memory_budget=30_000)
