"""A light forecaster of an hourly grid signal (Chase forecasts the next time frame too).

Forecast of the value ``h`` hours ahead: a blend of persistence (the value now) and the daily
season (the value 24 h before that hour, which has been seen once the forecaster ran a day),
weighted ``exp(-h / persistence_h)`` toward persistence. Grid carbon intensity has a strong
daily cycle (solar in CISO) and persists for a few hours; the blend keeps both. Hours never
observed fall back to persistence.

:class:`PerfectForecaster` knows the signal's future (a replay's trace): an upper bound on what a
better forecast could give a policy, never something a live job can run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kareus_fx.errors import KareusError

__all__ = ["Forecaster", "PerfectForecaster", "SeasonalForecaster"]

DAY_H = 24


class Forecaster(Protocol):
    """What a signal-following policy needs: record the hour's value, predict the next hours."""

    def observe(self, elapsed_s: float, value: float) -> None: ...

    def forecast(self, elapsed_s: float, hours: int) -> list[float]: ...


@dataclass
class SeasonalForecaster:
    """Persistence blended with the value a day earlier (see the module docstring)."""

    persistence_h: float = 6.0
    _by_hour: dict[int, float] = field(default_factory=dict, init=False)

    def observe(self, elapsed_s: float, value: float) -> None:
        """Record the signal's value in the hour holding ``elapsed_s``; keeps two days."""
        hour = math.floor(elapsed_s / 3600.0)
        self._by_hour[hour] = value
        for old in [h for h in self._by_hour if h < hour - 2 * DAY_H]:
            del self._by_hour[old]

    def seed(self, hourly_values_before: list[float], elapsed_s: float = 0.0) -> None:
        """Hours before ``elapsed_s``'s hour (oldest first), e.g. a provider's recent history."""
        hour = math.floor(elapsed_s / 3600.0)
        for back, value in enumerate(reversed(hourly_values_before), start=1):
            self._by_hour[hour - back] = value

    def forecast(self, elapsed_s: float, hours: int) -> list[float]:
        """Values for the ``hours`` hours after the one holding ``elapsed_s`` (that hour must have
        been observed)."""
        hour = math.floor(elapsed_s / 3600.0)
        now = self._by_hour[hour]
        out = []
        for ahead in range(1, hours + 1):
            weight = math.exp(-ahead / self.persistence_h)
            seasonal = self._by_hour.get(hour + ahead - DAY_H, now)
            out.append(weight * now + (1.0 - weight) * seasonal)
        return out


@dataclass(frozen=True)
class PerfectForecaster:
    """The true future: ``hourly_values[h]`` is the signal in hour ``h`` after the job's start
    (e.g. ``trace.window(start, hours)``); hours past the end hold the last value."""

    hourly_values: Sequence[float]

    def __post_init__(self) -> None:
        if not self.hourly_values:
            raise KareusError("PerfectForecaster needs at least one hourly value (the trace window is empty)")

    def observe(self, elapsed_s: float, value: float) -> None:
        """Nothing to learn: the future is known."""

    def forecast(self, elapsed_s: float, hours: int) -> list[float]:
        """The true values of the ``hours`` hours after the one holding ``elapsed_s``."""
        hour = math.floor(elapsed_s / 3600.0)
        last = len(self.hourly_values) - 1
        return [float(self.hourly_values[min(hour + ahead, last)]) for ahead in range(1, hours + 1)]
