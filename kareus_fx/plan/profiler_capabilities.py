"""What each profiler can price beyond the traced graphs it measures, looked up by the profiler's name.

The planner asks a profiler's capabilities, never its name: a new profiler declares its own here.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PROFILER_CAPABILITIES", "ProfilerCapabilities", "profiler_capabilities"]


@dataclass(frozen=True)
class ProfilerCapabilities:
    """What a profiler can price beyond the traced graphs it measures."""

    prices_untraced_work: bool
    """It can price work the traced model does not run: a training framework's extra ops,
    overlaps and step tail, and a stage extended from slices of its layers. A measured profiler
    replays the traced ops, so it cannot."""
    prices_power_limits: bool
    """It can price a job-wide power limit (the power-limit baseline and curves); the on-device
    profilers never set one."""


PROFILER_CAPABILITIES: dict[str, ProfilerCapabilities] = {
    "simulated": ProfilerCapabilities(prices_untraced_work=True, prices_power_limits=True),
    "cuda": ProfilerCapabilities(prices_untraced_work=False, prices_power_limits=False),
    "cpu-replay": ProfilerCapabilities(prices_untraced_work=False, prices_power_limits=False),
}
"""Each ``--profiler``'s capabilities (``request.PROFILERS`` names them)."""


def profiler_capabilities(profiler: str) -> ProfilerCapabilities:
    """The capabilities of the profiler called ``profiler``."""
    return PROFILER_CAPABILITIES[profiler]
