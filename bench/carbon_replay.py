"""Replay a plan's frontier against an hourly grid carbon-intensity trace.

The job does a fixed amount of work: as many iterations as Kareus's fastest point runs in
``--days`` days. Each policy decides every hour which frontier point to run:

- ``always-max-throughput``: Kareus's fastest point, every hour (the reference);
- ``kareus+carbon``: Kareus's frontier under the carbon signal-budget policy (Chase's idea on
  Kareus's frontier: ``kareus_fx.policies.signal_budget``), at most ``--slo`` slower;
- ``perseus-static``: Megatron-LM + Perseus's fastest point, every hour (Perseus's static choice);
- ``megatron``: Megatron-LM at full power, every hour (what runs without any energy tool);
- ``chase-power-limit``: Megatron-LM under job-wide power limits (the plan's sixth method's
  curve), moved by the same signal-budget policy at the same ``--slo``: a Chase-style policy that
  only scales the power limit.

With the plan's Kareus power-limit curves (``methods.kareus.power_limits``: the max-throughput
schedule, clocks unlocked, under each limit; ``locked_power_limits``: at its planned clocks with the
limit on top; ``kareus_fx.plan.kareus_power_limit_curves``):

- ``kareus+carbon (clocks + power limits)``: the same policy over the union of Kareus's clock
  points and both curves (``hours_on_power_limit_points``: how many hours ran a power-limit point);
- ``kareus-power-limit`` / ``kareus-power-limit+carbon``: Kareus's power-limit mode alone (clocks
  unlocked, as where a cluster forbids locks) at its highest limit and under the policy; the latter
  against the former is ``same_knob``: the Chase-style policy's knob on Kareus's schedule.

Each signal policy also gets its perfect-foresight bound (``... (foresight)``): the least-carbon
hourly choices on the same candidates and budget knowing the whole trace
(``kareus_fx.policies.replay.foresight_schedule``), which says how far the forecast-driven policy
is from optimal. ``frontier_shape`` gives what decides the comparison: each knob's best constant
point within the budget (energy saved running it all the time) and the lower convex hull of
average power over speed near the fastest point (the only points a budgeted policy runs), and
``constant_slowdown_energy_reduction``: the energy saved running the hull at exactly ``1 / (1 + slo)``
of the fastest speed all the time (mixing its two neighbouring vertices). ``daily_swing`` is the
trace's mean daily range (max - min over a UTC day, over that day's mean) over the days the
Kareus + carbon job runs; ``kareus+carbon_time_ratio_percentiles`` where its hours sit on the
frontier (time over the fastest point's).

``--horizon-h`` sets both signal policies' horizon (default 24 h) and ``--forecast perfect`` gives
them the trace's true future instead of :class:`~kareus_fx.policies.forecast.SeasonalForecaster`'s
forecast (a bound on a better forecaster, not something a job can run).

``--extend-below-frontier 1050 1020 ...`` adds points past the frontier's slow end to Kareus's
candidates (both the policy's and its bound's): the least-energy point's instructions, every one at
that clock, priced from the plan's microbatch options as the planner prices a point (critical path
of 1F1B, blocking power when idle: ``kareus_fx.deploy.simulated_energy``). ``below_frontier``
gives each one's speed and power, the slope of power per speed from the least-energy point to it,
and the hours each policy ran them.

A knob's own reference is its un-throttled run: Kareus's policy is compared with always-max-
throughput, the power-limit policy with Megatron-LM at full power; both are also given against
Megatron-LM. ``verdicts`` says whether Kareus + carbon cuts more carbon than a power-limit-only
policy within the budget: on the same schedule (Kareus's, each knob against its own un-throttled
run), each on its own schedule (the power limit on Megatron-LM), and in absolute carbon and time. Every time and energy is the plan's: with the simulated profiler, predictions of a
cost model, not measurements. Carbon is energy x the trace's intensity in the hour it is used.

    python bench/carbon_replay.py --plan plans/qwen/plan.json --trace CISO --slo 0.03 --json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import warnings
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kareus_fx.compose.pipeline_schedule import PipelineNode, one_f_one_b_order
from kareus_fx.deploy.simulated_energy import simulated_iteration
from kareus_fx.plan.plan_format import Plan, load_plan
from kareus_fx.plan.power_limit_baseline import POWER_LIMIT_METHOD
from kareus_fx.policies.base import FrontierPoint
from kareus_fx.policies.forecast import PerfectForecaster, SeasonalForecaster
from kareus_fx.policies.replay import FixedPoint, ReplayResult, foresight_schedule, replay
from kareus_fx.policies.signal_budget import SignalBudgetPolicy
from kareus_fx.policies.signals import HourlyTrace, SignalWarning, load_hourly_trace
from kareus_fx.runtime.clock_controller import ClockRequest

TRACES_DIR = Path(__file__).parent / "traces" / "carbon_intensity_eia_2022"
SHIPPED_TRACES = ("CISO", "ERCO", "PJM")
FORECASTS = ("seasonal", "perfect")
DAY_H = 24


def _points(pairs: Sequence[Sequence[float]]) -> list[FrontierPoint]:
    return [FrontierPoint(index=i, time_s=float(t), energy_j=float(e)) for i, (t, e) in enumerate(pairs)]


def _fastest(points: Sequence[FrontierPoint]) -> FrontierPoint:
    return min(points, key=lambda p: (p.time_s, p.energy_j))


def _trace(name: str) -> HourlyTrace:
    path = TRACES_DIR / f"{name}.csv" if name in SHIPPED_TRACES else Path(name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", SignalWarning)
        trace = load_hourly_trace(path)
    for warning in caught:
        print(f"note: {warning.message}", file=sys.stderr)
    return trace


def _summary(result: ReplayResult, reference: ReplayResult) -> dict[str, float]:
    return {
        "time_h": result.time_s / 3600.0,
        "energy_kwh": result.energy_j / 3.6e6,
        "carbon_kg": result.carbon_g / 1e3,
        "time_increase": result.time_s / reference.time_s - 1.0,
        "energy_reduction": 1.0 - result.energy_j / reference.energy_j,
        "carbon_reduction": 1.0 - result.carbon_g / reference.carbon_g,
    }


def run(
    plan_path: str,
    trace_name: str,
    slo: float,
    days: float,
    start: datetime,
    horizon_h: int = 24,
    forecast: str = "seasonal",
    below_frontier_mhz: Sequence[int] = (),
) -> dict[str, Any]:
    """Every policy's replay (see the module docstring), as a JSON-ready dict."""
    if forecast not in FORECASTS:
        raise SystemExit(f"--forecast must be one of {', '.join(FORECASTS)}, got {forecast!r}")
    plan = load_plan(plan_path)
    methods: Mapping[str, Any] = plan.data["methods"]
    if POWER_LIMIT_METHOD not in methods:
        raise SystemExit(
            f"{plan_path} has no {POWER_LIMIT_METHOD!r} method (plans made before it, or measured on a GPU): "
            f"re-run `kareus plan` with the simulated profiler"
        )
    frontier = [FrontierPoint.from_plan_point(i, p) for i, p in enumerate(plan.frontier)]
    below = _below_frontier(plan, below_frontier_mhz)
    kareus = frontier + below
    # Kareus's max-throughput schedule under each power limit, clocks unlocked (the power-limit
    # deploy mode's frontier) and locked as planned with the limit on top, indexed after the clock
    # points: the deployment knows which knob each point uses.
    kareus_limits = [("unlocked", *row) for row in methods["kareus"].get("power_limits") or []] + [
        ("locked", *row) for row in methods["kareus"].get("locked_power_limits") or []
    ]
    limited = [
        FrontierPoint(index=len(kareus) + i, time_s=float(t), energy_j=float(e))
        for i, (_, _, t, e) in enumerate(kareus_limits)
    ]
    both = kareus + limited
    # Kareus's power-limit mode alone (clocks unlocked): the same knob as the Chase-style policy.
    unlocked = [p for p, row in zip(limited, kareus_limits) if row[0] == "unlocked"]
    perseus = _points(methods["megatron+perseus"]["frontier"])
    megatron = _points(methods["megatron"]["frontier"])
    limits = methods[POWER_LIMIT_METHOD]["power_limits"]
    power_limited = _points([(t, e) for _, t, e in limits])
    trace = _trace(trace_name)
    work = days * 86400.0 / _fastest(kareus).time_s

    def go(points: Sequence[FrontierPoint], policy: Any) -> ReplayResult:
        return replay(points, policy, trace, start, work)

    def follow(points: Sequence[FrontierPoint]) -> SignalBudgetPolicy:
        # The slowest candidate bounds the job's hours; the horizon looks past them.
        hours = math.ceil(work * max(p.time_s for p in points) / 3600.0) + horizon_h
        future = PerfectForecaster(trace.window(start, hours)) if forecast == "perfect" else SeasonalForecaster()
        return SignalBudgetPolicy("carbon", slo, horizon_h=horizon_h, forecaster=future)

    results = {
        "always-max-throughput": go(kareus, FixedPoint(_fastest(kareus).index)),
        "kareus+carbon": go(kareus, follow(kareus)),
        "perseus-static": go(perseus, FixedPoint(_fastest(perseus).index)),
        "megatron": go(megatron, FixedPoint(_fastest(megatron).index)),
        "chase-power-limit": go(power_limited, follow(power_limited)),
        **({"kareus+carbon (clocks + power limits)": go(both, follow(both))} if limited else {}),
        **({"kareus-power-limit": go(unlocked, FixedPoint(_fastest(unlocked).index))} if unlocked else {}),
        **({"kareus-power-limit+carbon": go(unlocked, follow(unlocked))} if unlocked else {}),
        "kareus+carbon (foresight)": go(kareus, foresight_schedule(kareus, trace, start, work, slo)),
        "chase-power-limit (foresight)": go(power_limited, foresight_schedule(power_limited, trace, start, work, slo)),
        **(
            {
                "kareus+carbon (clocks + power limits) (foresight)": go(
                    both, foresight_schedule(both, trace, start, work, slo)
                )
            }
            if limited
            else {}
        ),
    }
    reference, megatron_run = results["always-max-throughput"], results["megatron"]
    # Decisions are hourly, so a policy meets its slowdown budget to within one hour of the job.
    tolerance = 3600.0 / reference.time_s
    # The power-limit mode's policy against its own full-power run, as the Chase-style policy is.
    same_knob = (
        {
            "kareus-power-limit+carbon vs its full power": _summary(
                results["kareus-power-limit+carbon"], results["kareus-power-limit"]
            )
        }
        if unlocked
        else {}
    )
    job_days = math.ceil(len(results["kareus+carbon"].hourly_index) / DAY_H)
    time_ratios = _time_ratios(results["kareus+carbon"], kareus)
    below_indices = {p.index for p in below}
    least_energy = min(frontier, key=lambda p: p.energy_j)
    return {
        "plan": str(plan_path),
        "simulated": bool(plan.data.get("simulated")),
        "trace": trace.name,
        "trace_replaced_hours": trace.replaced_hours,
        "start_utc": start.isoformat(),
        "days_at_max_throughput": days,
        "slo": slo,
        "horizon_h": horizon_h,
        "forecast": forecast,
        "daily_swing": _daily_swing(trace.window(start, DAY_H * job_days)),
        "kareus+carbon_time_ratio_percentiles": {
            str(q): round(statistics.quantiles(time_ratios, n=10, method="inclusive")[q // 10 - 1], 4)
            for q in (10, 50, 90)
        },
        "vs_always_max_throughput": {name: _summary(r, reference) for name, r in results.items()},
        "vs_megatron": {name: _summary(r, megatron_run) for name, r in results.items()},
        "same_knob": same_knob,
        "power_limits_w": [int(limit) for limit, _, _ in limits],
        "kareus_power_limit_points": [f"{lock} {int(limit)} W" for lock, limit, _, _ in kareus_limits],
        "frontier_shape": {
            "kareus": _shape(kareus, slo),
            "chase-power-limit": _shape(power_limited, slo),
            **(
                {"kareus-power-limit": _shape(limited, slo), "kareus clocks + power limits": _shape(both, slo)}
                if limited
                else {}
            ),
        },
        "hours_on_power_limit_points": {
            name: sum(i >= len(kareus) for i in results[name].hourly_index)
            for name in results
            if name.startswith("kareus+carbon (clocks + power limits)")
        },
        "below_frontier": [
            {
                "clock_mhz": clock,
                "speed": _fastest(kareus).time_s / p.time_s,
                "power": p.average_power_w / _fastest(kareus).average_power_w,
                "power_per_speed_from_least_energy": (p.average_power_w - least_energy.average_power_w)
                / _fastest(kareus).average_power_w
                / (_fastest(kareus).time_s / p.time_s - _fastest(kareus).time_s / least_energy.time_s),
            }
            for clock, p in zip(below_frontier_mhz, below)
        ],
        "below_frontier_hours": {
            name: sum(i in below_indices for i in results[name].hourly_index)
            for name in ("kareus+carbon", "kareus+carbon (foresight)")
        },
        "slo_tolerance": tolerance,
        "verdicts": _verdicts(results, reference, megatron_run, slo + tolerance),
        "hourly": {
            "carbon_g_per_kwh": trace.window(start, len(results["kareus+carbon"].hourly_index)),
            "kareus+carbon_time_ratio": time_ratios,
            "chase-power-limit_w": [int(limits[i][0]) for i in results["chase-power-limit"].hourly_index],
            "cumulative_carbon_kg": {n: [c / 1e3 for c in r.cumulative_carbon_g] for n, r in results.items()},
        },
    }


def _beats(gain: Mapping[str, float], other: Mapping[str, float], budget: float) -> bool:
    """``gain`` cuts more carbon than ``other``, both within the slowdown ``budget``."""
    return (
        gain["carbon_reduction"] > other["carbon_reduction"]
        and gain["time_increase"] <= budget
        and other["time_increase"] <= budget
    )


def _verdicts(
    results: Mapping[str, ReplayResult], reference: ReplayResult, megatron_run: ReplayResult, budget: float
) -> dict[str, bool | None]:
    """Kareus + carbon against a policy that only scales the power limit, three ways.

    ``on_the_same_schedule``: both knobs drive the plan's Kareus schedule, each against its own
    un-throttled run (Kareus's fastest clock point; the power-limit mode at its highest limit), at
    the same slowdown budget: the controlled comparison of the two knobs. ``each_on_its_own_schedule``:
    Kareus + carbon against Kareus's fastest point, the power-limit policy on Megatron-LM against
    Megatron-LM at full power (it starts from a step with exposed collectives, whose slack a
    slowdown gets for free). ``less_carbon_and_time_than_power_limit_on_megatron``: the two jobs'
    absolute carbon and time over the same work. ``None`` where the plan has no Kareus power-limit
    curve.
    """
    kareus = _summary(results["kareus+carbon"], reference)
    chase = _summary(results["chase-power-limit"], megatron_run)
    unlocked = results.get("kareus-power-limit")
    union = results.get("kareus+carbon (clocks + power limits)")
    return {
        "on_the_same_schedule": None
        if unlocked is None
        else _beats(kareus, _summary(results["kareus-power-limit+carbon"], unlocked), budget),
        "each_on_its_own_schedule": _beats(kareus, chase, budget),
        "clocks_and_power_limits_each_on_its_own_schedule": None
        if union is None
        else _beats(_summary(union, reference), chase, budget),
        "less_carbon_and_time_than_power_limit_on_megatron": (
            results["kareus+carbon"].carbon_g < results["chase-power-limit"].carbon_g
            and results["kareus+carbon"].time_s < results["chase-power-limit"].time_s
        ),
    }


def _below_frontier(plan: Plan, clocks_mhz: Sequence[int]) -> list[FrontierPoint]:
    """The least-energy frontier point's instructions all at each of ``clocks_mhz`` (module
    docstring), indexed after the frontier. Each instruction keeps its kernel schedule, at that clock."""
    if not clocks_mhz:
        return []
    pp, microbatches = plan.workload["pp"], plan.workload["microbatches"]
    if plan.workload.get("virtual_stages", 1) != 1:
        raise SystemExit("--extend-below-frontier prices 1F1B plans only (this plan interleaves virtual stages)")
    slowest = min(range(len(plan.frontier)), key=lambda i: plan.frontier[i]["energy_j"])
    points = []
    for n, clock in enumerate(clocks_mhz):
        ranks = [
            [ClockRequest(0.0, clock, str(PipelineNode(s, i, mb))) for i, mb in one_f_one_b_order(pp, microbatches, s)]
            for s in range(pp)
        ]
        priced = simulated_iteration(plan, slowest, ranks)
        points.append(FrontierPoint(index=len(plan.frontier) + n, time_s=priced.time_s, energy_j=priced.energy_j))
    return points


def _daily_swing(hourly: Sequence[float]) -> float:
    """Mean over whole days of (max - min) / mean of the day's hourly values."""
    days = [hourly[d : d + DAY_H] for d in range(0, len(hourly) - DAY_H + 1, DAY_H)]
    return statistics.mean((max(day) - min(day)) / statistics.mean(day) for day in days)


def _power_on_hull(hull: Sequence[tuple[float, float]], speed: float) -> float:
    """Relative power on the hull at ``speed``, interpolated between its neighbouring vertices."""
    for (v, w), (v2, w2) in itertools.pairwise(hull):
        if v <= speed <= v2:
            return w + (w2 - w) * (speed - v) / (v2 - v) if v2 > v else w
    raise SystemExit(f"speed {speed:.4f} lies outside the frontier's hull ({hull[0][0]:.4f}-{hull[-1][0]:.4f})")


def _hull(points: Sequence[FrontierPoint]) -> list[tuple[float, float]]:
    """The lower convex hull of (speed, average power), both relative to the fastest point, by speed."""
    fastest = _fastest(points)
    lowest: dict[float, float] = {}
    for p in points:
        speed, power = fastest.time_s / p.time_s, p.average_power_w / fastest.average_power_w
        lowest[speed] = min(power, lowest.get(speed, power))
    pairs = sorted(lowest.items())
    hull: list[tuple[float, float]] = []
    for v, w in pairs:
        while len(hull) >= 2 and (hull[-1][0] - hull[-2][0]) * (w - hull[-2][1]) <= (hull[-1][1] - hull[-2][1]) * (
            v - hull[-2][0]
        ):
            hull.pop()
        hull.append((v, w))
    return hull


def _shape(points: Sequence[FrontierPoint], slo: float) -> dict[str, Any]:
    """What a budgeted policy can do with ``points`` (module docstring): the best constant point's
    energy saving within ``1 + slo`` of the fastest time, and the hull vertices down to the speed
    of twice that slowdown with the slope (relative power per relative speed) up to each, and the
    energy saved running the hull at exactly that slowdown all the time."""
    fastest = _fastest(points)
    within = [p for p in points if p.time_s <= (1.0 + slo) * fastest.time_s]
    hull = _hull(points)
    speed = 1.0 / (1.0 + slo)
    slopes = [
        {"speed": round(v, 4), "power": round(w, 4), "slope_to_faster": round((w2 - w) / (v2 - v), 3)}
        for (v, w), (v2, w2) in itertools.pairwise(hull)
        if v >= 1.0 / (1.0 + 2.0 * slo)
    ]
    return {
        "best_constant_energy_reduction": 1.0 - min(p.energy_j for p in within) / fastest.energy_j,
        "constant_slowdown_energy_reduction": 1.0 - _power_on_hull(hull, speed) / speed,
        "hull_near_fastest": slopes,
        "slowest": {"speed": round(hull[0][0], 4), "power": round(hull[0][1], 4)},
    }


def _time_ratios(result: ReplayResult, points: Sequence[FrontierPoint]) -> list[float]:
    fastest = _fastest(points).time_s
    by_index = {p.index: p for p in points}
    return [by_index[i].time_s / fastest for i in result.hourly_index]


def plot(report: Mapping[str, Any], path: Path) -> Path:
    """Carbon intensity, the chosen points and cumulative carbon over the replay, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hourly = report["hourly"]
    fig, axes = plt.subplots(3, 1, figsize=(9, 7.5), dpi=110, sharex=True)
    try:
        axes[0].plot(hourly["carbon_g_per_kwh"], color="tab:brown", linewidth=0.8)
        axes[0].set_ylabel("gCO2/kWh")
        axes[0].set_title(
            f"{report['trace']} from {report['start_utc'][:10]}, slo {100 * report['slo']:.0f}% "
            f"({'simulated GPU' if report['simulated'] else 'measured plan'})"
        )
        axes[1].plot(hourly["kareus+carbon_time_ratio"], color="tab:green", linewidth=0.8, label="Kareus + carbon")
        axes[1].set_ylabel("time / fastest")
        twin = axes[1].twinx()
        twin.plot(hourly["chase-power-limit_w"], color="tab:red", linewidth=0.8, alpha=0.6, label="power limit")
        twin.set_ylabel("power limit (W)")
        axes[1].legend(loc="upper left")
        twin.legend(loc="upper right")
        for name, series in hourly["cumulative_carbon_kg"].items():
            axes[2].plot(series, linewidth=1.0, label=name)
        axes[2].set_ylabel("cumulative kgCO2")
        axes[2].set_xlabel("hour")
        axes[2].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)
    return path


def _table(report: Mapping[str, Any]) -> str:
    lines = [
        f"{report['trace']}: {report['days_at_max_throughput']:g} days of work at max throughput, slo "
        f"{100 * report['slo']:.1f}% ({'simulated' if report['simulated'] else 'measured'} plan), horizon "
        f"{report['horizon_h']} h, {report['forecast']} forecast; daily swing {100 * report['daily_swing']:.0f}%",
        f"{'policy':24} {'time +%':>8} {'energy -%':>10} {'carbon -%':>10}   (vs always-max-throughput)",
    ]
    for name, s in report["vs_always_max_throughput"].items():
        lines.append(
            f"{name:24} {100 * s['time_increase']:8.2f} {100 * s['energy_reduction']:10.2f} "
            f"{100 * s['carbon_reduction']:10.2f}"
        )
    for name in ("chase-power-limit", "chase-power-limit (foresight)"):
        chase = report["vs_megatron"][name]
        lines.append(
            f"{name} vs Megatron-LM at full power: time +{100 * chase['time_increase']:.2f}%, carbon "
            f"-{100 * chase['carbon_reduction']:.2f}%"
        )
    for name, gain in report["same_knob"].items():
        lines.append(
            f"{name}: time +{100 * gain['time_increase']:.2f}%, carbon -{100 * gain['carbon_reduction']:.2f}% "
            f"(the power-limit knob on Kareus's schedule, clocks unlocked)"
        )
    lines.append(
        "Kareus + carbon cuts more than the power-limit policy: "
        + ", ".join(f"{name.replace('_', ' ')} {verdict}" for name, verdict in report["verdicts"].items())
        + (
            " (hours on power-limit points: "
            + ", ".join(f"{n} {h}" for n, h in report["hours_on_power_limit_points"].items())
            + ")"
            if report["hours_on_power_limit_points"]
            else ""
        )
    )
    for name, shape in report["frontier_shape"].items():
        slopes = ", ".join(f"{s['slope_to_faster']:.2f}@{s['speed']:.3f}" for s in shape["hull_near_fastest"])
        lines.append(
            f"{name}: best constant point within the slo saves {100 * shape['best_constant_energy_reduction']:.2f}% "
            f"energy, the hull at a constant {100 * report['slo']:.1f}% slowdown "
            f"{100 * shape['constant_slowdown_energy_reduction']:.2f}%; hull slope (power per speed) to the next faster vertex: {slopes}"
        )
    ratios = ", ".join(f"{q}%: {r:.3f}" for q, r in report["kareus+carbon_time_ratio_percentiles"].items())
    lines.append(f"kareus+carbon hours' time over the fastest point's, percentiles {ratios}")
    for below in report["below_frontier"]:
        lines.append(
            f"below the frontier at {below['clock_mhz']} MHz: speed {below['speed']:.3f}, power {below['power']:.3f}, "
            f"{below['power_per_speed_from_least_energy']:.2f} power per speed from the least-energy point"
        )
    if report["below_frontier"]:
        hours = ", ".join(f"{name} {n}" for name, n in report["below_frontier_hours"].items())
        lines.append(f"hours run below the frontier: {hours}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", required=True, help="plan.json made by `kareus plan` (simulated profiler)")
    parser.add_argument("--trace", default="CISO", help=f"{', '.join(SHIPPED_TRACES)} or a CSV path")
    parser.add_argument("--slo", type=float, default=0.03, help="allowed slowdown, a fraction (default 0.03)")
    parser.add_argument("--days", type=float, default=30.0, help="work: days at max throughput (default 30)")
    parser.add_argument("--start", default="2022-01-01", help="UTC date the job starts (default 2022-01-01)")
    parser.add_argument("--horizon-h", type=int, default=24, help="signal policies' horizon in hours (default 24)")
    parser.add_argument(
        "--forecast", choices=FORECASTS, default="seasonal", help="seasonal (default) or perfect (the trace's future)"
    )
    parser.add_argument(
        "--extend-below-frontier",
        type=int,
        nargs="+",
        default=[],
        metavar="MHZ",
        help="add the least-energy point's instructions at these clocks to Kareus's candidates",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--plot", type=Path, help="write the carbon / point / cumulative plot here (PNG)")
    parser.add_argument("--results", type=Path, help="add the report (without hourly series) to this JSON file")
    args = parser.parse_args(argv)
    start = datetime.fromisoformat(args.start).replace(tzinfo=timezone.utc)
    report = run(
        args.plan, args.trace, args.slo, args.days, start, args.horizon_h, args.forecast, args.extend_below_frontier
    )
    if args.plot:
        plot(report, args.plot)
    summary = {k: v for k, v in report.items() if k != "hourly"}
    if args.results:
        recorded = json.loads(args.results.read_text()) if args.results.exists() else {}
        recorded[report["trace"]] = {"command": " ".join(["python bench/carbon_replay.py", *sys.argv[1:]]), **summary}
        args.results.write_text(json.dumps(recorded, indent=2, sort_keys=True) + "\n")
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(_table(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
