"""The package's import graph, read from the source with ``ast`` (nothing is imported or run).

Rules that keep the layout readable (README "Layout"):

- no import cycles between modules, counting every import: module level, inside functions and
  under ``TYPE_CHECKING`` (a lazy import hides a cycle from the interpreter, not from a reader);
- at most six modules loose at the top of ``kareus_fx/``; the rest live in the room of the stage
  they implement.

Module names come from pyproject.toml's package list and package-dir map, so a folder installed
under another name (``passes/`` as ``kareus_fx.passes``) is read under the name users import.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent
MAX_LOOSE_TOP_MODULES = 6


def _package_folders() -> dict[str, Path]:
    """Installed package name -> source folder, as setuptools installs them."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dir = setuptools.get("package-dir", {})
    return {name: ROOT / package_dir.get(name, name.replace(".", "/")) for name in setuptools["packages"]}


def _modules() -> dict[str, Path]:
    """Every module of the installed packages: dotted name -> file (``__init__`` as the package)."""
    modules = {}
    for package, folder in _package_folders().items():
        for path in folder.glob("*.py"):
            modules[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return modules


def _imported_names(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """Every dotted name ``module`` imports (absolute and relative), with ``from X import y``
    giving both ``X`` and ``X.y`` (``y`` may be a submodule)."""
    names: set[str] = set()
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph() -> nx.DiGraph:
    """Edges importer -> imported, between the package's own modules."""
    modules = _modules()
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for name in _imported_names(tree, module, path.stem == "__init__"):
            if name in modules and name != module:
                graph.add_edge(module, name)
    return graph


def test_the_graph_sees_the_package() -> None:
    """The reader finds the modules and their imports (so the cycle test below can fail)."""
    graph = import_graph()
    assert "kareus_fx.cli" in graph and "kareus_fx.passes.analysis" in graph
    assert graph.has_edge("kareus_fx.capture.backend", "kareus_fx.capture.compile_step")
    assert graph.number_of_edges() > 50


def test_a_lazy_import_cycle_is_found() -> None:
    """A cycle made only of function-level imports is still a cycle."""
    source_a = "def f():\n    from kareus_fx.b import g\n"
    names = _imported_names(ast.parse(source_a), "kareus_fx.a", False)
    assert "kareus_fx.b" in names and "kareus_fx.b.g" in names
    relative = _imported_names(ast.parse("from ..passes import analysis\n"), "kareus_fx.capture.backend", False)
    assert "kareus_fx.passes.analysis" in relative


def test_no_import_cycles() -> None:
    graph = import_graph()
    cycles = [sorted(component) for component in nx.strongly_connected_components(graph) if len(component) > 1]
    if cycles:
        shown = []
        for component in cycles:
            edges = nx.find_cycle(graph.subgraph(component))
            shown.append(" -> ".join([edge[0] for edge in edges] + [edges[0][0]]))
        pytest.fail(
            "import cycles between modules (give the code both need one home that both import):\n  "
            + "\n  ".join(shown)
        )


def test_few_loose_modules_at_the_top() -> None:
    loose = sorted(p.name for p in (ROOT / "kareus_fx").glob("*.py"))
    assert len(loose) <= MAX_LOOSE_TOP_MODULES, (
        f"{len(loose)} modules loose at the top of kareus_fx/ ({', '.join(loose)}): "
        f"at most {MAX_LOOSE_TOP_MODULES}; move stage code into its room (README 'Layout')"
    )


def test_readme_layout_table_has_one_row_per_room() -> None:
    """README "Layout": one row per room, none for a folder that is gone. A room is ``kareus_fx`` or
    one of its direct subpackages; a deeper package (``kareus_fx.passes.batch_dims``) is part of its
    room's row."""
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Layout") :].split("\n\n")[1]
    rows = [line.split("|")[1].strip().strip("`") for line in table.splitlines()[2:]]
    rooms = {str(folder.relative_to(ROOT)) + "/" for name, folder in _package_folders().items() if name.count(".") <= 1}
    assert sorted(r for r in rows if r in rooms or r.startswith("kareus_fx/")) == sorted(rooms)
