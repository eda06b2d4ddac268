"""Bad input of every kind gets an error naming its cause and the fix, never a silently
wrong answer: budgets, hardware numbers, strategy patterns, data-dependent shapes,
saved plans (malformed, for another model, edited by hand), ranks that disagree,
call-time inputs of another dtype or device. Planning falls back per node where the
solver chooses, and says why it left a unit replicated."""

import copy
import json
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import autoshard
from autoshard import PlanError
from autoshard.cli import main
from autoshard.cost.hardware import Hardware
from autoshard.mesh import Mesh
from autoshard.planning.plan import Plan
from autoshard.planning.planner import plan_graph
from autoshard.planning.verify import check_plan
from autoshard.runtime.ranks import shared_pool
from autoshard.tracing.trace import trace

MESH = (2, 2, 2)
HERE = Path(__file__)


class TwoLinears(nn.Module):
    def __init__(self, width=16, hidden=32):
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class KeywordOnly(TwoLinears):
    def forward(self, *, x):
        return super().forward(x)


class Masked(TwoLinears):
    def forward(self, x):
        return self.fc1(x)[x.sum(-1) > 0].sum()


def two_linears():
    return TwoLinears(), (torch.randn(8, 16),)


def keyword_only():
    return KeywordOnly(), (torch.randn(8, 16),)


def _plan(model=None, inputs=None, **kw) -> Plan:
    model, inputs = (model, inputs) if model is not None else two_linears()
    return autoshard.plan(model, MESH, inputs, **kw)


# ---------------------------------------------------------------------------- budgets


def test_budgets_accept_numbers_and_size_strings_alike():
    assert _plan(memory_budget="2GiB").cost.peak_memory <= 2 * 2**30
    assert _plan(memory_budget="2GiB").to_json() == _plan(memory_budget=2 * 2**30).to_json()


@pytest.mark.parametrize(
    "budget, cause",
    [
        (float("nan"), "nan is not a positive, finite"),
        (-1, "-1 is not a positive"),
        (0, "0 is not a positive"),
        ("lots", "'lots' is not a size"),
        ([1], r"\[1\] \(list\) is not a size"),
    ],
)
def test_budgets_refuse_what_is_not_a_size(budget, cause):
    with pytest.raises(autoshard.BudgetError, match=cause):
        _plan(memory_budget=budget)


def test_the_cli_reads_budgets_with_the_same_parser(capsys):
    with pytest.raises(SystemExit):
        main(["show", f"{HERE}:two_linears", "--mesh", "2x2x2", "--budget=-5MiB"])
    assert "memory_budget '-5MiB' is not a positive" in capsys.readouterr().err


# ---------------------------------------------------------------------------- hardware


@pytest.mark.parametrize(
    "field, value, cause",
    [
        ("beta", -1.0, r"axes\[0\]\.beta = -1.0 must be a positive"),
        ("alpha", -1e-6, r"axes\[0\]\.alpha = -1e-06 must be a finite number ≥ 0"),
        ("efficiency", 0.0, r"efficiency = 0.0 must be in \(0, 1\]"),
        ("memory_bandwidth", float("inf"), "memory_bandwidth = inf must be a positive finite"),
    ],
)
def test_hardware_numbers_are_range_checked(tmp_path, field, value, cause):
    data = json.loads(Hardware.load("nvlink-8").to_json())
    if field in ("alpha", "beta"):
        data["axes"][0][field] = value
    else:
        data[field] = value
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(data))
    with pytest.raises(autoshard.HardwareError, match=cause):
        Hardware.load(path)


# ---------------------------------------------------------------------------- strategies


def test_a_pattern_matching_no_module_is_an_error_listing_module_paths():
    with pytest.raises(autoshard.StrategyError, match=r"'fc3' matches no module.*'fc1', 'fc2'"):
        _plan(strategy={"fc3": "replicated"})


def test_a_pattern_naming_a_parent_module_says_how_to_reach_its_children():
    model = nn.Sequential(nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16)))  # "0" runs no op
    with pytest.raises(autoshard.StrategyError, match=r"parent module: write '0\.\*'"):
        _plan(model, (torch.randn(8, 16),), strategy={"0": "replicated"})


# ---------------------------------------------------------------------------- tracing


def test_a_data_dependent_shape_names_the_op():
    with pytest.raises(
        autoshard.TraceError, match=r"node 'index' \(aten.index.Tensor\) has a data-dependent"
    ):
        _plan(Masked(), (torch.randn(8, 16),))


class SeededInForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)

    def forward(self, x):  # a fixed random projection, drawn from a generator made here
        proj = torch.randn(16, 4, generator=torch.Generator().manual_seed(9))
        return self.a(x) @ proj


def test_a_generator_made_in_forward_names_its_reader_and_what_to_do():
    # the planner read .ndim on the generator before (an AttributeError)
    with pytest.raises(autoshard.TraceError, match=r"Generator \(read by 'randn'.*buffer"):
        _plan(SeededInForward(), (torch.randn(8, 16),))


def test_a_keyword_only_forward_traces_from_its_examples_in_declaration_order():
    traced = trace(*keyword_only())
    assert [spec.name for spec in traced.inputs] == ["x"]


def test_too_many_example_inputs_name_the_signature():
    with pytest.raises(autoshard.TraceError, match=r"forward\(x\) takes 1 inputs but 2"):
        trace(TwoLinears(), (torch.randn(8, 16), torch.randn(8, 16)))


# ---------------------------------------------------------------------------- saved plans


def _saved(**kw) -> dict:
    return json.loads(_plan(strategy="3d", **kw).to_json())


def _load(data) -> Plan:
    return Plan.from_json(json.dumps(data))


def test_truncated_json_is_a_plan_error(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(_plan().to_json()[:200])
    with pytest.raises(PlanError, match="not valid JSON.*truncated"):
        Plan.load(path)
    with pytest.raises(PlanError, match="cannot read a plan"):
        Plan.load(tmp_path / "missing.json")


class MakesTensorsInForward(nn.Module):
    """Makes a tensor of a number and one of a list from Python data in forward."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        y = self.fc(x)
        floor = torch.tensor(-3.0, device=y.device)
        scale = torch.tensor([0.5, 2.0], device=y.device).repeat(8)
        return torch.where(y > 0, y, floor) * scale


def test_a_tensor_made_from_a_list_in_forward_on_meta_is_refused():
    # traced on meta, it would be a constant of the program with no values: every
    # rank would compute with whatever its memory held. A tensor of one number is
    # traced as the op that makes it, and is no constant.
    with torch.device("meta"):
        model = MakesTensorsInForward()
    compiled = autoshard.compile(model, MESH, (torch.empty(8, 16, device="meta"),), strategy="3d")
    assert [t.tolist() for t in compiled.constants.values() if not t.is_meta] == []
    assert len(compiled.constants) == 1  # the list's tensor; the number's is an op
    with pytest.raises(
        autoshard.InputError,
        match=r"Python data .*line \d+, in forward scale = torch.tensor\(\[0.5.*torch.full",
    ):
        compiled.parameters(model)
    real = MakesTensorsInForward()  # built on the CPU, the constants have their values
    compiled = autoshard.compile(real, MESH, (torch.randn(8, 16),), strategy="3d")
    assert sorted(map(str, (t.tolist() for t in compiled.constants.values()))) == [
        "-3.0",
        "[0.5, 2.0]",
    ]
    assert compiled.parameters(real)


class HoldsAPlainTensor(TwoLinears):
    def __init__(self):
        super().__init__()
        self.scale = torch.ones(16)  # neither a parameter nor a buffer

    def forward(self, x):
        return super().forward(x) * self.scale


def test_a_plain_tensor_attribute_on_meta_is_refused():
    with torch.device("meta"):
        model = HoldsAPlainTensor()
    compiled = autoshard.compile(model, MESH, (torch.empty(8, 16, device="meta"),), strategy="3d")
    with pytest.raises(autoshard.InputError, match="'scale' as a plain attribute.*register"):
        compiled.parameters(model)


class BranchesOnANumber(nn.Module):
    def forward(self, x):
        if torch.tensor(2.0) > 1:  # torch.export folds a constant it knows the value of
            x = 2 * x
        return x[:, : torch.tensor(3).item()]


def test_a_tensor_of_a_number_off_meta_stays_a_constant_forward_may_branch_on():
    x = torch.randn(4, 8)
    traced = trace(BranchesOnANumber(), (x,))
    assert torch.equal(traced.graph_module(x)[0], BranchesOnANumber()(x))


def test_a_plan_from_an_older_autoshard_is_refused():
    data = _saved()
    del data["version"]
    with pytest.raises(PlanError, match="older autoshard.*plan again"):
        _load(data)


def test_a_missing_field_is_named():
    data = _saved()
    del data["nodes"][0]["strategy"]
    with pytest.raises(PlanError, match=r"plan.nodes\[0\] \('linear'\).strategy is missing"):
        _load(data)
    data = _saved()
    data["nodes"][0]["input_steps"] = "none"
    with pytest.raises(PlanError, match=r"\('linear'\).input_steps must be a list"):
        _load(data)


@pytest.mark.parametrize("field", ["overlap", "chunked"])
def test_a_plan_without_a_field_of_its_schema_is_refused_naming_it(field):
    data = _saved()
    del data[field]
    with pytest.raises(PlanError, match=rf"plan.{field} is missing: .*plan again"):
        _load(data)


def test_an_unknown_axis_is_named():
    data = _saved()
    data["nodes"][0]["strategy"]["stored"]["dims"][0] = ["z"]
    with pytest.raises(PlanError, match=r"strategy.stored.dims\[0\]\[0\] names mesh axis 'z'"):
        _load(data)


def test_a_layout_that_cannot_split_its_shape_is_named():
    data = _saved()
    data["storage"]["fc1.bias"] = {"dims": [["a", "b", "c"]], "partial": []}  # 32 over 8: fits
    _load(data)
    data["storage"]["fc2.bias"] = {"dims": [["a", "b", "c"]], "partial": []}
    data["graph"] = [e if e[0] != "fc2.bias" else [*e[:4], [12]] for e in data["graph"]]
    with pytest.raises(PlanError, match=r"storage\['fc2.bias'\].*cannot split shape \[12\]"):
        _load(data)


def test_a_plan_for_another_model_names_the_first_difference():
    plan = _plan()
    with pytest.raises(PlanError, match=r"graph node 0 is `fc1.bias.*\[32\]` in the plan"):
        check_plan(plan, trace(TwoLinears(hidden=24), (torch.randn(8, 16),)))
    with pytest.raises(
        PlanError, match=r"`x = input → float32\[8, 16\]` in the plan but .*\[4, 16\]"
    ):
        check_plan(plan, trace(TwoLinears(), (torch.randn(4, 16),)))
    check_plan(Plan.from_json(plan.to_json()), trace(*two_linears()))  # its own model: fine


def _edited(edit) -> Plan:
    data = _saved()
    edit({n["name"]: n for n in data["nodes"]})
    return _load(data)


def test_a_hand_edited_layout_is_caught():
    traced = trace(*two_linears())

    def reorder_stored(nodes):  # the stored layout's axes in another order
        stored = nodes["linear"]["strategy"]["stored"]
        stored["dims"][0] = stored["dims"][0][::-1]

    with pytest.raises(PlanError, match=r"node 'linear'.*output: its steps make"):
        check_plan(_edited(reorder_stored), traced)

    def drop_the_sum(nodes):  # K's partial sum split instead of reduce-scattered
        strategy = nodes["linear"]["strategy"]
        strategy["output"]["partial"] = []
        for step in nodes["linear"]["output_steps"]:
            step["kind"] = "split" if step["kind"] == "reduce_scatter" else step["kind"]

    with pytest.raises(PlanError, match=r"node 'linear'.*is not one the rule .* proposes"):
        check_plan(_edited(drop_the_sum), traced)


# ---------------------------------------------------------------------------- solver


def test_the_solver_falls_back_per_node_to_the_next_family_that_fits():
    model, inputs = TwoLinears(), (torch.randn(6, 16),)  # 6 tokens: no "3d" layout divides
    # a family the user forced is kept where it fits; the node it cannot split runs
    # replicated, with a warning that names it
    for budget in (None, "1GiB"):
        with pytest.warns(UserWarning, match=r"node 'linear'.*no '3d' layout.*runs replicated"):
            forced = _plan(model, inputs, strategy="3d", memory_budget=budget)
        assert forced.nodes["linear"].strategy.detail == "no layout divides"
    assert _plan(model, inputs).cost is not None  # solved: other families fit
    fell = plan_graph(trace(model, inputs), Mesh.from_shape(MESH), "3d", fallback=True)
    assert re.search(
        r"node 'linear'.*no '3d' layout.*planned as '3d-allreduce'", fell.fallbacks["linear"]
    )
    assert fell.nodes["linear"].strategy.family == "3d-allreduce"


def test_the_solver_says_why_it_left_a_unit_replicated(capsys):
    plan = _plan(memory_budget="1GiB")
    assert plan.choices == {"<prologue>": "replicated"}
    reason = plan.reasons["<prologue>"]
    assert re.fullmatch(
        r"replicated is fastest at this budget: 3d would cost [\d.e-]+ ms more; "
        r"3d-allreduce would cost [\d.e-]+ ms more",
        reason,
    )
    assert Plan.from_json(plan.to_json()).reasons == plan.reasons
    main(["show", f"{HERE}:two_linears", "--mesh", "2x2x2", "--no-code"])
    assert "<prologue>: replicated is fastest at this budget: 3d would cost" in (
        capsys.readouterr().out
    )


# ---------------------------------------------------------------------------- on ranks


def _outcome(run) -> str:
    try:
        run()
    except autoshard.AutoshardError as e:
        return f"{type(e).__name__}: {e}"
    return "ok"


def _bad_ranks_job(mesh):
    """Every rank-side case in one job; each raises on every rank alike (no hangs)."""
    rank = dist.get_rank()
    out = {}
    torch.manual_seed(0)
    model, (x,) = two_linears()
    out["inputs differ"] = _outcome(lambda: autoshard.parallelize(model, mesh, (x + rank,)))
    torch.manual_seed(rank)
    other = TwoLinears()
    out["weights differ"] = _outcome(lambda: autoshard.parallelize(other, mesh, (x,)))
    out["unchecked"] = _outcome(
        lambda: autoshard.parallelize(model, mesh, (x + rank,), check=False)
    )
    parallel = autoshard.parallelize(model, mesh, (x,))
    out["dtype"] = _outcome(lambda: parallel(x.double()))
    out["device"] = _outcome(lambda: parallel(torch.empty(8, 16, device="meta")))
    out["last batch"] = _outcome(lambda: parallel(x[:6]))
    out["unknown keyword"] = _outcome(lambda: parallel(y=x))
    want = model(x)
    out["by keyword"] = str(
        torch.equal(parallel(x=x), parallel(x))
        and torch.allclose(parallel(x), want, rtol=1e-5, atol=1e-6)
    )
    twin = copy.deepcopy(parallel)
    same = torch.equal(twin(x), parallel(x))
    apart = all(
        a.data_ptr() != b.data_ptr() for a, b in zip(twin.parameters(), parallel.parameters())
    )
    out["deepcopy"] = str(same and apart)
    out["keyword-only forward"] = str(_keyword_only_matches_serial(mesh))
    wider = TwoLinears(hidden=24)
    out["another model's plan"] = _outcome(
        lambda: autoshard.parallelize(wider, mesh, (x,), plan=parallel.plan)
    )
    always = autoshard.parallelize(model, mesh, (x,), check="always")
    out["calls differ"] = _outcome(lambda: always(x + rank))
    out["calls agree"] = _outcome(lambda: always(x))
    return out


def _keyword_only_matches_serial(mesh) -> bool:
    """forward(self, *, x), called by keyword: outputs and every gradient as serial."""
    torch.manual_seed(0)
    model, (x,) = keyword_only()
    serial = copy.deepcopy(model)
    parallel = autoshard.parallelize(model, mesh, (x,), strategy="3d")
    got, want = parallel(x=x), serial(x=x)
    weight = torch.randn(got.shape, generator=torch.Generator().manual_seed(1))
    (got * weight).sum().backward()
    (want * weight).sum().backward()
    grads = parallel.full_grads()
    close = [torch.allclose(got, want, rtol=1e-5, atol=1e-6)]
    close += [
        torch.allclose(grads[n], p.grad, rtol=1e-5, atol=1e-6) for n, p in serial.named_parameters()
    ]
    return all(close) and len(close) == 5


def test_bad_input_on_ranks_names_the_cause():
    per_rank = shared_pool(8).run(_bad_ranks_job, MESH)
    expected = {
        "inputs differ": r"InputError: example input 'x' differs on ranks 1, 2, 3, 4, 5, 6, 7 "
        r"from rank 0 \(same shape, other values\): every rank must pass the same full global",
        "weights differ": r"InputError: weight 'fc1.weight' differs on ranks 1, .*manual_seed",
        "unchecked": "ok",
        "dtype": r"InputError: input 'x' is float64 on cpu; this module was planned for float32",
        "device": r"InputError: input 'x' is float32 on meta",
        "last batch": r"InputError: inputs of shapes \[\(6, 16\)\] differ .*drop_last=True",
        "unknown keyword": r"InputError: the call does not match forward\(x\)",
        "by keyword": "True",
        "deepcopy": "True",
        "keyword-only forward": "True",
        "another model's plan": r"PlanError: the plan was made for another model: graph node 0",
        "calls differ": r"InputError: call-time input 'x' differs on ranks 1, .* same full global",
        "calls agree": "ok",
    }
    for rank, outcomes in enumerate(per_rank):
        for case, pattern in expected.items():
            assert re.match(pattern, outcomes[case]), (rank, case, outcomes[case])
