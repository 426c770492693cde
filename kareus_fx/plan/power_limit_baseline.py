"""The sixth method: Megatron-LM under one job-wide GPU power limit, chosen as Zeus would.

Zeus's ``GlobalPowerLimitOptimizer`` profiles the training step at power limits from the GPU's
maximum down in 25 W steps and keeps the one its selector picks (``ZeusCost(eta_knob=0.5)`` by
default: ``eta * energy + (1 - eta) * max_power * time``). Here each limit's step is the un-split
(Megatron-LM) microbatch at the maximum clock priced by the simulated GPU with that limit as its
power cap (the clock throttles to where the average power meets it), composed over the same
1F1B pipeline, link waits and blocking-power accounting as the other methods; the selection is
Zeus's own selector class on those (time, energy) pairs. The curve over every limit is the
frontier a power-limit-only policy (Chase) moves along, and what a cluster that forbids locking
clocks but allows power limits can deploy.

Assumptions: one limit for every GPU of the job; the limit binds the microbatch's average power
(a GPU's power management acts over about 100 ms windows, the order of one microbatch); the grid
stops at the first limit under which the step is slower than the un-capped step at the planner's
lowest tuning clock (below that a limit only slows the job further, as Perseus's clock range
does). Only the simulated profiler prices limits: the on-device profiler never changes a card's
power limit, so plans it measures carry no power-limit curve.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from zeus.optimizer.power_limit import PowerLimitMeasurement, ZeusCost

from kareus_fx.compose.pipeline_schedule import iteration_energy_j, pipeline_makespan_s
from kareus_fx.errors import KareusError
from kareus_fx.workload import Measurement

__all__ = [
    "POWER_LIMIT_METHOD",
    "ZEUS_ETA_KNOB",
    "PowerLimitPoint",
    "curve_of_plan",
    "iteration_of",
    "limit_for_target",
    "limit_grid",
    "power_limit_curve",
    "zeus_choice",
]

POWER_LIMIT_METHOD = "megatron+power-limit"
ZEUS_POWER_LIMIT_STEP_W = 25
"""``GlobalPowerLimitOptimizer``'s default ``pl_step``."""
ZEUS_ETA_KNOB = 0.5
"""``GlobalPowerLimitOptimizer``'s default selector is ``ZeusCost(eta_knob=0.5)``."""

NodeMeasurements = Mapping[tuple[int, str], Measurement]
"""Per (stage, "forward"/"backward"): one microbatch's un-split instruction, link wait included."""


@dataclass(frozen=True)
class PowerLimitPoint:
    """The iteration under one job-wide power limit."""

    power_limit_w: int
    time_s: float
    energy_j: float


def iteration_of(
    nodes: NodeMeasurements,
    pp: int,
    microbatches: int,
    blocking_power_w: float,
    energy_scale: float,
    virtual_stages: int = 1,
) -> tuple[float, float]:
    """(time_s, energy_j) of the 1F1B (interleaved 1F1B over ``virtual_stages`` chunks per GPU)
    iteration whose every microbatch runs ``nodes`` (keyed by global stage)."""
    time_s = pipeline_makespan_s(pp, microbatches, virtual_stages, lambda n: nodes[(n.stage, n.instruction)].time_s)
    busy_s = microbatches * sum(m.time_s for m in nodes.values())
    busy_j = microbatches * sum(m.energy_j for m in nodes.values())
    return time_s, energy_scale * iteration_energy_j(pp, time_s, busy_s, busy_j, blocking_power_w)


def power_limit_curve(
    measure_at: Callable[[int | None], NodeMeasurements],
    *,
    tdp_w: float,
    floor_time_s: float,
    pp: int,
    microbatches: int,
    blocking_power_w: float,
    energy_scale: float,
    virtual_stages: int = 1,
) -> list[PowerLimitPoint]:
    """The iteration at each power limit from ``tdp_w`` down in Zeus's 25 W steps.

    ``measure_at(limit_w)`` prices every (stage, instruction) under that limit (None: no limit);
    ``floor_time_s`` is the un-capped iteration at the lowest tuning clock, where the grid stops
    (see the module docstring). ``energy_scale`` turns one traced rank's energy into the plan's
    scope (its tensor- and context-parallel ranks)."""
    return limit_grid(
        lambda limit_w: iteration_of(
            measure_at(limit_w), pp, microbatches, blocking_power_w, energy_scale, virtual_stages
        ),
        tdp_w=tdp_w,
        floor_time_s=floor_time_s,
    )


