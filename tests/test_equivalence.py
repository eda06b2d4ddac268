"""The parallel program equals the serial model: outputs, every gradient, and the
parameters after the SGD steps, on real gloo meshes."""

import math
from pathlib import Path

import pytest
import torch

from autoshard.testing import Mismatch, _compare, assert_equivalent, failures

MODELS = str(Path(__file__).parent / "models.py")
MIXED = {"layers.*.fc1": "3d-allreduce", "layers.1.*": "replicated", "head": "3d"}


@pytest.mark.parametrize("mesh", [(2, 2, 2), (1, 2, 4), (2, 1, 1), (1, 1, 1)])
@pytest.mark.parametrize("strategy", ["3d", "3d-allreduce", "replicated", MIXED], ids=str)
def test_mlp_matches_serial(mesh, strategy):
    report = assert_equivalent(f"{MODELS}:mlp", mesh, strategy=strategy, steps=3, rtol=1e-5)
    grads = {m.name for m in report if m.what == "grad"}
    assert {"layers.0.fc1.weight", "layers.1.norm.bias", "head.bias"} <= grads
    assert {m.step for m in report if m.what == "output"} == {0, 1, 2}


def test_two_dimensional_input_on_a_cube():
    assert_equivalent(f"{MODELS}:mlp_2d_input", (2, 2, 2), strategy="3d")


def test_a_norm_over_split_features_far_from_zero():
    import autoshard

    model, inputs = autoshard.factory.load_factory(f"{MODELS}:offset_norm")()
    plan = autoshard.plan(model, (2, 2, 2), inputs, strategy="3d")
    [norm] = [n for n in plan.nodes.values() if n.op == "aten.layer_norm.default"]
    assert norm.strategy.internal  # its features are split: statistics are combined
    report = assert_equivalent(f"{MODELS}:offset_norm", (2, 2, 2), strategy="3d")
    grads = {m.name for m in report if m.what == "grad"}
    assert {"norm.bias", "input 0"} <= grads


def test_a_mask_of_the_lowest_value_made_with_the_default_dtype_has_a_float64_reference():
    report = assert_equivalent(f"{MODELS}:lowest_mask", (2, 2, 2), strategy="3d", steps=1)
    assert all(not math.isnan(m.serial_error) for m in report)


def test_an_output_that_is_a_parameter_is_compared_as_forward_returned_it():
    report = assert_equivalent(f"{MODELS}:returns_its_weight", (2, 2, 2), strategy="3d")
    assert {m.name for m in report if m.what == "output"} == {"0", "1"}


def test_a_parameter_and_a_buffer_only_returned_are_returned_whole():
    report = assert_equivalent(f"{MODELS}:returns_what_nothing_reads", (2, 2, 2))
    assert {m.name for m in report if m.what == "output"} == {"0", "1", "2"}


@pytest.mark.parametrize("strategy", ["3d", "megatron"])
def test_a_float64_model_is_compared_with_its_serial_program(strategy):
    # against itself as reference, only a rounding floor was left: 120 comparisons
    # failed, the worst 2.3e-12 off values near 1
    report = assert_equivalent(f"{MODELS}:offset_norm_in_float64", (2, 2, 2), strategy=strategy)
    assert all(math.isnan(m.serial_error) for m in report if m.eps)  # it is the reference
    assert 0 < max(m.max_abs for m in report) < 1e-10


def test_an_fp32_model_returning_float64_keeps_its_float64_reference():
    report = assert_equivalent(f"{MODELS}:upcasts_its_output", (2, 2, 2), strategy="3d")
    assert all(not math.isnan(m.serial_error) for m in report)


def test_a_model_casting_to_float32_in_forward_has_a_float64_reference():
    report = assert_equivalent(f"{MODELS}:casts_in_forward", (2, 2, 2), strategy="3d")
    assert all(not math.isnan(m.serial_error) for m in report)


def test_a_checkpointed_block_casting_inside_has_a_float64_reference():
    report = assert_equivalent(f"{MODELS}:checkpointed_casts", (2, 2, 2), strategy="3d")
    assert all(not math.isnan(m.serial_error) for m in report)


def test_an_embedding_with_sparse_gradients_runs_replicated_and_matches_serial():
    with pytest.warns(UserWarning, match="does not handle sparse=True"):
        report = assert_equivalent(f"{MODELS}:sparse_embedding", (2, 2, 2), strategy="3d")
    [grad] = {m.name for m in report if m.what == "grad" and m.name.startswith("embedding")}
    assert grad == "embedding.weight"


def test_a_difference_is_caught():
    # `perturbed_mlp`'s serial reference has one weight off by 1e-3: the check must fail.
    with pytest.raises(AssertionError, match="differs from the serial model"):
        assert_equivalent(f"{MODELS}:perturbed_mlp", (2, 2, 2), strategy="3d", steps=1)


