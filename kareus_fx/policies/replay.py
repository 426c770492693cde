"""Replay a policy over an hourly signal trace: a fixed amount of training work, hour by hour.

The job must run ``work_iterations`` iterations. Each hour the policy sees that hour's carbon
intensity (and price, if a tariff is given) and picks a frontier point; the hour runs
``3600 / time_s`` iterations at that point's predicted time and energy (the last hour only what
is left). Totals: the job's duration, energy, carbon (energy x that hour's intensity) and cost.
The frontier's times and energies are whatever the plan holds: with the simulated profiler, a
cost model's predictions, so a replay's results are simulated too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import partial

from kareus_fx.errors import KareusError
from kareus_fx.policies.base import FrontierPoint, Observation, Policy
from kareus_fx.policies.signal_budget import choice_at, smallest_price_of_work
from kareus_fx.policies.signals import HourlyTrace, read_signal

__all__ = ["FixedPoint", "HourlySchedule", "ReplayResult", "foresight_schedule", "replay"]

J_PER_KWH = 3.6e6
MAX_REPLAY_HOURS = 24 * 366 * 5


@dataclass(frozen=True)
class FixedPoint:
    """Always the same frontier point (always-max-throughput, or Perseus's static choice)."""

    index: int

    def choose(self, candidates: Sequence[FrontierPoint], observation: Observation) -> int:
        return self.index


@dataclass(frozen=True)
class HourlySchedule:
    """A frontier index fixed in advance for each hour of a replay (the last one holds after)."""

    indices: tuple[int, ...]

    def choose(self, candidates: Sequence[FrontierPoint], observation: Observation) -> int:
        return self.indices[min(int(observation.elapsed_s // 3600.0), len(self.indices) - 1)]


def foresight_schedule(
    candidates: Sequence[FrontierPoint], trace: HourlyTrace, start: datetime, work_iterations: float, slo: float
) -> HourlySchedule:
    """The least-carbon hourly choices that do ``work_iterations`` within ``1 + slo`` times the
    fastest candidate's time, knowing the whole trace: a bound on any hourly policy over these
    candidates and budget (a job cannot run it: it needs the future).

    Each hour of signal ``s`` runs :func:`~kareus_fx.policies.signal_budget.choice_at` with one
    price of work ``mu`` for the whole job, the smallest whose choices finish the work within the
    budget (the Lagrangian of the budget), then spends the slack one price leaves (up to about an
    hour) on the moves to slower points that save the most carbon per iteration given up."""
    fastest = min(candidates, key=lambda p: (p.time_s, p.energy_j))
    budget_s = (1.0 + slo) * work_iterations * fastest.time_s
    hours = math.ceil(budget_s / 3600.0)
    signal = trace.window(start, hours)

    def work(mu: float) -> float:
        return sum(
            min(3600.0, budget_s - 3600.0 * h) / choice_at(candidates, s, mu).time_s for h, s in enumerate(signal)
        )

    mu = smallest_price_of_work(work, work_iterations)
    chosen = [choice_at(candidates, s, mu) for s in signal]
    # One price leaves up to an hour's slack (an hour runs one point); spend it on the moves to
    # slower points that save the most carbon per iteration given up, one move per hour.
    seconds = [min(3600.0, budget_s - 3600.0 * h) for h in range(hours)]
    slack = sum(t / p.time_s for t, p in zip(seconds, chosen)) - work_iterations
    moves = [
        (s * t * (p.average_power_w - q.average_power_w) / lost, lost, h, q)
        for h, (s, t, p) in enumerate(zip(signal, seconds, chosen))
        for q in candidates
        if q.time_s > p.time_s and (lost := t / p.time_s - t / q.time_s) > 0
    ]
    moved: set[int] = set()
    for saving, lost, h, q in sorted(moves, key=lambda m: -m[0]):
        if saving > 0 and lost <= slack and h not in moved:
            chosen[h], slack = q, slack - lost
            moved.add(h)
    return HourlySchedule(tuple(p.index for p in chosen))


@dataclass
class ReplayResult:
    """One policy's run of the work over the trace."""

    time_s: float = 0.0
    energy_j: float = 0.0
    carbon_g: float = 0.0
    cost: float = 0.0
    iterations: float = 0.0
    hourly_index: list[int] = field(default_factory=list)
    """The frontier index each hour ran."""
    cumulative_carbon_g: list[float] = field(default_factory=list)


def replay(
    candidates: Sequence[FrontierPoint],
    policy: Policy,
    trace: HourlyTrace,
    start: datetime,
    work_iterations: float,
    price_at: Callable[[datetime], float] | None = None,
) -> ReplayResult:
    """Run ``work_iterations`` iterations from ``start`` under ``policy`` (see the module
    docstring). ``price_at`` gives the electricity price per kWh at a time (None: no cost)."""
    if not candidates:
        raise KareusError("a replay needs at least one frontier point")
    if work_iterations <= 0:
        raise KareusError(f"work_iterations must be positive, got {work_iterations!r}")
    by_index = {p.index: p for p in candidates}
    ordered = sorted(candidates, key=lambda p: p.time_s)
    result = ReplayResult()
    current = ordered[0].index
    hour = 0
    while result.iterations < work_iterations:
        if hour >= MAX_REPLAY_HOURS:
            raise KareusError(f"the replay did not finish in {MAX_REPLAY_HOURS} hours; is the work too large?")
        now = start + timedelta(hours=hour)
        observation = Observation(
            iteration=int(result.iterations),
            elapsed_s=3600.0 * hour,
            current_index=current,
            carbon_intensity_g_per_kwh=read_signal("carbon intensity", partial(trace.at, now)),
            price_per_kwh=None if price_at is None else read_signal("price", partial(price_at, now)),
        )
        chosen = policy.choose(ordered, observation)
        if chosen not in by_index:
            raise KareusError(f"the policy chose frontier point {chosen}, which is not a candidate")
        point = by_index[chosen]
        iterations = min(3600.0 / point.time_s, work_iterations - result.iterations)
        energy_j = iterations * point.energy_j
        result.time_s += iterations * point.time_s
        result.energy_j += energy_j
        result.carbon_g += energy_j / J_PER_KWH * trace.at(now)
        if price_at is not None:
            result.cost += energy_j / J_PER_KWH * price_at(now)
        result.iterations += iterations
        result.hourly_index.append(chosen)
        result.cumulative_carbon_g.append(result.carbon_g)
        current = chosen
        hour += 1
    return result
