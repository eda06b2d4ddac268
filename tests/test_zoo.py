"""Every zoo model (`hf_zoo.py`) equals the serial model on real gloo ranks.

`make test` runs every model under "3d" (`FAST_MODELS`) and the first model of each
family under a solved tight budget (`FAST_BUDGET`), on 2×2×2 for one SGD step; `make zoo`
(``pytest -m zoo``) runs every model in the full matrix: every strategy, 1×2×4
too, bf16, three steps. Each case is compiled once (`zoo.compile_model`: traced,
planned and emitted, in a process beside this one that keeps ahead of the ranks:
`zoo.compiling_ahead`) and applied by every rank, which traces nothing.
A model autoshard refuses must raise the documented error listed in
`hf_zoo.EXPECTED_ERRORS`; the models the check itself cannot run
(`hf_zoo.UNCHECKABLE`) are strict expected failures. Plans are the same in
processes with different ``PYTHONHASHSEED`` (`test_zoo_plans_are_identical_across_hash_seeds`,
the first model of each family, forced and solved: tracing is most of planning's time,
and each process traces its own).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import hf_zoo  # noqa: E402
import zoo_plans as zoo  # noqa: E402

from autoshard import errors  # noqa: E402
from autoshard.planning.verify import check_plan  # noqa: E402
from autoshard.testing import assert_equivalent  # noqa: E402

FAST_MODELS = hf_zoo.MODELS
# Under a tight budget in `make test`: the first model of each family (`make zoo` runs
# every model under it, on both meshes).
FAST_BUDGET = [family[0] for family in hf_zoo.ZOO.values()]
FULL = [
    (setting, mesh)
    for setting in ("3d", "3d-allreduce", "replicated", "budget")
    for mesh in ((2, 2, 2), (1, 2, 4))
]


def _models(names: list[str]) -> list:
    """`names` as parameters, the ones `assert_equivalent` cannot check marked so."""
    return [
        pytest.param(
            name,
            marks=pytest.mark.xfail(
                name in hf_zoo.UNCHECKABLE,
                reason=hf_zoo.UNCHECKABLE.get(name, ""),
                raises=RuntimeError,  # in this process: the float64 reference runs here
                strict=True,
            ),
        )
        for name in names
    ]


def _check(name: str, setting: str, mesh, *, steps: int, **tolerance) -> None:
    expected = hf_zoo.EXPECTED_ERRORS.get(name.removesuffix("_bf16"))
    if expected is not None:
        with pytest.raises(getattr(errors, expected[0])):
            zoo.compile_model(name, mesh, setting)
        return
    compiled = zoo.compiled(name, mesh, setting)
    assert_equivalent(zoo.factory(name), mesh, steps=steps, compiled=compiled, **tolerance)


@pytest.mark.parametrize("name", _models(FAST_MODELS))
def test_zoo(name):
    _check(name, "3d", (2, 2, 2), steps=1)


@pytest.mark.parametrize("name", _models(FAST_BUDGET))
def test_zoo_under_a_tight_budget(name):
    _check(name, "budget", (2, 2, 2), steps=1)


@pytest.mark.zoo
@pytest.mark.parametrize(("setting", "mesh"), FULL, ids=str)
@pytest.mark.parametrize("name", _models(hf_zoo.MODELS))
def test_zoo_full(name, setting, mesh):
    _check(name, setting, mesh, steps=3)


@pytest.mark.zoo
@pytest.mark.parametrize("name", _models(hf_zoo.MODELS))
def test_zoo_bf16(name):
    # bf16 rounds at every op, and the parallel program sums in another order.
    _check(f"{name}_bf16", "3d", (2, 2, 2), steps=3, rtol=3e-2)


# The cases the hash-seed test compares: the first model of each family, forced and solved.
HASHED = [
    (name, (2, 2, 2), setting)
    for name in FAST_BUDGET
    if name not in hf_zoo.EXPECTED_ERRORS
    for setting in ("3d", "budget")
]
# The case each test compiles, from its parameters, for `zoo.compiling_ahead`.
_CASES = {
    "test_zoo": lambda p: (p["name"], (2, 2, 2), "3d"),
    "test_zoo_under_a_tight_budget": lambda p: (p["name"], (2, 2, 2), "budget"),
    "test_zoo_full": lambda p: (p["name"], p["mesh"], p["setting"]),
    "test_zoo_bf16": lambda p: (f"{p['name']}_bf16", (2, 2, 2), "3d"),
}


@pytest.fixture(scope="module", autouse=True)
def compiled_ahead(request):
    """Every case this session runs here, compiled in order beside the rank jobs."""
    cases = []
    for item in request.session.items:
        case = _CASES.get(getattr(item, "originalname", ""))
        if case is not None and item.callspec.params["name"] not in hf_zoo.EXPECTED_ERRORS:
            cases.append(case(item.callspec.params))
        elif getattr(item, "originalname", "") == _HASH_TEST:
            cases += HASHED
    with zoo.compiling_ahead(cases):
        yield


_PLAN_HASHES = """
import hashlib, sys
sys.path.insert(0, {tests!r})
import zoo_plans
for name, mesh, setting in {cases!r}:
    plan = zoo_plans.plan_model(name, mesh, setting)
    print(name, setting, hashlib.sha256(plan.to_json().encode()).hexdigest())
