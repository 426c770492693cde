"""The profilers the planner measures with, behind the profile database, and the distinct partition
types they tune (one plan type id per structure across every traced graph)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kareus_fx.capture.dump import load_dump
from kareus_fx.cost_models.hardware import canonical_gpu_name
from kareus_fx.cost_models.profile_db import fingerprint
from kareus_fx.cost_models.simulated_profiler import SimulatedProfiler
from kareus_fx.runtime.clock_backends import parse_clock_mode
from kareus_fx.runtime.clock_controller import ClockController
from kareus_fx.runtime.device_profiler import DeviceProfiler, node_tables_from_dump, replay_key
from kareus_fx.runtime.recorded_ops import NodeTable
from kareus_fx.tuner.tune_pool import CachedProfilerFactory
from kareus_fx.workload import GraphName, PartitionType

if TYPE_CHECKING:
    from kareus_fx.plan.request import PlanRequest
    from kareus_fx.plan.stage_tracing import StageGraphs

QUEUE_FILE = "profile-queue.sqlite"
"""The work queue and measurement log beside ``profile.sqlite`` (``cost_models.profile_queue``)."""


@contextlib.contextmanager
def profiler_factory(
    req: PlanRequest, traced: Sequence[StageGraphs], db_path: Path, queue_path: Path | None = None
) -> Iterator[CachedProfilerFactory]:
    """The factory of the request's profiler behind the profile database (keyed by the profiler's
    kind, "simulated" or "cuda-graph", so measurements never mix and a rerun resumes).

    ``cuda``: one :class:`DeviceProfiler` for the whole plan (one GPU, one clock controller opened
    in ``req.clock_mode``), which every factory call returns; it replays the ops of every traced
    graph from their own dump (:func:`replay_tables`), and leaving the block closes it, restoring
    the clock. Each call of a ``cuda`` factory returns that same profiler, so the factory serves
    this process only (``validate_plan_request`` allows one worker). Every measurement made is logged
    in ``queue_path`` (default: ``QUEUE_FILE`` beside the database) for the plan's duplicate count.
    """
    gpu = canonical_gpu_name(req.gpu)
    logged = {"log_path": str(queue_path or db_path.parent / QUEUE_FILE), "run": uuid.uuid4().hex}
    if req.profiler == "simulated":
        yield CachedProfilerFactory(db_path=str(db_path), inner=functools.partial(SimulatedProfiler, gpu), **logged)
        return
    tables = replay_tables(traced)
    device = DeviceProfiler(
        gpu,
        frequency=ClockController.open(parse_clock_mode(req.clock_mode or "real")),
        tables_by_ops=tables,
        min_window_s=req.device_window_s,
    )
    try:
        yield CachedProfilerFactory(db_path=str(db_path), inner=lambda: device, **logged)
    finally:
        device.close()


def replay_tables(traced: Sequence[StageGraphs]) -> dict[str, NodeTable]:
    """Node tables by the :func:`replay_key` of what the planner measures: each partition type's
    ops, the work outside partitions (nanobatched dump) and the un-split microbatch (sequential
    dump), forward and backward of every traced stage. Node names repeat across these dumps;
    keying by the ops measured (names and targets) gives each its own dump's records."""
    tables: dict[str, NodeTable] = {}
    for stage in traced:
        by_dump = {kind: node_tables_from_dump(load_dump(path)) for kind, path in stage.dump_paths.items()}
        for name, graph in stage.sequential.items():
            tables[replay_key(graph.ops)] = by_dump["sequential"][name]
        for name, split in (stage.partitioned or {}).items():
            tables[replay_key(split.outside.ops)] = by_dump["nanobatched"][name]
            for ptype in split.ptypes:
                tables[replay_key(op for slot in ptype.slots for op in slot.ops)] = by_dump["nanobatched"][name]
    return tables


LocalKey = tuple[int, GraphName, str]
"""(index of the traced stage group, graph, the type id the partition pass gave)."""


def distinct_types(
    traced: Sequence[StageGraphs], launch_search: bool = True
) -> tuple[dict[str, PartitionType], dict[LocalKey, str]]:
    """One plan type id (T0, T1, ...) per distinct structure across all traced graphs.

    ``launch_search=False`` leaves each type only launch slot 0 (see ``PlanRequest``)."""
    by_fingerprint: dict[str, str] = {}
    ptypes: dict[str, PartitionType] = {}
    local_to_plan: dict[LocalKey, str] = {}
    for g, stage in enumerate(traced):
        for name, graph in sorted((stage.partitioned or {}).items()):
            for ptype in graph.ptypes:
                fp = fingerprint(ptype)
                if fp not in by_fingerprint:
                    plan_id = f"T{len(by_fingerprint)}"
                    by_fingerprint[fp] = plan_id
                    ptypes[plan_id] = dataclasses.replace(ptype, type_id=plan_id)
                    if not launch_search:
                        ptypes[plan_id] = dataclasses.replace(ptypes[plan_id], launch_slots=(0,))
                local_to_plan[(g, name, ptype.type_id)] = by_fingerprint[fp]
    return ptypes, local_to_plan


def simulated_profiler(gpu: str, power_limit_w: int | None) -> SimulatedProfiler:
    """The simulated ``gpu`` under ``power_limit_w`` (None: none); a module-level function, so a
    worker process gets it pickled."""
    return SimulatedProfiler(gpu, power_limit_w=power_limit_w)
