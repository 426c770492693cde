"""A plan's clock schedule at one frontier point (shared by the deployment and the point switcher)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kareus_fx.compose.pipeline_schedule import INSTRUCTIONS
from kareus_fx.plan.plan_format import Plan
from kareus_fx.runtime.step_context import ClockSchedule

__all__ = ["clock_schedule", "plan_num_stages"]


def plan_num_stages(workload: Mapping[str, Any]) -> int:
    """Global pipeline stages of a plan's workload: ``pp x virtual_stages`` (a plan older than
    ``virtual_stages`` has one chunk per GPU). Stage-indexed plan fields use the global index
    (``torch.distributed.pipelining``'s ``stage_index``; GPU ``r`` holds ``r, r + pp, ...``)."""
    return int(workload["pp"]) * int(workload.get("virtual_stages", 1))


def clock_schedule(plan: Plan, point_index: int, every_clock_mhz: int | None = None) -> ClockSchedule:
    """The plan's clock of every (stage, instruction, microbatch) at frontier point ``point_index``
    (``every_clock_mhz``: that clock for every instruction instead, e.g. a power-limit point's maximum).

    A plan that locks no clock (``--max-clock-only``) gives a schedule that requests none."""
    workload = plan.workload

    def clock_of(stage: int, name: str, mb: int) -> int:
        if every_clock_mhz is not None:
            return every_clock_mhz
        return int(plan.option(point_index, stage, name, mb)["clock_mhz"])

    return ClockSchedule.from_entries(
        (
            (stage, name, mb, clock_of(stage, name, mb))
            for stage in range(plan_num_stages(workload))
            for name in INSTRUCTIONS
            for mb in range(workload["microbatches"])
        ),
        requests_clocks=plan.locks_clocks,
    )
