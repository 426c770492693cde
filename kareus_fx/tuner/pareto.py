"""Pareto fronts and 2-D hypervolume, all for minimisation.

Conventions:

- Points are rows of an ``(n, d)`` array; smaller is better in every column.
- ``a`` dominates ``b`` when ``a <= b`` in every objective and ``a < b`` in at least one.
  Identical points do not dominate each other, so duplicates of a front point stay on the front.
- Hypervolume (HV) is the area dominated by the front and bounded by a reference point ``ref``;
  points not strictly better than ``ref`` in both objectives add nothing.
- The tuner works on normalised objectives (:class:`Normalizer`): each objective is min-max scaled
  over the points measured so far, so 0 is the best observed value and 1 the worst.
- Reference point (:func:`reference_point`): "slightly worse than the worst observation" (paper
  section 4.3; appendix C's formula did not survive in our copy of the paper). We take the worst
  value *on the measured Pareto front* plus ``REF_MARGIN`` = 10 % of the observed range, per
  objective (``basis="front"``, the tuner's default). The margin keeps the front's extreme points
  (fastest; least energy) contributing a strip of area, so HVI still rewards extending the front at
  its ends. ``basis="observed"`` (worst over all measured points) makes the hypervolume mostly the
  big box that every point dominates: relative HV improvements near the front shrink to a few
  1e-4 and the stopping rule fired early (with threshold 0.005 and our first budgets: HV ratio
  0.967 against 0.998 on the simulated Llama MLP partition, ``bench/mbo_quality.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike

REF_MARGIN = 0.1
"""Reference point = worst observation + 10 % of the observed range (normalised: 1.1)."""


def _as_points(points: ArrayLike, dim: int | None = None) -> np.ndarray:
    arr = np.asarray(points, dtype=float)
    if arr.size == 0:
        return arr.reshape(0, dim or (arr.shape[-1] if arr.ndim == 2 else 2))
    if arr.ndim != 2:
        raise ValueError(f"points must be an (n, d) array, got shape {arr.shape}")
    return arr


def pareto_mask(points: ArrayLike) -> np.ndarray:
    """Boolean mask of the non-dominated rows of ``points`` (minimisation, duplicates kept)."""
    pts = _as_points(points)
    n = len(pts)
    if n == 0:
        return np.zeros(0, dtype=bool)
    if pts.shape[1] == 2:
        return _pareto_mask_2d(pts)
    mask = np.ones(n, dtype=bool)
    for i in range(n):
        le = np.all(pts <= pts[i], axis=1)
        lt = np.any(pts < pts[i], axis=1)
        mask[i] = not np.any(le & lt)
    return mask


def _pareto_mask_2d(pts: np.ndarray) -> np.ndarray:
    # Sort lexicographically by (x, y). A point is dominated iff some lexicographically smaller,
    # distinct point has y <= its y: that point also has x <= its x.
    order = np.lexsort((pts[:, 1], pts[:, 0]))
    mask = np.zeros(len(pts), dtype=bool)
    best_y = np.inf  # min y over points strictly before the current group of identical points
    i = 0
    while i < len(order):
        j = i
        x, y = pts[order[i]]
        while j < len(order) and pts[order[j], 0] == x and pts[order[j], 1] == y:
            j += 1
        if y < best_y:
            mask[order[i:j]] = True
            best_y = y
        i = j
    return mask


def pareto_front(points: ArrayLike) -> np.ndarray:
    """The non-dominated rows of ``points``, sorted by the first objective (2-D: a staircase)."""
    pts = _as_points(points)
    front = pts[pareto_mask(pts)]
    return front[np.lexsort(front.T[::-1])] if len(front) else front


def hypervolume_2d(points: ArrayLike, ref: ArrayLike) -> float:
    """Exact area dominated by ``points`` and bounded by ``ref`` (2 objectives)."""
    pts = _as_points(points, 2)
    r = np.asarray(ref, dtype=float)
    pts = pts[np.all(pts < r, axis=1)]
    if len(pts) == 0:
        return 0.0
    front = pareto_front(pts)
    xs = np.append(front[:, 0], r[0])
    return float(np.sum((xs[1:] - xs[:-1]) * (r[1] - front[:, 1])))


def hv_improvement_2d(candidates: ArrayLike, front: ArrayLike, ref: ArrayLike) -> np.ndarray:
    """HV(front + {c}) - HV(front) for every row ``c`` of ``candidates`` (vectorised).

    ``front`` need not be non-dominated; it is filtered first. The area is computed strip by strip:
    between consecutive front x-coordinates the front already covers everything above its y, so a
    candidate adds ``overlap-width x max(0, strip-level - c_y)``.
    """
    cands = _as_points(candidates, 2)
    r = np.asarray(ref, dtype=float)
    fr = _as_points(front, 2)
    fr = pareto_front(fr[np.all(fr < r, axis=1)]) if len(fr) else fr
    # Strips: [-inf, x1) at level r_y, then [x_i, x_{i+1}) at level y_i, the last ending at r_x.
    lefts = np.concatenate([[-np.inf], fr[:, 0]])
    rights = np.concatenate([fr[:, 0], [r[0]]])
    levels = np.concatenate([[r[1]], fr[:, 1]])
    cx = np.minimum(cands[:, :1], r[0])
    widths = np.clip(rights[None, :] - np.maximum(lefts[None, :], cx), 0.0, None)
    heights = np.clip(levels[None, :] - cands[:, 1:2], 0.0, None)
    return np.sum(widths * heights, axis=1)


def domination_gap(candidates: ArrayLike, front: ArrayLike, ref: ArrayLike) -> np.ndarray:
    """How far each candidate is from adding hypervolume (0 where its HVI would be positive).

    The additive epsilon by which a candidate must improve in every objective to escape domination
    by ``front`` (``max over q of min(c - q)``, clipped at 0), plus how far it lies outside the
    reference box. Used to rank candidates whose HVI is zero: smaller is closer to useful.
    """
    cands = _as_points(candidates, 2)
    fr = _as_points(front, 2)
    r = np.asarray(ref, dtype=float)
    if len(fr):
        eps = np.max(np.min(cands[:, None, :] - fr[None, :, :], axis=2), axis=1)
        eps = np.clip(eps, 0.0, None)
    else:
        eps = np.zeros(len(cands))
    outside = np.sum(np.clip(cands - r[None, :], 0.0, None), axis=1)
    return eps + outside


@dataclass(frozen=True)
class Normalizer:
    """Min-max scaling of objectives: ``ideal`` maps to 0, ``nadir`` to 1."""

    ideal: np.ndarray
    nadir: np.ndarray

    @classmethod
    def from_points(cls, points: ArrayLike) -> Normalizer:
        pts = _as_points(points)
        if len(pts) == 0:
            raise ValueError("cannot normalise without points")
        return cls(ideal=pts.min(axis=0), nadir=pts.max(axis=0))

    @property
    def scale(self) -> np.ndarray:
        span = self.nadir - self.ideal
        # A degenerate objective (all equal) keeps unit scale relative to its magnitude.
        fallback = np.maximum(np.abs(self.ideal), 1e-12)
        return np.where(span > 0, span, fallback)

    def __call__(self, points: ArrayLike) -> np.ndarray:
        return (np.asarray(points, dtype=float) - self.ideal) / self.scale


RefBasis = Literal["front", "observed"]


def reference_point(points: ArrayLike, margin: float = REF_MARGIN, basis: RefBasis = "front") -> np.ndarray:
    """Reference point for normalised ``points``: their worst value plus ``margin`` per objective.

    ``basis="observed"`` takes the worst over all points (1 + margin after normalisation);
    ``basis="front"`` the worst over their Pareto front only, so the hypervolume measures the region
    near the frontier rather than a big box that every point dominates.
    """
    pts = _as_points(points)
    base = pareto_front(pts) if basis == "front" else pts
    return base.max(axis=0) + margin
