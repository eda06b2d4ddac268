"""Tests of the persistent gloo rank pool in autoshard.runtime.ranks."""

import os
import pickle
import time

import pytest
import torch
import torch.distributed as dist

from autoshard.runtime.ranks import RankError, RankPool


def _axis_sum(mesh, axis):
    value = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(value, group=mesh.get_group(axis))
    return value.item()


def _whoami(mesh):
    return dist.get_rank(), mesh.get_coordinate(), mesh.mesh_dim_names, mesh.size()


def _raise_on_rank_3(mesh):
    if dist.get_rank() == 3:
        raise ValueError("boom on rank 3")
    return dist.get_rank()


def _rank_tensor(mesh, scale):
    return torch.full((2,), float(dist.get_rank()) * scale), torch.rand(1)


def _crash_or_hang(mesh, mode):
    if dist.get_rank() == 1:
        if mode == "crash":
            os._exit(3)
        time.sleep(60)
    return dist.get_rank()


def test_all_reduce_over_each_axis_of_2x2x2(rank_pool):
    # Rank r sits at coordinate (r // 4, r // 2 % 2, r % 2).
    assert rank_pool.run(_axis_sum, (2, 2, 2), "c") == [1, 1, 5, 5, 9, 9, 13, 13]
    assert rank_pool.run(_axis_sum, (2, 2, 2), "b") == [2, 4, 2, 4, 10, 12, 10, 12]
    assert rank_pool.run(_axis_sum, (2, 2, 2), "a") == [4, 6, 8, 10, 4, 6, 8, 10]


def test_different_meshes_and_a_sub_world_in_one_pool(rank_pool):
    results = rank_pool.run(_whoami, (1, 2, 4))
    assert [coord for _, coord, _, _ in results] == [(0, r // 4, r % 4) for r in range(8)]
    assert results[5][2:] == (("a", "b", "c"), 8)

    # Only ranks 0 and 1 form the mesh; the others build it but do not run the job.
    assert rank_pool.run(_whoami, (2, 1, 1)) == [
        (0, (0, 0, 0), ("a", "b", "c"), 2),
        (1, (1, 0, 0), ("a", "b", "c"), 2),
    ]
    assert rank_pool.run(_axis_sum, (2, 1, 1), "a") == [1, 1]
    assert rank_pool.run(_axis_sum, (4,), "a") == [6, 6, 6, 6]


def test_results_come_back_per_rank_and_jobs_are_seeded(rank_pool):
    first = rank_pool.run(_rank_tensor, (2, 2, 2), scale=10.0)
    assert [full.tolist() for full, _ in first] == [[10.0 * r] * 2 for r in range(8)]
    torch.manual_seed(0)
    expected = torch.rand(1)
    assert all(torch.equal(rand, expected) for _, rand in first)
    second = rank_pool.run(_rank_tensor, (2, 2, 2), scale=1.0)
    assert all(torch.equal(rand, expected) for _, rand in second)


def test_exception_on_one_rank_raises_with_its_traceback(rank_pool):
    with pytest.raises(RankError) as info:
        rank_pool.run(_raise_on_rank_3, (2, 2, 2))
    message = str(info.value)
    assert "rank 3 failed" in message
    assert "Traceback (most recent call last)" in message
    assert "_raise_on_rank_3" in message
    assert "ValueError: boom on rank 3" in message
    assert list(info.value.failures) == [3]
    assert info.value.missing == ()
    # The pool is still usable afterwards.
    assert rank_pool.run(_raise_on_rank_3, (2, 1)) == [0, 1]


def test_unpicklable_job_is_rejected_in_the_caller(rank_pool):
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        rank_pool.run(lambda mesh: None, (2,))
    with pytest.raises(ValueError, match="needs more"):
        rank_pool.run(_whoami, (4, 4))


def test_dead_or_hung_rank_restarts_the_pool():
    # A job may take 1 s here, less than spawning a worker and importing torch takes: the
    # pool starts, and restarts, anyway, since start-up waits for start_timeout_s instead.
    with RankPool(world_size=2, timeout_s=1.0, start_timeout_s=300.0) as pool:
        with pytest.raises(RankError, match=r"ranks \[1\] did not answer") as info:
            pool.run(_crash_or_hang, (2,), "crash")
        assert "rank 1 died with exit code 3" in str(info.value)
        assert pool.run(_crash_or_hang, (1,), "crash") == [0]

        with pytest.raises(RankError, match=r"ranks \[1\] did not answer within 1 s"):
            pool.run(_crash_or_hang, (2,), "hang")
        assert pool.run(_axis_sum, (2,), "a") == [1, 1]
    assert pool.closed
