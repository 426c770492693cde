"""Calibration step 6: the coefficients the micro data leave unidentified, fitted end to end on the
paper's Llama 3.2 3B rows (Tables 3 and 4, ``paper_testbed.CALIBRATION_ROWS``).

A collective's slowdown beside a nanobatch's kernels decides how much of it an overlap hides, and
so every method's time and energy reductions. The micro data pin it only loosely: NanoFlow's
network-beside-GEMM rows leave ``comm_contention_compute`` anywhere in ``COMPUTE_CONTENTION_RANGE``
(each row alone fits a value in it), and the Kareus attention-overlap run trades
``comm_contention`` (beside memory-bound kernels) against the all-reduce's own rate. The rows that
measure whole training steps decide them: each candidate is planned on every calibration row
(``kareus plan`` in-process on the simulated GPU, each row traced once per fit) and scored by its
cells' errors against the paper, each over its group's target (``paper_testbed.TARGET_PP``).

Assumptions:

- the stage split of each row is the one balanced at the fit's starting parameters (the split
  prices stages at the maximum clock without overlap, where the contention barely enters); the
  bench re-plans every row from scratch afterwards, which would show a moved split;
- the objective is piecewise constant at fine scale (tuned frontiers move in steps), so the
  optimiser is Nelder-Mead (no gradients) on the box of ``BOUNDS``, started at the micro fit;
- leave-one-row-out error is read over the points the fit evaluated: for each row, the point best
  for the other rows, and this row's error there. An overfit shows as a held-out error well above
  the fitted one.

Only the calibration rows are read here: the validation rows (the Qwen3 rows and Table 8) stay
unseen by anything in the package.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from scipy.optimize import minimize

from kareus_fx.cost_models.paper_testbed import COLUMNS, TARGET_PP, calibration_rows, row_cells
from kareus_fx.cost_models.sim_params import OVERRIDES_ENV, SimParams, clear_cache

COMPUTE_CONTENTION_RANGE = (2.4, 8.2)
"""``comm_contention_compute`` each NanoFlow network-interference row fits on its own (step 2b)."""
MEMORY_CONTENTION_RANGE = (5.0, 20.0)
"""``comm_contention`` (step 3's bounds, above the slowdowns HBM sharing alone explains)."""
BOUNDS: dict[str, tuple[float, float]] = {
    "comm_contention_compute": COMPUTE_CONTENTION_RANGE,
    "comm_contention": MEMORY_CONTENTION_RANGE,
}
"""The end-to-end coefficients and the box the fit searches."""
MAX_EVALUATIONS = 18
"""Nelder-Mead's budget of candidate points (each plans every row: about a minute on 2 cores)."""


def _source_fingerprint() -> str:
    """Hash of the package's source: cached plans are reused only by the code that made them."""
    import kareus_fx

    roots = [Path(kareus_fx.__file__).parent, Path(__file__).parent]
    digest = hashlib.sha256()
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


@contextlib.contextmanager
def simulator_overrides(values: Mapping[str, float]) -> Iterator[None]:
    """The simulated GPU with ``values`` replacing its parameters (``OVERRIDES_ENV``: the planner's
    spawned processes inherit it; empty: the calibrated parameters), restored after."""
    before = os.environ.get(OVERRIDES_ENV)
    if values:
        os.environ[OVERRIDES_ENV] = json.dumps(dict(values))
    else:
        os.environ.pop(OVERRIDES_ENV, None)
    clear_cache()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(OVERRIDES_ENV, None)
        else:
            os.environ[OVERRIDES_ENV] = before
        clear_cache()


class RowPlanner:
    """Plans the calibration rows for candidate parameters; each row is traced once, each
    (row, parameters) planned once: kept in ``cache_path`` (a JSON file), so a stopped fit resumes."""

    def __init__(self, base: SimParams, cache_path: Path | None, work_dir: Path) -> None:
        self.base = base
        self.rows = calibration_rows()
        self.work_dir = work_dir
        self.cache_path = cache_path
        self.fingerprint = _source_fingerprint()
        self._cache: dict[str, dict[str, Any]] = {}
        if cache_path is not None and cache_path.exists():
            stored = json.loads(cache_path.read_text())
            if stored.get("source") == self.fingerprint:
                self._cache = stored["plans"]
        self._traced: dict[str, tuple[Any, Any]] = {}

    def _key(self, preset: str, values: Mapping[str, float]) -> str:
        params = {**self.base.to_dict(), **values}
        return preset + ":" + hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:16]

    def metrics(self, preset: str, values: Mapping[str, float]) -> dict[str, Any]:
        """Every method's ``frontier_metrics`` of ``preset`` planned with ``values`` over the base."""
        key = self._key(preset, values)
        if key not in self._cache:
            from kareus_fx.plan.planner import plan_traced
            from kareus_fx.plan.request import plan_request_from_preset
            from kareus_fx.plan.stage_tracing import trace_plan_stages

            params = {**self.base.to_dict(), **values}
            with simulator_overrides(params):
                if preset not in self._traced:
                    dumps = self.work_dir / "dumps" / preset
                    self._traced[preset] = trace_plan_stages(plan_request_from_preset(preset), dumps)
                req, traced = self._traced[preset]
                with tempfile.TemporaryDirectory(dir=self.work_dir) as work:
                    outcome = plan_traced(req, traced, work, progress=False)
            self._cache[key] = {m: d["metrics"] for m, d in outcome.data["methods"].items()}
            self._save()
        return self._cache[key]

    def _save(self) -> None:
        if self.cache_path is not None:
            self.cache_path.write_text(json.dumps({"source": self.fingerprint, "plans": self._cache}))


