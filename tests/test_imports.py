"""The folders show the pipeline: every module imports only its own stage or earlier
ones, so no import cycle is possible and nothing low depends on the tools above it
(the CLI and the test harness sit on top; nothing imports them)."""

import ast
from pathlib import Path

ROOT = Path(__file__).parent.parent

# Stages in pipeline order; a module may import modules of its stage or before.
# The kernels the emitted program calls (collectives, local implementations) need
# only the words; they come before the rules because an op's registry entry holds
# its lowering, which names its kernel. They live in runtime/ with what runs them.
STAGES = [
    [
        "autoshard.errors",
        "autoshard.sizes",
        "autoshard.mesh",
        "autoshard.layout",
        "autoshard.formula",
    ],
    ["autoshard.runtime.comm", "autoshard.runtime.ops", "autoshard.runtime.losses"],
    ["autoshard.tracing"],
    ["autoshard.strategies"],
    ["autoshard.cost"],
    ["autoshard.planning"],
    ["autoshard.runtime"],
    ["passes"],
    [
        "autoshard.api",
        "autoshard.checkpoint",
        "autoshard.initialize",
        "autoshard.clip",
        "autoshard.factory",
    ],
    ["autoshard.cli", "autoshard.testing", "autoshard"],
]


def _stage(module: str) -> int:
    """The stage of the longest prefix of `module` that names one (`autoshard` itself,
    the package's public face, is last)."""
    best, stage = -1, None
    for index, prefixes in enumerate(STAGES):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, stage = len(prefix), index
    assert stage is not None, f"{module} belongs to no stage: add it to STAGES"
    return stage


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(path: Path) -> set[str]:
    """The project modules `path` imports when it runs (not those under
    ``if TYPE_CHECKING:``, which are type hints only)."""
    tree = ast.parse(path.read_text())
    hinted = {
        id(child)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for child in ast.walk(node)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in hinted:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:  # a submodule, or a name the module defines
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if _known(submodule) else node.module)
    return {name for name in found if name.split(".")[0] in ("autoshard", "passes")}


def _modules() -> list[Path]:
    return sorted([*(ROOT / "autoshard").rglob("*.py"), *(ROOT / "passes").rglob("*.py")])


def _known(name: str) -> bool:
    """`name` is a module of the project (not a name imported from one)."""
    relative = Path(*name.split("."))
    return (ROOT / relative).with_suffix(".py").is_file() or (ROOT / relative).is_dir()


def test_no_module_imports_a_later_stage():
    upward = []
    for path in _modules():
        module = _module_name(path)
        for imported in _runtime_imports(path):
            if _stage(imported) > _stage(module):
                upward.append(f"{module} imports {imported}")
    assert not upward, "imports against the pipeline:\n" + "\n".join(upward)


def test_nothing_imports_the_cli_or_the_test_harness():
    users = [
        f"{_module_name(path)} imports {imported}"
        for path in _modules()
        if _module_name(path) not in ("autoshard.cli", "autoshard.testing")
        for imported in _runtime_imports(path)
        if imported in ("autoshard.cli", "autoshard.testing")
        or imported.startswith(("autoshard.cli.", "autoshard.testing."))
    ]
    assert not users, "\n".join(users)


def test_the_check_sees_an_upward_import(tmp_path):
    # the scan finds a lazy import inside a function, as well as one at the top
    source = tmp_path / "low.py"
    source.write_text("def f():\n    from autoshard.cli import main\n")
    assert "autoshard.cli" in _runtime_imports(source)
    assert _stage("autoshard.cli") > _stage("autoshard.layout")


def test_no_import_cycle():
    graph = {_module_name(path): _runtime_imports(path) for path in _modules()}
    done, path = set(), []

    def visit(module):
        if module in path:
            return path[path.index(module) :] + [module]
        if module in done or module not in graph:
            return None
        path.append(module)
        for imported in sorted(graph[module]):
            if imported != "autoshard" and (cycle := visit(imported)):  # the package's face
                return cycle
        path.pop()
        done.add(module)
        return None

    cycles = [cycle for module in sorted(graph) if (cycle := visit(module))]
    assert not cycles, " → ".join(cycles[0])
