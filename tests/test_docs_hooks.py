"""The docs build's hooks (docs/hooks/): API pages for every installed module, results tables from the
committed results. ``mkdocs build --strict`` (the check command) renders them all; these tests name
what broke without a build: a module the reference would miss, a package nested in a remapped one,
a results file whose shape a table no longer reads, a page naming a table that does not exist.
Skipped without the ``docs`` extra (mkdocs)."""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("mkdocs")

ROOT = Path(__file__).resolve().parent.parent


def _hook(name: str):
    spec = importlib.util.spec_from_file_location(f"docs_hook_{name}", ROOT / "docs" / "hooks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


api_pages = _hook("api_pages")
results_tables = _hook("results_tables")


def test_every_public_module_of_every_installed_package_gets_a_page():
    packages = api_pages.package_folders()
    assert packages["kareus_fx.passes"] == ROOT / "passes"  # installed through package-dir
    documented = {name for names in api_pages.module_names(packages).values() for name in names}
    for package, folder in packages.items():
        assert package in documented
        for path in folder.glob("*.py"):
            if not path.stem.startswith("_"):
                assert f"{package}.{path.stem}" in documented


def test_a_package_inside_a_remapped_one_is_found_in_its_folder_and_in_the_view(tmp_path):
    """``kareus_fx.passes.x`` lives in ``passes/x/`` (setuptools' longest package-dir prefix); the
    import view griffe reads shows it at ``kareus_fx/passes/x``."""
    (tmp_path / "kareus_fx").mkdir()
    (tmp_path / "kareus_fx" / "__init__.py").write_text('"""Top."""\n')
    (tmp_path / "kareus_fx" / "cli.py").write_text("")
    (tmp_path / "passes" / "rules").mkdir(parents=True)
    (tmp_path / "passes" / "__init__.py").write_text("")
    (tmp_path / "passes" / "rules" / "__init__.py").write_text("")
    (tmp_path / "passes" / "rules" / "pointwise.py").write_text('"""Pointwise rules. More text."""\n')
    (tmp_path / "pyproject.toml").write_text(
        '[tool.setuptools]\npackages = ["kareus_fx", "kareus_fx.passes", "kareus_fx.passes.rules"]\n'
        '[tool.setuptools.package-dir]\n"kareus_fx.passes" = "passes"\n'
    )
    packages = api_pages.package_folders(tmp_path)
    assert packages["kareus_fx.passes.rules"] == tmp_path / "passes" / "rules"
    view = tmp_path / "view"
    api_pages.build_view(packages, view, tmp_path)
    assert os.readlink(view / "kareus_fx" / "passes") == str(tmp_path / "passes")
    assert (view / "kareus_fx" / "passes" / "rules" / "pointwise.py").is_file()
    assert (view / "kareus_fx" / "cli.py").is_file()
    assert api_pages.module_names(packages)["kareus_fx.passes.rules"] == [
        "kareus_fx.passes.rules",
        "kareus_fx.passes.rules.pointwise",
    ]
    assert api_pages.docstring_summary(tmp_path / "passes" / "rules" / "pointwise.py") == "Pointwise rules."


@pytest.mark.parametrize("name", sorted(results_tables.RENDERERS))
def test_every_results_table_renders_from_the_committed_results(name):
    table = results_tables.RENDERERS[name]()
    rows = [line for line in table.splitlines() if line.startswith("|")]
    assert len(rows) >= 3, table  # header, rule, at least one row
    assert len({row.count("|") for row in rows[:3]}) == 1, table  # every row has the header's columns


def test_docs_pages_name_only_tables_that_exist():
    used = {
        match.group(2)
        for page in (ROOT / "docs").glob("*.md")
        for match in results_tables.MARKER.finditer(page.read_text())
    }
    assert used and used <= set(results_tables.RENDERERS)


def test_the_readme_includes_the_command_blocks_that_ci_runs():
    """The development page includes the README's command blocks by snippet section; .ci/run reads
    them by their markers. Both marker pairs must enclose the same block."""
    readme = (ROOT / "README.md").read_text()
    for block in ("check-command", "test-command"):
        section = re.search(rf"--8<-- \[start:{block}\] -->\n(.*?)<!-- --8<-- \[end:{block}\]", readme, re.S)
        assert section, block
        assert section.group(1).startswith(f"<!-- {block} -->\n```bash\n"), section.group(1)
