"""The paper's comparison metrics over iteration frontiers (section 6.1, figure 9).

A frontier is a list of ``(time_s, energy_j)`` points. Lower is better in both.

- Max-throughput (baseline Megatron-LM, one point): a method runs at its fastest point;
  ``time reduction = 1 - T_fastest / T_megatron`` and
  ``energy reduction = 1 - E(fastest point) / E_megatron``.
- Frontier improvement (baseline Megatron-LM + Perseus, a frontier):
  iso-time energy reduction: with the deadline ``T* = `` M+P's minimum time, a method's least
  energy among its points no slower than ``T*``, against M+P's energy at ``T*``;
  iso-energy time reduction: with the budget ``E* = `` M+P's minimum energy, a method's least time
  among its points using at most ``E*``, against M+P's time at ``E*``.
  Undefined (``None``) when the method has no point meeting the deadline or the budget.

All reductions are fractions (0.1 = 10%).
"""

from __future__ import annotations

from collections.abc import Sequence

Frontier = Sequence[tuple[float, float]]

__all__ = ["Frontier", "frontier_metrics", "least_energy_within", "least_time_within"]

_TOLERANCE = 1e-9
"""Relative slack when comparing against a deadline or budget (floating-point sums)."""


def _fastest(frontier: Frontier) -> tuple[float, float]:
    return min(frontier, key=lambda p: (p[0], p[1]))


def least_energy_within(frontier: Frontier, deadline_s: float) -> float | None:
    """Least energy of a point finishing by ``deadline_s``; None if none does."""
    energies = [e for t, e in frontier if t <= deadline_s * (1 + _TOLERANCE)]
    return min(energies) if energies else None


def least_time_within(frontier: Frontier, budget_j: float) -> float | None:
    """Least time of a point using at most ``budget_j``; None if none does."""
    times = [t for t, e in frontier if e <= budget_j * (1 + _TOLERANCE)]
    return min(times) if times else None


def frontier_metrics(
    frontier: Frontier, megatron: tuple[float, float], megatron_perseus: Frontier
) -> dict[str, float | None]:
    """The four reductions of one method (see the module docstring)."""
    if not frontier or not megatron_perseus:
        raise ValueError("frontiers must not be empty")
    fast_t, fast_e = _fastest(frontier)
    mp_fast_t, mp_fast_e = _fastest(megatron_perseus)
    mp_least_e_point = min(megatron_perseus, key=lambda p: (p[1], p[0]))
    energy_at_deadline = least_energy_within(frontier, mp_fast_t)
    time_at_budget = least_time_within(frontier, mp_least_e_point[1])
    return {
        "max_throughput_time_reduction": 1.0 - fast_t / megatron[0],
        "max_throughput_energy_reduction": 1.0 - fast_e / megatron[1],
        "iso_time_energy_reduction": (None if energy_at_deadline is None else 1.0 - energy_at_deadline / mp_fast_e),
        "iso_energy_time_reduction": (None if time_at_budget is None else 1.0 - time_at_budget / mp_least_e_point[0]),
    }
