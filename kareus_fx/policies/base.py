"""The interface every run-time policy implements.

A policy is asked once per iteration boundary (or every K) which point of a plan's iteration
frontier the next iteration runs. It sees the candidate points (the ones whose variants were
compiled before training) and one :class:`Observation` of the world; it answers a frontier
index from the candidates. Policies are small and compose: a constraint (a power budget) can
narrow the candidates another policy (carbon) chooses from. The deployment, not the policy,
makes the choice collective across a pipeline's ranks and applies it at the next iteration.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class FrontierPoint:
    """One point of a plan's iteration frontier, as a policy sees it."""

    index: int
    """Index into ``plan.frontier``."""
    time_s: float
    """Predicted iteration time."""
    energy_j: float
    """Predicted iteration energy of every GPU the plan covers."""

    @property
    def average_power_w(self) -> float:
        return self.energy_j / self.time_s

    @classmethod
    def from_plan_point(cls, index: int, point: Mapping[str, Any]) -> FrontierPoint:
        return cls(index=index, time_s=float(point["time_s"]), energy_j=float(point["energy_j"]))


@dataclass(frozen=True)
class Observation:
    """What the world looks like at an iteration boundary; a signal nobody feeds is None."""

    iteration: int
    elapsed_s: float
    """Seconds since training started (wall clock, or simulated time in a replay)."""
    current_index: int
    """The frontier index the iteration that just ended ran."""
    slowest_replica_time_s: float | None = None
    """The slowest data-parallel replica's iteration time (as :mod:`~kareus_fx.policies.straggler`
    reports it: normalised to the straggler policy's base point)."""
    carbon_intensity_g_per_kwh: float | None = None
    price_per_kwh: float | None = None
    power_budget_w: float | None = None
    fastest_replica_time_s: float | None = None
    """The fastest replica's iteration time, normalised as ``slowest_replica_time_s``."""
    replica_time_s: float | None = None
    """This replica's iteration time, normalised as ``slowest_replica_time_s``."""


class Policy(Protocol):
    """Chooses the frontier point of the next iteration."""

    def choose(self, candidates: Sequence[FrontierPoint], observation: Observation) -> int:
        """A ``FrontierPoint.index`` from ``candidates`` (never empty, sorted by time_s)."""
        ...
