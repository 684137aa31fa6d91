"""The layers: engine/ imports no other part of the project, control/ only engine/, daemon/ no
bench or tools."""

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
