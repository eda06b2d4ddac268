"""Models named on the command line or in a rank job: ``path/to/file.py:factory``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def load_factory(spec: str):
    """`path/to/file.py:name` → the callable `name` defined in that file."""
    path, _, name = spec.rpartition(":")
    if not path or not name:
        raise ValueError(f"expected MODEL as path/to/file.py:factory, got {spec!r}")
    module_spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    if module_spec is None:
        raise FileNotFoundError(f"no Python file at {path!r}")
    module = importlib.util.module_from_spec(module_spec)
    # Registered while the file runs (a dataclass under postponed annotations looks its
    # module up in sys.modules), then unregistered: a module of the same name imported
    # the usual way (`from gpt import GPT`) stays the one pickle finds.
    previous = sys.modules.get(module_spec.name)
    sys.modules[module_spec.name] = module
    try:
        module_spec.loader.exec_module(module)
    finally:
        if previous is None:
            del sys.modules[module_spec.name]
        else:
            sys.modules[module_spec.name] = previous
    return getattr(module, name)
