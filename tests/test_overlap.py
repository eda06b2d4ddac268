"""Gradient-bucket reductions (and gather buckets' reduce-scatters) overlapped with
backward (`Plan.overlap`, the default): backward launches a bucket's calls and goes
on, waiting where a result is read (a bucket over another axis, the parameters'
gradients). The program still equals serial with it on and off, logs exactly the
predicted calls, and the cost model takes off the step time what runs hidden
(`autoshard.planning.overlap`)."""

import dataclasses
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import autoshard
from autoshard.cost.hardware import Hardware
from autoshard.cost.model import gather_seconds, node_costs
from autoshard.planning import collectives
from autoshard.planning.overlap import backward_end, overlapped
from autoshard.planning.plan import Bucket
from autoshard.runtime import comm
from autoshard.runtime.ranks import shared_pool
from autoshard.testing import assert_equivalent, load_factory
from autoshard.tracing.trace import trace

EXAMPLES = Path(__file__).parents[1] / "examples"
GPT, MLP = f"{EXAMPLES}/gpt.py:gpt", f"{EXAMPLES}/mlp.py:mlp"
MESH = (2, 2, 2)
REDUCTIONS = ("all_reduce", "reduce_scatter_single")  # what buckets launch


@pytest.mark.parametrize(
    "factory, overlap", [(GPT, False), (MLP, True), (MLP, False)], ids=["gpt-off", "mlp", "mlp-off"]
)
def test_the_program_equals_serial_with_overlap_on_and_off(factory, overlap):
    # GPT with overlap on: tests/test_shared_collectives.py (the default)
    assert_equivalent(factory, MESH, strategy="3d", overlap=overlap)


def _accumulated(mesh, programs):
    """Per program: the calls logged over two backward passes that accumulate into
    the same gradients, how many bucket calls were launched asynchronously, and the
    full gradients."""
    launched = []
    synchronous = {name: getattr(comm.dist, name) for name in REDUCTIONS}

    def counted(name):
        def call(*args, **kwargs):
            launched.append(kwargs.get("async_op", False))
            return synchronous[name](*args, **kwargs)

        return call

    out = []
    for compiled in programs:
        torch.manual_seed(0)
        model, inputs = load_factory(GPT)()
        parallel = autoshard.parallelize(model, mesh, inputs, compiled=compiled)
        launched.clear()
        for name in REDUCTIONS:
            setattr(comm.dist, name, counted(name))
        try:
            with autoshard.comm_log() as log:
                for _ in range(2):
                    parallel(*inputs).backward()
        finally:
            for name, function in synchronous.items():
                setattr(comm.dist, name, function)
        logged = Counter((r.node, r.kind, r.axis, r.phase, r.bytes) for r in log.records)
        out.append((logged, sum(launched), parallel.full_grads(), len(comm._PENDING)))
    return out


def test_overlapped_reductions_are_waited_for_accumulate_and_log_as_predicted():
    model, inputs = load_factory(GPT)()
    programs = [
        autoshard.compile(model, MESH, inputs, strategy="3d", overlap=overlap)
        for overlap in (True, False)
    ]
    on, off = (program.plan for program in programs)
    assert on.overlap and not off.overlap
    calls = sum(len(b.calls) for b in on.buckets) + len(on.gathers)
    assert on.gathers
    for ranks in shared_pool(8).run(_accumulated, MESH, programs):
        (logged, launched, grads, pending), (plain, synchronous, want, _) = ranks
        for plan, log in ((on, logged), (off, plain)):
            predicted = Counter(
                (c.node, c.kind, c.axis, c.phase, c.nbytes) for c in plan.predicted_calls()
            )
            assert log == Counter({key: 2 * n for key, n in predicted.items()})
        assert (launched, synchronous) == (2 * calls, 0)  # each bucket call, each pass
        assert not pending  # every launched reduction was waited for
        assert grads.keys() == want.keys()
        for name, grad in grads.items():  # two passes accumulated, as without overlap
            assert torch.equal(grad, want[name]), name


