"""MkDocs hook: one API reference page per module, generated from the source tree at build time.

The modules are read from ``pyproject.toml`` (``[tool.setuptools] packages`` and ``package-dir``),
the list setuptools installs, so a module or package added or moved in the source gets its page
(and its entry in the navigation) at the next build without editing the docs. Each page holds one
mkdocstrings directive (``::: kareus_fx.x.y``) that renders the module's docstrings.

``passes/``, ``runtime/`` and ``cost_models/`` install as ``kareus_fx.passes`` / ``.runtime`` /
``.cost_models`` through ``package-dir``, which griffe (mkdocstrings' loader) cannot read: it looks
for ``kareus_fx/passes`` on disk. So the hook first lays out an import view,
``build/docs-api-view/kareus_fx/``, made of symlinks: every entry of ``kareus_fx/`` plus one link per
remapped folder, and mkdocs.yml points mkdocstrings' ``paths`` at it (the same idea as
``typings/kareus_fx/`` for mypy).
"""

from __future__ import annotations

import ast
import importlib.util
import posixpath
import shutil
from pathlib import Path
from types import ModuleType
from typing import Any

import tomllib
from mkdocs.config.defaults import MkDocsConfig
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]


def _load_sibling(name: str) -> ModuleType:
    """A module of docs/hooks/ (MkDocs loads each hook by path; they are no package)."""
    spec = importlib.util.spec_from_file_location(f"docs_hooks_{name}", Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


markdown_docstring = _load_sibling("griffe_rst_roles").markdown_docstring
"""The API pages' docstring markup rule, applied to the index's summaries too."""
VIEW = ROOT / "build" / "docs-api-view"
"""The import view griffe reads (mkdocs.yml: ``plugins.mkdocstrings.handlers.python.paths``)."""
REFERENCE = "reference"
"""Folder of the generated pages, relative to docs/."""
NAV_TITLE = "API reference"


def package_folders(root: Path = ROOT) -> dict[str, Path]:
    """Installed package name -> source folder, as setuptools installs them (pyproject.toml).

    A package under a remapped one sits in the remapped folder (``kareus_fx.passes.x`` in
    ``passes/x/``), as setuptools resolves it: the longest ``package-dir`` prefix wins."""
    setuptools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dir: dict[str, str] = setuptools.get("package-dir", {})
    folders = {}
    for name in setuptools["packages"]:
        prefixes = [p for p in package_dir if p and (name == p or name.startswith(p + "."))]
        if prefixes:
            prefix = max(prefixes, key=len)
            rest = name[len(prefix) :].lstrip(".").replace(".", "/")
            folders[name] = root / package_dir[prefix] / rest
        else:
            folders[name] = root / name.replace(".", "/")
    return folders


def module_names(packages: dict[str, Path]) -> dict[str, list[str]]:
    """Package -> its modules' dotted names (the package itself first, then its ``.py`` files by
    name). Private modules (a leading underscore) are left out: they are no API."""
    modules = {}
    for package, folder in sorted(packages.items()):
        names = [package]
        for path in sorted(folder.glob("*.py")):
            if not path.stem.startswith("_"):
                names.append(f"{package}.{path.stem}")
        modules[package] = names
    return modules


def _natural_folder(name: str, packages: dict[str, Path], root: Path) -> Path:
    """Where ``name`` would sit without ``package-dir``: inside its parent package's folder."""
    parent, _, last = name.rpartition(".")
    return packages[parent] / last if parent in packages else root / name.replace(".", "/")


def build_view(packages: dict[str, Path], view: Path = VIEW, root: Path = ROOT) -> None:
    """Lay out ``view`` so that every package sits at its import path: real folders along the way,
    a symlink for each source entry and for each remapped package folder."""
    if view.exists():
        shutil.rmtree(view)
    remapped = {name: folder for name, folder in packages.items() if folder != _natural_folder(name, packages, root)}
    for parent in sorted({name.rpartition(".")[0] for name in remapped} - {""}):
        target = view / parent.replace(".", "/")
        target.mkdir(parents=True)
        for entry in packages[parent].iterdir():
            if entry.name != "__pycache__" and entry.name not in {n.rpartition(".")[2] for n in remapped}:
                (target / entry.name).symlink_to(entry)
    for name, folder in remapped.items():
        (view / name.replace(".", "/")).symlink_to(folder)
    for name in packages:  # top-level packages that nothing is remapped into
        top = view / name.split(".")[0]
        if not top.exists():
            top.symlink_to(root / name.split(".")[0])


def docstring_summary(path: Path) -> str:
    """The module docstring's first sentence, on one line, for the reference index ("" when none)."""
    docstring = ast.get_docstring(ast.parse(path.read_text()))
    if not docstring:
        return ""
    paragraph = " ".join(docstring.strip().split("\n\n")[0].split())
    sentence_end = paragraph.find(". ")
    return paragraph if sentence_end < 0 else paragraph[: sentence_end + 1]


def _page_path(module: str, package: str) -> str:
    parts = module.split(".")
    if module == package:
        return f"{REFERENCE}/{'/'.join(parts)}/index.md"
    return f"{REFERENCE}/{'/'.join(parts)}.md"


def _source(module: str, packages: dict[str, Path]) -> Path:
    if module in packages:
        return packages[module] / "__init__.py"
    package, name = module.rsplit(".", 1)
    return packages[package] / f"{name}.py"


@event_priority(100)  # before mkdocstrings reads its paths
def on_config(config: MkDocsConfig) -> MkDocsConfig:
    """Build the import view and add the reference section to the navigation."""
    packages = package_folders()
    build_view(packages)
    modules = module_names(packages)
    section: list[Any] = [f"{REFERENCE}/index.md"]
    for package, names in modules.items():
        # Under its package's heading a module is listed by its own name (the page says the full one).
        entries = [{name.rpartition(".")[2] if name != package else name: _page_path(name, package)} for name in names]
        section.append({package: entries})
    config.nav = [*(config.nav or []), {NAV_TITLE: section}]
    return config


def _module_table(names: list[str], package: str, packages: dict[str, Path], relative_to: str) -> list[str]:
    """A table of ``names`` (modules of ``package``, or packages): each linked relative to the page at
    ``relative_to``, with its docstring's first sentence."""
    rows = ["| module | what it holds |", "|---|---|"]
    for name in names:
        page = _page_path(name, name if name in packages else package)
        link = posixpath.relpath(page, posixpath.dirname(relative_to))
        label = name if name == package else name.rpartition(".")[2]
        summary = markdown_docstring(docstring_summary(_source(name, packages))).replace("|", "\\|")
        rows.append(f"| [`{label}`]({link}) | {summary} |")
    return rows


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Add the generated pages: one per module (a package's lists its modules) and the index."""
    packages = package_folders()
    index_page = f"{REFERENCE}/index.md"
    index = [
        f"# {NAV_TITLE}",
        "",
        "Generated at build time from the docstrings (mkdocstrings), one page per module of every package "
        "that `pyproject.toml` installs. `passes/`, `runtime/` and `cost_models/` install as "
        "`kareus_fx.passes`, `kareus_fx.runtime` and `kareus_fx.cost_models`.",
        "",
    ]
    for package, names in module_names(packages).items():
        index += [f"## `{package}`", "", *_module_table(names, package, packages, index_page), ""]
        package_page = _page_path(package, package)
        children = [name for name in packages if name.rpartition(".")[0] == package] + names[1:]
        modules = _module_table(children, package, packages, package_page) if children else []
        content = [f"# `{package}`", "", f"::: {package}", "", *(["## Contents", "", *modules] if modules else [])]
        files.append(File.generated(config, package_page, content="\n".join(content) + "\n"))
        for name in names[1:]:
            files.append(File.generated(config, _page_path(name, package), content=f"# `{name}`\n\n::: {name}\n"))
    files.append(File.generated(config, index_page, content="\n".join(index)))
    return files
