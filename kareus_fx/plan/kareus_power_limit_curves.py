"""Kareus's own power-limit frontier: its max-throughput schedule under each job-wide power limit.

Where a cluster forbids locking clocks but allows power limits, Kareus still
controls what a clock lock does not: the nanobatch split, each collective's SM count and launch
slot. This prices Kareus's max-throughput point's schedule (per pipeline instruction and
microbatch, the option that point runs: split or sequential, per partition type's configuration)
with every clock request at the GPU's maximum (no lock: the GPU boosts as far as the limit lets
it) under each limit from the TDP down in Zeus's 25 W steps (:func:`~kareus_fx.plan.power_limit_baseline.limit_grid`).

What differs from a clock point, in the simulated GPU: a clock point locks one clock per
instruction for all its partitions; under a power limit each measured unit throttles on its own
(the simulator's power cap, the same one the planner prices Kareus's options under at the TDP):
every partition (its kernels and its overlapped collective) and the work outside partitions as
one sequence. A compute-bound partition, drawing more than the limit, slows down; a memory-bound
or communication-bound one keeps its clock. So a limit spends a slowdown where it saves the most
power, at the granularity of a partition (milliseconds), finer than the clock grid and finer
than an instruction. (On the simulated A100 at its maximum clock nearly every busy partition
already draws the TDP, so a lower limit throttles them all alike; on the README's plan both curves
lie above Kareus's clock frontier: ``bench/carbon_replay.py`` reports the hull of the union.)

Assumptions: one limit for every GPU of the job; the GPU's power management holds a partition's
average power to the limit (real power management acts over windows of tens of milliseconds, so
on a GPU the throttle would blur across neighbouring partitions: a simulated, not measured,
advantage); the link waits between stages cost the blocking power as in every other method; the
grid stops at the first limit slower than the same schedule un-capped at the lowest tuning clock.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kareus_fx.compose.microbatch import MicrobatchPoint
from kareus_fx.compose.pipeline_schedule import PipelineNode, iteration_energy_j, pipeline_dag, pipeline_makespan_s
from kareus_fx.frameworks.base import BackwardReprice
from kareus_fx.plan.graph_workload import PartitionedGraph, SequentialGraph
from kareus_fx.plan.power_limit_baseline import PowerLimitPoint, limit_grid
from kareus_fx.workload import Measurement, SequenceProfiler

__all__ = ["NodeWork", "kareus_power_limit_curves", "price_option", "schedule_iteration"]


@dataclass(frozen=True)
class NodeWork:
    """One pipeline instruction of the schedule: the option it runs and the graphs that option runs."""

    option: MicrobatchPoint
    sequential: SequentialGraph
    """The instruction's un-split graph (run when ``option`` is sequential)."""
    partitioned: PartitionedGraph | None
    """Its nanobatched graph, partition types named as ``option.configs`` names them."""
    wait_s: float
    """The link wait the planner adds to the instruction (a send at the blocking power)."""
    sequential_reprice: BackwardReprice | None = None
    """How the training framework runs the un-split graph (``frameworks.base.BackwardReprice``), as the planner prices it."""
    outside_reprice: BackwardReprice | None = None
    """The same for the work outside partitions."""


def price_option(profiler: SequenceProfiler, work: NodeWork, clock_mhz: int, blocking_power_w: float) -> Measurement:
    """``work``'s option with every clock request at ``clock_mhz`` on ``profiler`` (under its
    power limit, if it has one), as the planner prices an option: the work outside partitions as
    one sequence plus each partition type ``count`` times; the link wait at the blocking power."""
    return _price_graphs(profiler, work, clock_mhz).with_link_wait(work.wait_s, blocking_power_w)


def _price_graphs(profiler: SequenceProfiler, work: NodeWork, clock_mhz: int) -> Measurement:
    """``work``'s option on ``profiler`` without its link wait (:func:`price_option`)."""
    option = work.option
    if option.configs is None:
        return _sequence(profiler, work.sequential, work.sequential_reprice, clock_mhz)
    if work.partitioned is None:
        raise ValueError("a nanobatched option needs its partitioned graph")
    total = _sequence(profiler, work.partitioned.outside, work.outside_reprice, clock_mhz)
    for ptype in work.partitioned.ptypes:
        config = dataclasses.replace(option.config_for(ptype.type_id), clock_mhz=clock_mhz)
        total = total.plus(profiler.measure(ptype, config), ptype.count)
    return total


