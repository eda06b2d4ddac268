"""Layouts and the steps between them (no processes)."""

import pytest
from torch.distributed.tensor import Partial, Replicate, Shard

from autoshard.errors import MeshError
from autoshard.layout import Layout, redistribute
from autoshard.mesh import Mesh

MESH = Mesh.from_shape((2, 2, 2))


def steps(src, dst, shape=(8, 16), grad=()):
    return [str(s) for s in redistribute(src, dst, shape, 4, MESH, frozenset(grad))]


def test_mesh_is_padded_to_three_axes():
    assert Mesh.from_shape((2, 4)) == Mesh(("a", "b", "c"), (2, 4, 1))
    assert Mesh.from_shape((4,), names=("tp",)).names == ("tp", "a", "b")
    with pytest.raises(MeshError, match="1 to 3 axes"):
        Mesh.from_shape((2, 2, 2, 2))


def test_placements_use_dtensor_vocabulary():
    layout = Layout((("a", "b"), ()), partial=("c",))
    assert layout.placements(MESH) == (Shard(0), Shard(0), Partial())
    assert Layout.replicated(2).placements(MESH) == (Replicate(),) * 3
    assert str(layout) == "S0(a,b) P(c)"


def test_gather_over_the_inner_axis_reduces_gradient_when_work_is_split():
    src, dst = Layout((("a", "b"), ("c",))), Layout((("a",), ("c",)))
    assert steps(src, dst, grad={"b"}) == ["all_gather(b, dim=0) ↔ reduce_scatter"]
    assert steps(src, dst) == ["all_gather(b, dim=0) ↔ split"]


def test_gather_of_an_outer_axis_regathers_the_inner_one():
    src, dst = Layout((("a", "b"), ())), Layout((("b",), ()))
    assert steps(src, dst) == [
        "all_gather(b, dim=0) ↔ split",
        "all_gather(a, dim=0) ↔ split",
        "split(b, dim=0) ↔ all_gather",
    ]


def test_a_free_split_comes_before_a_gather_of_another_dim():
    # keys moving from their sequence split over c to heads split over b (attention on
    # split query rows): split the heads first, so that the gather, and its backward,
    # moves half the bytes
    src, dst = Layout((("a",), (), ("c",), ())), Layout((("a",), ("b",), (), ()))
    shape = (4, 8, 16, 4)
    assert steps(src, dst, shape, grad={"c"}) == [
        "split(b, dim=1) ↔ all_gather",
        "all_gather(c, dim=2) ↔ reduce_scatter",
    ]
    gather = redistribute(src, dst, shape, 4, MESH, frozenset())[1]
    assert gather.nbytes == 4 // 2 * 8 // 2 * 16 * 4 * 4
    # an axis that splits another dim, or is partial, moves only after its gather
    assert steps(Layout((("b",), ())), Layout(((), ("b",)))) == [
        "all_gather(b, dim=0) ↔ split",
        "split(b, dim=1) ↔ all_gather",
    ]


def test_partial_sums_reduce_scatter_onto_a_shard_or_all_reduce():
    src = Layout((("a",), ("b",)), partial=("c",))
    assert steps(src, Layout((("a", "c"), ("b",)))) == ["reduce_scatter(c, dim=0) ↔ all_gather"]
    assert steps(src, Layout((("a",), ("b",)))) == ["all_reduce(c) ↔ identity"]
    assert steps(src, Layout((("a",), ("b",))), grad={"c"}) == ["all_reduce(c) ↔ all_reduce"]


def test_replicated_value_entering_split_work_all_reduces_its_gradient():
    rep = Layout.replicated(2)
    assert steps(rep, rep, grad={"b"}) == ["grad_all_reduce(b) ↔ all_reduce"]
    assert steps(rep, Layout(((), ("c",)))) == ["split(c, dim=1) ↔ all_gather"]


def test_size_one_axes_never_communicate():
    mesh = Mesh.from_shape((1, 2, 4))
    layout = Layout((("a", "b"), ("c",))).normalized(mesh)
    assert layout == Layout((("b",), ("c",)))
    assert redistribute(layout, layout, (8, 16), 4, mesh, frozenset({"a"})) == []


def test_step_bytes_are_the_full_buffer():
    (gather,) = redistribute(
        Layout((("a", "b"), ())), Layout((("a",), ())), (8, 16), 4, MESH, frozenset()
    )
    assert gather.nbytes == 8 // 2 * 16 * 4  # gathered output on this rank
    assert gather.ring_bytes("all_gather") == gather.nbytes / 2
    assert Layout((("a", "b"), ("c",))).local_shape((8, 16), MESH) == (2, 8)
    assert "dim 1 of size 6" in Layout(((), ("c", "a", "b"))).indivisible((8, 6), MESH)
