"""A light forecaster of an hourly grid signal (Chase forecasts the next time frame too).

Forecast of the value ``h`` hours ahead: a blend of persistence (the value now) and the daily
season (the value 24 h before that hour, which has been seen once the forecaster ran a day),
weighted ``exp(-h / persistence_h)`` toward persistence. Grid carbon intensity has a strong
daily cycle (solar in CISO) and persists for a few hours; the blend keeps both. Hours never
observed fall back to persistence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["SeasonalForecaster"]

DAY_H = 24


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
