"""Power cap / demand response: the fastest point whose average power fits a budget in watts.

A point's average power is its predicted iteration energy over its predicted iteration time, for
every GPU the plan covers (one pipeline), times ``replicas`` (data-parallel copies of it), so the
budget is the job's. The budget comes from the observation (``power_budget_w``, e.g. a demand
response signal) or from the policy's own ``budget_w``: a number, or a function of the seconds
since training started (a time-varying cap). Without any budget every candidate fits.

A budget below the lowest-power candidate cannot be met by any point: the policy warns
(:class:`PowerBudgetWarning`, once per budget value) and runs the lowest-power point; training
does not stop. A budget that is not a positive number raises :class:`PowerBudgetError`.

Composable: given ``then`` (another policy), it narrows the candidates to those that fit and
lets ``then`` choose among them (for example a straggler or carbon policy under a cap).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kareus_fx.errors import KareusError
from kareus_fx.policies.base import FrontierPoint, Observation, Policy

__all__ = ["PowerBudgetError", "PowerBudgetWarning", "PowerCapPolicy"]


class PowerBudgetError(KareusError, ValueError):
    """A power budget that is not a positive number of watts."""


class PowerBudgetWarning(UserWarning):
    """No candidate point fits the power budget; the lowest-power point runs."""


@dataclass
class PowerCapPolicy:
    """The fastest candidate (or ``then``'s choice among them) whose average power fits the budget."""

    budget_w: float | Callable[[float], float] | None = None
    """The job's budget (W) or a function of the elapsed seconds; the observation's
    ``power_budget_w``, when given, wins."""
    replicas: int = 1
    """Data-parallel copies of the plan's pipeline that the budget covers."""
    then: Policy | None = None
    _warned: set[float] = field(default_factory=set, init=False, repr=False)

    def budget_at(self, observation: Observation) -> float | None:
        """The budget in force at ``observation`` (None: no cap)."""
        budget = observation.power_budget_w
        if budget is None and self.budget_w is not None:
            budget = self.budget_w(observation.elapsed_s) if callable(self.budget_w) else self.budget_w
        if budget is None:
            return None
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not math.isfinite(budget) or budget <= 0:
            raise PowerBudgetError(f"a power budget must be a positive number of watts, got {budget!r}")
        return float(budget)

    def power_w(self, point: FrontierPoint) -> float:
        """The job's average power at ``point``."""
        return point.average_power_w * self.replicas

    def choose(self, candidates: Sequence[FrontierPoint], observation: Observation) -> int:
        budget = self.budget_at(observation)
        fitting = list(candidates) if budget is None else [p for p in candidates if self.power_w(p) <= budget]
        if not fitting:
            lowest = min(candidates, key=lambda p: (self.power_w(p), p.time_s))
            if budget not in self._warned:
                self._warned.add(budget)  # type: ignore[arg-type]
                warnings.warn(
                    f"no candidate point fits the power budget of {budget:.1f} W (the lowest-power one, "
                    f"frontier point {lowest.index}, averages {self.power_w(lowest):.1f} W); running it. Raise "
                    f"the budget, or add lower-power points to PointSwitcher(candidates=...)",
                    PowerBudgetWarning,
                    stacklevel=2,
                )
            return lowest.index
        fastest = min(fitting, key=lambda p: (p.time_s, p.energy_j)).index
        if self.then is None:
            return fastest
        chosen = self.then.choose(fitting, observation)
        return chosen if any(p.index == chosen for p in fitting) else fastest  # e.g. "keep the current point"