def limit_grid(
    iteration_at: Callable[[int], tuple[float, float]], *, tdp_w: float, floor_time_s: float
) -> list[PowerLimitPoint]:
    """``iteration_at(limit_w)`` (time_s, energy_j) at each limit from ``tdp_w`` down in Zeus's
    25 W steps, up to the first limit slower than ``floor_time_s`` (module docstring)."""
    points: list[PowerLimitPoint] = []
    limit_w = int(tdp_w)
    while limit_w > 0:
        time_s, energy_j = iteration_at(limit_w)
        if points and time_s > floor_time_s:
            break
        points.append(PowerLimitPoint(limit_w, time_s, energy_j))
        limit_w -= ZEUS_POWER_LIMIT_STEP_W
    return points


def zeus_choice(points: list[PowerLimitPoint], gpus: int, eta_knob: float = ZEUS_ETA_KNOB) -> PowerLimitPoint:
    """The limit Zeus's ``ZeusCost(eta_knob, world_size=gpus)`` selects from ``points``, whose
    energies are all ``gpus`` GPUs' (the selector scales the maximum power by ``world_size``, so
    time and energy are both the job's)."""
    selector = ZeusCost(eta_knob=eta_knob, world_size=gpus)
    chosen_w = selector.select(
        [PowerLimitMeasurement(power_limit=p.power_limit_w, energy=p.energy_j, time=p.time_s) for p in points]
    )
    return next(p for p in points if p.power_limit_w == chosen_w)


def curve_of_plan(data: Mapping[str, Any], source: str = "<plan>") -> list[PowerLimitPoint]:
    """The power-limit curve a plan file holds; a plan without one is refused naming why."""
    method = data.get("methods", {}).get(POWER_LIMIT_METHOD)
    if not method or not method.get("power_limits"):
        raise KareusError(
            f"the plan {source} has no {POWER_LIMIT_METHOD!r} curve: it was made before kareus-fx priced power "
            f"limits, or measured on a GPU (the on-device profiler never sets a power limit); re-run `kareus plan` "
            f"with the simulated profiler, or deploy in clock mode"
        )
    return [PowerLimitPoint(int(w), float(t), float(e)) for w, t, e in method["power_limits"]]


def limit_for_target(points: Sequence[PowerLimitPoint], target: Any) -> PowerLimitPoint:
    """The curve's point ``target`` selects, as ``Plan.point_index`` does for clocks:
    'max-throughput' the fastest; ``{"deadline_s": X}`` the least energy finishing by X;
    ``{"energy_budget_j": Y}`` the fastest within Y."""
    if target == "max-throughput":
        return min(points, key=lambda p: (p.time_s, p.energy_j))
    if isinstance(target, Mapping) and len(target) == 1:
        ((key, limit),) = target.items()
        if key == "deadline_s":
            fits = [p for p in points if p.time_s <= float(limit)]
            best = min(p.time_s for p in points)
            pick = min(fits, key=lambda p: (p.energy_j, p.time_s)) if fits else None
            what = f"finishes an iteration by {float(limit):.4g} s (fastest: {best:.4g} s)"
        elif key == "energy_budget_j":
            fits = [p for p in points if p.energy_j <= float(limit)]
            least = min(p.energy_j for p in points)
            pick = min(fits, key=lambda p: (p.time_s, p.energy_j)) if fits else None
            what = f"fits an energy budget of {float(limit):.4g} J (least: {least:.4g} J)"
        else:
            pick, what = None, ""
        if pick is not None:
            return pick
        if what:
            raise KareusError(f"no power limit {what}; relax the target or use 'max-throughput'")
    raise KareusError(
        f"a power-limit deployment takes target 'max-throughput', {{'deadline_s': X}} or {{'energy_budget_j': Y}}, "
        f"got {target!r}"
    )