def test_buckets_cut_at_units_launch_as_backward_passes_them(monkeypatch):
    """With a bucket cap below one block's bucketed bytes, every unit's gradients are
    buckets of their own, placed at the unit's first reader: the program still equals
    serial, logs exactly the predicted calls, and the cost model hides more of them."""
    model, inputs = load_factory(GPT)()
    whole = autoshard.compile(model, MESH, inputs, strategy="3d")
    monkeypatch.setattr(collectives, "BUCKET_BYTES", 1)
    cut = autoshard.compile(model, MESH, inputs, strategy="3d")
    axes = {b.axis for b in whole.plan.buckets}
    assert len(whole.plan.buckets) == len(axes) < len(cut.plan.buckets)
    assert len(set(cut.plan.bucket_places().values())) > 1
    assert cut.plan.cost.overlapped > whole.plan.cost.overlapped
    for ranks in shared_pool(8).run(_accumulated, MESH, [cut, whole]):
        (logged, launched, grads, pending), (_, _, want, _) = ranks
        predicted = Counter(
            (c.node, c.kind, c.axis, c.phase, c.nbytes) for c in cut.plan.predicted_calls()
        )
        assert logged == Counter({key: 2 * n for key, n in predicted.items()})
        launched_calls = len(cut.plan.buckets) + len(cut.plan.gathers)
        assert launched == 2 * launched_calls and not pending
        for name, grad in grads.items():  # the same sums, in other buckets
            torch.testing.assert_close(grad, want[name], rtol=1e-5, atol=1e-6)
    assert_equivalent(GPT, MESH, compiled=cut)


@pytest.mark.parametrize("hardware", ["nvlink-8", "ib-cluster"])
@pytest.mark.parametrize("factory", [GPT, MLP], ids=["gpt", "mlp"])
def test_overlap_never_lengthens_the_predicted_step(factory, hardware):
    model, inputs = load_factory(factory)()
    on, off = (
        autoshard.plan(model, MESH, inputs, strategy="3d", hardware=hardware, overlap=overlap)
        for overlap in (True, False)
    )
    assert off.cost.overlapped == 0.0
    assert 0.0 < on.cost.overlapped <= sum(on.cost.communication.values())
    assert on.cost.step_time == pytest.approx(off.cost.step_time - on.cost.overlapped)
    assert on.cost.communication == off.cost.communication  # the same calls, hidden or not


def test_buckets_over_different_axes_run_side_by_side():
    # The 3d MLP's buckets (a parameter replicated over a and b is reduced over b
    # first, then a): c and b launch together, a once b's are done. Its first op
    # reads a bucketed parameter, so no compute follows: hidden is min(R_b, R_c),
    # R = 2(n−1)α + 2(n−1)/n·S/β for a call of S bytes over n = 2 ranks (β: bytes/s).
    model, inputs = load_factory(MLP)()
    hardware = Hardware.load("nvlink-8")
    plan = autoshard.plan(model, MESH, inputs, strategy="3d", hardware=hardware)
    plan = dataclasses.replace(plan, gathers=())  # the gradient buckets alone
    buckets = {b.axis: b for b in plan.buckets}
    assert [b.axis for b in plan.buckets] == ["a", "b", "c"]
    assert set(buckets["b"].serves) & set(buckets["a"].serves)
    assert set(buckets["c"].serves) & set(buckets["a"].serves)
    assert not set(buckets["b"].serves) & set(buckets["c"].serves)

    def seconds(axis):
        link = hardware.link(plan.mesh.index(axis))
        return 2 * link.alpha + buckets[axis].nbytes / link.beta

    hidden = overlapped(plan, node_costs(trace(model, inputs), plan, hardware), hardware)
    assert hidden == pytest.approx(min(seconds("b"), seconds("c")), rel=1e-12)


def test_a_gather_bucket_reduces_while_the_units_before_it_compute():
    # The MLP's blocks each gather their two weights over a at the block's start:
    # backward launches a block's reduce-scatter once past the block and goes on with
    # the blocks before it, so more is hidden than with the gradient buckets alone.
    model, inputs = load_factory(MLP)()
    hardware = Hardware.load("nvlink-8")
    plan = autoshard.plan(model, MESH, inputs, strategy="3d", hardware=hardware)
    costs = node_costs(trace(model, inputs), plan, hardware)
    assert len(plan.gathers) == 3 and {g.axis for g in plan.gathers} == {"a"}
    alone = overlapped(dataclasses.replace(plan, gathers=()), costs, hardware)
    reduce_scatters = sum(gather_seconds(g, plan.mesh, hardware) for g in plan.gathers)
    assert alone < plan.cost.overlapped <= alone + reduce_scatters


def test_a_unit_that_fills_a_bucket_alone_launches_its_buckets_itself(monkeypatch):
    # The later unit fills a bucket over a alone; the earlier one's b gradients would
    # fit beside its own over b, but joining would place both units' buckets at the
    # earlier unit's first reader (they share a parameter reduced over a and b), a
    # unit late: the full unit's buckets launch once backward is past it.
    monkeypatch.setattr(collectives, "BUCKET_BYTES", 100)

    def served(node, nbytes):
        return [(node, 0, SimpleNamespace(nbytes=nbytes))]

    earlier = {("b", "float32"): served("norm_0", 10)}
    later = {("a", "float32"): served("mlp_1", 150), ("b", "float32"): served("norm_1", 10)}
    assert collectives._segments([earlier, later]) == [earlier, later]
    small = {("a", "float32"): served("mlp_1", 50), ("b", "float32"): served("norm_1", 10)}
    (joined,) = collectives._segments([earlier, small])  # neither fills one: together
    assert joined["b", "float32"] == earlier["b", "float32"] + small["b", "float32"]


