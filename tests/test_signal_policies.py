"""Carbon and price signals, the forecaster, the signal-budget policy and the replay.
Frontiers here are synthetic (a convex time-energy trade-off); the shipped traces are real."""

from __future__ import annotations

import json
import math
import warnings
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from zeus.monitor.carbon import CarbonIntensityProvider
from zeus.monitor.price import ElectricityPriceProvider

from kareus_fx.policies.base import FrontierPoint, Observation
from kareus_fx.policies.forecast import PerfectForecaster, SeasonalForecaster
from kareus_fx.policies.replay import FixedPoint, foresight_schedule, replay
from kareus_fx.policies.signal_budget import SignalBudgetPolicy
from kareus_fx.policies.signals import (
    CsvCarbonIntensityProvider,
    HourlyTrace,
    SignalError,
    SignalWarning,
    TariffPriceProvider,
    load_hourly_trace,
    price_per_kwh_at,
    read_signal,
)

TRACES = Path(__file__).parent.parent / "bench" / "traces" / "carbon_intensity_eia_2022"
START = datetime(2022, 1, 1, tzinfo=timezone.utc)
# Slower points draw less power: +2 % time for -5 % energy, then flattening.
FRONTIER = [
    FrontierPoint(i, t, e) for i, (t, e) in enumerate([(1.0, 1000.0), (1.02, 950.0), (1.05, 915.0), (1.10, 890.0)])
]


def _write(tmp_path: Path, rows: list[str]) -> Path:
    path = tmp_path / "trace.csv"
    path.write_text("timestamp_utc,gco2_per_kwh\n" + "\n".join(rows) + "\n")
    return path


def _hours(values: list[str]) -> list[str]:
    return [f"{(START + timedelta(hours=h)).isoformat().replace('+00:00', 'Z')},{v}" for h, v in enumerate(values)]


def test_shipped_traces_load_a_year_with_their_gaps_replaced():
    for name, at_least in (("CISO", 3), ("ERCO", 0), ("PJM", 23)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trace = load_hourly_trace(TRACES / f"{name}.csv")
        assert len(trace.values) == 8760 and trace.replaced_hours >= at_least
        assert all(40.0 < v < 600.0 for v in trace.values)
        assert bool(caught) == (trace.replaced_hours > 0)


def test_gaps_non_numbers_and_outliers_hold_the_last_good_value(tmp_path):
    values = ["300", "", "nan", "abc", "310", "5", "-1", "320"] + ["300"] * 20
    with pytest.warns(SignalWarning, match="5 of 28 hours"):
        trace = load_hourly_trace(_write(tmp_path, _hours(values)))
    assert trace.values[:8] == (300.0, 300.0, 300.0, 300.0, 310.0, 310.0, 310.0, 320.0)


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (_hours(["", "x"]), "no numeric value"),
        (["2022-01-01T00:00:00Z,1", "2022-01-01T02:00:00Z,1"], "one hour apart"),
        (["yesterday,1"], "not ISO 8601"),
    ],
)
def test_unusable_traces_are_refused_with_the_line(tmp_path, rows, message):
    with pytest.raises(SignalError, match=message):
        load_hourly_trace(_write(tmp_path, rows))


def test_the_csv_provider_is_a_zeus_carbon_provider_read_at_the_callers_clock():
    trace = HourlyTrace("t", START, tuple(float(h) for h in range(48)), 0)
    now = [START + timedelta(hours=30, minutes=20)]
    provider = CsvCarbonIntensityProvider(trace, clock=lambda: now[0])
    assert isinstance(provider, CarbonIntensityProvider)
    assert provider.get_current_carbon_intensity() == 30.0
    recent = provider.get_recent_carbon_intensity()
    assert len(recent) == provider.history_length == 24 and min(recent.values()) == 7.0
    assert provider.update_period == timedelta(hours=1)


def test_a_tariff_in_openei_format_prices_weekdays_and_weekends(tmp_path):
    peak_hours = [1 if 16 <= h < 21 else 0 for h in range(24)]
    rates = {
        "energy_rate_structure": [[{"rate": 0.10}], [{"rate": 0.30}]],
        "energy_weekday_schedule": [peak_hours] * 12,
        "energy_weekend_schedule": [[0] * 24] * 12,
    }
    path = tmp_path / "tariff.json"
    path.write_text(json.dumps(rates))
    provider = TariffPriceProvider(path)
    assert isinstance(provider, ElectricityPriceProvider)
    monday_peak = datetime(2022, 1, 3, 17, tzinfo=timezone.utc)
    assert price_per_kwh_at(provider.get_current_electricity_prices(), monday_peak) == 0.30
    assert price_per_kwh_at(rates, monday_peak + timedelta(days=5)) == 0.10  # Saturday
    path.write_text(json.dumps({"energy_rate_structure": []}))
    with pytest.raises(SignalError, match="energy_weekday_schedule"):
        TariffPriceProvider(path)


def test_a_failing_provider_gives_no_signal_and_the_policy_keeps_its_point():
    def timeout() -> float:
        raise TimeoutError("ElectricityMaps did not answer")

    with pytest.warns(SignalWarning, match="keeping the current point"):
        assert read_signal("carbon intensity", timeout) is None
    policy = SignalBudgetPolicy("carbon", slo=0.05)
    observation = Observation(iteration=10, elapsed_s=0.0, current_index=2, carbon_intensity_g_per_kwh=None)
    assert policy.choose(FRONTIER, observation) == 2


