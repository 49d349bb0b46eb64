"""The arrows of docs/architecture.md, held: settings import neither the algorithms nor
the engine, algorithms import no runtime, and the Flower runtime does not lean on the
simulation's module."""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "edgepfl"


def imported(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth of its code (late imports too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def closure(module: str) -> set[str]:
    """``module`` and every edgepfl module it imports, transitively."""
    seen, todo = set(), [module]
    while todo:
        name = todo.pop()
        if name in seen or not name.startswith("edgepfl"):
            continue
        seen.add(name)
        rel = Path(*name.split(".")[1:])
        path = SRC / rel.with_suffix(".py") if (SRC / rel.with_suffix(".py")).exists() \
            else SRC / rel / "__init__.py"
        if path.exists():
            todo += [m for m in imported(path) if m.startswith("edgepfl")]
    return seen


def test_settings_import_neither_the_algorithms_nor_the_engine():
    reached = closure("edgepfl.config")
    assert not {m for m in reached if m.startswith(("edgepfl.algorithms", "edgepfl.engine"))}


@pytest.mark.parametrize("path", sorted((SRC / "algorithms").glob("*.py")), ids=lambda p: p.name)
def test_algorithms_import_no_runtime(path):
    assert not {m for m in imported(path)
                if m.startswith(("edgepfl.engine", "edgepfl.report", "edgepfl.system"))}


def test_flower_does_not_import_the_simulation_module():
    assert "edgepfl.engine.simulation" not in imported(SRC / "engine" / "flower.py")