def _bucket(name, axis, *serves):
    return Bucket(name, axis, 2, "float32", 4, tuple((s, 0) for s in serves))


def _end(buckets, seconds, after: float, before: float = 0.0) -> float:
    """`backward_end` with every bucket placed before node "reader": `after` seconds of
    backward compute above it (run after the launch), `before` below it."""
    compute = {"above": after, "reader": 0.0, "below": before}
    return backward_end(buckets, seconds, compute, {b.name: "reader" for b in buckets})


def test_backward_ends_when_the_compute_after_and_every_reduction_are_done():
    a, b = _bucket("a", "a", "x"), _bucket("b", "b", "y")
    seconds = {"a": 3.0, "b": 2.0}
    # independent: both launched at once, beside the compute above the first reader
    assert _end((a, b), seconds, after=1.0) == 3.0
    assert _end((a, b), seconds, after=5.0) == 5.0
    assert _end((a, b), seconds, after=1.0, before=2.0) == 2.0 + 3.0
    # a reduces what b reduced: autograd waits for b, then launches a
    chained = _bucket("b", "b", "x")
    assert _end((a, chained), seconds, after=1.0) == 2.0 + 3.0
    assert _end((a, chained), seconds, after=4.0) == 2.0 + 4.0
    # two buckets over one axis (two dtypes) take turns on it
    same = _bucket("b", "a", "y")
    assert _end((a, same), seconds, after=1.0) == 5.0


def test_a_later_blocks_bucket_launches_while_the_first_blocks_compute():
    # two blocks' buckets over one axis: the second block's launches once backward is
    # past it, and reduces while the first block computes; the first block's then waits
    # for the axis
    first, second = _bucket("first", "a", "block0"), _bucket("second", "a", "block1")
    seconds = {"first": 2.0, "second": 2.0}
    compute = {"block0": 3.0, "block1": 1.0}
    places = {"first": "block0", "second": "block1"}
    # block1 computes (1), launches second (1 → 3); block0 computes (→ 4), launches first
    # (4 → 6): 6 against 1 + 3 + 2 + 2 = 8 serially, 2 s hidden
    assert backward_end((first, second), seconds, compute, places) == 6.0
    # one bucket for both, placed before block0: nothing runs beside it
    both = _bucket("both", "a", "block0", "block1")
    assert backward_end((both,), {"both": 4.0}, compute, {"both": "block0"}) == 8.0


def _autograd_node(root, name: str):
    """The node of the autograd graph behind `root` whose name holds `name`."""
    seen, todo = set(), [root]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if name in node.name():
            return node
        todo += [parent for parent, _ in node.next_functions]
    raise LookupError(name)


def _stopped_before_the_wait(mesh, program):
    """A backward that raises before the program's `grad_wait` (the reductions its
    buckets launched are never waited for there), then a normal step: the reductions
    left pending after each, and the normal step's full gradients."""
    torch.manual_seed(0)
    model, inputs = load_factory(MLP)(dropout=0.0)
    parallel = autoshard.parallelize(model, mesh, inputs, compiled=program)
    out = parallel(*inputs).sum()

    def stop(grads):
        raise RuntimeError("stopped")

    _autograd_node(out.grad_fn, "_GradWaitBackward").register_prehook(stop)
    with pytest.raises(RuntimeError, match="stopped"):
        out.backward()
    stale = len(comm._PENDING)
    parallel.zero_grad()  # what the stopped pass accumulated (the unbucketed gradients)
    parallel(*inputs).sum().backward()
    return stale, len(comm._PENDING), parallel.full_grads()


def test_reductions_a_stopped_backward_left_are_settled_by_the_next_step():
    torch.manual_seed(0)
    model, inputs = load_factory(MLP)(dropout=0.0)
    program = autoshard.compile(model, MESH, inputs, strategy="3d", overlap=True)
    assert program.plan.buckets
    model(*inputs).sum().backward()
    want = {name: p.grad for name, p in model.named_parameters()}
    for stale, pending, grads in shared_pool(8).run(_stopped_before_the_wait, MESH, program):
        assert stale > 0  # the stopped backward launched reductions it never waited for
        assert pending == 0
        assert grads.keys() == want.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, want[name], rtol=1e-5, atol=1e-6)
