"""``kareus plan``: trace, partition, tune, compose and compare, end to end (docs/design.md steps 1-6).

1. Trace every distinct pipeline stage on the meta device under the ``fake`` process group, once
   with Dynamo, and compile the graph twice (``tracing.trace_both_splits``): nanobatched (partition
   types, work outside partitions) and un-split (the sequential microbatch of Megatron-LM and of
   execution-model switching). A stage of more than 5 layers is
   traced as two slices of its layers (2 and 3 layers, nanobatched and un-split) and extended to its
   layer count (``layer_slice.py``); ``full_trace`` traces every layer. The traces are
   independent: they run at once, one process per core (``capture.trace_pool``).
2. Tune each distinct partition type once (types of different stages with the same structure
   share one tuning run) with multi-objective Bayesian optimisation; every measurement goes
   through the profile database in the output directory, so a killed run resumes.
3. Measure the baselines' microbatches on the same profiler (``methods.py``), as the request's
   training framework runs them (``kareus_fx.frameworks``: its backward repricing, sends and step
   tail), lengthen every instruction that ends with a pipeline send by that send (the stage's
   output activation, or its gradient, over NVLink or the node network, at the blocking power;
   every method alike), compose each method's microbatch options into an iteration frontier over
   the 1F1B pipeline (lowtime), and compute the paper's metrics (``metrics.py``).
4. Build the plan (``plan_format.py``).

Assumptions: every rank of a stage costs what the traced rank (rank 0 of the tensor- and
context-parallel group) costs, so a pipeline's energy is ``tp x cp`` times the traced GPUs'. With
the simulated profiler every time and energy is a cost-model prediction; with ``cuda`` it is
measured on this process's GPU (``runtime.device_profiler``: recorded ops replayed, each collective
a local SM-limited reduce without link time).
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kareus_fx.capture.dump import load_dump
from kareus_fx.compose.iteration import IterationFrontier
from kareus_fx.cost_models.hardware import canonical_gpu_name, gpu_spec
from kareus_fx.cost_models.profile_queue import ProfileQueue
from kareus_fx.cost_models.run_calibration import apply_run_calibration, fit_run_calibration
from kareus_fx.plan.composition import compose_methods
from kareus_fx.plan.plan_data import plan_data
from kareus_fx.plan.profilers import QUEUE_FILE, distinct_types, profiler_factory
from kareus_fx.plan.profiling_cost import MeasurementLedger, ProfilingCost
from kareus_fx.plan.request import PlanRequest, validate_plan_request, validate_tuning_request
from kareus_fx.plan.stage_tracing import LoadedDumps, StageGraphs, backward_repricing, trace_plan_stages
from kareus_fx.tuner.mbo import MBOSettings
from kareus_fx.tuner.tune_pool import tune_partition_types

__all__ = [
    "PlanOutcome",
    "PlanRequest",
    "make_plan",
    "plan_traced",
]


@dataclass
class PlanOutcome:
    """The plan and how long each phase took."""

    data: dict[str, Any]
    wall_s: dict[str, float] = field(default_factory=dict)
    iteration: dict[str, IterationFrontier] = field(default_factory=dict)


def make_plan(req: PlanRequest, work_dir: str | Path | None = None, *, progress: bool = True) -> PlanOutcome:
    """Plan ``req`` (see the module docstring). ``work_dir`` keeps the dumps and the profile
    database (a rerun resumes from it); None uses a temporary directory."""
    validate_plan_request(req)
    started = time.perf_counter()
    wall: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="kareus-plan-") as tmp:
        work = Path(work_dir) if work_dir is not None else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        load = LoadedDumps()
        req, traced = trace_plan_stages(req, work / "dumps", load)
        wall["trace_s"] = time.perf_counter() - t0
        outcome = plan_traced(req, traced, work, progress=progress, load=load)
    outcome.wall_s = {**wall, **outcome.wall_s, "total_s": time.perf_counter() - started}
    outcome.data["wall_s"] = outcome.wall_s
    return outcome


def plan_traced(
    req: PlanRequest,
    traced: Sequence[StageGraphs],
    work_dir: str | Path,
    *,
    progress: bool = True,
    profiler: Any | None = None,
    groups: int = 1,
    device: str | None = None,
    load: Callable[[Path], Mapping[str, Any]] = load_dump,
) -> PlanOutcome:
    """Steps 2-4 of the module docstring on graphs already traced (``traced``: one entry per
    distinct stage, covering stages 0..pp-1). ``work_dir`` keeps the profile database.

    ``profiler``: one that keeps its own database and measures with ``groups`` parallel groups of
    ``tp x cp`` devices (the distributed profilers, ``distributed_plan.py``; ``device`` says what
    measured); None builds the request's profiler. ``load`` reads a dump (the tracing step's
    :class:`~kareus_fx.plan.stage_tracing.LoadedDumps` serves the dumps it already read)."""
    validate_tuning_request(req)
    repricing = backward_repricing(req, traced, load)
    started = time.perf_counter()
    wall: dict[str, float] = {}
    t0 = time.perf_counter()
    ptypes, local_to_plan = distinct_types(traced, req.launch_search)
    ledger = MeasurementLedger()
    queue_path = Path(work_dir) / QUEUE_FILE
    given = contextlib.nullcontext(lambda: profiler) if profiler is not None else None
    with given or profiler_factory(req, traced, Path(work_dir) / "profile.sqlite", queue_path) as factory:
        settings = _tuning_settings(req)
        tuned = tune_partition_types(
            list(ptypes.values()), factory, settings=settings, seed=req.seed, workers=req.workers, progress=progress
        )
        ledger.add_tuning(ptypes, tuned)
        wall["tune_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        composing = ledger.wrap(factory())
        composed = compose_methods(req, traced, repricing, ptypes, local_to_plan, tuned, composing, progress)
        wall["compose_s"] = time.perf_counter() - t0
    wall["total_s"] = time.perf_counter() - started
    data = plan_data(req, traced, ptypes, local_to_plan, tuned, composed, composing.kind, wall, device)
    if req.calibrate_from:
        data = apply_run_calibration(data, fit_run_calibration(req.calibrate_from))
    with ProfileQueue(queue_path) as log:
        data["profiling"] = _profiling_cost(req, ledger, log.duplicates(), groups, device).to_dict()
    return PlanOutcome(data=data, wall_s=wall, iteration=composed.iteration)


def _tuning_settings(req: PlanRequest) -> MBOSettings:
    """The tuner's settings: the request's clock stride; with ``max_clock_only`` the maximum clock
    alone, and no cap on the measured share of that space: it is ``clocks`` times smaller than the
    full one, so the size class's budget stays within what the capped full tuning measures."""
    if not req.max_clock_only:
        return MBOSettings(clock_stride_mhz=req.clock_stride_mhz)
    top = gpu_spec(canonical_gpu_name(req.gpu)).clock_max_mhz
    return MBOSettings(clock_stride_mhz=req.clock_stride_mhz, supported_clocks_mhz=(top,), max_fraction=None)


def _profiling_cost(
    req: PlanRequest, ledger: MeasurementLedger, duplicates: int, groups: int, device: str | None
) -> ProfilingCost:
    """The plan's ``profiling`` record: ``groups`` groups of ``--gpu`` GPUs, each a stage's TP x CP grid
    (with its expert-parallel replicas) (``profiling_cost.py``)."""
    gpu = canonical_gpu_name(req.gpu)
    if device is None:
        device = (
            f"estimate for one group of {req.stage_group_size} {gpu} GPUs; the measurements are cost-model predictions"
            if req.profiler == "simulated"
            else f"this process's {gpu} GPU"
        )
    return ProfilingCost(
        measurements=len(ledger),
        duplicates=duplicates,
        groups=groups,
        gpus_per_group=req.stage_group_size,
        window_s=req.device_window_s,
        device=device,
        by_purpose=ledger.by_purpose(),
    )
