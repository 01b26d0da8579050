"""The house rules docs/design.md states, checked: no import circles anywhere in src/ and benchmarks/
(every import counts, also one inside a function or under ``TYPE_CHECKING``: a circle deferred is
still a circle in the design), and no module in src/ or benchmarks/ over 500 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def module_graph(top: Path, prefix: str = "") -> dict[str, set[str]]:
    """Module name -> the modules of the same tree it imports (a package's ``__init__`` is its face,
    not a room of its own: importing through it is not counted as importing the package)."""
    paths = {}
    for path in sorted(top.rglob("*.py")):
        parts = path.relative_to(top).with_suffix("").parts
        name = prefix + ".".join(parts).removesuffix(".__init__")
        paths[name] = path
    graph: dict[str, set[str]] = {name: set() for name in paths}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            for target in targets:
                if target in paths and target != name and paths[target].name != "__init__.py":
                    graph[name].add(target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan), as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_circle_finder_finds_a_circle(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import x\n")
    (pkg / "b.py").write_text("def f():\n    from pkg import a\n    return a\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    assert circles(module_graph(tmp_path)) == [["pkg.a", "pkg.b"]]


def test_src_has_no_import_circles() -> None:
    assert circles(module_graph(ROOT / "src")) == []


def test_benchmarks_have_no_import_circles() -> None:
    graph = module_graph(ROOT / "benchmarks", prefix="benchmarks.")  # imported as the package `benchmarks`
    assert "benchmarks.common.results_file" in graph["benchmarks.run"]  # the imports are seen
    assert circles(graph) == []


MAX_MODULE_LINES = 500


@pytest.mark.parametrize("tree", ["src", "benchmarks"])
def test_no_module_is_over_500_lines(tree: str) -> None:
    big = {str(p.relative_to(ROOT)): n for p in sorted((ROOT / tree).rglob("*.py"))
           if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert big == {}, f"split these by job: {big}"
