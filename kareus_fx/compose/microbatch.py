"""Partition frontiers -> microbatch frontier (Kareus paper section 4.4, execution-model switching
in section 4.5).

A forward or backward microbatch runs its partitions one after another, plus the parts that
belong to no partition (embedding, loss, the ops between partitions). Its time and energy are the
sums over all of them. Two rules keep the enumeration small (section 4.4):

- one GPU clock for the whole microbatch (switching clocks takes milliseconds);
- one configuration (SMs for the collective, launch slot) per partition *type*: all partitions of
  a type run the same schedule, so a type contributes ``count x`` its per-partition measurement.

The whole microbatch run sequentially (no nanobatch split, no overlap) at each clock is always a
candidate too (section 4.5), so the frontier picks the better execution model by itself.

Algorithm (the paper's Algorithm 2, pruned incrementally): for each clock, start from the cost of
the parts outside partitions, add the partition types one at a time (every partial sum times every
point of the next type at that clock) and drop the dominated partial sums after each type. Sums are
monotone, so a partial sum dominated by another stays dominated however it is completed: the
result is exactly the frontier that full enumeration gives, at the cost of (frontier size x points
per type) per type instead of the product over all types. The per-clock frontiers and the
sequential candidates are merged and pruned once more. No factor is applied to any measurement.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from kareus_fx.compose.pipeline_schedule import CompositionError
from kareus_fx.workload import Measurement, PartitionConfig

__all__ = [
    "MicrobatchFrontier",
    "MicrobatchPoint",
    "compose_microbatch",
    "pareto_front",
]

_ZERO = Measurement(time_s=0.0, energy_j=0.0, dynamic_energy_j=0.0, static_energy_j=0.0)


@dataclass(frozen=True)
class MicrobatchPoint:
    """One way to run a whole microbatch: a clock and either per-type configs or sequential."""

    time_s: float
    energy_j: float
    dynamic_energy_j: float
    static_energy_j: float
    clock_mhz: int
    configs: tuple[tuple[str, PartitionConfig], ...] | None
    """``(type_id, config)`` per partition type, sorted by type id; ``None`` when sequential."""

    @property
    def sequential(self) -> bool:
        """True when the microbatch runs without nanobatch split or overlap."""
        return self.configs is None

    def config_for(self, type_id: str) -> PartitionConfig:
        """The configuration every partition of ``type_id`` runs with at this point."""
        if self.configs is None:
            raise KeyError(f"point at {self.clock_mhz} MHz runs the microbatch sequentially")
        for tid, config in self.configs:
            if tid == type_id:
                return config
        raise KeyError(type_id)


@dataclass(frozen=True)
class MicrobatchFrontier:
    """Pareto-optimal microbatch points, fastest first (energy falls as time grows)."""

    points: tuple[MicrobatchPoint, ...]
    skipped_clocks_mhz: tuple[int, ...] = ()
    """Clocks at which some partition type (or the outside parts) has no measurement, so no
    uniform-clock partitioned schedule exists there (sequential candidates are still used)."""

    def __len__(self) -> int:
        return len(self.points)

    def __iter__(self):
        return iter(self.points)


T = TypeVar("T")


def pareto_front(items: Iterable[T], key=lambda item: (item.time_s, item.energy_j)) -> list[T]:
    """Items not dominated in (time, energy), sorted by time ascending (energy then descends).

    An item is dropped when another is no slower and no costlier; of exact ties the first in
    ``items`` order is kept. Lower is better in both coordinates.
    """
    decorated = sorted(
        ((key(item), index, item) for index, item in enumerate(items)),
        key=lambda d: (d[0][0], d[0][1], d[1]),
    )
    front: list[T] = []
    best_energy = float("inf")
    for (_, energy), _, item in decorated:
        if energy < best_energy:
            front.append(item)
            best_energy = energy
    return front


@dataclass(frozen=True)
class _Partial:
    time_s: float
    energy_j: float
    dynamic_energy_j: float
    static_energy_j: float
    configs: tuple[tuple[str, PartitionConfig], ...]


def _check_measurement(what: str, m: Measurement) -> None:
    if not isinstance(m, Measurement):
        raise CompositionError(f"{what}: expected a Measurement, got {type(m).__name__}")
    for name in ("time_s", "energy_j", "dynamic_energy_j", "static_energy_j"):
        value = getattr(m, name)
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise CompositionError(f"{what}: {name} must be a finite number >= 0, got {value!r}")


def compose_microbatch(
    partition_points: Mapping[str, Sequence[tuple[PartitionConfig, Measurement]]],
    counts: Mapping[str, int],
    *,
    outside: Mapping[int, Measurement] | None,
    sequential: Mapping[int, Measurement],
) -> MicrobatchFrontier:
    """The microbatch time-energy frontier from measured partition points.

    Args:
        partition_points: per partition type id, its measured ``(config, measurement)`` points
            for ONE partition (any points: dominated ones are dropped per clock).
        counts: how many partitions of each type the microbatch has (same keys).
        outside: per clock, the measured cost of everything in the microbatch outside
            partitions; ``None`` when there is nothing outside partitions.
        sequential: per clock, the measurement of the whole microbatch run sequentially (may be
            empty when it was not measured; then only partitioned schedules are candidates).

    Raises:
        CompositionError: mismatched keys, a count below 1, a negative or non-finite
            measurement, or no candidate at all.

    Of candidates with exactly equal time and energy, the sequential one is kept.
    """
    if set(partition_points) != set(counts):
        missing = sorted(set(partition_points) ^ set(counts))
        raise CompositionError(
            f"partition_points and counts must name the same partition types; these appear in only one: {missing}"
        )
    for type_id, count in counts.items():
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise CompositionError(f"count of partition type {type_id!r} must be >= 1, got {count!r}")
    outside_by_clock: Mapping[int, Measurement] | None = outside
    for clock, m in (outside or {}).items():
        _check_measurement(f"outside cost at {clock} MHz", m)
    for clock, m in sequential.items():
        _check_measurement(f"sequential microbatch at {clock} MHz", m)

    # Per type and clock: the per-type contribution (count x one partition), dominated ones dropped.
    by_type: dict[str, dict[int, list[_Partial]]] = {}
    for type_id in sorted(partition_points):
        count = counts[type_id]
        per_clock: dict[int, list[_Partial]] = {}
        for config, m in partition_points[type_id]:
            if not isinstance(config, PartitionConfig):
                raise CompositionError(
                    f"partition type {type_id!r}: points must be (PartitionConfig, Measurement) pairs"
                )
            _check_measurement(f"partition type {type_id!r} at {config}", m)
            per_clock.setdefault(config.clock_mhz, []).append(
                _Partial(
                    count * m.time_s,
                    count * m.energy_j,
                    count * m.dynamic_energy_j,
                    count * m.static_energy_j,
                    ((type_id, config),),
                )
            )
        by_type[type_id] = {clock: pareto_front(pts) for clock, pts in per_clock.items()}

    all_clocks: set[int] = set(sequential)
    for per_clock in by_type.values():
        all_clocks.update(per_clock)
    if outside_by_clock is not None:
        all_clocks.update(outside_by_clock)

    # Sequential candidates first: on an exact tie the simpler execution model wins.
    candidates: list[MicrobatchPoint] = [
        MicrobatchPoint(m.time_s, m.energy_j, m.dynamic_energy_j, m.static_energy_j, clock, None)
        for clock, m in sorted(sequential.items())
    ]
    skipped: list[int] = []
    partitioned_clocks = set.intersection(*(set(per_clock) for per_clock in by_type.values())) if by_type else set()
    if outside_by_clock is not None:
        partitioned_clocks &= set(outside_by_clock)
    for clock in sorted(all_clocks):
        if clock not in partitioned_clocks:
            if by_type:
                skipped.append(clock)
            continue
        base = _ZERO if outside_by_clock is None else outside_by_clock[clock]
        partials = [_Partial(base.time_s, base.energy_j, base.dynamic_energy_j, base.static_energy_j, ())]
        for type_id in sorted(by_type):
            options = by_type[type_id][clock]
            partials = pareto_front(
                _Partial(
                    p.time_s + o.time_s,
                    p.energy_j + o.energy_j,
                    p.dynamic_energy_j + o.dynamic_energy_j,
                    p.static_energy_j + o.static_energy_j,
                    p.configs + o.configs,
                )
                for p in partials
                for o in options
            )
        candidates.extend(
            MicrobatchPoint(p.time_s, p.energy_j, p.dynamic_energy_j, p.static_energy_j, clock, p.configs)
            for p in partials
        )
    if not candidates:
        raise CompositionError(
            "no microbatch candidate: no clock has a measurement for every partition type"
            + ("" if outside_by_clock is None else " and for the outside parts")
            + ", and no sequential measurement was given"
        )
    return MicrobatchFrontier(tuple(pareto_front(candidates)), tuple(skipped))
