"""Multi-pass batch selection (paper section 4.3.2, appendix C).

A batch is filled by four passes, in this order, with these shares of the batch:

======== ===== =============================================================================
pass     share what it maximises
======== ===== =============================================================================
total    0.4   HVI on (time, total energy): ``e_dyn_hat + P_static * t_hat``
dynamic  0.2   HVI on (time, dynamic energy): ``e_dyn_hat`` (favours low clocks)
static   0.2   HVI on (time, static energy): ``P_static * t_hat`` (favours fast configs)
uncert.  0.2   sum over time and dynamic energy of the ensemble standard deviation
======== ===== =============================================================================

HVI is computed on normalised objectives (:class:`~kareus_fx.tuner.pareto.Normalizer` fitted on
the measured points) against the non-dominated set of measured points and the reference point of
:func:`~kareus_fx.tuner.pareto.reference_point` (10 % beyond the measured front's worst values).
Within a pass the selection is greedy: after a candidate is picked, its predicted
point joins the front, so the next pick must add area the picked ones do not already promise.
Candidates with zero HVI are ranked after every positive one by how far they are from adding area
(:func:`~kareus_fx.tuner.pareto.domination_gap`), so a pass always fills its share. In the static
pass the front of (time, ``P_static * time``) is essentially the fastest point (static energy grows
with time), so that pass picks configs predicted faster than anything measured and then, by
the gap, the predicted-fastest remaining ones.

The uncertainty score sums the per-objective standard deviations (not variances) after dividing each
by its objective's measured range, so seconds and joules weigh the same. Later passes never pick what
an earlier pass of the same batch picked; measured configs are never candidates.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from kareus_fx.tuner.pareto import (
    REF_MARGIN,
    Normalizer,
    RefBasis,
    domination_gap,
    hv_improvement_2d,
    pareto_front,
    pareto_mask,
    reference_point,
)
from kareus_fx.tuner.surrogate import Prediction

PASSES = ("total", "dynamic", "static", "uncertainty")
DEFAULT_PASS_FRACTIONS: dict[str, float] = {
    "total": 0.4,
    "dynamic": 0.2,
    "static": 0.2,
    "uncertainty": 0.2,
}


NEIGHBOUR_PICKS = 2
"""Picks of the total pass reserved for the measured front's grid neighbours, per batch."""


def allocate_pass_counts(batch_size: int, fractions: Mapping[str, float] = DEFAULT_PASS_FRACTIONS) -> dict[str, int]:
    """Split ``batch_size`` over the passes by largest remainder (ties: pass order)."""
    names = [p for p in PASSES if fractions.get(p, 0.0) > 0]
    total = sum(fractions[p] for p in names)
    if batch_size <= 0 or not names:
        return dict.fromkeys(PASSES, 0)
    exact = {p: batch_size * fractions[p] / total for p in names}
    counts = {p: int(np.floor(exact[p])) for p in PASSES if p in exact}
    left = batch_size - sum(counts.values())
    for p in sorted(names, key=lambda p: (-(exact[p] - counts[p]), PASSES.index(p)))[:left]:
        counts[p] += 1
    return {p: counts.get(p, 0) for p in PASSES}


@dataclass(frozen=True)
class MeasuredObjectives:
    """The measured points' objectives, one row per measured config."""

    time_s: np.ndarray
    energy_j: np.ndarray
    dynamic_energy_j: np.ndarray
    static_energy_j: np.ndarray

    def pair(self, objective: str) -> np.ndarray:
        energy = {
            "total": self.energy_j,
            "dynamic": self.dynamic_energy_j,
            "static": self.static_energy_j,
        }[objective]
        return np.column_stack([self.time_s, energy])


def _predicted_pair(pred: Prediction, objective: str) -> np.ndarray:
    energy = {
        "total": pred.total_energy_j,
        "dynamic": pred.dynamic_energy_j,
        "static": pred.static_energy_j,
    }[objective]
    return np.column_stack([pred.time_s, energy])


def greedy_hvi_select(
    predicted: np.ndarray,
    measured: np.ndarray,
    available: np.ndarray,
    k: int,
    ref_margin: float = REF_MARGIN,
    ref_basis: RefBasis = "front",
) -> list[int]:
    """Pick ``k`` rows of ``predicted`` (2 objectives) by greedy hypervolume improvement.

    ``measured`` are the measured points (the normaliser and the starting front come from them);
    ``available`` is a boolean mask of rows that may be picked. Returns row indices in pick order.
    """
    norm = Normalizer.from_points(measured)
    front = pareto_front(norm(measured))
    ref = reference_point(norm(measured), ref_margin, ref_basis)
    pts = norm(predicted)
    avail = available.copy()
    picks: list[int] = []
    for _ in range(min(k, int(avail.sum()))):
        idx = np.flatnonzero(avail)
        hvi = hv_improvement_2d(pts[idx], front, ref)
        if np.any(hvi > 0):
            best = idx[int(np.argmax(hvi))]
        else:
            best = idx[int(np.argmin(domination_gap(pts[idx], front, ref)))]
        picks.append(int(best))
        avail[best] = False
        front = pareto_front(np.vstack([front, pts[best]]))
    return picks


