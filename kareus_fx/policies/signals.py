"""Outside signals a run-time policy follows: grid carbon intensity and electricity price.

Both come through Zeus's provider interfaces, so a live source (Zeus's ``ElectrictyMapsClient``
for carbon, ``OpenEIClient`` for price) and the offline ones here are interchangeable:

- :class:`CsvCarbonIntensityProvider`: an hourly trace (``timestamp_utc,gco2_per_kwh``), read at
  a clock the caller moves (a replay's simulated time, or the wall clock). Real traces have gaps
  and outliers (the shipped 2022 EIA traces do): an empty or non-numeric hour, or one implausibly
  far from its neighbours, is replaced by the last good value, with one warning per trace.
- :class:`TariffPriceProvider`: a time-of-use tariff in the OpenEI rate format that Zeus's
  ``OpenEIClient`` returns (rate structure, weekday and weekend schedules by month and hour).

:func:`read_signal` asks a provider and never raises: a provider that fails or times out yields
None, and the policy keeps the job's current point.
"""

from __future__ import annotations

import csv
import itertools
import json
import math
import statistics
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from zeus.monitor.carbon import CarbonIntensityProvider
from zeus.monitor.price import ElectricityPriceProvider

from kareus_fx.errors import KareusError

__all__ = [
    "CsvCarbonIntensityProvider",
    "HourlyTrace",
    "SignalError",
    "SignalWarning",
    "TariffPriceProvider",
    "load_hourly_trace",
    "price_per_kwh_at",
    "read_signal",
]

OUTLIER_RATIO = 3.0
"""An hour below 1/3 or above 3x the median of the surrounding day is an outlier. Grid carbon
intensity moves by at most about 2x within a day (CISO's solar swing, 2022: 74 to 449 over the
year, about 2x in a day); PJM's 2022 trace has a few hours under 50 g/kWh beside 300-400."""

OUTLIER_WINDOW_H = 24


class SignalError(KareusError, ValueError):
    """A signal trace or tariff that cannot be used at all (no usable value, bad format)."""


class SignalWarning(UserWarning):
    """A signal value was skipped or replaced (a gap, an outlier, a provider that failed)."""


@dataclass(frozen=True)
class HourlyTrace:
    """An hourly signal: ``values[i]`` holds from ``start + i hours`` for one hour."""

    name: str
    start: datetime
    values: tuple[float, ...]
    replaced_hours: int
    """Gaps and outliers replaced by the last good value."""

    def at(self, when: datetime) -> float:
        """The value holding at ``when``; outside the trace, it wraps around (a year repeats)."""
        hours = math.floor((when - self.start).total_seconds() / 3600.0)
        return self.values[hours % len(self.values)]

    def window(self, start: datetime, hours: int) -> list[float]:
        """``hours`` consecutive hourly values from ``start``."""
        return [self.at(start + timedelta(hours=h)) for h in range(hours)]


def _parse_time(text: str, source: str, line: int) -> datetime:
    try:
        parsed = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError as err:
        raise SignalError(f"{source}:{line}: timestamp {text!r} is not ISO 8601 (e.g. 2022-01-01T00:00:00Z)") from err
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) and value >= 0.0 else None


