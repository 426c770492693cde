"""What profiling a plan costs, or would cost, on the device (the plan's ``profiling`` record).

A plan uses a set of measurements: every (partition type, configuration) the tuner measured or
found failing, the baselines' nanobatching configurations, and every sequence (the un-split
microbatch and the work outside partitions) at every clock. On a GPU each of them takes one
energy window (``--device-window``, 5 s by default) and a thermal cooldown before it (the paper's
5 s, section 5.3 and appendix D), in one TP (x CP) group of GPUs; ``groups`` such groups measure in
parallel. So, for any profiler, the simulated one included:

    wall_s_on_device = measurements x (window_s + cooldown_s) / groups
    gpu_hours = wall_s_on_device x groups x gpus_per_group / 3600

``by_purpose`` splits ``measurements`` by what they are for: ``tuning`` (the MBO runs of the partition
types), ``nanobatching`` (the nanobatching baseline's configuration of each type at each clock, also
Kareus candidates) and ``sequences`` (the un-split microbatch and the work outside partitions, forward
and backward, of each traced stage at each clock). A key used for two purposes counts once, under
the first.

This is an estimate of device time (it leaves out tracing, tuning compute, warm-up and a
cooldown that takes longer than 5 s), not a measured time. ``duplicates`` counts measurements made
of a key the profile database already held (the same configuration measured twice), from the
measurement log (:mod:`kareus_fx.cost_models.profile_queue`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kareus_fx.cost_models.profile_db import fingerprint
from kareus_fx.runtime.device_profiler import replay_key
from kareus_fx.tuner.mbo import TuningResult
from kareus_fx.workload import CollectiveSpec, Measurement, OpCost, PartitionConfig, PartitionType

__all__ = ["DEVICE_COOLDOWN_S", "PURPOSES", "MeasurementLedger", "ProfilingCost", "sequence_fingerprint"]

DEVICE_COOLDOWN_S = 5.0
"""Thermal cooldown before each measurement on a GPU (the paper's, section 5.3)."""


def sequence_fingerprint(ops: Sequence[OpCost], collectives: Sequence[CollectiveSpec]) -> str:
    """The key of a sequence of ops and its collectives (its ops' names and targets, the collectives)."""
    return "seq-" + replay_key(
        [
            *ops,
            *(
                OpCost(f"collective{i}", f"{c.kind}:{c.bytes:g}:{c.group_size}:{c.fused}", 0.0, 0.0)
                for i, c in enumerate(collectives)
            ),
        ]
    )


PURPOSES = ("tuning", "nanobatching", "sequences")
"""What a measurement is for (module docstring)."""


class MeasurementLedger:
    """The distinct measurements a plan used, as (fingerprint, configuration) keys, each with the
    purpose it was first used for (one of :data:`PURPOSES`)."""

    def __init__(self) -> None:
        self.keys: dict[tuple[str, PartitionConfig], str] = {}

    def add(self, key: tuple[str, PartitionConfig], purpose: str) -> None:
        """Record ``key``; a key already recorded keeps its first purpose."""
        self.keys.setdefault(key, purpose)

    def add_tuning(self, ptypes: Mapping[str, PartitionType], tuned: Mapping[str, TuningResult]) -> None:
        """Every configuration the tuner measured or found failing."""
        for type_id, result in tuned.items():
            fp = fingerprint(ptypes[type_id])
            for config in (*(p.config for p in result.points), *(p.config for p in result.failed)):
                self.add((fp, config), "tuning")

    def by_purpose(self) -> dict[str, int]:
        """Distinct measurements per purpose, every purpose listed."""
        counts = dict.fromkeys(PURPOSES, 0)
        for purpose in self.keys.values():
            counts[purpose] += 1
        return counts

    def wrap(self, profiler: Any) -> LedgerProfiler:
        """``profiler``, recording in this ledger what it is asked to measure."""
        return LedgerProfiler(profiler, self)

    def __len__(self) -> int:
        return len(self.keys)


class LedgerProfiler:
    """A profiler that records each key it is asked for in a :class:`MeasurementLedger`, then asks ``inner``.

    It wraps the profiler of the composing step, which asks for partition configurations only for
    the nanobatching baseline (purpose ``nanobatching``) and for sequences (``sequences``)."""

    def __init__(self, inner: Any, ledger: MeasurementLedger) -> None:
        self.inner = inner
        self.ledger = ledger
        self.gpu_name = inner.gpu_name
        self.kind = getattr(inner, "kind", type(inner).__name__)

    def measure(self, ptype: PartitionType, config: PartitionConfig) -> Measurement:
        self.ledger.add((fingerprint(ptype), config), "nanobatching")
        return self.inner.measure(ptype, config)

    def measure_sequence(
        self, ops: Sequence[OpCost], collectives: Sequence[CollectiveSpec], clock_mhz: int, **kwargs: Any
    ) -> Measurement:
        self.ledger.add((sequence_fingerprint(ops, collectives), PartitionConfig(clock_mhz, 1, None)), "sequences")
        return self.inner.measure_sequence(ops, collectives, clock_mhz, **kwargs)

    def prefetch(self, **batch: Any) -> None:
        """Forward a batch to an inner profiler that measures batches in parallel."""
        prefetch = getattr(self.inner, "prefetch", None)
        if prefetch is not None:
            prefetch(**batch)


@dataclass(frozen=True)
class ProfilingCost:
    """The plan's ``profiling`` record (module docstring)."""

    measurements: int
    duplicates: int
    groups: int
    gpus_per_group: int
    window_s: float
    cooldown_s: float = DEVICE_COOLDOWN_S
    device: str = "estimate for the plan's GPU"
    """What ran the measurements (the simulator, a test device, GPUs)."""
    by_purpose: Mapping[str, int] | None = None
    """``measurements`` split by :data:`PURPOSES` (module docstring); None when not known."""

    def __post_init__(self) -> None:
        if self.groups < 1 or self.gpus_per_group < 1:
            raise ValueError(f"groups and gpus_per_group must be positive, got {self.groups}, {self.gpus_per_group}")
        if self.by_purpose is not None and sum(self.by_purpose.values()) != self.measurements:
            raise ValueError(f"by_purpose {dict(self.by_purpose)} does not add up to {self.measurements} measurements")

    @property
    def wall_s_on_device(self) -> float:
        return self.measurements * (self.window_s + self.cooldown_s) / self.groups

    @property
    def gpu_hours(self) -> float:
        return self.wall_s_on_device * self.groups * self.gpus_per_group / 3600.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "measurements": self.measurements,
            "duplicates": self.duplicates,
            "groups": self.groups,
            "gpus_per_group": self.gpus_per_group,
            "window_s": self.window_s,
            "cooldown_s": self.cooldown_s,
            "wall_s_on_device": self.wall_s_on_device,
            "gpu_hours": self.gpu_hours,
            "device": self.device,
            **({"by_purpose": dict(self.by_purpose)} if self.by_purpose is not None else {}),
        }
