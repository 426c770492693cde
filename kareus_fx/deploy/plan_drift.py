"""Warn once when a run drifts from its plan.

What is compared, like with like:

- energy: per GPU, measured over predicted (:attr:`~kareus_fx.deploy.run_record.RunRecord.energy_ratio`),
  only for records whose energy was measured (``energy_source == "zeus"``); a simulated energy is
  the plan's own price, so comparing it would always agree;
- time: measured over predicted iteration time, only when the run measured a GPU (the same
  records) or when ``compare_time_on_cpu`` asks for it: on CPU the kernels are not the plan's
  GPU's, so their time says nothing about the plan unless the user wants that comparison (tests,
  or a plan priced for that CPU's speed).

A ratio is the median over the last ``window`` iterations after ``warmup`` iterations (compilation,
caches) are skipped; it drifts when it is off 1 by more than ``threshold`` (0.15: outside
0.85-1.15). One :class:`PlanDriftWarning` per check, naming the ratio(s), then silence.
"""

from __future__ import annotations

import statistics
import warnings
from collections import deque
from dataclasses import dataclass, field

from kareus_fx.deploy.run_record import RunRecord

__all__ = ["DriftCheck", "PlanDriftWarning"]


class PlanDriftWarning(UserWarning):
    """The run's measured time or energy is off its plan's prediction beyond the threshold."""


@dataclass
class DriftCheck:
    """Feed every record of one rank's run log to :meth:`observe`."""

    threshold: float = 0.15
    window: int = 5
    warmup: int = 2
    compare_time_on_cpu: bool = False
    warned: bool = False
    _time_ratios: deque[float] = field(init=False)
    _energy_ratios: deque[float] = field(init=False)

    def __post_init__(self) -> None:
        self._time_ratios = deque(maxlen=self.window)
        self._energy_ratios = deque(maxlen=self.window)

    def observe(self, record: RunRecord) -> None:
        """Add one iteration; warn (once) when a full window's median ratio drifts."""
        if record.iteration < self.warmup or self.warned:
            return
        measured = record.energy_source == "zeus"
        if measured or self.compare_time_on_cpu:
            self._time_ratios.append(record.time_ratio)
        if measured:
            self._energy_ratios.append(record.energy_ratio)
        drifts = [
            f"{what} {median:.3f}x the plan's"
            for what, ratios in (("time", self._time_ratios), ("energy per GPU", self._energy_ratios))
            if len(ratios) == self.window
            for median in (statistics.median(ratios),)
            if abs(median - 1.0) > self.threshold
        ]
        if drifts:
            self.warned = True
            warnings.warn(
                f"rank {record.rank} drifts from the plan {record.plan} at point {record.point}: measured "
                f"{' and '.join(drifts)} (median of iterations {record.iteration - self.window + 1}-"
                f"{record.iteration}, threshold {self.threshold:.0%}); the plan's prices do not hold on this "
                f"machine: re-plan with `kareus plan ... --calibrate-from RUN.jsonl`",
                PlanDriftWarning,
                stacklevel=2,
            )
