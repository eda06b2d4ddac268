"""Every docstring example in autoshard and passes runs and prints what it shows."""

import doctest
import importlib
from pathlib import Path

import pytest

import autoshard
import passes


def _modules() -> list[str]:
    """Every module of the two packages, from their files (the package's own folder
    only, whatever else its import path may hold)."""
    names = []
    for package in (autoshard, passes):
        root = Path(package.__file__).parent
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root.parent).with_suffix("").parts
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def test_the_modules_with_examples_are_found():
    assert {"autoshard.cost.model", "autoshard.layout", "autoshard.planning.planner"} <= set(
        _modules()
    )


@pytest.mark.parametrize("name", _modules())
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} fail"