"""
_HASH_TEST = "test_zoo_plans_are_identical_across_hash_seeds"


def _another_seed() -> str:
    """A PYTHONHASHSEED that is not this process's."""
    own = os.environ.get("PYTHONHASHSEED", "random")
    return str(int(own) + 1) if own.isdigit() else "0"  # 0: no randomization at all


@pytest.fixture(scope="module", autouse=True)
def plans_under_another_seed(request):
    """The `HASHED` cases planned by another process with another hash seed, started
    with the module (when the hash-seed test is selected) so that it runs beside the
    rank jobs instead of after them."""
    if not any(getattr(item, "originalname", "") == _HASH_TEST for item in request.session.items):
        yield None
        return
    script = _PLAN_HASHES.format(tests=str(Path(__file__).parent), cases=HASHED)
    run = subprocess.Popen(
        [sys.executable, "-c", script],
        env={**os.environ, "PYTHONHASHSEED": _another_seed()},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    yield run
    run.kill()
    run.communicate()


def test_zoo_plans_are_identical_across_hash_seeds(plans_under_another_seed):
    # The plans the tests ran (made once, in `zoo.compiling_ahead`'s process) against
    # another process's, under another seed: a plan that iterates a set or hashes a name
    # would differ between them.
    ours = {(name, setting): zoo.compiled(name, mesh, setting).plan_digest
            for name, mesh, setting in HASHED}  # fmt: skip
    out, err = plans_under_another_seed.communicate(timeout=900)
    assert plans_under_another_seed.returncode == 0, err[-2000:]
    theirs = {(name, setting): digest for name, setting, digest in map(str.split, out.splitlines())}
    assert sorted(theirs) == sorted(ours)
    differing = sorted(case for case in ours if ours[case] != theirs[case])
    assert not differing, f"plans differ across PYTHONHASHSEED for {differing}"


def test_a_plan_solved_on_a_relabeled_mesh_passes_the_check_a_saved_plan_gets():
    """The solver plans each order of the mesh axes on the mesh relabeled: an experts'
    product it chose there names a size-1 axis in another place than the rule lists it
    for the mesh itself (Qwen2-MoE on 1×2×4: "N=a,b" for "N=b,a", the same layouts).
    A saved plan is checked for what runs, not for how a strategy is described."""
    check_plan(zoo.plan_model("qwen2_moe", (1, 2, 4), "budget"), zoo.traced_model("qwen2_moe")[1])


@pytest.mark.parametrize("mesh", [(2, 2, 2), (1, 2, 4)], ids=str)
def test_a_split_planned_in_a_block_passes_the_check_a_saved_plan_gets(mesh):
    """A block is planned with the values entering it in layouts the joined plan may
    store otherwise: RoFormer's rotary table arrived split over its features in the
    block, where its chunk into sines and cosines cut each piece over those axes; the
    joined plan stores the table otherwise and gathers it on the way in. The check
    derived the chunk's candidates from the stored layout only, and refused the plan."""
    check_plan(zoo.plan_model("roformer", mesh, "budget"), zoo.traced_model("roformer")[1])
