"""Calibration step 6 and the testbed comparison it shares with bench/validate_end_to_end.py.

The fit itself plans every calibration row per candidate (half an hour); these tests check its
parts on small inputs: the cell comparison, the loss, the leave-one-row-out reading, that the
packaged rows are the calibration rows only, and that steps 3-5 keep held coefficients.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kareus_fx.cost_models import calibration
from kareus_fx.cost_models.end_to_end_fit import BOUNDS, Evaluation, leave_one_row_out, row_loss
from kareus_fx.cost_models.paper_testbed import COLUMNS, TARGET_PP, calibration_rows, compare_rows, row_cells

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = ("kareus_fx", "passes", "runtime", "cost_models")


def _metrics(reduction: float) -> dict[str, dict[str, float | None]]:
    """Every method's metrics at one reduction (a fraction)."""
    names = {metric for _, metric, _ in COLUMNS.values()}
    methods = {method for method, _, _ in COLUMNS.values()}
    return {m: dict.fromkeys(names, reduction) for m in methods}


def _row(**cells: str) -> dict[str, str]:
    return {"preset": "p", **dict.fromkeys(COLUMNS, "NA"), **cells}


def test_packaged_rows_are_the_llama_calibration_rows_only():
    rows = calibration_rows()
    assert len(rows) == 4
    assert all(r["preset"].startswith("llama3.2-3b-") for r in rows)
    assert set(COLUMNS) <= set(rows[0])


def test_cells_give_errors_in_points_and_skip_na():
    row = _row(kareus_time_red="10.0", np_time_red="4.0")
    cells = {c["metric"]: c for c in row_cells(row, _metrics(0.08))}
    assert cells["kareus_time_red"]["err_pp"] == pytest.approx(-2.0)
    assert cells["np_time_red"]["err_pp"] == pytest.approx(4.0)
    assert cells["mp_energy_red"]["err_pp"] is None


def test_summary_counts_cells_within_their_group_target():
    row = _row(kareus_time_red="10.0", np_time_red="4.0", kareus_iso_time_energy_red="12.0")
    _, summary = compare_rows([row], {"p": {"metrics": _metrics(0.08)}})
    assert summary["compared"] == {"time": 2, "energy": 0, "iso": 1}
    assert summary["within_target"] == {"time": 1, "energy": 0, "iso": 1}  # |4 - 8| > 3; |12 - 8| <= 5
    assert summary["max_abs_err_pp"]["time"] == pytest.approx(4.0)
    assert summary["mean_abs_err_pp"] == pytest.approx((2 + 4 + 4) / 3, abs=0.01)


def test_kareus_below_a_baseline_the_paper_has_it_above_is_listed():
    row = _row(kareus_time_red="10.0", np_time_red="4.0")
    metrics = _metrics(0.05)
    metrics["kareus"]["max_throughput_time_reduction"] = 0.03
    _, summary = compare_rows([row], {"p": {"metrics": metrics}})
    assert summary["kareus_not_below"] == ["p: kareus time 3.0 < np 5.0"]


def test_loss_weighs_errors_by_their_group_target_and_counts_unreached_cells():
    row = _row(kareus_time_red="10.0", kareus_iso_time_energy_red="20.0", mp_time_red="1.0")
    metrics = _metrics(0.10)
    assert row_loss(row, metrics) == pytest.approx((10.0 / TARGET_PP["iso"]) ** 2)  # mp time is in no group
    metrics["kareus"]["iso_time_energy_reduction"] = None
    assert row_loss(row, metrics) == pytest.approx(1.0)


def test_leave_one_row_out_takes_the_point_best_for_the_other_rows():
    evaluations = [
        Evaluation({"k": 1.0}, {"a": 0.0, "b": 0.0, "c": 9.0}),
        Evaluation({"k": 2.0}, {"a": 1.0, "b": 1.0, "c": 1.0}),
    ]
    loo = leave_one_row_out(evaluations)
    assert loo["c"]["values"] == {"k": 1.0} and loo["c"]["held_out_loss"] == 9.0
    assert loo["a"]["values"] == {"k": 2.0} and loo["a"]["held_out_loss"] == 1.0
    assert all(entry["fitted_loss"] == evaluations[1].row_loss[row] for row, entry in loo.items())


def test_held_coefficients_keep_their_values_through_partition_timing():
    params = calibration.SimParams(comm_contention=7.5)
    rows = calibration.load_overlap()
    spec = calibration.gpu_spec(calibration.A100)
    harness = calibration.OverlapHarness(0.55, 500e-6)
    fitted, _, prov = calibration.fit_partition_timing(params, rows, harness, spec, held=("comm_contention",))
    assert fitted.comm_contention == 7.5
    assert "comm_contention" not in prov["fitted"]


def test_the_end_to_end_box_holds_the_packaged_values():
    values = calibration.previous_end_to_end().get("values", {})
    for name, value in values.items():
        lo, hi = BOUNDS[name]
        assert lo <= value <= hi


def test_nothing_in_the_package_reads_the_validation_rows():
    """Only bench/validate_end_to_end.py reads the validation folder; string constants naming it
    anywhere in the package would let a fit see them."""
    offenders = []
    for folder in PACKAGE_DIRS:
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    text = node.value.lower()
                    if "data/validation" in text or "qwen3-1.7b.csv" in text or "_ablation.csv" in text:
                        offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []
