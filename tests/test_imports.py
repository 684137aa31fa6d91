"""The layers: engine/ imports no other part of the project, control/ only engine/, daemon/ no
bench or tools. bench/ and tools/ sit on top and never reach into daemon/ (an engine is assembled
by control/assemble.py); bench/ may read tools/corpus.py (the text the default models learnt and
the text held out from them), tools/ never imports bench/. Inside engine/ no modules import each
other in a circle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("engine", "control", "daemon", "bench", "tools")
FORBIDDEN = {
    "engine": {"control", "daemon", "bench", "tools"},
    "control": {"daemon", "bench", "tools"},
    "daemon": {"bench", "tools"},
    "bench": {"daemon"},
    "tools": {"daemon", "bench"},
}


def project_imports(path: Path) -> set[str]:
    """The project's top-level packages that a module imports (at any depth in the file)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found.update(name.split(".")[0] for name in names if name.split(".")[0] in PARTS)
    return found


@pytest.mark.parametrize("part", sorted(FORBIDDEN))
def test_no_module_imports_a_layer_above_its_own(part):
    modules = sorted((ROOT / part).rglob("*.py"))
    assert modules
    wrong = {str(m.relative_to(ROOT)): sorted(project_imports(m) & FORBIDDEN[part]) for m in modules}
    assert {m: parts for m, parts in wrong.items() if parts} == {}


def test_the_walk_sees_an_import_inside_a_function(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from daemon.logs import configure_logging\n    import bench.spec\n")
    assert project_imports(module) == {"daemon", "bench"}


def test_every_part_of_the_project_has_its_rules():
    """A new top-level folder of modules would escape the rules above: each must be named."""
    folders = {d.name for d in ROOT.iterdir() if d.is_dir() and not d.name.startswith(".") and any(d.rglob("*.py"))}
    assert folders - {"tests"} == set(FORBIDDEN)


def engine_imports(path: Path) -> set[str]:
    """The engine modules a module of engine/ imports, at any depth (type-checking imports too),
    as dotted names; `from engine.x import y` counts engine.x.y where that is a module."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            continue
        found.update(name for name in names if name.startswith("engine.") or name == "engine")
    return found


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_modules_of_engine_import_each_other_in_a_circle():
    modules = {module_name(m): m for m in (ROOT / "engine").rglob("*.py")}
    graph = {name: {i for i in engine_imports(path) if i in modules and i != name} for name, path in modules.items()}
    assert len(graph) > 20
    assert circles(graph) == []


def test_the_circle_check_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
