"""Follow a grid signal (carbon intensity or electricity price) within a slowdown budget.

Chase's idea on a Kareus frontier: when the grid is dirty (or power dear), run a slower, lower-
power point; when it is clean, run fast; over a horizon the job may be at most ``slo`` slower than
always running the fastest candidate (``slo=0.03``: 3 % more time for the same work).

Per hour of signal ``s`` the policy picks the point minimising ``s * P_p - mu / t_p``: what an
hour at point ``p`` costs (average power ``P_p`` times the signal) against the work it does
(``1 / t_p`` iterations per second), with ``mu`` the price of work. ``mu`` is the smallest value
whose choices over the forecast horizon keep the job's work rate at ``1 / (1 + slo)`` of the
fastest point's, counting what the job has already run: a budget used early leaves less for later
(the slowdown is tracked over all time so far, not per window). Assumptions: the work rate of a
point is ``1 / time_s``; the signal holds for an hour; the forecast is ``forecaster``'s
(:class:`SeasonalForecaster` by default).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from kareus_fx.errors import KareusError
from kareus_fx.policies.base import FrontierPoint, Observation
from kareus_fx.policies.forecast import Forecaster, SeasonalForecaster

__all__ = ["SignalBudgetPolicy", "choice_at", "smallest_price_of_work"]

Signal = Literal["carbon", "price"]

_BISECTION_STEPS = 60


def _signal_of(observation: Observation, signal: Signal) -> float | None:
    return observation.carbon_intensity_g_per_kwh if signal == "carbon" else observation.price_per_kwh


def choice_at(candidates: Sequence[FrontierPoint], signal: float, mu: float) -> FrontierPoint:
    """The candidate minimising ``signal x average power - mu / time`` for one hour: the Lagrangian
    of the slowdown budget, so the choice lies on the lower convex hull of power over speed."""
    return min(candidates, key=lambda p: (signal * p.average_power_w - mu / p.time_s, p.time_s))


def smallest_price_of_work(work: Callable[[float], float], needed: float) -> float:
    """The smallest ``mu`` (to bisection precision, from above) with ``work(mu) >= needed``;
    ``work`` must not decrease with ``mu`` (a higher price of work picks faster points)."""
    high = 1.0
    while work(high) < needed and high < 1e30:
        high *= 4.0
    low = 0.0
    for _ in range(_BISECTION_STEPS):
        mid = 0.5 * (low + high)
        if work(mid) >= needed:
            high = mid
        else:
            low = mid
    return high


@dataclass
class SignalBudgetPolicy:
    """Minimise the signal-weighted energy of the work at most ``slo`` slower than the fastest
    candidate (see the module docstring). One instance follows one job."""

    signal: Signal
    slo: float
    horizon_h: int = 24
    forecaster: Forecaster = field(default_factory=SeasonalForecaster)
    _last_elapsed_s: float | None = field(default=None, init=False)
    _work_s: float = field(default=0.0, init=False)
    """Integral of (fastest time / current time) over the job's time so far: seconds of
    fastest-point work done."""
    _last_speed: float = field(default=1.0, init=False)

    def __post_init__(self) -> None:
        if self.signal not in ("carbon", "price"):
            raise KareusError(f"signal must be 'carbon' or 'price', got {self.signal!r}")
        if not 0.0 <= self.slo < 1.0:
            raise KareusError(f"slo is the allowed slowdown as a fraction (0.03 = 3 %), got {self.slo!r}")
        if self.horizon_h < 1:
            raise KareusError(f"horizon_h must be at least 1 hour, got {self.horizon_h!r}")

    def choose(self, candidates: Sequence[FrontierPoint], observation: Observation) -> int:
        fastest = min(candidates, key=lambda p: p.time_s)
        self._account(observation.elapsed_s)
        value = _signal_of(observation, self.signal)
        if value is None:  # no signal this time: keep the current point if it is a candidate
            current = [p for p in candidates if p.index == observation.current_index]
            chosen = current[0] if current else fastest
        else:
            self.forecaster.observe(observation.elapsed_s, value)
            chosen = self._best(candidates, fastest, value, observation.elapsed_s)
        self._last_speed = fastest.time_s / chosen.time_s
        return chosen.index

    def _account(self, elapsed_s: float) -> None:
        if self._last_elapsed_s is not None:
            self._work_s += max(0.0, elapsed_s - self._last_elapsed_s) * self._last_speed
        self._last_elapsed_s = elapsed_s

    def _best(
        self, candidates: Sequence[FrontierPoint], fastest: FrontierPoint, value: float, elapsed_s: float
    ) -> FrontierPoint:
        horizon = [value, *self.forecaster.forecast(elapsed_s, self.horizon_h - 1)]
        window_s = 3600.0 * len(horizon)
        # Fastest-point work the horizon must do so that all time so far plus the horizon keeps
        # the rate 1/(1+slo); a budget already overspent asks for full speed.
        needed = min(window_s, max(0.0, (elapsed_s + window_s) / (1.0 + self.slo) - self._work_s))

        def work(mu: float) -> float:
            return sum(3600.0 * fastest.time_s / choice_at(candidates, s, mu).time_s for s in horizon)

        return choice_at(candidates, value, smallest_price_of_work(work, needed))
