"""GPU power: static power plus dynamic power from clock, voltage and activity (paper 2.1, 4.5).

Dynamic power has parts that switch every cycle while a workload runs (clocks and uncore:
``busy_power_w``; SMs holding compute CTAs: ``sm_active_power_w``; SMs holding a collective's
CTAs: ``comm_sm_active_power_w``), which scale with clock x voltage^2,
and parts that are energy per unit of work: arithmetic (``flop_energy_j``, scales with
voltage^2) and HBM / link traffic (per byte; the memory clock is fixed). Voltage sits at a floor
up to a knee clock and rises linearly to the max clock above it, so dynamic power grows about as
clock^3 above the knee (the regime of the paper's Appendix A) and about linearly below it.

The power cap is the simulator's (``simulator.py``): an execution (a partition, or a sequence of
ops) whose average power at the requested clock exceeds the TDP throttles; its clock swings in
the GPU's clock steps around a lower centre (:meth:`PowerModel.throttle_swing`), time following
the centre and dynamic energy the swing (paper Appendix A).

An execution is summarised by :class:`EnergyTerms`, whose energy is linear in the power
coefficients (the calibration fits them by linear least squares).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kareus_fx.cost_models.hardware import GPUSpec
from kareus_fx.cost_models.sim_params import SimParams


@dataclass(frozen=True)
class EnergyTerms:
    """What one execution did, each term already weighted by the clock and voltage it ran at."""

    time_s: float
    clock_s: float
    """Integral of clock x voltage^2 (relative to max clock) over time: multiplies ``busy_power_w``."""
    sm_clock_s: float
    """Integral of (busy SMs / all SMs) x clock x voltage^2 over time: multiplies ``sm_active_power_w``."""
    flops_v2: float
    """FLOPs x voltage^2 (relative): multiplies ``flop_energy_j``."""
    hbm_bytes: float
    link_bytes: float
    clock_mhz_s: float = 0.0
    """Integral of the SM clock over time (for the time-averaged clock)."""
    comm_sm_clock_s: float = 0.0
    """Integral of (SMs holding a collective's CTAs / all SMs) x clock x voltage^2 over time:
    multiplies ``comm_sm_active_power_w`` (``sm_clock_s`` counts the compute kernels' SMs only)."""

    def __add__(self, other: EnergyTerms) -> EnergyTerms:
        return EnergyTerms(*(a + b for a, b in zip(self.as_tuple(), other.as_tuple())))

    def scaled(self, k: float) -> EnergyTerms:
        return EnergyTerms(*(a * k for a in self.as_tuple()))

    def as_tuple(self) -> tuple[float, ...]:
        return (
            self.time_s,
            self.clock_s,
            self.sm_clock_s,
            self.flops_v2,
            self.hbm_bytes,
            self.link_bytes,
            self.clock_mhz_s,
            self.comm_sm_clock_s,
        )

    def features(self) -> tuple[float, float, float, float, float]:
        """Multipliers of (busy W, SM-active W, J/FLOP, J/HBM byte, J/link byte)."""
        return (self.clock_s, self.sm_clock_s, self.flops_v2, self.hbm_bytes, self.link_bytes)

    def fitted_features(self) -> tuple[float, float, float, float]:
        """Multipliers of the fitted power coefficients (busy W, SM-active W, collective
        SM-active W, J/FLOP): what the calibration's linear least squares sees."""
        return (self.clock_s, self.sm_clock_s, self.comm_sm_clock_s, self.flops_v2)

    @property
    def average_clock_mhz(self) -> float:
        return self.clock_mhz_s / self.time_s if self.time_s > 0 else 0.0


ZERO_TERMS = EnergyTerms(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)


class PowerModel:
    """Power and energy on one GPU with one parameter set."""

    def __init__(self, spec: GPUSpec, params: SimParams) -> None:
        self.spec = spec
        self.params = params
        self._knee_mhz = params.voltage_knee_frac * spec.clock_max_mhz

    def voltage(self, clock_mhz: float) -> float:
        """Core voltage relative to the voltage at the max clock."""
        p = self.params
        fmax = self.spec.clock_max_mhz
        if clock_mhz <= self._knee_mhz or fmax <= self._knee_mhz:
            return p.voltage_floor
        return p.voltage_floor + (1.0 - p.voltage_floor) * (clock_mhz - self._knee_mhz) / (fmax - self._knee_mhz)

    def throttle_swing(self, centre_mhz: float, requested_mhz: float) -> tuple[tuple[float, float], ...]:
        """The clock levels of a throttling GPU around ``centre_mhz`` and their time shares.

        The power controller moves the clock one step (``spec.clock_step_mhz``) at a time, down
        while over the cap and up while under it, so the clock spends equal time on the levels
        ``centre +- k x step`` (``k <= n``) of a swing of half-width ``throttle_swing_mhz``, clipped
        so that it stays within the minimum and the requested clock (a request just over the cap
        barely swings). The levels' mean is the centre. Their average of a smooth function of the
        clock is taken by the two-point rule at ``centre +- sigma`` (``sigma``: the levels' standard
        deviation, ``step x sqrt(n (n + 1) / 3)``), exact for a cubic; power is about cubic in
        the clock above the voltage knee (module docstring).
        """
        step = float(self.spec.clock_step_mhz)
        half = min(self.params.throttle_swing_mhz, requested_mhz - centre_mhz, centre_mhz - self.spec.clock_min_mhz)
        levels = math.floor(max(half, 0.0) / step)
        if levels == 0:
            return ((centre_mhz, 1.0),)
        sigma = step * math.sqrt(levels * (levels + 1) / 3.0)
        return ((centre_mhz - sigma, 0.5), (centre_mhz + sigma, 0.5))

    def clock_scale(self, clock_mhz: float) -> float:
        """clock x voltage^2 relative to the max clock (per-cycle switching power)."""
        v = self.voltage(clock_mhz)
        return clock_mhz / self.spec.clock_max_mhz * v * v

    def phase_power_w(
        self,
        clock_mhz: float,
        busy_sm_frac: float,
        flops_per_s: float,
        hbm_bytes_per_s: float,
        link_bytes_per_s: float = 0.0,
        comm_sm_frac: float = 0.0,
    ) -> float:
        """Total power of a phase with the given activity rates at ``clock_mhz`` (``busy_sm_frac``:
        SMs holding compute CTAs, ``comm_sm_frac``: SMs holding a collective's, each a share of all SMs)."""
        p = self.params
        v = self.voltage(clock_mhz)
        scale = clock_mhz / self.spec.clock_max_mhz * v * v
        return (
            self.spec.static_power_w
            + scale * (p.busy_power_w + p.sm_active_power_w * busy_sm_frac + p.comm_sm_active_power_w * comm_sm_frac)
            + p.flop_energy_j * v * v * flops_per_s
            + p.hbm_energy_j_per_byte * hbm_bytes_per_s
            + p.link_energy_j_per_byte * link_bytes_per_s
        )

    def dynamic_energy_j(self, terms: EnergyTerms) -> float:
        p = self.params
        return (
            p.busy_power_w * terms.clock_s
            + p.sm_active_power_w * terms.sm_clock_s
            + p.comm_sm_active_power_w * terms.comm_sm_clock_s
            + p.flop_energy_j * terms.flops_v2
            + p.hbm_energy_j_per_byte * terms.hbm_bytes
            + p.link_energy_j_per_byte * terms.link_bytes
        )

    def static_energy_j(self, time_s: float) -> float:
        """Static energy = the GPU's ready-state power x time (docs/design.md)."""
        return self.spec.static_power_w * time_s

    def energy_j(self, terms: EnergyTerms) -> float:
        return self.static_energy_j(terms.time_s) + self.dynamic_energy_j(terms)