def test_the_forecaster_blends_persistence_with_the_day_before():
    forecaster = SeasonalForecaster(persistence_h=6.0)
    for hour in range(48):
        forecaster.observe(3600.0 * hour, 100.0 + 50.0 * math.sin(2 * math.pi * hour / 24))
    ahead = forecaster.forecast(3600.0 * 47, 23)
    now = 100.0 + 50.0 * math.sin(2 * math.pi * 47 / 24)
    assert ahead[0] == pytest.approx(
        math.exp(-1 / 6) * now + (1 - math.exp(-1 / 6)) * (100 + 50 * math.sin(2 * math.pi * 24 / 24))
    )
    far = 100.0 + 50.0 * math.sin(2 * math.pi * (47 + 23) / 24)
    assert abs(ahead[-1] - far) < abs(now - far)  # far ahead, the daily season dominates


def test_the_perfect_forecaster_gives_the_true_future_and_holds_the_last_hour():
    forecaster = PerfectForecaster([10.0, 20.0, 30.0, 40.0])
    forecaster.observe(3600.0, 99.0)  # observing changes nothing: the future is known
    assert forecaster.forecast(3600.0 * 1.5, 4) == [30.0, 40.0, 40.0, 40.0]
    from kareus_fx.errors import KareusError

    with pytest.raises(KareusError, match="at least one hourly value"):
        PerfectForecaster([])


def test_a_perfect_forecast_beats_the_seasonal_one_when_days_differ():
    """Days alternate between a morning and an evening peak, so the day before misleads the
    seasonal forecaster; the policy told the true future emits less, within the same budget."""
    values = tuple(250 + 150 * math.sin(2 * math.pi * h / 24 + math.pi * ((h // 24) % 2)) for h in range(24 * 8))
    trace, slo = HourlyTrace("alternating", START, values, 0), 0.03
    work = 5 * 86400.0 / FRONTIER[0].time_s
    fast = replay(FRONTIER, FixedPoint(0), trace, START, work)
    seasonal = replay(FRONTIER, SignalBudgetPolicy("carbon", slo), trace, START, work)
    perfect = replay(
        FRONTIER, SignalBudgetPolicy("carbon", slo, forecaster=PerfectForecaster(values)), trace, START, work
    )
    assert perfect.time_s <= (1 + slo) * fast.time_s + 3600.0
    assert perfect.carbon_g < seasonal.carbon_g < fast.carbon_g


def _daily_trace(days: int) -> HourlyTrace:
    return HourlyTrace("daily", START, tuple(250 + 150 * math.sin(2 * math.pi * h / 24) for h in range(24 * days)), 0)


@pytest.mark.parametrize("slo", [0.0, 0.01, 0.03, 0.06])
def test_the_policy_cuts_carbon_within_its_slowdown_budget(slo):
    trace = _daily_trace(30)
    work = 14 * 86400.0 / FRONTIER[0].time_s
    fast = replay(FRONTIER, FixedPoint(0), trace, START, work)
    follow = replay(FRONTIER, SignalBudgetPolicy("carbon", slo), trace, START, work)
    slowdown = follow.time_s / fast.time_s - 1.0
    assert slowdown <= slo + 0.002
    if slo == 0.0:
        assert set(follow.hourly_index) == {0} and follow.carbon_g == pytest.approx(fast.carbon_g)
        return
    assert follow.carbon_g < fast.carbon_g
    # Carbon-aware beats running the same slowdown flat: its carbon falls more than its energy.
    assert 1 - follow.carbon_g / fast.carbon_g > 1 - follow.energy_j / fast.energy_j
    assert len(set(follow.hourly_index)) > 1


def test_the_foresight_bound_is_within_budget_and_no_worse_than_the_policy():
    """The bound knows the trace: within the same budget it emits at most what the forecasting
    policy or any constant point within the budget does; at slo 0 it runs the fastest point."""
    trace, slo = _daily_trace(30), 0.03
    work = 14 * 86400.0 / FRONTIER[0].time_s
    assert set(foresight_schedule(FRONTIER, trace, START, work, 0.0).indices) == {0}
    fast = replay(FRONTIER, FixedPoint(0), trace, START, work)
    bound = replay(FRONTIER, foresight_schedule(FRONTIER, trace, START, work, slo), trace, START, work)
    follow = replay(FRONTIER, SignalBudgetPolicy("carbon", slo), trace, START, work)
    assert bound.time_s <= (1 + slo) * fast.time_s + 3600.0
    assert bound.carbon_g <= follow.carbon_g
    constant = replay(FRONTIER, FixedPoint(1), trace, START, work)  # the one constant point within 3 %
    assert bound.carbon_g < constant.carbon_g < fast.carbon_g


def test_the_price_policy_follows_the_price_not_the_carbon():
    trace = _daily_trace(10)
    price = lambda when: 0.4 if when.hour in (17, 18, 19) else 0.1  # noqa: E731
    work = 5 * 86400.0 / FRONTIER[0].time_s
    result = replay(FRONTIER, SignalBudgetPolicy("price", 0.03), trace, START, work, price_at=price)
    time_of = {p.index: p.time_s for p in FRONTIER}
    days = [result.hourly_index[d * 24 : (d + 1) * 24] for d in range(1, len(result.hourly_index) // 24)]
    assert days
    for day in days:  # the dearest hours run the slowest points of their day
        peak = [time_of[i] for h, i in enumerate(day) if h in (17, 18, 19)]
        off_peak = [time_of[i] for h, i in enumerate(day) if h not in (17, 18, 19)]
        assert min(peak) >= max(off_peak) and max(peak) > min(off_peak)


@pytest.mark.parametrize(("kwargs", "message"), [({"signal": "wind"}, "signal"), ({"slo": 1.5}, "slo")])
def test_bad_policy_settings_are_refused(kwargs, message):
    from kareus_fx.errors import KareusError

    settings = {"signal": "carbon", "slo": 0.03, **kwargs}
    with pytest.raises(KareusError, match=message):
        SignalBudgetPolicy(**settings)
