"""Per-iteration time and GPU energy of the running job, to compare with the plan.

:class:`IterationEnergyMonitor` opens one Zeus measurement window (``ZeusMonitor.begin_window`` /
``end_window``) per training iteration on this process's GPU(s). Zeus reads NVML's cumulative
energy counter (Volta and newer) and synchronises CUDA at both ends of the window. Without a
GPU (CPU runs) it measures time only and reports energy as None, never an estimate.

NVML updates its counters about every 100 ms (paper 5.3): an iteration much shorter than that
has an imprecise energy; compare over many iterations (:func:`compare_with_plan` averages).

A counter that cannot be read (NVML did not start, or returned an error code) raises
:class:`EnergyMeasurementError`; :func:`open_zeus_monitor` and :func:`zeus_errors` do that mapping
for every Zeus caller in the runtime (this monitor, the device profiler, the group replay).
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kareus_fx.errors import KareusError

if TYPE_CHECKING:  # zeus is imported when a monitor is made, not at import time
    from zeus.monitor.energy import ZeusMonitor


class EnergyMonitorError(KareusError, ValueError):
    """Measurements or predictions that cannot be compared (none, non-positive prediction)."""


class EnergyMeasurementError(KareusError, RuntimeError):
    """The GPU's energy counter cannot be read through Zeus (no NVML, or an NVML error code)."""


@contextmanager
def zeus_errors(what: str) -> Iterator[None]:
    """Raise Zeus's errors (each NVML error code maps to one) as :class:`EnergyMeasurementError`."""
    from zeus.exception import ZeusBaseError

    try:
        yield
    except ZeusBaseError as err:
        raise EnergyMeasurementError(
            f"could not {what} ({type(err).__name__}: {err}); the GPU's energy counter is read through "
            "NVML: check the driver (nvidia-smi) and that this process sees the GPU"
        ) from err


def open_zeus_monitor(gpu_indices: list[int]) -> ZeusMonitor:
    """A ``ZeusMonitor`` of ``gpu_indices`` (no CPU); :class:`EnergyMeasurementError` if it cannot
    read their energy. Zeus falls back to an empty GPU set when NVML does not start, and then
    fails on the first GPU call with a ValueError: that is mapped too."""
    from zeus.monitor.energy import ZeusMonitor

    with zeus_errors(f"open the energy counters of GPUs {gpu_indices}"):
        try:
            return ZeusMonitor(gpu_indices=gpu_indices, cpu_indices=[])
        except ValueError as err:
            raise EnergyMeasurementError(
                f"Zeus sees no GPU to measure GPUs {gpu_indices} on ({err}): NVML did not start. Energy needs "
                "an NVIDIA driver; without a GPU, measure time only (IterationEnergyMonitor(gpu_indices=[]))"
            ) from err


@dataclass(frozen=True)
class IterationMeasurement:
    """One iteration: wall time and the monitored GPUs' energy (None without a GPU)."""

    iteration: int
    time_s: float
    energy_j: float | None


@dataclass(frozen=True)
class PlanComparison:
    """Measured means against the plan's prediction; ratios are measured / predicted."""

    iterations: int
    predicted_time_s: float
    measured_time_s: float
    time_ratio: float
    predicted_energy_j: float
    measured_energy_j: float | None
    energy_ratio: float | None


class IterationEnergyMonitor:
    """Measures each iteration's time and energy through Zeus.

    ``gpu_indices``: the GPUs to measure (Zeus / CUDA indices); default this process's current
    CUDA device, or none without CUDA. ``zeus_monitor``: an existing ``ZeusMonitor`` to use
    instead of making one (its own GPU indices then apply).
    """

    def __init__(self, gpu_indices: list[int] | None = None, zeus_monitor: ZeusMonitor | None = None) -> None:
        if zeus_monitor is None:
            if gpu_indices is None:
                gpu_indices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
            zeus_monitor = open_zeus_monitor(gpu_indices)
        self._zeus = zeus_monitor
        self.energy_available = bool(zeus_monitor.gpu_indices)
        self.measurements: list[IterationMeasurement] = []
        self._iterations = itertools.count()
        self._open_window: str | None = None

    def begin_iteration(self) -> None:
        """Start measuring an iteration (waits for queued GPU work first)."""
        if self._open_window is not None:
            raise EnergyMonitorError(f"{self._open_window} is still being measured: call end_iteration() first")
        window = f"kareus_iteration_{next(self._iterations)}"
        with zeus_errors("read the energy counter at the iteration's start"):
            self._zeus.begin_window(window)
        self._open_window = window

    def end_iteration(self) -> IterationMeasurement:
        """Stop measuring the iteration; return and keep its measurement."""
        if self._open_window is None:
            raise EnergyMonitorError("end_iteration() without begin_iteration()")
        window, self._open_window = self._open_window, None
        with zeus_errors("read the energy counter at the iteration's end"):
            result = self._zeus.end_window(window)
        measurement = IterationMeasurement(
            iteration=len(self.measurements),
            time_s=float(result.time),
            energy_j=float(sum(result.gpu_energy.values())) if self.energy_available else None,
        )
        self.measurements.append(measurement)
        return measurement

    @contextmanager
    def iteration(self) -> Iterator[None]:
        """Measure the body as one iteration (a failed iteration is not kept)."""
        self.begin_iteration()
        try:
            yield
        except BaseException:
            window, self._open_window = self._open_window, None
            if window is not None:  # begin_iteration opened it
                self._zeus.end_window(window, cancel=True)
            raise
        self.end_iteration()


def compare_with_plan(
    measurements: Sequence[IterationMeasurement],
    predicted_time_s: float,
    predicted_energy_j: float,
) -> PlanComparison:
    """Mean measured time and energy against the plan's per-iteration prediction.

    The prediction must cover the same GPUs as the measurements (a plan's iteration energy
    covers every GPU of the pipeline; one rank's monitor measures its own GPU). Drop warm-up
    iterations before calling.
    """
    if not measurements:
        raise EnergyMonitorError("no measurements to compare: measure at least one iteration")
    if predicted_time_s <= 0 or predicted_energy_j <= 0:
        raise EnergyMonitorError(f"predictions must be positive, got {predicted_time_s} s and {predicted_energy_j} J")
    measured_time_s = statistics.fmean(m.time_s for m in measurements)
    energies_j = [m.energy_j for m in measurements if m.energy_j is not None]
    measured_energy_j = statistics.fmean(energies_j) if len(energies_j) == len(measurements) else None
    return PlanComparison(
        iterations=len(measurements),
        predicted_time_s=predicted_time_s,
        measured_time_s=measured_time_s,
        time_ratio=measured_time_s / predicted_time_s,
        predicted_energy_j=predicted_energy_j,
        measured_energy_j=measured_energy_j,
        energy_ratio=None if measured_energy_j is None else measured_energy_j / predicted_energy_j,
    )
