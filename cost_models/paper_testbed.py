"""The Kareus paper's testbed rows (Tables 3 and 4) and how a plan's metrics compare with them.

Each row is one preset run on the paper's testbed (16 A100s) with every method's measured
reductions against Megatron-LM, in percent. A plan's :func:`~kareus_fx.plan.metrics.frontier_metrics`
hold the same reductions as fractions; :func:`compare_rows` sets one against the other cell by
cell, in percentage points, and groups the cells the way the fidelity targets are stated.

The package holds only the calibration rows (the Llama 3.2 3B rows, ``CALIBRATION_ROWS``); the
validation rows are read by ``bench/validate_end_to_end.py`` alone, from the shared data folder.
"""

from __future__ import annotations

import csv
from collections.abc import Iterable, Mapping, Sequence
from importlib import resources
from typing import Any

CALIBRATION_ROWS = "data/calibration/kareus_paper_testbed/llama3.2-3b.csv"
"""The Llama 3.2 3B rows of Tables 3 and 4, inside ``kareus_fx.cost_models`` (source in SOURCES.md)."""

COLUMNS: dict[str, tuple[str, str, str | None]] = {
    "mp_time_red": ("megatron+perseus", "max_throughput_time_reduction", None),
    "np_time_red": ("nanobatching+perseus", "max_throughput_time_reduction", "time"),
    "kareus_time_red": ("kareus", "max_throughput_time_reduction", "time"),
    "mp_energy_red": ("megatron+perseus", "max_throughput_energy_reduction", "energy"),
    "np_energy_red": ("nanobatching+perseus", "max_throughput_energy_reduction", "energy"),
    "kareus_energy_red": ("kareus", "max_throughput_energy_reduction", "energy"),
    "np_iso_time_energy_red": ("nanobatching+perseus", "iso_time_energy_reduction", "iso"),
    "kareus_iso_time_energy_red": ("kareus", "iso_time_energy_reduction", "iso"),
    "np_iso_energy_time_red": ("nanobatching+perseus", "iso_energy_time_reduction", "iso"),
    "kareus_iso_energy_time_red": ("kareus", "iso_energy_time_reduction", "iso"),
}
"""CSV column -> (method, metric of ``frontier_metrics``, target group or None). Megatron-LM +
Perseus's time reduction is in no group: the paper's is within half a point of zero."""

GROUPS = ("time", "energy", "iso", "ablation")
TARGET_PP = {"time": 3.0, "energy": 3.0, "iso": 5.0, "ablation": 3.0}
"""A compared cell is within its group's target at this absolute error (percentage points)."""


def read_rows(lines: Iterable[str]) -> list[dict[str, str]]:
    """Rows of a testbed CSV (``#`` lines are comments: the source and the units)."""
    return list(csv.DictReader(line for line in lines if not line.startswith("#")))


def calibration_rows() -> list[dict[str, str]]:
    """The calibration rows shipped with the package."""
    text = resources.files("kareus_fx.cost_models").joinpath(CALIBRATION_ROWS).read_text()
    return read_rows(text.splitlines())


def csv_number(cell: str) -> float | None:
    """A CSV cell as a number; ``NA`` (out of memory on the testbed, or lost in extraction) is None."""
    cell = cell.strip()
    return None if cell in ("", "NA") else float(cell)


def ours_pct(metrics: Mapping[str, Mapping[str, Any]], method: str, metric: str) -> float | None:
    """One method's metric of a plan in percent (None where the frontier does not reach it)."""
    value = metrics[method][metric]
    return None if value is None else 100.0 * value


def mean_abs(errors_pp: Sequence[float]) -> float | None:
    """Mean of absolute errors (pp), None for none."""
    return round(sum(abs(e) for e in errors_pp) / len(errors_pp), 2) if errors_pp else None


def row_cells(row: Mapping[str, str], metrics: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per column of ``COLUMNS``: the paper's value, ours and the error in pp (None where either is NA)."""
    cells = []
    for column, (method, metric, _) in COLUMNS.items():
        paper, ours = csv_number(row[column]), ours_pct(metrics, method, metric)
        err = None if paper is None or ours is None else ours - paper
        cells.append({"preset": row["preset"], "metric": column, "paper": paper, "ours": ours, "err_pp": err})
    return cells


def kareus_not_below(row: Mapping[str, str], metrics: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Where the paper has Kareus at or above Nanobatching + Perseus or Megatron-LM + Perseus (time
    or energy reduction at maximum throughput) and ours has it below."""
    found = []
    for kind in ("time", "energy"):
        key = f"max_throughput_{kind}_reduction"
        k_paper, k_ours = csv_number(row[f"kareus_{kind}_red"]), ours_pct(metrics, "kareus", key)
        for other, method in (("np", "nanobatching+perseus"), ("mp", "megatron+perseus")):
            o_paper = csv_number(row[f"{other}_{kind}_red"])
            if k_paper is None or o_paper is None or k_paper < o_paper:
                continue
            o_ours = ours_pct(metrics, method, key)
            if k_ours is not None and o_ours is not None and k_ours < o_ours - 1e-9:
                found.append(f"{row['preset']}: kareus {kind} {k_ours:.1f} < {other} {o_ours:.1f}")
    return found


def compare_rows(
    rows: Sequence[Mapping[str, str]], plans: Mapping[str, Mapping[str, Any]]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Per row and column the paper's value and ours (``plans``: preset -> {"metrics": ...}); the
    row set's summary: cells compared and within target per group, worst and mean absolute error."""
    cells: list[dict[str, Any]] = []
    not_below: list[str] = []
    for row in rows:
        metrics = plans[row["preset"]]["metrics"]
        cells += row_cells(row, metrics)
        not_below += kareus_not_below(row, metrics)
    dense = [g for g in GROUPS if g != "ablation"]
    grouped = [(COLUMNS[c["metric"]][2], c["err_pp"]) for c in cells if c["err_pp"] is not None]
    grouped_errs = [(g, e) for g, e in grouped if g is not None]
    summary = {
        "rows": len(rows),
        "compared": {g: sum(1 for h, _ in grouped_errs if h == g) for g in dense},
        "max_abs_err_pp": {g: round(max([abs(e) for h, e in grouped_errs if h == g], default=0.0), 2) for g in dense},
        "within_target": {g: sum(1 for h, e in grouped_errs if h == g and abs(e) <= TARGET_PP[g]) for g in dense},
        "mean_abs_err_pp": mean_abs([e for _, e in grouped_errs]),
        "na_cells": sum(1 for c in cells if c["err_pp"] is None),
        "ours_na_where_paper_has_value": [
            f"{c['preset']}: {c['metric']}" for c in cells if c["paper"] is not None and c["ours"] is None
        ],
        "kareus_not_below": not_below,
    }
    return cells, summary
