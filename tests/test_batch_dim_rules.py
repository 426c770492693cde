"""The batch-rule registry of ``passes/batch_dims/``: one rule per op name, refinements said out loud,
and every op-family module imported by the package (so its rules are in force)."""

from __future__ import annotations

from pathlib import Path

import pytest

import kareus_fx.passes.batch_dims as batch_dims
from kareus_fx.passes.batch_dims import BATCH_RULES, RULE_FAMILIES, BatchRuleRegistry

CORE_MODULES = {"__init__", "values", "node_args", "op_names", "propagation"}
"""The package's modules that register no rules (what a value is, op names, the driver)."""


def _first(an, node, name):
    raise AssertionError("a rule under test is never applied")


def _second(an, node, name):
    raise AssertionError("a rule under test is never applied")


def test_a_second_rule_for_a_name_is_refused_unless_it_replaces_the_first() -> None:
    registry = BatchRuleRegistry()
    registry.register("sort", "topk")(_first)
    with pytest.raises(ValueError, match="already has a rule"):
        registry.register("sort")(_second)
    assert registry.rule("sort") is _first
    registry.register("sort", replace=True)(_second)
    assert registry.rule("sort") is _second and registry.rule("topk") is _first


def test_replacing_a_name_without_a_rule_is_refused() -> None:
    registry = BatchRuleRegistry()
    with pytest.raises(ValueError, match="no rule"):
        registry.register("histc", replace=True)(_first)
    assert registry.rule("histc") is None


def test_partial_sum_rules_are_a_table_of_their_own() -> None:
    registry = BatchRuleRegistry()
    registry.register_partial("add")(_first)
    registry.register("add")(_second)
    assert registry.partial_rule("add") is _first and registry.rule("add") is _second
    assert registry.partial_rule("exp") is None


def test_every_family_module_is_imported_by_the_package() -> None:
    """A family module left out of ``__init__`` would register nothing: its ops would fall back."""
    folder = Path(batch_dims.__file__).parent
    families = {path.stem for path in folder.glob("*.py")} - CORE_MODULES
    assert {module.__name__.rpartition(".")[2] for module in RULE_FAMILIES} == families


def test_the_package_registry_decides_the_common_ops() -> None:
    for name in ("linear", "add", "view", "sum", "getitem", "scaled_dot_product_attention", "c10d.all_reduce"):
        assert BATCH_RULES.rule(name) is not None, name
    assert BATCH_RULES.partial_rule("view") is not None and BATCH_RULES.partial_rule("exp") is None