@dataclass(frozen=True)
class Evaluation:
    """One candidate's normalised squared errors per row (cells over their group's target)."""

    values: dict[str, float]
    row_loss: dict[str, float]

    def loss(self, rows: Sequence[str] | None = None) -> float:
        return sum(v for r, v in self.row_loss.items() if rows is None or r in rows)


def row_loss(row: Mapping[str, str], metrics: Mapping[str, Any]) -> float:
    """Sum of squared (error / group target) over a row's grouped cells; a cell the paper has and
    our frontier does not reach counts as one target's error."""
    total = 0.0
    for cell in row_cells(row, metrics):
        group = COLUMNS[cell["metric"]][2]
        if group is None or cell["paper"] is None:
            continue
        err = TARGET_PP[group] if cell["err_pp"] is None else cell["err_pp"]
        total += (err / TARGET_PP[group]) ** 2
    return total


def leave_one_row_out(evaluations: Sequence[Evaluation]) -> dict[str, Any]:
    """For each row: the evaluated point best for the other rows, and this row's loss there beside
    its loss at the full fit's point."""
    best = min(evaluations, key=lambda e: e.loss())
    out = {}
    for row in best.row_loss:
        others = [r for r in best.row_loss if r != row]
        held_out = min(evaluations, key=lambda e: e.loss(others))
        out[row] = {
            "values": {k: round(v, 3) for k, v in held_out.values.items()},
            "held_out_loss": round(held_out.row_loss[row], 3),
            "fitted_loss": round(best.row_loss[row], 3),
        }
    return out


def fit_end_to_end(
    base: SimParams,
    *,
    cache_path: Path | None = None,
    max_evaluations: int = MAX_EVALUATIONS,
    log: Callable[[str], None] = print,
) -> tuple[dict[str, float], dict[str, Any]]:
    """Step 6: ``BOUNDS``' coefficients minimising the calibration rows' loss, started at ``base``'s
    values (clipped into the box). Returns the fitted values and their provenance."""
    names = list(BOUNDS)
    lo = np.array([BOUNDS[n][0] for n in names])
    hi = np.array([BOUNDS[n][1] for n in names])
    evaluations: list[Evaluation] = []
    with tempfile.TemporaryDirectory(prefix="kareus-e2e-") as tmp:
        planner = RowPlanner(base, cache_path, Path(tmp))

        def evaluate(z: np.ndarray) -> float:
            values = {n: round(float(v), 4) for n, v in zip(names, lo + np.clip(z, 0.0, 1.0) * (hi - lo))}
            losses = {row["preset"]: row_loss(row, planner.metrics(row["preset"], values)) for row in planner.rows}
            evaluations.append(Evaluation(values, losses))
            log(f"    {values} loss {sum(losses.values()):.3f}")
            return sum(losses.values())

        start = np.array([getattr(base, n) for n in names])
        z0 = np.clip((start - lo) / (hi - lo), 0.0, 1.0)
        simplex = np.array([z0, *[np.clip(z0 + np.eye(len(names))[i] * 0.25, 0, 1) for i in range(len(names))]])
        for i in range(1, len(simplex)):
            if np.allclose(simplex[i], z0):  # at the upper bound: step down instead
                simplex[i, i - 1] = z0[i - 1] - 0.25
        minimize(
            evaluate,
            z0,
            method="Nelder-Mead",
            bounds=[(0.0, 1.0)] * len(names),
            options={"maxfev": max_evaluations, "initial_simplex": simplex, "xatol": 0.01, "fatol": 1e-3},
        )
    start_eval = evaluations[0]
    best = min(evaluations, key=lambda e: e.loss())
    prov = {
        "rows": [row["preset"] for row in planner.rows],
        "objective": "sum over the rows' grouped cells of (error / group target)^2; "
        "a cell our frontier does not reach counts one target",
        "optimiser": f"Nelder-Mead on the box, at most {max_evaluations} candidates",
        "bounds": {n: list(b) for n, b in BOUNDS.items()},
        "start": {"values": start_eval.values, "loss": round(start_eval.loss(), 3)},
        "fitted": {"values": best.values, "loss": round(best.loss(), 3)},
        "row_loss": {r: round(v, 3) for r, v in best.row_loss.items()},
        "leave_one_row_out": leave_one_row_out(evaluations),
        "evaluations": [{"values": e.values, "loss": round(e.loss(), 3)} for e in evaluations],
        "stage_split": "balanced at the start parameters, held during the fit",
    }
    return dict(best.values), prov


def with_values(params: SimParams, values: Mapping[str, float]) -> SimParams:
    """``params`` with the end-to-end coefficients replaced."""
    fields: dict[str, Any] = {k: float(v) for k, v in values.items()}  # float fields only (mypy sees ints too)
    return dataclasses.replace(params, **fields)


def calibration_rows_loss(params: SimParams, cache_path: Path | None = None) -> dict[str, float]:
    """Each calibration row's loss (:func:`row_loss`) planned with ``params``."""
    with tempfile.TemporaryDirectory(prefix="kareus-e2e-") as tmp:
        planner = RowPlanner(params, cache_path, Path(tmp))
        return {row["preset"]: round(row_loss(row, planner.metrics(row["preset"], {})), 3) for row in planner.rows}