def test_the_float64_reference_trains_on_the_same_loss():
    # The loss's random weights were drawn under the reference's float64 modes, other
    # numbers than the fp32 programs drew: every gradient was ~100 % off its reference,
    # and the checks, scaled by the serial program's own error, let a wrong optimizer
    # step through. The serial program is now within rounding of its reference.
    report = assert_equivalent(f"{MODELS}:mlp", (2, 2, 2), strategy="3d", steps=2)
    checked = [m for m in report if m.what in ("grad", "param") and m.scale]
    assert checked and all(m.serial_error < 1e-4 * m.scale for m in checked)


def test_dropout_draws_the_same_mask_in_float64():
    # the float64 reference relies on it: same seed, same mask, whatever the dtype
    masks = []
    for dtype in (torch.float32, torch.float64):
        torch.manual_seed(7)
        masks.append(torch.nn.functional.dropout(torch.ones(4096, dtype=dtype), 0.3) != 0)
    assert torch.equal(*masks)


def test_errors_are_measured_against_float64_tensor_by_tensor():
    exact = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    serial = exact.float()
    one_ulp = torch.nextafter(serial, serial + 1)  # another summation order may round so
    close = _compare("grad", "w", 0, one_ulp, serial, exact)
    wrong = _compare("grad", "w", 0, serial + torch.tensor([0.0, 0.0, 2e-5]), serial, exact)
    small = _compare("grad", "zero", 0, torch.zeros(3), torch.zeros(3), torch.zeros(3).double())
    assert failures([close, small]) == []
    assert failures([close, wrong]) == [wrong]  # 7e-6 relative: rtol=1e-5 let it through
    count = Mismatch("output", "count (parallel 1, serial 2)", 0, math.inf, 1.0)
    assert failures([count]) == [count]
    # A float64 reference with a NaN (prophetnet's key bias) leaves the fp32 serial one:
    # a gradient that is zero in exact arithmetic differs there by rounding of its kind's
    # scale, not of its own.
    nan = torch.tensor([math.nan, 0.0, 0.0], dtype=torch.float64)
    noise = torch.tensor([1e-13, -2e-13, 0.0])
    rounded = _compare("grad", "k_bias", 0, noise, noise.flip(0), nan)
    shifted = _compare("grad", "k_bias", 0, noise + 1e-3, noise, nan)
    assert failures([close, rounded]) == []
    assert failures([close, shifted]) == [shifted]


def test_nan_and_infinities_are_compared_not_skipped():
    serial = torch.tensor([-math.inf, 1.0, 2.0])
    exact = serial.double()
    masked = _compare("output", "scores", 0, serial.clone(), serial, exact)
    assert masked.max_abs == 0.0 and masked.scale == 2.0  # an infinity scales nothing
    assert failures([masked]) == []
    for wrong in (math.nan, math.inf, 3.0):
        got = serial.clone()
        got[0 if wrong != 3.0 else 2] = wrong
        assert failures([_compare("output", "scores", 0, got, serial, exact)]), wrong


def test_a_reference_the_serial_program_is_far_from_does_not_judge():
    # In float64, ``h.to(torch.float64)`` is ``h`` itself: a model that updates the cast
    # in place computes something else there. Scaled by the serial program's error
    # against that reference, any parallel error would pass; it is held to `rtol`
    # against the serial program instead.
    serial = torch.tensor([12.7, 1.0])
    other = torch.tensor([6.1, 1.0], dtype=torch.float64)  # another computation
    same = _compare("output", "0", 0, serial.clone(), serial, other)
    off = _compare("output", "0", 0, serial + torch.tensor([0.5, 0.0]), serial, other)
    assert failures([same]) == [] and failures([off]) == [off]
    # After an update, what the update amplified is the serial program's own error as
    # much as the parallel one's (Adam's lr-sized steps of random sign on a key bias,
    # whose gradient is rounding noise): the reference judges, scaled by that error.
    exact = torch.tensor([0.1841, 0.01], dtype=torch.float64)
    serial_step = exact.float() + torch.tensor([9.4e-3, 0.0])
    parallel_step = exact.float() - torch.tensor([9.4e-3, 0.0])
    adam = _compare("param", "k.bias", 1, parallel_step, serial_step, exact)
    assert failures([adam]) == []


class _StepBySize(torch.optim.Optimizer):
    """A step scaled by the tensor's size: on a shard it is another step (the gradients
    still match serial)."""

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] / p.numel())


def test_an_update_that_differs_where_gradients_match_is_named():
    with pytest.raises(AssertionError, match="only the parameters after _StepBySize's last"):
        assert_equivalent(
            f"{MODELS}:mlp", (2, 2, 2), strategy="3d", steps=1, torch_optimizer=_StepBySize
        )


def test_a_diverged_serial_run_is_refused():
    with pytest.raises(ValueError, match="'layers.0.norm.weight' is not finite after 2 steps"):
        assert_equivalent(f"{MODELS}:mlp", (2, 2, 2), strategy="3d", steps=2, lr=1e6)
