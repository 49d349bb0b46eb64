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


@pytest.mark.parametrize("path", sorted(p for layer in ("algorithms", "contract", "training")
                                         for p in (SRC / layer).glob("*.py")),
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_algorithms_import_no_runtime(path):
    assert not {m for m in imported(path)
                if m.startswith(("edgepfl.engine", "edgepfl.report", "edgepfl.experiments",
                                 "edgepfl.system"))}


def test_the_algorithms_folder_holds_methods_only():
    """Each module there registers a method (``ALGORITHM`` or ``ALGORITHMS``) or is a part of
    one (``<method>_<part>.py``); the contract and the training machinery live apart."""
    modules = {p.stem: p for p in (SRC / "algorithms").glob("*.py") if p.stem != "__init__"}
    methods = {name for name, p in modules.items()
               if {"ALGORITHM", "ALGORITHMS"} & {t.id for node in ast.parse(p.read_text()).body
                                                 if isinstance(node, ast.Assign)
                                                 for t in node.targets if isinstance(t, ast.Name)}}
    parts = {name for name in modules if name.split("_")[0] in methods}
    assert set(modules) - methods - parts == set()


@pytest.mark.parametrize("path", sorted((SRC / "engine").glob("flower*.py")), ids=lambda p: p.name)
def test_flower_does_not_import_the_simulation_module(path):
    assert "edgepfl.engine.simulation" not in imported(path)


# -- fitness: sizes and the import graph, held so that what was met stays met ----------------
MAX_FILE_LINES, MAX_FUNCTION_LINES = 800, 60


def _sources() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def test_no_source_file_is_over_800_lines():
    sizes = {str(p.relative_to(SRC)): len(p.read_text().splitlines()) for p in _sources()}
    over = {name: n for name, n in sizes.items() if n > MAX_FILE_LINES}
    assert not over, f"files over {MAX_FILE_LINES} lines (split them by what they do): {over}"


def test_no_function_is_over_60_lines():
    over = {}
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    over[f"{path.relative_to(SRC)}:{node.lineno} {node.name}"] = lines
    assert not over, f"functions over {MAX_FUNCTION_LINES} lines: {over}"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_nodes(tree: ast.AST):
    """Every node but those under ``if TYPE_CHECKING:`` (names for the type checker,
    never imported when the code runs)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if not (isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test)):
                todo.append(child)


def import_graph() -> dict[str, set[str]]:
    """edgepfl module -> the edgepfl modules it imports when it runs, late imports
    included; ``from package import name`` points at the package (its ``__init__`` runs)
    and at the submodule when there is one."""
    modules = {_module_name(p): p for p in _sources()}
    graph = {}
    for name, path in modules.items():
        out = set()
        for node in _runtime_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                out |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # the package runs first (its __init__), then a submodule named in it
                out.add(node.module)
                out |= {f"{node.module}.{a.name}" for a in node.names} & set(modules)
        graph[name] = {m for m in out if m in modules and m != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_sees_late_imports_and_the_finder_finds_cycles():
    # plugins.register_algorithm imports the registry inside the function
    assert "edgepfl.algorithms" in import_graph()["edgepfl.plugins"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    # a package's module importing a name from the package is an arrow back to it
    assert "edgepfl.data" in import_graph()["edgepfl.engine.parts"]


def test_no_import_cycle_late_imports_included():
    found = cycles(import_graph())
    assert not found, f"modules that import each other, at any depth: {found}"
