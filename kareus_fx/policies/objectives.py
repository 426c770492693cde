"""Zeus-style objectives over frontier points: ``zeus_cost`` (eta_knob) and ``max_slowdown`` (factor).

Zeus (``zeus.optimizer.power_limit``) chooses a GPU power limit with an ``OptimumSelector``; two
of them carry over to a frontier of (iteration time, iteration energy) points:

- ``ZeusCost(eta_knob)``: minimise ``eta x energy + (1 - eta) x max_power x time`` (Zeus's
  ``zeus.utils.metric.zeus_cost``), where ``max_power`` is the maximum power limit of every GPU the
  energy covers (Zeus: the largest power limit measured x ``world_size``; here the GPU's TDP x
  the GPUs the plan covers). ``eta_knob`` 0 is pure time, 1 pure energy.
- ``MaxSlowdownConstraint(factor)``: Zeus takes the lowest power limit whose time is within
  ``factor`` x the time at the maximum limit; on a frontier that is the least-energy point whose
  time is within ``factor`` x the fastest point's.

:func:`zeus_cost_point` and :func:`max_slowdown_point` back the plan targets
``{"zeus_cost": eta}`` and ``{"max_slowdown": factor}``
(:meth:`~kareus_fx.plan.plan_format.Plan.point_index`); :class:`ZeusCostPolicy` and
:class:`MaxSlowdownPolicy` choose the same way among a run's candidate points (e.g. under a power cap).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kareus_fx.errors import KareusError
from kareus_fx.policies.base import FrontierPoint, Observation

__all__ = [
    "MaxSlowdownPolicy",
    "ObjectiveError",
    "ZeusCostPolicy",
    "check_eta_knob",
    "check_slowdown_factor",
    "max_slowdown_point",
    "zeus_cost_j",
    "zeus_cost_point",
]


class ObjectiveError(KareusError, ValueError):
    """An ``eta_knob`` outside [0, 1] or a slowdown factor below 1."""


def check_eta_knob(eta_knob: float) -> float:
    if isinstance(eta_knob, bool) or not isinstance(eta_knob, (int, float)) or not 0 <= eta_knob <= 1:
        raise ObjectiveError(f"zeus_cost's eta_knob must be a number in [0, 1] (0: time, 1: energy), got {eta_knob!r}")
    return float(eta_knob)


def check_slowdown_factor(factor: float) -> float:
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not (math.isfinite(factor) and factor >= 1):
        raise ObjectiveError(f"max_slowdown's factor must be a number >= 1 (1.1: at most 10% slower), got {factor!r}")
    return float(factor)


def zeus_cost_j(point: FrontierPoint, eta_knob: float, max_power_w: float) -> float:
    """Zeus's time-energy cost of one iteration at ``point`` (joules)."""
    return eta_knob * point.energy_j + (1 - eta_knob) * max_power_w * point.time_s


def zeus_cost_point(points: Sequence[FrontierPoint], eta_knob: float, max_power_w: float) -> FrontierPoint:
    """The point of least Zeus cost (ties: the faster)."""
    eta_knob = check_eta_knob(eta_knob)
    if not max_power_w > 0:
        raise ObjectiveError(f"max_power_w must be a positive number of watts, got {max_power_w!r}")
    return min(points, key=lambda p: (zeus_cost_j(p, eta_knob, max_power_w), p.time_s))


def max_slowdown_point(points: Sequence[FrontierPoint], factor: float) -> FrontierPoint:
    """The least-energy point at most ``factor`` x slower than the fastest (ties: the faster)."""
    factor = check_slowdown_factor(factor)
    fastest_s = min(p.time_s for p in points)
    return min((p for p in points if p.time_s <= factor * fastest_s), key=lambda p: (p.energy_j, p.time_s))


@dataclass(frozen=True)
class ZeusCostPolicy:
    """Runs the candidate of least Zeus cost; ``max_power_w``: TDP x the GPUs the plan covers."""

    eta_knob: float
    max_power_w: float

    def choose(self, candidates: Sequence[FrontierPoint], observation: Observation) -> int:
        return zeus_cost_point(candidates, self.eta_knob, self.max_power_w).index


@dataclass(frozen=True)
class MaxSlowdownPolicy:
    """Runs the least-energy candidate at most ``factor`` x slower than the fastest candidate."""

    factor: float

    def choose(self, candidates: Sequence[FrontierPoint], observation: Observation) -> int:
        return max_slowdown_point(candidates, self.factor).index