def uncertainty_select(pred: Prediction, measured: MeasuredObjectives, available: np.ndarray, k: int) -> list[int]:
    """Pick the ``k`` available rows with the largest normalised sum of ensemble stds."""
    t_range = np.ptp(measured.time_s) or abs(float(measured.time_s.mean())) or 1.0
    e_range = np.ptp(measured.dynamic_energy_j) or abs(float(measured.dynamic_energy_j.mean())) or 1.0
    score = pred.time_std_s / t_range + pred.dynamic_energy_std_j / e_range
    idx = np.flatnonzero(available)
    order = idx[np.argsort(-score[idx], kind="stable")]
    return [int(i) for i in order[:k]]


def grid_neighbours(grid_shape: tuple[int, ...], rows: np.ndarray) -> np.ndarray:
    """Mask of the configs one step along one axis from any of ``rows``, in a space laid out as a
    row-major grid of ``grid_shape`` (``SearchSpace``: clock, SMs, launch option)."""
    mask = np.zeros(int(np.prod(grid_shape)), dtype=bool)
    if len(rows) == 0:
        return mask
    coords = np.array(np.unravel_index(np.asarray(rows, dtype=int), grid_shape)).T
    for axis, size in enumerate(grid_shape):
        for step in (-1, 1):
            moved = coords.copy()
            moved[:, axis] += step
            inside = (moved[:, axis] >= 0) & (moved[:, axis] < size)
            mask[np.ravel_multi_index(tuple(moved[inside].T), grid_shape)] = True
    return mask


def select_batch(
    pred: Prediction,
    measured: MeasuredObjectives,
    available: np.ndarray,
    batch_size: int,
    fractions: Mapping[str, float] = DEFAULT_PASS_FRACTIONS,
    ref_margin: float = REF_MARGIN,
    ref_basis: RefBasis = "front",
    neighbourhood: tuple[tuple[int, ...], np.ndarray] | None = None,
) -> list[tuple[int, str]]:
    """Fill one batch: ``(row, pass name)`` pairs, rows into ``pred`` / ``available``.

    Passes run in :data:`PASSES` order; each skips rows an earlier pass picked. A pass that runs out
    of candidates leaves its share unfilled (the batch is then smaller).

    ``neighbourhood`` (the space's grid shape and the measured rows, in ``measured``'s order) makes
    the total pass pick among the grid neighbours of the measured total front first: a frontier of
    clock scaling is a chain of adjacent clocks and SM counts, and the configs beside a measured
    frontier point are where the surrogate's error matters most, yet its predicted improvement for
    them is often within its own error. Picks beyond the neighbours come from the whole space.
    """
    avail = np.asarray(available, dtype=bool).copy()
    counts = allocate_pass_counts(min(batch_size, int(avail.sum())), fractions)
    chosen: list[tuple[int, str]] = []
    for name in PASSES:
        k = counts[name]
        if k <= 0 or not avail.any():
            continue
        if name == "uncertainty":
            picks = uncertainty_select(pred, measured, avail, k)
        elif name == "total" and neighbourhood is not None:
            picks = _front_neighbours_first(pred, measured, avail, k, ref_margin, ref_basis, neighbourhood)
        else:
            picks = greedy_hvi_select(_predicted_pair(pred, name), measured.pair(name), avail, k, ref_margin, ref_basis)
        for row in picks:
            avail[row] = False
            chosen.append((row, name))
    return chosen


def _front_neighbours_first(
    pred: Prediction,
    measured: MeasuredObjectives,
    available: np.ndarray,
    k: int,
    ref_margin: float,
    ref_basis: RefBasis,
    neighbourhood: tuple[tuple[int, ...], np.ndarray],
) -> list[int]:
    """The total pass on the measured front's unmeasured grid neighbours, then on the rest."""
    grid_shape, measured_rows = neighbourhood
    front_rows = measured_rows[pareto_mask(measured.pair("total"))]
    near = available & grid_neighbours(grid_shape, front_rows)
    predicted, points = _predicted_pair(pred, "total"), measured.pair("total")
    picks = greedy_hvi_select(predicted, points, near, min(k, NEIGHBOUR_PICKS), ref_margin, ref_basis)
    rest = available.copy()
    rest[picks] = False
    return picks + greedy_hvi_select(predicted, points, rest, k - len(picks), ref_margin, ref_basis)