def load_hourly_trace(path: str | Path, column: str | None = None) -> HourlyTrace:
    """An hourly trace from a CSV whose first column is an ISO timestamp (UTC) and whose
    ``column`` (default: the second) is the value. Rows must be one hour apart.

    Empty, non-numeric or negative values, and outliers (see :data:`OUTLIER_RATIO`), are replaced
    by the last good value (the first good value for a leading gap); one :class:`SignalWarning`
    says how many. A trace with no usable value raises :class:`SignalError`."""
    source = str(path)
    try:
        with open(path, newline="") as handle:
            rows = list(csv.reader(handle))
    except OSError as err:
        raise SignalError(f"cannot read signal trace {source}: {err}") from err
    if len(rows) < 2:
        raise SignalError(f"{source}: a trace needs a header row and at least one hourly row")
    header = rows[0]
    index = 1 if column is None else (header.index(column) if column in header else -1)
    if index < 1 or index >= len(header):
        raise SignalError(f"{source}: no value column {column!r}; the header is {header}")
    times = [_parse_time(row[0], source, line) for line, row in enumerate(rows[1:], start=2) if row]
    for line, (before, after) in enumerate(itertools.pairwise(times), start=3):
        if after - before != timedelta(hours=1):
            raise SignalError(f"{source}:{line}: rows must be one hour apart; {before} is followed by {after}")
    raw = [_number(row[index]) if len(row) > index else None for row in rows[1:] if row]
    good = [v for v in raw if v is not None]
    if not good:
        raise SignalError(f"{source}: no numeric value in column {header[index]!r}")
    values: list[float] = []
    replaced = 0
    last = good[0]
    for i, value in enumerate(raw):
        neighbours = [
            v for v in raw[max(0, i - OUTLIER_WINDOW_H // 2) : i + OUTLIER_WINDOW_H // 2 + 1] if v is not None
        ]
        median = statistics.median(neighbours) if neighbours else last
        if value is None or (median > 0 and not (median / OUTLIER_RATIO <= value <= median * OUTLIER_RATIO)):
            replaced += 1
            values.append(last)
        else:
            values.append(value)
            last = value
    if replaced:
        warnings.warn(
            f"{source}: {replaced} of {len(raw)} hours were gaps, non-numbers or outliers (outside "
            f"1/{OUTLIER_RATIO:g}-{OUTLIER_RATIO:g}x the median of the surrounding {OUTLIER_WINDOW_H} h); "
            f"each holds the last good value",
            SignalWarning,
            stacklevel=2,
        )
    return HourlyTrace(name=Path(source).stem, start=times[0], values=tuple(values), replaced_hours=replaced)


class CsvCarbonIntensityProvider(CarbonIntensityProvider):
    """Zeus's carbon-intensity interface over an hourly trace, read at ``clock()``.

    ``clock`` returns the current time (UTC); a replay passes its simulated time, a job
    ``lambda: datetime.now(timezone.utc)``."""

    def __init__(self, trace: HourlyTrace, clock: Callable[[], datetime], history_hours: int = 24) -> None:
        self.trace = trace
        self.clock = clock
        self._history_hours = history_hours

    def get_current_carbon_intensity(self) -> float:
        return self.trace.at(self.clock())

    def get_recent_carbon_intensity(self) -> dict[datetime, float]:
        now = self.clock().replace(minute=0, second=0, microsecond=0)
        return {now - timedelta(hours=h): self.trace.at(now - timedelta(hours=h)) for h in range(self._history_hours)}

    @property
    def update_period(self) -> timedelta:
        return timedelta(hours=1)

    @property
    def history_length(self) -> int:
        return self._history_hours


def price_per_kwh_at(rates: Mapping[str, Any], when: datetime) -> float:
    """The energy rate (currency per kWh, first tier) that an OpenEI rate record sets at ``when``.

    ``rates`` holds ``energy_rate_structure`` (periods, each a list of tiers with a ``rate``),
    ``energy_weekday_schedule`` and ``energy_weekend_schedule`` (12 months x 24 hours of period
    indices), as Zeus's ``OpenEIClient.get_current_electricity_prices`` returns them."""
    try:
        schedule = rates["energy_weekend_schedule" if when.weekday() >= 5 else "energy_weekday_schedule"]
        period = int(schedule[when.month - 1][when.hour])
        rate = float(rates["energy_rate_structure"][period][0]["rate"])
    except (KeyError, IndexError, TypeError, ValueError) as err:
        raise SignalError(
            f"the tariff has no usable rate for {when:%Y-%m-%d %H:00} ({err!r}); it needs energy_rate_structure, "
            f"energy_weekday_schedule and energy_weekend_schedule as OpenEI's utility rates API returns them"
        ) from err
    if not math.isfinite(rate) or rate < 0:
        raise SignalError(f"the tariff's rate for {when:%Y-%m-%d %H:00} is {rate!r}, not a non-negative number")
    return rate


class TariffPriceProvider(ElectricityPriceProvider):
    """Zeus's electricity-price interface over a tariff file in OpenEI's rate format (JSON)."""

    def __init__(self, path: str | Path) -> None:
        try:
            self.rates: dict[str, Any] = json.loads(Path(path).read_text())
        except (OSError, ValueError) as err:
            raise SignalError(f"cannot read tariff {path}: {err}") from err
        price_per_kwh_at(self.rates, datetime(2022, 1, 3, tzinfo=timezone.utc))  # fail early on a bad file

    def get_current_electricity_prices(self) -> dict[str, list[Any]]:
        return self.rates


def read_signal(name: str, ask: Callable[[], float]) -> float | None:
    """``ask()``, or None with a :class:`SignalWarning` when the provider fails (an HTTP error, a
    timeout, a non-number): the policy then keeps the current point. Never raises."""
    try:
        value = float(ask())
    except Exception as err:  # noqa: BLE001 - any provider failure must leave the job running
        warnings.warn(f"{name} signal unavailable ({err!r}); keeping the current point", SignalWarning, stacklevel=2)
        return None
    if not math.isfinite(value) or value < 0:
        warnings.warn(f"{name} signal gave {value!r}; keeping the current point", SignalWarning, stacklevel=2)
        return None
    return value
