"""bench/carbon_replay.py's report arithmetic: the daily swing, the hull at a constant slowdown and
the points priced below the frontier (every README number comes from a command)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import carbon_replay

from kareus_fx.plan.plan_format import load_plan
from kareus_fx.policies.base import FrontierPoint
from kareus_fx.policies.replay import ReplayResult


def test_the_daily_swing_is_the_mean_daily_range_over_the_daily_mean():
    day_one = [100.0] * 12 + [300.0] * 12  # range 200 over a mean of 200: 1.0
    day_two = [150.0] * 24  # flat: 0.0
    assert carbon_replay._daily_swing(day_one + day_two + [999.0]) == pytest.approx(0.5)  # a partial day is left out


def test_the_constant_slowdown_runs_the_hull_between_its_neighbouring_vertices():
    # (time, energy): average power 1000, 900, 700 W at speeds 1, 1/1.02, 1/1.10; the 1.05 point lies above the hull.
    points = [
        FrontierPoint(i, t, t * w) for i, (t, w) in enumerate([(1.0, 1000), (1.02, 900), (1.05, 890), (1.10, 700)])
    ]
    shape = carbon_replay._shape(points, slo=0.03)
    speed = 1 / 1.03
    v1, v2 = 1 / 1.10, 1 / 1.02
    power = 0.7 + (0.9 - 0.7) * (speed - v1) / (v2 - v1)
    assert shape["constant_slowdown_energy_reduction"] == pytest.approx(1 - power / speed)
    # Mixing the hull's vertices saves more than the best single point within the budget (1.02).
    assert (
        shape["constant_slowdown_energy_reduction"]
        > shape["best_constant_energy_reduction"]
        == pytest.approx(1 - 1.02 * 900 / 1000)
    )


def test_points_below_the_frontier_are_slower_than_its_least_energy_point(small_real_plan):
    plan = load_plan(small_real_plan[0])
    clocks = sorted({o["clock_mhz"] for o in plan.data["microbatch_options"]["0/forward"]})
    least_energy = min(plan.frontier, key=lambda p: p["energy_j"])
    below = carbon_replay._below_frontier(plan, [clocks[0]])
    assert [p.index for p in below] == [len(plan.frontier)]
    assert below[0].time_s >= least_energy["time_s"] * (1 - 1e-12)
    assert math.isfinite(below[0].energy_j) and below[0].energy_j > 0
    assert carbon_replay._below_frontier(plan, []) == []


def _run(time_h: float, carbon_kg: float) -> ReplayResult:
    return ReplayResult(time_s=3600.0 * time_h, energy_j=1.0, carbon_g=1e3 * carbon_kg)


def test_each_verdict_compares_the_knobs_against_its_own_reference():
    # Kareus's schedule: the clock policy cuts 7 % from its fastest point, the power-limit knob 5 % from its own
    # full power; Megatron-LM's power-limit policy cuts 8 % from Megatron-LM, yet emits more and runs longer.
    results = {
        "always-max-throughput": _run(100, 100),
        "kareus+carbon": _run(103, 93),
        "kareus-power-limit": _run(100, 110),
        "kareus-power-limit+carbon": _run(103, 104.5),
        "megatron": _run(113, 130),
        "chase-power-limit": _run(116, 119.6),
    }
    verdicts = carbon_replay._verdicts(results, results["always-max-throughput"], results["megatron"], 0.031)
    assert verdicts == {
        "on_the_same_schedule": True,
        "each_on_its_own_schedule": False,
        "clocks_and_power_limits_each_on_its_own_schedule": None,
        "less_carbon_and_time_than_power_limit_on_megatron": True,
    }
    # A policy over its slowdown budget never wins, however much it cuts.
    results["kareus+carbon"] = _run(104, 80)
    verdicts = carbon_replay._verdicts(results, results["always-max-throughput"], results["megatron"], 0.031)
    assert verdicts["on_the_same_schedule"] is False