def _sequence(
    profiler: SequenceProfiler, graph: SequentialGraph, reprice: BackwardReprice | None, clock_mhz: int
) -> Measurement:
    """``graph`` run op after op on ``profiler``, repriced as the framework runs it (``reprice``)
    on the profiler's simulator where it has one."""
    measured = {clock_mhz: profiler.measure_sequence(graph.ops, graph.collectives, clock_mhz)}
    simulator = getattr(profiler, "simulator", None)
    if reprice is None or simulator is None:
        return measured[clock_mhz]
    return reprice.reprice(measured, graph, simulator)[clock_mhz]


def schedule_iteration(
    costs: Mapping[PipelineNode, Measurement],
    pp: int,
    microbatches: int,
    blocking_power_w: float,
    energy_scale: float,
    virtual_stages: int = 1,
) -> tuple[float, float]:
    """(time_s, energy_j) of the 1F1B (interleaved over ``virtual_stages``) iteration whose every
    instruction costs ``costs[node]``: the critical path, and every GPU at the blocking power when
    idle (the composer's accounting), times ``energy_scale`` (the plan's ranks per traced rank)."""
    dag = pipeline_dag(pp, microbatches, virtual_stages)  # built once per size (compose/pipeline_schedule.py)
    time_s = pipeline_makespan_s(pp, microbatches, virtual_stages, lambda node: costs[node].time_s)
    busy_s = sum(costs[node].time_s for node in dag)
    busy_j = sum(costs[node].energy_j for node in dag)
    return time_s, energy_scale * iteration_energy_j(pp, time_s, busy_s, busy_j, blocking_power_w)


def kareus_power_limit_curves(
    schedule: Mapping[PipelineNode, NodeWork],
    profiler_at: Callable[[int | None], SequenceProfiler],
    *,
    lock_modes: Sequence[bool],
    tdp_w: float,
    max_clock_mhz: int,
    lowest_clock_mhz: int,
    pp: int,
    microbatches: int,
    blocking_power_w: float,
    energy_scale: float,
    virtual_stages: int = 1,
) -> dict[bool, list[PowerLimitPoint]]:
    """``schedule`` (every instruction of the iteration) under each power limit (module
    docstring), one curve per ``lock_clocks`` in ``lock_modes``: every clock request at
    ``max_clock_mhz`` (``False``, clocks unlocked: the power-limit deploy mode), or each instruction
    at its option's clock with the limit on top (``True``). ``profiler_at(limit_w)`` prices under
    that limit (None: no limit). Equal to one call per mode; the un-capped floor (the same for
    both) is priced once. Each curve prices on
    profilers of its own, as a separate call does: the simulated GPU caches a throttled clock
    per schedule and reuses it for other requested clocks, so pricing one limit's locked clocks
    after its maximum clock moved the locked curve's times by up to 7e-5 (relative) on the 70B
    PP10 x 128 plan."""

    def iteration_at(limit_w: int | None, clock_mhz: int | None) -> tuple[float, float]:
        profiler = profiler_at(limit_w)
        # Priced once per graph, option and clock: the stages of one distinct stage share their
        # graph objects (``sequential``; ``partitioned`` follows from it), only the wait differs.
        graphs: dict[tuple[int, object, int], Measurement] = {}
        priced: dict[tuple[int, str, object, int], Measurement] = {}
        costs: dict[PipelineNode, Measurement] = {}
        for node, work in schedule.items():
            clock = work.option.clock_mhz if clock_mhz is None else clock_mhz
            key = (node.stage, node.instruction, work.option.configs, clock)
            if key not in priced:
                shared = (id(work.sequential), work.option.configs, clock)
                if shared not in graphs:
                    graphs[shared] = _price_graphs(profiler, work, clock)
                priced[key] = graphs[shared].with_link_wait(work.wait_s, blocking_power_w)
            costs[node] = priced[key]
        return schedule_iteration(costs, pp, microbatches, blocking_power_w, energy_scale, virtual_stages)

    floor_s, _ = iteration_at(None, lowest_clock_mhz)

    def curve(lock_clocks: bool) -> list[PowerLimitPoint]:
        requested = None if lock_clocks else max_clock_mhz
        return limit_grid(lambda limit_w: iteration_at(limit_w, requested), tdp_w=tdp_w, floor_time_s=floor_s)

    return {lock: curve(lock) for lock in lock_modes}
