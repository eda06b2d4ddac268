"""Shared pytest fixtures."""

import pytest

from autoshard.runtime.ranks import RankPool, shared_pool


@pytest.fixture(scope="session")
def rank_pool() -> RankPool:
    """The session's pool of 8 gloo ranks (started once, ~15-20 s on two cores)."""
    return shared_pool()
