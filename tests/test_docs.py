"""Every docstring example in autoshard and passes runs and prints what it shows."""

import doctest
import importlib
import pkgutil

import pytest

import autoshard
import passes


def _modules() -> list[str]:
    names = []
    for package in (autoshard, passes):
        names.append(package.__name__)
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            names.append(info.name)
    return names


def test_the_modules_with_examples_are_found():
    assert {"autoshard.cost", "autoshard.layout", "autoshard.planner"} <= set(_modules())


@pytest.mark.parametrize("name", _modules())
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} fail"
