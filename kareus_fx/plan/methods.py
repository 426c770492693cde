"""The options each method gives one (stage, instruction) of the pipeline (paper section 6.1).

Every method runs the same traced graphs on the same profiler; they differ only in what a
microbatch may do:

- ``megatron``: the un-split graph, op after op, each collective alone (default SM count), at the
  maximum clock: one option.
- ``megatron+perseus``: the same at every tuning clock (Perseus picks one per microbatch).
- ``nanobatching``: the nanobatched graph with every collective issued as soon as possible (launch
  slot 0 of its partition) with the default SM count on NCCL, at the maximum clock; the work outside
  partitions runs sequentially (NCCL, as every collective outside Kareus's tuned partitions).
- ``nanobatching+perseus``: the same at every tuning clock.
- ``kareus``: the microbatch frontier of the tuned partition frontiers (one clock per microbatch,
  one configuration per partition type, section 4.4) with the sequential microbatch as a
  candidate at every clock (execution-model switching, section 4.5). A type's candidates are the
  points the tuner measured plus the nanobatching schedule, which lies in Kareus's search space
  and is measured anyway for the baseline.

Times and energies are one GPU's (the traced rank's); every term is a profiler measurement
(with the simulated profiler: a cost-model prediction, not a measurement of a GPU).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kareus_fx.compose.iteration import InstructionOption
from kareus_fx.compose.microbatch import MicrobatchFrontier, compose_microbatch
from kareus_fx.plan.graph_workload import PartitionedGraph, SequentialGraph
from kareus_fx.workload import Measurement, PartitionConfig, SequenceProfiler

__all__ = [
    "BASELINES",
    "METHODS",
    "SequenceProfiler",
    "as_options",
    "kareus_microbatch_frontier",
    "nanobatching_config",
    "nanobatching_measurements",
    "sequential_measurements",
]

METHODS = ("megatron", "megatron+perseus", "nanobatching", "nanobatching+perseus", "kareus")
BASELINES = METHODS[:-1]

ConfigPoints = Sequence[tuple[PartitionConfig, Measurement]]


def _prefetch(profiler: object, **batch: object) -> None:
    """Hand a profiler that measures batches in parallel (``prefetch``) the whole batch first."""
    prefetch = getattr(profiler, "prefetch", None)
    if prefetch is not None:
        prefetch(**batch)


def sequential_measurements(
    profiler: SequenceProfiler, graph: SequentialGraph, clocks_mhz: Sequence[int]
) -> dict[int, Measurement]:
    """Per clock, the graph run op after op (the Megatron-LM microbatch, or leftovers)."""
    _prefetch(profiler, sequences=[(graph.ops, graph.collectives, c) for c in clocks_mhz])
    return {c: profiler.measure_sequence(graph.ops, graph.collectives, c) for c in clocks_mhz}


def nanobatching_config(clock_mhz: int, default_comm_sms: int) -> PartitionConfig:
    """The nanobatching baseline's schedule of every partition: collective first, default SMs, NCCL."""
    return PartitionConfig(clock_mhz=clock_mhz, comm_sms=default_comm_sms, launch_slot=0, comm_library="nccl")


def nanobatching_measurements(
    profiler: SequenceProfiler,
    graph: PartitionedGraph,
    outside: Mapping[int, Measurement],
    default_comm_sms: int,
) -> tuple[dict[int, Measurement], dict[str, list[tuple[PartitionConfig, Measurement]]]]:
    """Per clock of ``outside``, the nanobatched microbatch with collectives as soon as possible.

    Also returns, per partition type, the measured ``(config, measurement)`` points (Kareus reuses
    them as candidates).
    """
    _prefetch(
        profiler, partitions=[(t, nanobatching_config(c, default_comm_sms)) for c in outside for t in graph.ptypes]
    )
    per_type: dict[str, list[tuple[PartitionConfig, Measurement]]] = {t.type_id: [] for t in graph.ptypes}
    totals: dict[int, Measurement] = {}
    for clock, rest in outside.items():
        total = rest
        for ptype in graph.ptypes:
            config = nanobatching_config(clock, default_comm_sms)
            m = profiler.measure(ptype, config)
            per_type[ptype.type_id].append((config, m))
            total = total.plus(m, ptype.count)
        totals[clock] = total
    return totals, per_type


def kareus_microbatch_frontier(
    graph: PartitionedGraph,
    tuned_points: Mapping[str, ConfigPoints],
    outside: Mapping[int, Measurement],
    sequential: Mapping[int, Measurement],
) -> MicrobatchFrontier:
    """The Kareus microbatch frontier of one (stage, instruction); see the module docstring."""
    return compose_microbatch(
        {t.type_id: list(tuned_points[t.type_id]) for t in graph.ptypes},
        {t.type_id: t.count for t in graph.ptypes},
        outside=outside,
        sequential=sequential,
    )


@dataclass(frozen=True)
class ClockKnob:
    """What a baseline option runs: its method and clock."""

    method: str
    clock_mhz: int


def as_options(method: str, by_clock: Mapping[int, Measurement], clocks_mhz: Sequence[int]) -> list[InstructionOption]:
    """``by_clock`` restricted to ``clocks_mhz`` as composer options (knob: method and clock)."""
    return [
        InstructionOption(time_s=by_clock[c].time_s, energy_j=by_clock[c].energy_j, knob=ClockKnob(method, c))
        for c in clocks_mhz
    ]
