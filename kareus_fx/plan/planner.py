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
3. Measure the baselines' microbatches on the same profiler (``methods.py``), lengthen every
   instruction that ends with a pipeline send by that send (``stage_transfer.py``: the stage's
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
import dataclasses
import functools
import json
import os
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kareus_fx import __version__
from kareus_fx.capture.dump import load_dump
from kareus_fx.capture.trace_pool import run_calls, start_method
from kareus_fx.capture.tracing import TraceSpec, distinct_stages, trace_both_splits, validate_trace_spec
from kareus_fx.compose.iteration import (
    DEFAULT_UNIT_TIME_S,
    IterationFrontier,
    choose_unit_time_s,
    count_solver_steps,
)
from kareus_fx.compose.microbatch import MicrobatchFrontier, MicrobatchPoint, pareto_front
from kareus_fx.compose.pipeline_schedule import INSTRUCTIONS, CompositionError, PipelineNode, check_interleaving
from kareus_fx.compose.slack import with_reclaimed_fastest
from kareus_fx.compose.solve_pool import compose_iterations
from kareus_fx.cost_models.hardware import DEFAULT_GPU, GPUSpec, canonical_gpu_name, gpu_spec
from kareus_fx.cost_models.profile_db import fingerprint
from kareus_fx.cost_models.profile_queue import ProfileQueue
from kareus_fx.cost_models.run_calibration import apply_run_calibration, fit_run_calibration
from kareus_fx.cost_models.sim_params import gpu_params
from kareus_fx.cost_models.simulated_profiler import SimulatedProfiler
from kareus_fx.cost_models.simulator import Simulator
from kareus_fx.errors import OptionsError, ParallelConfigError, UnsupportedGraphError
from kareus_fx.models.configs import ModelConfig, get_config
from kareus_fx.models.stage_layers import StageRole, even_layer_counts, stage_role
from kareus_fx.plan.async_dgrad import AsyncDgrad, async_dgrad_split, with_async_dgrad
from kareus_fx.plan.dropout_traffic import dropout_ops
from kareus_fx.plan.graph_workload import (
    PartitionedGraph,
    SequentialGraph,
    graph_fingerprint,
    partitioned_graphs,
    sequential_graphs,
    with_extra_ops,
)
from kareus_fx.plan.kareus_power_limit_curves import NodeWork, kareus_power_limit_curves
from kareus_fx.plan.layer_slice import SLICE_LAYERS, SliceNotRepresentativeError, block_dump, extend_dump, slice_pays
from kareus_fx.plan.main_grad_traffic import main_grad_ops
from kareus_fx.plan.methods import (
    BASELINES,
    METHODS,
    as_options,
    kareus_microbatch_frontier,
    nanobatching_config,
    nanobatching_measurements,
    sequential_measurements,
)
from kareus_fx.plan.metrics import frontier_metrics
from kareus_fx.plan.plan_format import PLAN_FORMAT, PLAN_SCHEMA_VERSION, instruction_key
from kareus_fx.plan.power_limit_baseline import (
    POWER_LIMIT_METHOD,
    PowerLimitPoint,
    iteration_of,
    power_limit_curve,
    zeus_choice,
)
from kareus_fx.plan.presets import Preset, get_preset
from kareus_fx.plan.profiling_cost import MeasurementLedger, ProfilingCost
from kareus_fx.plan.stage_balance import StageCost, balanced_layer_counts, cost_from_slices
from kareus_fx.plan.stage_transfer import boundary_bytes, stage_transfer_s
from kareus_fx.plan.step_tail import StepTail, stage_parameters, step_tail, with_step_tail
from kareus_fx.plan.testbed_config import HF_DEFAULTS, MegatronSettings
from kareus_fx.runtime.clock_backends import parse_clock_mode
from kareus_fx.runtime.clock_controller import ClockController
from kareus_fx.runtime.device_profiler import DeviceProfiler, node_tables_from_dump, replay_key
from kareus_fx.runtime.recorded_ops import NodeTable
from kareus_fx.tuner.mbo import MBOSettings, TuningResult
from kareus_fx.tuner.space import DEFAULT_CLOCK_STRIDE_MHZ, clock_grid_mhz
from kareus_fx.tuner.tune_pool import CachedProfilerFactory, tune_partition_types
from kareus_fx.workload import GraphName, Measurement, OpCost, PartitionType

__all__ = [
    "LIVE_GRAPH_MODEL",
    "PlanOutcome",
    "PlanRequest",
    "StageGraphs",
    "make_plan",
    "plan_request_from_preset",
    "plan_traced",
    "stage_graphs_from_dumps",
    "validate_plan_request",
    "validate_tuning_request",
]

PROFILERS = ("simulated", "cuda", "cpu-replay")
DISTRIBUTED_PROFILERS = ("cpu-replay", "cuda")
"""Profilers that run over torch.distributed (``distributed_plan.py``); cuda also on one GPU alone."""
QUEUE_FILE = "profile-queue.sqlite"
"""The work queue and measurement log beside ``profile.sqlite`` (``cost_models.profile_queue``)."""
LIVE_GRAPH_MODEL = "live-graph"
"""``PlanRequest.model`` of a plan made from a live graph (``kareus_fx.plan.live_tuning``): no reference
model, so its layer count is unknown (``workload.layers`` is null)."""
CLOCK_MODES = ("real", "dry-run")
"""Clock modes of ``--profiler cuda``: lock each measured configuration's clock (``real``), or
leave the card's clock alone and only record the requests (``dry-run``)."""
DEFAULT_DEVICE_WINDOW_S = 5.0
MIN_DEVICE_WINDOW_S = 1.0
"""Energy windows of ``--profiler cuda`` (``--device-window``): the issue's 5 s by default; below
1 s NVML's ~100 ms counter update is more than a tenth of the window."""
STAGE_SPLITS = ("even", "balanced")
"""The named ``--stage-layers`` rules (see :attr:`PlanRequest.stage_layers`)."""
MAX_SOLVER_STEPS = 500
"""Iteration-frontier solver steps per method on the largest pipelines (at least
``SOLVER_NODE_STEPS`` nodes / 500): the time quantum, the same for every method, grows from
Perseus's 1 ms (or a quarter of the shortest instruction, if shorter) until every method's solve
fits (see compose.iteration, :func:`composition_quantum`); :func:`solver_steps` raises it for a
pipeline where 500 steps would need a quantum above half its shortest instruction."""
SOLVER_NODE_STEPS = 160_000
"""The solve's work bound, steps x pipeline nodes (:func:`solver_step_cap`): 500 steps at 320 nodes
(Llama 3.3 70B PP10 x 16 microbatches), up to ``FINE_SOLVER_STEPS`` on smaller pipelines, which
also solve from a finer floor, ``FINE_UNIT_TIME_S``. The testbed presets (2 stages x 8
microbatches, 32 nodes) then solve at 0.5 ms, where 500 steps coarsened them to 1.4-2.8 ms
(``bench/compose_resolution.py``)."""
FINE_SOLVER_STEPS = 4000
"""The most solver steps per method on a small pipeline (:func:`solver_step_cap`)."""
FINE_UNIT_TIME_S = 0.5e-3
"""The finest quantum of a pipeline allowed more than ``MAX_SOLVER_STEPS`` steps (half Perseus's
1 ms): on Qwen TP8 mbs16, CP2 x TP4 mbs16 and TP8 mbs8 its iso metrics lie within 0.15 pp of a
0.25 ms solve, where 1 ms left them up to 0.66 pp off and 500 steps (1.4-2.8 ms) up to 0.50 pp
(``bench/compose_resolution.py``; the solver is a heuristic, so coarser is not monotonically
worse)."""
PARALLEL_COMPOSE_MIN_NODES = 1000
"""Pipelines of at least this many (stage, instruction, microbatch) nodes compose the methods'
frontiers in parallel processes (``compose.solve_pool``; PP10 x 128 microbatches has 2560): a
solve there takes seconds to minutes per method, against about a second to start a process."""


@dataclass(frozen=True)
class PlanRequest:
    """What to plan: the workload, the GPU and how to tune."""

    model: str
    tp: int
    cp: int
    pp: int
    microbatches: int
    mbs: int
    seq: int
    layers: int | None = None
    gpu: str = DEFAULT_GPU
    profiler: str = "simulated"
    seed: int = 0
    clock_stride_mhz: int = DEFAULT_CLOCK_STRIDE_MHZ
    workers: int = 1
    preset: str | None = None
    dtype: str = "bfloat16"
    """Parameter and activation dtype of the traced model (a torch dtype name)."""
    launch_search: bool = True
    """False restricts every partition to launching its collective first (slot 0): an ablation
    that searches only clocks and SM counts (used to check that ``kareus bench`` catches it)."""
    clock_mode: str | None = None
    """``--profiler cuda`` only (see ``CLOCK_MODES``); None means ``real``."""
    device_window_s: float = DEFAULT_DEVICE_WINDOW_S
    """``--profiler cuda`` only: the least energy window of one measurement (NVML's energy counter
    updates about every 100 ms; 5 s keeps its error near 2 %)."""
    max_clock_only: bool = False
    """Kareus without frequency scaling (``--max-clock-only``, paper section 6.4): every microbatch
    runs at the GPU's maximum clock; only the kernel schedule (collective SMs, launch slot,
    execution-model switching) is tuned, at that clock. For a user who may not lock clocks: the
    plan says so (``max_clock_only`` in plan.json) and deployment requests no clock. The
    baselines are still composed at every clock (they are the plan's comparison)."""
    exact_min_cut: bool = False
    """Compose with lowtime's own min-cut (``--exact-min-cut``, the reference) instead of SciPy's
    Dinic (``compose.solver_loop``: the same cut up to lowtime's FP_ERROR tolerance)."""
    full_trace: bool = False
    """Trace every layer of each stage (``--full-trace``) instead of a slice extended to the stage's
    layer count (``layer_slice.py``). ``--profiler cuda`` always traces in full: it replays the
    dumps' recorded ops."""
    stage_layers: str | tuple[int, ...] = "even"
    """How the pipeline's stages split the decoder layers (``--stage-layers``): ``"even"`` (Megatron-LM's
    default), ``"balanced"`` (the split that evens out the stages' step times on the simulated GPU;
    ``stage_balance.py``; the emulation presets' default; the testbed presets give the artifact's
    15 + 13, ``testbed_config.py``) or one count per stage. :func:`trace_plan_stages`
    resolves ``"balanced"`` to counts."""
    recompute: str = "none"
    """Activation checkpointing of the traced model (``--recompute``): ``"none"``, ``"full"`` (every
    decoder layer, Megatron-LM's full recompute; the presets' default, as the paper's testbed) or
    ``"selective"`` (core attention, Megatron-LM's selective recompute); see
    ``kareus_fx.models.recompute``. The backward graph then holds the recomputed forward."""
    dp: int = 1
    """Data-parallel replicas of the pipeline (``--dp``): each runs the same plan on its own data, so
    the plan's energies are ``dp`` times one pipeline's; times are one replica's (data-parallel
    gradient collectives, which the plan does not schedule, are outside it)."""
    virtual_stages: int = 1
    """Model chunks per GPU (``--virtual-stages``): above 1 the pipeline runs interleaved 1F1B
    (``compose.pipeline_schedule``) over ``pp x virtual_stages`` global stages, GPU ``r`` holding stages ``r,
    r + pp, ...``; every stage-indexed field (``stage_layers``, the plan's ``stages``) counts global stages."""

    megatron: MegatronSettings = HF_DEFAULTS
    """Training settings outside the traced model that the plan prices (``testbed_config.py``):
    tied embeddings, distributed optimizer (``step_tail.py``), dropout (``dropout_traffic.py``).
    The testbed presets carry the paper's artifact's; otherwise the traced model's tying, no
    distributed optimizer, no dropout."""

    calibrate_from: tuple[str, ...] = ()
    """Run logs (``--calibrate-from``, ``deploy/run_log.py``) whose measured over predicted medians
    rescale every price of the plan (``cost_models/run_calibration.py``); empty: the simulator's own."""

    compile_unit: str = "stage"
    """What the job compiles as one graph (``--compile-unit``): the whole stage (``"stage"``:
    ``torch.compile(stage_module)``) or each decoder layer (``"block"``: torchtitan's per-block
    compile, ``integrations.torchtitan.compile_blocks``). A block plan's graphs are one block's
    forward and backward (what deployment checks a live graph against); a stage costs its layer
    count times the block (``block_dump``), and the embedding, final norm, LM head and loss,
    which run un-compiled around the blocks, are not priced."""

    @property
    def world_size(self) -> int:
        """GPUs of one pipeline (tp x cp x pp); the job has ``dp`` times as many."""
        return self.tp * self.cp * self.pp

    @property
    def num_stages(self) -> int:
        """Global pipeline stages (model chunks): ``pp x virtual_stages``."""
        return self.pp * self.virtual_stages

    def trace_spec(self, stage: int = 0) -> TraceSpec:
        """The trace of stage ``stage``: an unresolved ``"balanced"`` split traces as the even one."""
        counts = self.stage_layers if isinstance(self.stage_layers, tuple) else None
        return TraceSpec(
            model=self.model,
            tp=self.tp,
            cp=self.cp,
            mbs=self.mbs,
            seq=self.seq,
            layers=self.layers,
            pp=self.num_stages,
            stage=stage,
            dtype=torch_dtype(self.dtype),
            stage_layers=counts,
            recompute=self.recompute,
            compile_unit=self.compile_unit,
        )


def plan_request_from_preset(name: str, **overrides: Any) -> PlanRequest:
    """The request of preset ``name`` (``kareus_fx.plan.presets``), with ``overrides`` applied."""
    p: Preset = get_preset(name)
    fields = {
        "model": p.model,
        "tp": p.tp,
        "cp": p.cp,
        "pp": p.pp,
        "virtual_stages": p.virtual_stages,
        "microbatches": p.microbatches,
        "mbs": p.mbs,
        "seq": p.seq,
        "preset": p.name,
        "stage_layers": p.stage_layers,
        "recompute": p.recompute,
        "dp": p.dp,
        "gpu": p.gpu,
        "megatron": p.megatron,
    }
    return PlanRequest(**{**fields, **overrides})


def validate_plan_request(req: PlanRequest) -> None:
    """Raise a clear error for a request that cannot be planned, before any tracing."""
    validate_tuning_request(req)
    if isinstance(req.dp, bool) or not isinstance(req.dp, int) or req.dp < 1:
        raise ParallelConfigError(f"--dp must be a number of data-parallel replicas (int >= 1), got {req.dp!r}")
    if isinstance(req.stage_layers, str) and req.stage_layers not in STAGE_SPLITS:
        raise ParallelConfigError(
            f"--stage-layers must be {' or '.join(STAGE_SPLITS)} or one layer count per "
            f"stage (e.g. 15,13), got {req.stage_layers!r}"
        )
    validate_trace_spec(req.trace_spec())  # model, tp/cp divisibility, seq, layers, pp, stage layers, unit
    if req.compile_unit == "block":
        _validate_block_request(req)


def _validate_block_request(req: PlanRequest) -> None:
    """``--compile-unit block``: what a plan of one compiled block can price (``block_dump``)."""
    refused = [
        (req.profiler != "simulated", f"--profiler {req.profiler} (it replays a whole stage's recorded ops)"),
        (req.recompute != "none", f"--recompute {req.recompute} (the checkpoint wraps the block from outside)"),
        (req.stage_layers == "balanced", "--stage-layers balanced (it prices the stages' slices)"),
    ]
    for refuse, what in refused:
        if refuse:
            raise OptionsError(
                f"--compile-unit block plans one compiled block, which does not support {what}; drop that "
                f"option (--profiler simulated, --recompute none, --stage-layers even or counts) or plan "
                f"--compile-unit stage"
            )


def validate_tuning_request(req: PlanRequest) -> None:
    """The checks that do not depend on tracing a reference model (also for live graphs)."""
    canonical_gpu_name(req.gpu)  # unknown GPU -> error listing the known ones
    if req.profiler not in PROFILERS:
        raise OptionsError(f"--profiler must be one of {', '.join(PROFILERS)}, got {req.profiler!r}")
    if req.profiler == "cuda":
        _validate_cuda_request(req)
    elif req.profiler == "cpu-replay" and req.workers != 1:
        raise OptionsError(
            f"--profiler cpu-replay measures with its process groups (--nproc or torchrun), not "
            f"tuning workers: use --workers 1 (got --workers {req.workers})"
        )
    elif req.clock_mode is not None:
        raise OptionsError(
            f"--clock-mode applies to --profiler cuda only (the {req.profiler} profiler sets no GPU clock); "
            "drop --clock-mode or add --profiler cuda"
        )
    elif req.device_window_s != DEFAULT_DEVICE_WINDOW_S:
        raise OptionsError(
            f"--device-window applies to --profiler cuda only (the {req.profiler} profiler reads no energy "
            "counter); drop --device-window or add --profiler cuda"
        )
    if req.microbatches < 1:
        raise ParallelConfigError(f"--microbatches must be a positive integer, got {req.microbatches}")
    if req.microbatches < req.pp:
        raise ParallelConfigError(
            f"{req.microbatches} microbatches cannot fill a {req.pp}-stage 1F1B pipeline (every stage "
            f"needs a microbatch in flight); use --microbatches >= {req.pp} or a smaller --pp"
        )
    try:
        check_interleaving(req.pp, req.virtual_stages, req.microbatches)
    except CompositionError as err:
        raise ParallelConfigError(f"--virtual-stages {req.virtual_stages}: {err}") from None
    torch_dtype(req.dtype)
    if req.workers < 1 or req.clock_stride_mhz < 1:
        raise OptionsError("--workers and --clock-stride must be positive integers")
    if req.max_clock_only and req.clock_stride_mhz != DEFAULT_CLOCK_STRIDE_MHZ:
        raise OptionsError(
            f"--clock-stride sets the clocks Kareus tunes, but --max-clock-only tunes at the maximum clock "
            f"only: drop --clock-stride (got {req.clock_stride_mhz}) or --max-clock-only"
        )


def _validate_cuda_request(req: PlanRequest) -> None:
    """``--profiler cuda``: one process measuring on this machine's CUDA GPU, the one ``--gpu`` names."""
    if req.clock_mode is not None and req.clock_mode not in CLOCK_MODES:
        raise OptionsError(f"--clock-mode must be one of {', '.join(CLOCK_MODES)}, got {req.clock_mode!r}")
    if req.workers != 1:
        raise OptionsError(
            f"--profiler cuda measures on one GPU, one configuration at a time: use --workers 1 "
            f"(got --workers {req.workers})"
        )
    if not req.device_window_s >= MIN_DEVICE_WINDOW_S:
        raise OptionsError(
            f"--device-window must be at least {MIN_DEVICE_WINDOW_S:g} s (NVML's energy counter updates about "
            f"every 100 ms, so a shorter window reads energy with an error above 10 %), got {req.device_window_s:g}"
        )
    if not torch.cuda.is_available():
        raise OptionsError(
            "--profiler cuda measures on-device and needs a CUDA GPU, but this machine has none "
            "(torch.cuda.is_available() is False): plan here with --profiler simulated, or run "
            "kareus plan --profiler cuda on the GPU node"
        )
    family = canonical_gpu_name(req.gpu).split("-")[0]
    device = torch.cuda.get_device_name(0)
    if family not in device:
        raise OptionsError(
            f"--gpu {req.gpu} is a {family}, but this process's GPU is {device!r}: pass the --gpu of the "
            f"card that measures (e.g. --gpu h100), or select it with CUDA_VISIBLE_DEVICES"
        )


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype called ``name`` ("bfloat16", "float16", "float32")."""
    dtype = getattr(torch, name, None) if name in ("bfloat16", "float16", "float32") else None
    if dtype is None:
        raise OptionsError(f"dtype must be bfloat16, float16 or float32, got {name!r}")
    return dtype


@dataclass(frozen=True)
class StageGraphs:
    """One traced stage's forward and backward: un-split, and nanobatched when it partitions."""

    stages: tuple[int, ...]
    sequential: Mapping[GraphName, SequentialGraph]
    partitioned: Mapping[GraphName, PartitionedGraph] | None
    dump_paths: Mapping[str, Path] = field(default_factory=dict)
    """The dumps the graphs come from, by "nanobatched" / "sequential" (the on-device profiler
    replays their recorded ops)."""
    sent_bytes: float | None = None
    """Bytes of the activation the stage sends on to the next (``stage_transfer.boundary_bytes``)."""
    async_dgrad: Mapping[str, AsyncDgrad | None] = field(default_factory=dict)
    """The backward's asynchronous input-gradient all-reduces (``async_dgrad.py``), by
    "sequential" (the un-split microbatch) and "outside" (the work outside partitions)."""


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
        req, traced = trace_plan_stages(req, work / "dumps")
        wall["trace_s"] = time.perf_counter() - t0
        outcome = plan_traced(req, traced, work, progress=progress)
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
) -> PlanOutcome:
    """Steps 2-4 of the module docstring on graphs already traced (``traced``: one entry per
    distinct stage, covering stages 0..pp-1). ``work_dir`` keeps the profile database.

    ``profiler``: one that keeps its own database and measures with ``groups`` parallel groups of
    ``tp x cp`` devices (the distributed profilers, ``distributed_plan.py``; ``device`` says what
    measured); None builds the request's profiler."""
    validate_tuning_request(req)
    traced = engine_stage_graphs(req, traced)
    started = time.perf_counter()
    wall: dict[str, float] = {}
    t0 = time.perf_counter()
    ptypes, local_to_plan = _distinct_types(traced, req.launch_search)
    ledger = MeasurementLedger()
    queue_path = Path(work_dir) / QUEUE_FILE
    given = contextlib.nullcontext(lambda: profiler) if profiler is not None else None
    with given or _profiler_factory(req, traced, Path(work_dir) / "profile.sqlite", queue_path) as factory:
        settings = _tuning_settings(req)
        tuned = tune_partition_types(
            list(ptypes.values()), factory, settings=settings, seed=req.seed, workers=req.workers, progress=progress
        )
        ledger.add_tuning(ptypes, tuned)
        wall["tune_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        composing = ledger.wrap(factory())
        composed = _compose_methods(req, traced, ptypes, local_to_plan, tuned, composing, progress)
        wall["compose_s"] = time.perf_counter() - t0
    wall["total_s"] = time.perf_counter() - started
    data = _plan_data(req, traced, ptypes, local_to_plan, tuned, composed, composing.kind, wall, device)
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
    """The plan's ``profiling`` record: ``groups`` TP x CP groups of ``--gpu`` GPUs (``profiling_cost.py``)."""
    gpu = canonical_gpu_name(req.gpu)
    if device is None:
        device = (
            f"estimate for one group of {req.tp * req.cp} {gpu} GPUs; the measurements are cost-model predictions"
            if req.profiler == "simulated"
            else f"this process's {gpu} GPU"
        )
    return ProfilingCost(
        measurements=len(ledger),
        duplicates=duplicates,
        groups=groups,
        gpus_per_group=req.tp * req.cp,
        window_s=req.device_window_s,
        device=device,
        by_purpose=ledger.by_purpose(),
    )


# ----- 1. tracing -------------------------------------------------------------------------------
def trace_plan_stages(req: PlanRequest, dump_root: Path) -> tuple[PlanRequest, list[StageGraphs]]:
    """``req`` with its stage split resolved, and every distinct stage's graphs (:func:`_trace_stages`).

    ``"balanced"`` traces each stage role's slices first (``layer_slice.SLICE_LAYERS``), prices
    them as Megatron-LM runs them on the simulated GPU at its maximum clock and takes the split
    that evens out the stages (``stage_balance.py``); the stages' graphs then extend the same
    slices (or trace the stages in full, where slicing does not apply)."""
    if req.stage_layers != "balanced":
        return req, _with_megatron_traffic(req, _trace_stages(req, dump_root))
    if req.num_stages == 1:
        req = dataclasses.replace(req, stage_layers="even")
        return req, _with_megatron_traffic(req, _trace_stages(req, dump_root))
    first_stage_of_role = {stage_role(i, req.num_stages): i for i in reversed(range(req.num_stages))}
    load = LoadedDumps()
    dumps = _run_traces(
        {
            stage: [_slice_trace(req, stage, layers, dump_root) for layers in SLICE_LAYERS]
            for stage in first_stage_of_role.values()
        }
    )
    role_slices = {role: dumps[stage] for role, stage in first_stage_of_role.items()}
    req = dataclasses.replace(req, stage_layers=_balanced_stage_layers(req, role_slices, load))
    return req, _with_megatron_traffic(req, _trace_stages(req, dump_root, role_slices, load))


def _with_megatron_traffic(req: PlanRequest, traced: list[StageGraphs]) -> list[StageGraphs]:
    """``traced`` with the work of ``req.megatron`` that the traced model does not run, on the
    simulated GPU: hidden dropout's memory traffic (``dropout_traffic.py``) and the unfused
    gradient accumulation (``main_grad_traffic.py``). Unchanged without either, for a measured
    profiler (it replays the traced ops), a live graph or a block plan (no model config or stage
    layer count)."""
    settings = req.megatron
    if (
        (settings.hidden_dropout <= 0.0 and settings.gradient_accumulation_fusion is not False)
        or req.profiler != "simulated"
        or req.model == LIVE_GRAPH_MODEL
        or req.compile_unit == "block"
    ):
        return traced
    cfg = _priced_model_config(req)
    counts = _stage_layer_counts(req)
    params = stage_parameters(cfg, counts, req.tp)
    elements = req.mbs * req.seq / req.cp * cfg.hidden_size
    priced = []
    for graphs in traced:
        stage = graphs.stages[0]
        extra: dict[GraphName, tuple[OpCost, ...]] = {"forward": (), "backward": ()}
        if settings.hidden_dropout > 0.0:
            for g in extra:
                extra[g] += dropout_ops(g, counts[stage], elements, req.recompute)
        if settings.gradient_accumulation_fusion is False:
            extra["backward"] += main_grad_ops(params[stage])
        sequential, partitioned = with_extra_ops(graphs.sequential, graphs.partitioned, extra)
        # the asynchronous-dgrad reprice swaps the backward's sequence for its split: the split runs them too
        async_dgrad = {
            k: None
            if split is None
            else dataclasses.replace(split, rest=with_extra_ops({"backward": split.rest}, None, extra)[0]["backward"])
            for k, split in graphs.async_dgrad.items()
        }
        priced.append(
            dataclasses.replace(graphs, sequential=sequential, partitioned=partitioned, async_dgrad=async_dgrad)
        )
    return priced


def _balanced_stage_layers(
    req: PlanRequest,
    role_slices: Mapping[StageRole, Sequence[Mapping[str, Path]]],
    load: LoadedDumps,
) -> tuple[int, ...]:
    """The balanced split (``stage_balance.py``): each role's cost priced from its un-split slice
    dumps, each stage's plus the pipeline sends it ends with (``stage_transfer.py``)."""
    profiler = SimulatedProfiler(canonical_gpu_name(req.gpu))
    spec = profiler.simulator.spec
    dumps = {role: [load(kinds["sequential"]) for kinds in slices] for role, slices in role_slices.items()}

    def step_s(dump: Mapping[str, Any]) -> float:
        total_s = 0.0
        for name, g in sequential_graphs(dump).items():
            m = {spec.clock_max_mhz: profiler.measure_sequence(g.ops, g.collectives, spec.clock_max_mhz)}
            if name == "backward":
                m = _with_async(req, m, g, async_dgrad_split(_backward_graph(dump)))
            total_s += m[spec.clock_max_mhz].time_s
        return total_s

    role_costs = {
        role: cost_from_slices(step_s(short), step_s(long), SLICE_LAYERS[0]) for role, (short, long) in dumps.items()
    }
    roles = [stage_role(s, req.num_stages) for s in range(req.num_stages)]
    sends = stage_transfer_s([boundary_bytes(dumps[role][0]) for role in roles], req.tp, req.cp, spec, ranks=req.pp)
    return balanced_layer_counts(
        _model_layers(req),
        [
            StageCost(
                role_costs[role].fixed_s + sends[(s, "forward")] + sends[(s, "backward")], role_costs[role].per_layer_s
            )
            for s, role in enumerate(roles)
        ],
    )


def _stage_layer_counts(req: PlanRequest) -> list[int]:
    """Decoder layers per pipeline stage: the request's own list (a named split is resolved to
    one before the stages are traced), else the even split of the model's layers."""
    if isinstance(req.stage_layers, tuple):
        return list(req.stage_layers)
    return even_layer_counts(_model_layers(req), req.num_stages)


def _priced_model_config(req: PlanRequest) -> ModelConfig:
    """The reference model's config with the embedding tying ``req.megatron`` trains
    (``testbed_config.py``; None keeps the config's own)."""
    cfg = get_config(req.model)
    if req.megatron.tie_embeddings is not None:
        cfg = dataclasses.replace(cfg, tie_embeddings=req.megatron.tie_embeddings)
    return cfg


def _model_layers(req: PlanRequest) -> int:
    """The reference model's decoder layer count (``--layers`` or its config's)."""
    return req.layers or get_config(req.model).num_layers


def _trace_stages(
    req: PlanRequest,
    dump_root: Path,
    role_slices: Mapping[StageRole, Sequence[Mapping[str, Path]]] | None = None,
    load: LoadedDumps | None = None,
) -> list[StageGraphs]:
    """Every distinct stage's graphs: its role's slices' traces extended (``layer_slice.py``) or,
    where slicing does not pay, is off, or gives a slice that is not representative (with a
    warning), a full trace. Each role's slices are traced once (``role_slices``: already traced);
    the traces of all stages run at once (``capture.trace_pool``). ``req``'s split is resolved
    (:func:`trace_plan_stages`). ``load`` reads each dump once (:class:`LoadedDumps`)."""
    load = load or LoadedDumps()
    if req.stage_layers == "balanced":
        raise ValueError("a 'balanced' stage split is resolved by trace_plan_stages before tracing the stages")
    if req.compile_unit == "block":
        return _block_stages(req, dump_root)
    role_slices = dict(role_slices or {})
    groups = distinct_stages(req.trace_spec())
    sliced = {
        group.stages[0]
        for group in groups
        if not req.full_trace and req.profiler == "simulated" and slice_pays(group.num_layers)
    }
    slice_at: dict[StageRole, int] = {}
    for group in groups:
        if group.stages[0] in sliced and group.role not in role_slices:
            slice_at.setdefault(group.role, group.stages[0])
    traces = {
        stage: [_slice_trace(req, stage, layers, dump_root) for layers in SLICE_LAYERS] for stage in slice_at.values()
    }
    traces.update(
        {
            group.stages[0]: [_full_trace(req, group.stages[0], dump_root)]
            for group in groups
            if group.stages[0] not in sliced
        }
    )
    dumps = _run_traces(traces)
    role_slices.update({role: dumps[stage] for role, stage in slice_at.items()})
    paths = {group.stages[0]: dumps[group.stages[0]][0] for group in groups if group.stages[0] not in sliced}
    for group in groups:
        stage = group.stages[0]
        if stage not in sliced:
            continue
        try:
            short, long = role_slices[group.role]
            paths[stage] = _extend_slices(stage, group.num_layers, short, long, dump_root, load)
        except SliceNotRepresentativeError as err:
            warnings.warn(f"{err}; tracing all {group.num_layers} layers of stage {stage}", stacklevel=2)
    retraced = _run_traces(
        {
            group.stages[0]: [_full_trace(req, group.stages[0], dump_root)]
            for group in groups
            if group.stages[0] not in paths
        }
    )
    paths.update({stage: stage_dumps[0] for stage, stage_dumps in retraced.items()})
    return [
        stage_graphs_from_dumps(
            tuple(group.stages),
            paths[group.stages[0]]["nanobatched"],
            paths[group.stages[0]]["sequential"],
            boundary=paths[group.stages[0]].get("boundary", paths[group.stages[0]]["sequential"]),
            load=load,
        )
        for group in groups
    ]


def _block_stages(req: PlanRequest, dump_root: Path) -> list[StageGraphs]:
    """Every distinct stage's graphs when each decoder layer is compiled on its own: one trace
    of a block (the last layer of stage 0 with one layer per stage; the layers are identical),
    each stage priced as its layer count of blocks (``layer_slice.block_dump``) and checked
    against the block's own fingerprints."""
    spec = dataclasses.replace(req.trace_spec(0), layers=req.num_stages, stage_layers=None)
    (block,) = _run_traces({0: [_trace(req, spec, dump_root, "block-{kind}")]})[0]
    traced = {kind: load_dump(path) for kind, path in block.items()}
    stages = []
    for group in distinct_stages(req.trace_spec()):
        paths = {}
        for kind, dump in traced.items():
            paths[kind] = dump_root / f"stage{group.stages[0]}-{kind}-blocks.json"
            paths[kind].write_text(json.dumps(block_dump(dump, group.num_layers, f"stage {group.stages[0]} {kind}")))
        graphs = stage_graphs_from_dumps(
            tuple(group.stages), paths["nanobatched"], paths["sequential"], block["sequential"]
        )
        stages.append(_with_fingerprints_of(graphs, traced))
    return stages


def _with_fingerprints_of(graphs: StageGraphs, block: Mapping[str, Mapping[str, Any]]) -> StageGraphs:
    """``graphs`` (a stage priced as its blocks) carrying the fingerprints of the ``block``
    dumps' graphs (by "nanobatched" / "sequential": one block, what a deployment compiles and checks)."""
    own = {kind: {g["name"]: graph_fingerprint(g) for g in dump["graphs"]} for kind, dump in block.items()}
    sequential = {
        name: dataclasses.replace(g, fingerprint=own["sequential"][name]) for name, g in graphs.sequential.items()
    }
    partitioned = (
        None
        if graphs.partitioned is None
        else {
            name: dataclasses.replace(g, fingerprint=own["nanobatched"][name]) for name, g in graphs.partitioned.items()
        }
    )
    return dataclasses.replace(graphs, sequential=sequential, partitioned=partitioned)


def _run_traces(traces: Mapping[int, Sequence[functools.partial]]) -> dict[int, list[dict[str, Path]]]:
    """Each stage's traces' dumps by kind, in order: all traces at once, one process per core
    (``capture.trace_pool``; one process: one after another, here), the longest first
    (:func:`pool_order`)."""
    calls = [trace for stage_traces in traces.values() for trace in stage_traces]
    processes = parallel_processes(len(calls))
    order = pool_order([_trace_cost(call.args[0]) for call in calls], processes)
    by_call = dict(zip(order, run_calls([calls[i] for i in order], processes), strict=True))
    results = iter(by_call[i] for i in range(len(calls)))
    return {
        stage: [dict(zip(("nanobatched", "sequential"), next(results), strict=True)) for _ in stage_traces]
        for stage, stage_traces in traces.items()
    }


def _trace_cost(spec: TraceSpec) -> float:
    """A trace's relative cost, in decoder layers: its stage's layer count, plus the LM head and
    loss of the last stage and the embedding of the first (about 0.8 and 0.4 of a layer: the
    70B PP10 plan's slice traces took 4.7-6.0 s for 2 middle layers, 5.5-6.6 s for the first
    stage's and 6.0-8.4 s for the last's on the 2-core machine)."""
    counts = spec.stage_layers or even_layer_counts(spec.layers or get_config(spec.model).num_layers, spec.pp)
    return (
        counts[spec.stage] + 0.8 * (spec.pp > 1 and spec.stage == spec.pp - 1) + 0.4 * (spec.pp > 1 and spec.stage == 0)
    )


def pool_order(costs: Sequence[float], processes: int) -> list[int]:
    """The order to hand calls of these ``costs`` to ``capture.trace_pool``, in which this process
    takes calls from the back and its ``processes - 1`` workers from the front.

    The longest-processing-time rule: the calls, the costliest first, each go to the process
    that is free first (this one on a tie); this process's calls go to the back (its first
    last), the workers' to the front in the order they start them. The pool still hands calls
    out as processes come free, so a wrong estimate costs balance, not correctness. On 2 cores
    the 70B PP10 plan's 6 slice traces (43 s of CPU) went from about 24.5 s for the slowest
    process (the calls' stage order) to about 22 s."""
    free_at = [0.0] * max(1, processes)
    taken: list[list[tuple[float, int]]] = [[] for _ in free_at]
    for index in sorted(range(len(costs)), key=lambda i: costs[i], reverse=True):
        process = min(range(len(free_at)), key=lambda p: free_at[p])
        taken[process].append((free_at[process], index))
        free_at[process] += costs[index]
    front = [index for _, index in sorted(start for worker in taken[1:] for start in worker)]
    return [*front, *(index for _, index in reversed(taken[0]))]


def _slice_trace(req: PlanRequest, stage: int, layers: int, dump_root: Path) -> functools.partial:
    """The trace of stage ``stage`` with ``layers`` layers in its role: every stage of a pipeline of
    ``layers * pp`` layers has ``layers``."""
    return _trace(
        req,
        dataclasses.replace(req.trace_spec(stage), layers=layers * req.num_stages, stage_layers=None),
        dump_root,
        f"stage{stage}-{{kind}}-slice{layers}",
    )


def _full_trace(req: PlanRequest, stage: int, dump_root: Path) -> functools.partial:
    return _trace(req, req.trace_spec(stage), dump_root, f"stage{stage}-{{kind}}")


def _trace(req: PlanRequest, spec: TraceSpec, dump_root: Path, name: str) -> functools.partial:
    """A call tracing ``spec`` once that returns its nanobatched and its sequential dump, written
    under ``dump_root / name.format(kind=kind)`` (``tracing.trace_both_splits``)."""
    return functools.partial(
        trace_both_splits,
        spec,
        canonical_gpu_name(req.gpu),
        *(dump_root / name.format(kind=kind) for kind in ("nanobatched", "sequential")),
    )


def _extend_slices(
    stage: int, num_layers: int, short: Mapping[str, Path], long: Mapping[str, Path], dump_root: Path, load: LoadedDumps
) -> dict[str, Path]:
    """Dumps of stage ``stage`` at ``num_layers`` layers, extended from the dumps of its
    ``SLICE_LAYERS`` slices (``layer_slice.py``), nanobatched and sequential."""
    paths = {}
    dump_root.mkdir(parents=True, exist_ok=True)
    for kind in ("nanobatched", "sequential"):
        paths[kind] = dump_root / f"stage{stage}-{kind}-extended.json"
        extended = extend_dump(
            load(short[kind]), load(long[kind]), SLICE_LAYERS[1], num_layers, f"stage {stage} {kind}"
        )
        paths[kind].write_text(json.dumps(extended))
    paths["boundary"] = short["sequential"]  # an extended dump keeps no outputs; the slice's are the stage's
    return paths


class LoadedDumps:
    """Reads a dump file (``load_dump``: parsed and validated) the first time it is asked for and
    returns the same dump after that. A stage role's slice dumps serve the balanced split, every
    stage of the role's extension and its boundary: with this the 70B PP10 plan reads 18 dumps,
    not 27. It lives for one tracing step (nothing kept on disk); the dumps are read-only."""

    def __init__(self) -> None:
        self._dumps: dict[Path, dict[str, Any]] = {}

    def __call__(self, path: Path) -> dict[str, Any]:
        if path not in self._dumps:
            self._dumps[path] = load_dump(path)
        return self._dumps[path]


def parallel_processes(tasks: int) -> int:
    """How many processes the planner runs ``tasks`` independent tasks in (traces, iteration
    solves): one per core, at most one per task."""
    return max(1, min(os.cpu_count() or 1, tasks))


def stage_graphs_from_dumps(
    stages: tuple[int, ...],
    nanobatched: Path,
    sequential: Path,
    boundary: Path | None = None,
    *,
    load: Callable[[Path], dict[str, Any]] = load_dump,
) -> StageGraphs:
    """The graphs of ``stages`` from a nanobatched and an un-split dump of one stage's forward and
    backward; a nanobatched graph without partitions is planned sequentially (with a warning).
    ``boundary``: a dump with the stage's outputs, for the activation it sends on (None: not read).
    ``load`` reads a dump (``load_dump``; the planner's :class:`LoadedDumps` reads each once)."""
    try:
        partitioned = partitioned_graphs(load(nanobatched))
    except UnsupportedGraphError as err:
        warnings.warn(f"stage {stages[0]}: {err}; Kareus plans it sequentially", stacklevel=2)
        partitioned = None
    sequential_dump = load(sequential)
    sequential_by_name = sequential_graphs(sequential_dump)  # refuses a dump without forward and backward
    async_dgrad = {"sequential": async_dgrad_split(_backward_graph(sequential_dump))}
    if partitioned is not None:
        nanobatched_backward = _backward_graph(load(nanobatched))
        leftover = nanobatched_backward["leftover"]
        async_dgrad["outside"] = async_dgrad_split(nanobatched_backward, [*leftover["nodes"], *leftover["collectives"]])
    sent_bytes = (
        None if boundary is None else boundary_bytes(sequential_dump if boundary == sequential else load(boundary))
    )
    return StageGraphs(
        stages=stages,
        sequential=sequential_by_name,
        partitioned=partitioned,
        dump_paths={"nanobatched": nanobatched, "sequential": sequential},
        sent_bytes=sent_bytes,
        async_dgrad=async_dgrad,
    )


def engine_stage_graphs(req: PlanRequest, traced: Sequence[StageGraphs]) -> list[StageGraphs]:
    """``traced`` as the request's engine runs them: without their asynchronous dgrad all-reduces
    (``async_dgrad.py``) unless it overlaps them (``MegatronSettings.te_async_dgrad``), so the
    un-split microbatch keeps the traced order, as kareus deploys it."""
    if req.megatron.te_async_dgrad:
        return list(traced)
    return [dataclasses.replace(graphs, async_dgrad={}) for graphs in traced]


def _backward_graph(dump: Mapping[str, Any]) -> Mapping[str, Any]:
    """The dump's backward graph record."""
    (graph,) = [g for g in dump["graphs"] if g["name"] == "backward"]
    return graph


def _with_async(
    req: PlanRequest, measured: Mapping[int, Measurement], graph: SequentialGraph, split: AsyncDgrad | None
) -> dict[int, Measurement]:
    """``measured`` with the asynchronous dgrad all-reduces of ``split`` priced (``async_dgrad.py``)
    on the simulated GPU where the request's engine overlaps them (``MegatronSettings.te_async_dgrad``);
    a measured profiler's sequences are its own (unchanged)."""
    if req.profiler != "simulated" or split is None or not req.megatron.te_async_dgrad:
        return dict(measured)
    return with_async_dgrad(measured, graph, split, _async_simulator(canonical_gpu_name(req.gpu)))


@functools.cache
def _async_simulator(gpu: str) -> Simulator:
    """One simulator per GPU for the asynchronous-dgrad prices (its caches serve every stage and clock)."""
    return SimulatedProfiler(gpu).simulator


# ----- profilers ------------------------------------------------------------------------------------
@contextlib.contextmanager
def _profiler_factory(
    req: PlanRequest, traced: Sequence[StageGraphs], db_path: Path, queue_path: Path | None = None
) -> Iterator[CachedProfilerFactory]:
    """The factory of the request's profiler behind the profile database (keyed by the profiler's
    kind, "simulated" or "cuda-graph", so measurements never mix and a rerun resumes).

    ``cuda``: one :class:`DeviceProfiler` for the whole plan (one GPU, one clock controller opened
    in ``req.clock_mode``), which every factory call returns; it replays the ops of every traced
    graph from their own dump (:func:`_replay_tables`), and leaving the block closes it, restoring
    the clock. Each call of a ``cuda`` factory returns that same profiler, so the factory serves
    this process only (``validate_plan_request`` allows one worker). Every measurement made is logged
    in ``queue_path`` (default: ``QUEUE_FILE`` beside the database) for the plan's duplicate count.
    """
    gpu = canonical_gpu_name(req.gpu)
    logged = {"log_path": str(queue_path or db_path.parent / QUEUE_FILE), "run": uuid.uuid4().hex}
    if req.profiler == "simulated":
        yield CachedProfilerFactory(db_path=str(db_path), inner=functools.partial(SimulatedProfiler, gpu), **logged)
        return
    tables = _replay_tables(traced)
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


def _replay_tables(traced: Sequence[StageGraphs]) -> dict[str, NodeTable]:
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


# ----- 2. distinct partition types -----------------------------------------------------------------
LocalKey = tuple[int, GraphName, str]
"""(index of the traced stage group, graph, the type id the partition pass gave)."""


def _distinct_types(
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


# ----- 3. methods and composition ------------------------------------------------------------------
@dataclass
class _Composed:
    microbatch: dict[tuple[int, GraphName], MicrobatchFrontier]
    """Kareus's microbatch frontier per (traced stage group, graph)."""
    iteration: dict[str, IterationFrontier]
    metrics: dict[str, dict[str, float | None]]
    energy_scale: float
    power_limits: list[PowerLimitPoint]
    """Megatron-LM under each job-wide power limit (the sixth method's curve); empty when the
    profiler cannot price power limits."""
    power_limit_choice: PowerLimitPoint | None
    """The limit Zeus's selector picks on that curve (None without a curve)."""
    kareus_power_limits: list[PowerLimitPoint]
    """Kareus's max-throughput schedule under each job-wide power limit (``kareus_power_limit_curves.py``);
    empty when the profiler cannot price power limits."""
    kareus_locked_power_limits: list[PowerLimitPoint]
    """The same with each instruction's clock locked as the point plans it, the limit on top."""
    step_tail: StepTail | None = None
    """The work after the last microbatch that every frontier includes (``step_tail.py``); None
    where the profiler does not price it."""


def _compose_methods(req, traced, ptypes, local_to_plan, tuned, profiler, progress) -> _Composed:
    spec: GPUSpec = gpu_spec(canonical_gpu_name(req.gpu))
    clocks = list(clock_grid_mhz(spec, req.clock_stride_mhz))
    max_clock = [max(clocks)]
    # Kareus's clocks, and the baselines whose every plan is also a Kareus plan (_with_baseline_plans).
    kareus_clocks = max_clock if req.max_clock_only else clocks
    baselines = ("megatron", "nanobatching") if req.max_clock_only else ("megatron+perseus", "nanobatching+perseus")
    default_sms = gpu_params(spec.name).params.default_comm_sms
    tuned_points = {tid: [(p.config, p.measurement) for p in result.points] for tid, result in tuned.items()}

    per_group: dict[tuple[int, GraphName], dict[str, Sequence[Any]]] = {}
    baseline_offsets: dict[tuple[int, GraphName], dict[str, int]] = {}
    microbatch: dict[tuple[int, GraphName], MicrobatchFrontier] = {}
    for g, stage in enumerate(traced):
        for name in INSTRUCTIONS:
            sequential = sequential_measurements(profiler, stage.sequential[name], clocks)
            if name == "backward":
                sequential = _with_async(req, sequential, stage.sequential[name], stage.async_dgrad.get("sequential"))
            options: dict[str, Sequence[Any]] = {
                "megatron": as_options("megatron", sequential, max_clock),
                "megatron+perseus": as_options("megatron+perseus", sequential, clocks),
            }
            nanobatched_types: tuple[str, ...] | None = None
            if stage.partitioned is None:
                nanobatched = sequential
                frontier = MicrobatchFrontier(points=tuple(pareto_front(_baseline_points(sequential))))
            else:
                graph = _with_plan_ids(stage.partitioned[name], g, local_to_plan)
                outside = sequential_measurements(profiler, graph.outside, clocks)
                if name == "backward":
                    outside = _with_async(req, outside, graph.outside, stage.async_dgrad.get("outside"))
                nanobatched, nb_points = nanobatching_measurements(profiler, graph, outside, default_sms)
                candidates = {
                    t.type_id: [
                        (c, m)
                        for c, m in [*tuned_points[t.type_id], *nb_points[t.type_id]]
                        if c.clock_mhz in kareus_clocks
                    ]
                    for t in graph.ptypes
                }
                frontier = kareus_microbatch_frontier(
                    graph, candidates, _at(outside, kareus_clocks), _at(sequential, kareus_clocks)
                )
                nanobatched_types = tuple(t.type_id for t in graph.ptypes)
            options["nanobatching"] = as_options("nanobatching", nanobatched, max_clock)
            options["nanobatching+perseus"] = as_options("nanobatching+perseus", nanobatched, clocks)
            # Kareus's options: its frontier, then the M+P and the N+P microbatch at each of its
            # clocks (in the baselines' option order, so a baseline plan maps by an offset).
            options["kareus"] = [
                *frontier.points,
                *_baseline_points(_at(sequential, kareus_clocks)),
                *_baseline_points(_at(nanobatched, kareus_clocks), nanobatched_types, default_sms),
            ]
            baseline_offsets[(g, name)] = {
                baselines[0]: len(frontier.points),
                baselines[1]: len(frontier.points) + len(kareus_clocks),
            }
            per_group[(g, name)] = options
            microbatch[(g, name)] = frontier

    stage_group = {s: g for g, stage in enumerate(traced) for s in stage.stages}
    waits_s = _send_recv_s(req, traced, stage_group, spec)
    by_method = {
        method: {
            (s, name): _with_link_wait(
                per_group[(stage_group[s], name)][method], waits_s[(s, name)], spec.blocking_power_w
            )
            for s in range(req.num_stages)
            for name in INSTRUCTIONS
        }
        for method in METHODS
    }
    unit_s, max_steps = composition_quantum(by_method, req.num_stages, req.microbatches, req.virtual_stages)
    nodes = 2 * req.num_stages * req.microbatches
    workers_start = start_method()
    processes = 1
    if nodes >= PARALLEL_COMPOSE_MIN_NODES:
        # A forked worker costs nothing to start, so every solve gets a process and the cores are
        # shared among them: the solves end together (on 2 cores, 3 solves in 2 processes left
        # one core idle while the other solved the third).
        processes = len(by_method) if workers_start == "fork" else parallel_processes(len(by_method))
    scale = float(req.tp * req.cp * req.dp)  # every rank of a stage, in every replica
    curve: list[PowerLimitPoint] = []

    def price_power_limits() -> None:  # while the workers solve (it needs no frontier)
        curve.extend(_power_limit_curve(req, traced, stage_group, waits_s, spec, spec.tuning_clock_min_mhz, scale))

    iteration = compose_iterations(
        by_method,
        req.microbatches,
        processes=processes,
        progress=progress,
        meanwhile=price_power_limits,
        start_method=workers_start,
        blocking_power_w=spec.blocking_power_w,
        unit_time_s=unit_s,
        max_solver_steps=max_steps,
        virtual_stages=req.virtual_stages,
        min_cut="lowtime" if req.exact_min_cut else "dinic",
        fast_end_walk=True,  # the max-throughput metrics read the fastest plan at any quantum
    )
    # The solver's fastest plans keep slack unspent off the critical path (compose/slack.py); the
    # max-throughput metrics read them, so each method's is reclaimed (Kareus's before its
    # baselines' plans join it, so it takes theirs reclaimed too).
    iteration = {m: with_reclaimed_fastest(front) for m, front in iteration.items()}
    iteration["kareus"] = _with_baseline_plans(
        iteration, {(s, name): baseline_offsets[(stage_group[s], name)] for s, name in by_method["kareus"]}
    )
    tail = _step_tail(req, spec)
    if tail is not None:  # the gradient sync and optimizer step after the last microbatch, every method alike
        iteration = {m: with_step_tail(it, tail) for m, it in iteration.items()}
        curve[:] = _with_tail_points(curve, tail, scale)
    fronts = {m: [(p.time_s, p.energy_j * scale) for p in it.points] for m, it in iteration.items()}
    megatron = min(fronts["megatron"])
    metrics = {m: frontier_metrics(front, megatron, fronts["megatron+perseus"]) for m, front in fronts.items()}
    # Locked and unlocked side by side where a worker forks (a spawned one would import torch first).
    kareus_curves = _kareus_power_limit_curves(
        req,
        traced,
        stage_group,
        waits_s,
        spec,
        iteration["kareus"],
        local_to_plan,
        scale,
        processes=processes if workers_start == "fork" else 1,
    )
    if tail is not None:
        kareus_curves = {lock: _with_tail_points(points, tail, scale) for lock, points in kareus_curves.items()}
    chosen = zeus_choice(curve, gpus=req.tp * req.cp * req.pp * req.dp) if curve else None
    if chosen is not None:
        metrics[POWER_LIMIT_METHOD] = frontier_metrics(
            [(chosen.time_s, chosen.energy_j)], megatron, fronts["megatron+perseus"]
        )
    return _Composed(
        microbatch=microbatch,
        iteration=iteration,
        metrics=metrics,
        energy_scale=scale,
        power_limits=curve,
        power_limit_choice=chosen,
        kareus_power_limits=kareus_curves[False],
        kareus_locked_power_limits=kareus_curves[True],
        step_tail=tail,
    )


def _kareus_power_limit_curves(
    req: PlanRequest,
    traced: Sequence[StageGraphs],
    stage_group: Mapping[int, int],
    waits_s: Mapping[tuple[int, GraphName], float],
    spec: GPUSpec,
    kareus: IterationFrontier,
    local_to_plan: Mapping[LocalKey, str],
    energy_scale: float,
    processes: int = 1,
) -> dict[bool, list[PowerLimitPoint]]:
    """Kareus's max-throughput point's schedule under each job-wide power limit, by whether clocks
    are locked as planned (True) or unlocked (False) (``kareus_power_limit_curves.py``), the two curves
    in up to ``processes`` processes (the same curves: each prices on profilers of its own);
    empty curves for a profiler that cannot price a power limit."""
    if req.profiler != "simulated":
        return {False: [], True: []}
    gpu = canonical_gpu_name(req.gpu)
    fastest = min(kareus.points, key=lambda p: (p.time_s, p.energy_j))

    def work(node: PipelineNode, option: MicrobatchPoint) -> NodeWork:
        stage = traced[stage_group[node.stage]]
        partitioned = stage.partitioned and stage.partitioned.get(node.instruction)
        return NodeWork(
            option=option,
            sequential=stage.sequential[node.instruction],
            partitioned=None
            if not partitioned
            else _with_plan_ids(partitioned, stage_group[node.stage], local_to_plan),
            wait_s=waits_s[(node.stage, node.instruction)],
            sequential_async=stage.async_dgrad.get("sequential") if node.instruction == "backward" else None,
            outside_async=stage.async_dgrad.get("outside") if node.instruction == "backward" else None,
        )

    curves = functools.partial(
        kareus_power_limit_curves,
        {node: work(node, option) for node, option in kareus.plan(fastest).items()},
        functools.partial(_simulated_profiler, gpu),
        tdp_w=spec.tdp_w,
        max_clock_mhz=spec.clock_max_mhz,
        lowest_clock_mhz=spec.tuning_clock_min_mhz,
        pp=req.pp,
        microbatches=req.microbatches,
        blocking_power_w=spec.blocking_power_w,
        energy_scale=energy_scale,
        virtual_stages=req.virtual_stages,
    )
    if processes <= 1:
        return curves(lock_modes=(False, True))
    unlocked, locked = run_calls(
        [functools.partial(curves, lock_modes=(False,)), functools.partial(curves, lock_modes=(True,))], processes
    )
    return {**unlocked, **locked}


def _simulated_profiler(gpu: str, power_limit_w: int | None) -> SimulatedProfiler:
    """The simulated ``gpu`` under ``power_limit_w`` (None: none); a module-level function, so a
    worker process gets it pickled."""
    return SimulatedProfiler(gpu, power_limit_w=power_limit_w)


def solver_step_cap(nodes: int) -> int:
    """The planner's cap on solver steps per method for a pipeline of ``nodes`` (stage,
    instruction, microbatch) nodes: ``SOLVER_NODE_STEPS / nodes`` (a step's max-flow and plan
    evaluation grow with the nodes, so this bounds the solve's work), at least
    ``MAX_SOLVER_STEPS``, at most ``FINE_SOLVER_STEPS``."""
    return max(MAX_SOLVER_STEPS, min(FINE_SOLVER_STEPS, SOLVER_NODE_STEPS // max(nodes, 1)))


def composition_quantum(
    by_method: Mapping[str, Mapping[tuple[int, GraphName], Sequence[Any]]],
    num_stages: int,
    microbatches: int,
    virtual_stages: int,
) -> tuple[float, int]:
    """The time quantum every method's frontier is solved at, and the step cap it was chosen for.

    One quantum for every method, so their frontiers differ by their options, not by rounding:
    the smallest quantum, from Perseus's 1 ms (or a quarter of the shortest option, if shorter),
    at which every method's solve takes at most :func:`solver_step_cap` steps; where that would
    need a quantum above half the shortest option (a long pipeline), a quantum of half the
    shortest option and the steps it takes (:func:`solver_steps`)."""
    shortest_s = min(o.time_s for options in by_method.values() for opts in options.values() for o in opts)

    def unit_for(max_steps: int, floor_s: float) -> float:
        return max(
            choose_unit_time_s(options, microbatches, max_steps, min_unit_time_s=floor_s, virtual_stages=virtual_stages)
            for options in by_method.values()
        )

    nodes = 2 * num_stages * microbatches
    max_steps = solver_step_cap(nodes)
    floor_s = FINE_UNIT_TIME_S if max_steps > MAX_SOLVER_STEPS else DEFAULT_UNIT_TIME_S
    try:
        return unit_for(max_steps, min(floor_s, shortest_s / 4)), max_steps
    except CompositionError:  # too few steps at any quantum below the shortest option
        max_steps = solver_steps(by_method, microbatches, virtual_stages)
        return unit_for(max_steps, shortest_s / 2), max_steps


def solver_steps(
    by_method: Mapping[str, Mapping[tuple[int, GraphName], Sequence[Any]]], microbatches: int, virtual_stages: int
) -> int:
    """Solver steps per method: ``MAX_SOLVER_STEPS``, or, where that would need a time quantum
    above half the shortest instruction (so coarse that most clocks of an instruction collapse
    into one), the steps a quantum of half the shortest instruction takes (Llama 3.1 405B at
    PP16 x 4 chunks x 128 microbatches: 16,384 instructions, the shortest 18 ms)."""
    shortest_s = min(o.time_s for options in by_method.values() for opts in options.values() for o in opts)
    return max(
        MAX_SOLVER_STEPS,
        *(
            count_solver_steps(options, microbatches, shortest_s / 2, virtual_stages=virtual_stages)
            for options in by_method.values()
            if any(len(opts) > 1 for opts in options.values())  # one option each: no step
        ),
    )


def _power_limit_curve(
    req: PlanRequest,
    traced: Sequence[StageGraphs],
    stage_group: Mapping[int, int],
    waits_s: Mapping[tuple[int, GraphName], float],
    spec: GPUSpec,
    lowest_clock_mhz: int,
    energy_scale: float,
) -> list[PowerLimitPoint]:
    """Megatron-LM's iteration under each job-wide power limit (``power_limit_baseline.py``); empty for
    a profiler that cannot price a power limit (the on-device one never sets it)."""
    if req.profiler != "simulated":
        return []
    gpu = canonical_gpu_name(req.gpu)

    def measure_at(limit_w: int | None, clock_mhz: int = spec.clock_max_mhz) -> dict[tuple[int, str], Measurement]:
        profiler = SimulatedProfiler(gpu, power_limit_w=limit_w)
        # once per distinct stage (its stages run the same graphs), deterministic
        by_group = {
            (g, name): with_async_dgrad(
                {
                    clock_mhz: profiler.measure_sequence(
                        graphs.sequential[name].ops, graphs.sequential[name].collectives, clock_mhz
                    )
                },
                graphs.sequential[name],
                graphs.async_dgrad.get("sequential") if name == "backward" else None,
                profiler.simulator,
            )[clock_mhz]
            for g, graphs in enumerate(traced)
            for name in ("forward", "backward")
        }
        nodes = {}
        for s in range(req.num_stages):
            for name in ("forward", "backward"):
                m = by_group[(stage_group[s], name)]
                nodes[(s, name)] = m.with_link_wait(waits_s[(s, name)], spec.blocking_power_w)
        return nodes

    floor_s, _ = iteration_of(
        measure_at(None, lowest_clock_mhz),
        req.pp,
        req.microbatches,
        spec.blocking_power_w,
        energy_scale,
        req.virtual_stages,
    )
    return power_limit_curve(
        measure_at,
        tdp_w=spec.tdp_w,
        floor_time_s=floor_s,
        pp=req.pp,
        microbatches=req.microbatches,
        blocking_power_w=spec.blocking_power_w,
        energy_scale=energy_scale,
        virtual_stages=req.virtual_stages,
    )


def _step_tail(req: PlanRequest, spec: GPUSpec) -> StepTail | None:
    """The work after the last microbatch (``step_tail.py``) on the simulated GPU; None for a
    measured profiler (it measures the microbatches' graphs, not the optimizer) or a live graph
    (no model config to count parameters)."""
    if req.profiler != "simulated" or req.model == LIVE_GRAPH_MODEL:
        return None
    cfg = _priced_model_config(req)
    layers = _stage_layer_counts(req)
    simulator = SimulatedProfiler(spec.name).simulator
    return step_tail(
        simulator,
        cfg,
        layers,
        tp=req.tp,
        cp=req.cp,
        dp=req.dp,
        pp=req.pp,
        distributed_optimizer=req.megatron.distributed_optimizer,
    )


def _with_tail_points(points: Sequence[PowerLimitPoint], tail: StepTail, scale: float) -> list[PowerLimitPoint]:
    """Power-limit curve points lengthened by ``tail`` (energies over all GPUs: ``scale`` x one pipeline's)."""
    return [
        dataclasses.replace(p, time_s=p.time_s + tail.time_s, energy_j=p.energy_j + tail.energy_j * scale)
        for p in points
    ]


def _send_recv_s(
    req: PlanRequest, traced: Sequence[StageGraphs], stage_group: Mapping[int, int], spec: GPUSpec
) -> dict[tuple[int, GraphName], float]:
    """Per (stage, instruction), the blocking pipeline send it ends with (``stage_transfer.py``)."""
    if req.num_stages == 1:
        return {(0, "forward"): 0.0, (0, "backward"): 0.0}
    sent_bytes = {g: stage.sent_bytes for g, stage in enumerate(traced) if stage.sent_bytes is not None}
    missing = [g for g in range(len(traced)) if g not in sent_bytes]
    if missing:
        raise OptionsError(
            f"a {req.num_stages}-stage pipeline needs the activation each stage sends on, but the traced "
            f"stage group(s) {missing} hold none: build them with stage_graphs_from_dumps(boundary=...)"
        )
    return stage_transfer_s(
        [sent_bytes[stage_group[s]] for s in range(req.num_stages)], req.tp, req.cp, spec, ranks=req.pp
    )


def _with_link_wait(options: Sequence[Any], wait_s: float, power_w: float) -> list[Any]:
    """``options`` each lengthened by a send of ``wait_s`` at the blocking power ``power_w``."""
    if wait_s == 0.0:
        return list(options)
    extra_j = power_w * wait_s
    return [
        dataclasses.replace(
            o,
            time_s=o.time_s + wait_s,
            energy_j=o.energy_j + extra_j,
            **({"static_energy_j": o.static_energy_j + extra_j} if isinstance(o, MicrobatchPoint) else {}),
        )
        for o in options
    ]


def _at(by_clock: Mapping[int, Any], clocks: Sequence[int]) -> dict[int, Any]:
    """``by_clock`` at ``clocks`` only."""
    return {c: by_clock[c] for c in clocks}


def _baseline_points(
    by_clock: Mapping[int, Any], nanobatched_types: Sequence[str] | None = None, comm_sms: int = 0
) -> list[MicrobatchPoint]:
    """A baseline's microbatch at every clock as Kareus options: the un-split microbatch, or with
    ``nanobatched_types`` every partition type on the nanobatching schedule with ``comm_sms``.

    They lie in Kareus's search space; listing them (even where the microbatch frontier dominates
    them in time and energy) lets every baseline plan be written as a Kareus plan."""

    def configs(clock: int):
        return (
            None
            if nanobatched_types is None
            else tuple((tid, nanobatching_config(clock, comm_sms)) for tid in nanobatched_types)
        )

    return [
        MicrobatchPoint(m.time_s, m.energy_j, m.dynamic_energy_j, m.static_energy_j, clock, configs(clock))
        for clock, m in by_clock.items()
    ]


def _with_baseline_plans(
    iteration: Mapping[str, IterationFrontier], offsets: Mapping[tuple[int, str], Mapping[str, int]]
) -> IterationFrontier:
    """Kareus's frontier with the baselines' plans added where they are not dominated.

    The lowtime solver is a heuristic on a convex cost model: on the same options it can end a few
    hundredths of a percent apart at the frontier's ends. Every plan of a baseline named in
    ``offsets`` is also a Kareus plan: option ``j`` of the baseline at (stage, instruction) is
    Kareus's option ``offsets[(stage, instruction)][baseline] + j`` (``_baseline_points``), with
    the same exactly evaluated time and energy, so it is a candidate of Kareus's frontier."""
    kareus = iteration["kareus"]
    candidates = list(kareus.points)
    for name in next(iter(offsets.values())):
        base = iteration[name]
        assert base.nodes == kareus.nodes, "methods composed over different pipelines"
        shift = np.array([offsets[(n.stage, n.instruction)][name] for n in base.nodes], dtype=np.uint32)
        for point in base.points:
            choices = point.choices.astype(np.uint32) + shift
            choices.setflags(write=False)
            candidates.append(dataclasses.replace(point, choices=choices))
    return dataclasses.replace(kareus, points=tuple(pareto_front(candidates)))


def _with_plan_ids(graph: PartitionedGraph, group: int, local_to_plan: Mapping[LocalKey, str]) -> PartitionedGraph:
    renamed = tuple(
        dataclasses.replace(t, type_id=local_to_plan[(group, graph.graph, t.type_id)]) for t in graph.ptypes
    )
    return dataclasses.replace(graph, ptypes=renamed)


# ----- 4. the plan ---------------------------------------------------------------------------------
def _option_record(point: MicrobatchPoint) -> dict[str, Any]:
    return {
        "clock_mhz": point.clock_mhz,
        "sequential": point.sequential,
        "configs": None
        if point.configs is None
        else {
            tid: {"comm_sms": c.comm_sms, "launch_slot": c.launch_slot, "comm_library": c.comm_library}
            for tid, c in point.configs
        },
        "time_s": point.time_s,
        "energy_j": point.energy_j,
        "dynamic_energy_j": point.dynamic_energy_j,
        "static_energy_j": point.static_energy_j,
    }


def _type_record(ptype: PartitionType, result: TuningResult, counts: Mapping[str, int]) -> dict[str, Any]:
    return {
        "graph": ptype.graph,
        "count": counts[ptype.type_id],
        "fingerprint": fingerprint(ptype),
        "collective": dataclasses.asdict(ptype.collective),
        "slots": [
            {"bound": s.bound, "flops": s.flops, "bytes": s.bytes, "ops": [op.target for op in s.ops]}
            for s in ptype.slots
        ],
        "launch_slots": list(ptype.launch_slots),
        "frontier": [
            {**dataclasses.asdict(p.config), **dataclasses.asdict(p.measurement), "found_by": p.source}
            for p in result.frontier
        ],
        "tuning": {
            "space_size": result.stats.space_size,
            "measured": result.stats.measured,
            "fraction_measured": result.stats.fraction_measured,
            "batches": result.stats.batches,
            "stop_reason": result.stats.stop_reason,
            "frontier_sources": result.frontier_sources(),
        },
    }


def _measurement_provenance(req: PlanRequest, device: str | None = None) -> str:
    """Where the plan's times and energies come from, in words (``device``: a distributed profiler's words)."""
    if req.profiler == "cpu-replay":
        return (
            f"{device or 'test device'}: partitions replayed with their real collectives; times are the "
            f"slowest rank's wall clock, energies a fixed power model; NOT a GPU measurement"
        )
    if device is not None:
        return (
            f"measured on {device}: partitions replayed with their real collectives over SM-limited "
            f"communicators; CUDA-event time (slowest rank), Zeus energy summed over each group over "
            f">= {req.device_window_s:g} s windows"
        )
    if req.profiler == "simulated":
        return "simulated GPU: every time and energy is a cost-model prediction, nothing was measured"
    clocks = (
        "each configuration's SM clock locked while measuring"
        if (req.clock_mode or "real") == "real"
        else "clock mode dry-run: every point measured at the card's current clock, not at its clock_mhz"
    )
    return (
        f"measured on one GPU: CUDA-event time, NVML energy over >= {req.device_window_s:g} s windows; "
        f"collectives as a local SM-limited reduce (no link time); {clocks}"
    )


def _plan_data(
    req,
    traced,
    ptypes,
    local_to_plan,
    tuned,
    composed: _Composed,
    profiler_kind: str,
    wall: Mapping[str, float],
    device: str | None = None,
) -> dict[str, Any]:
    stage_group = {s: g for g, stage in enumerate(traced) for s in stage.stages}
    counts: dict[tuple[int, GraphName], dict[str, int]] = {}
    for (g, name, local), plan_id in local_to_plan.items():
        count = next(t.count for t in traced[g].partitioned[name].ptypes if t.type_id == local)
        counts.setdefault((g, name), {})[plan_id] = count
    stages = []
    for s in range(req.num_stages):
        g = stage_group[s]
        graphs = {}
        for name in INSTRUCTIONS:
            partitioned = traced[g].partitioned
            graphs[name] = {
                "fingerprint": (
                    partitioned[name].fingerprint if partitioned else traced[g].sequential[name].fingerprint
                ),
                "sequential_fingerprint": traced[g].sequential[name].fingerprint,
                "partition_types": {
                    local: pid for (gg, nn, local), pid in sorted(local_to_plan.items()) if gg == g and nn == name
                },
                "counts": counts.get((g, name), {}),
            }
        stages.append({"stage": s, "graphs": graphs})
    max_count = {pid: max(c.get(pid, 0) for c in counts.values()) for pid in ptypes}

    kareus = composed.iteration["kareus"]
    options = {
        instruction_key(s, name): [_option_record(p) for p in kareus.options[(s, name)]]
        for s in range(req.num_stages)
        for name in INSTRUCTIONS
    }
    frontier = []
    for point in kareus.points:
        choices: dict[str, list[int]] = {
            instruction_key(s, n): [0] * req.microbatches
            for s in range(req.num_stages)
            for n in ("forward", "backward")
        }
        for node, index in zip(kareus.nodes, point.choices):
            choices[instruction_key(node.stage, node.instruction)][node.microbatch] = int(index)
        frontier.append(
            {"time_s": point.time_s, "energy_j": point.energy_j * composed.energy_scale, "choices": choices}
        )
    methods: dict[str, dict[str, Any]] = {
        m: {
            "frontier": [[p.time_s, p.energy_j * composed.energy_scale] for p in composed.iteration[m].points],
            "metrics": composed.metrics[m],
        }
        for m in METHODS
    }
    chosen = composed.power_limit_choice
    if chosen is not None:
        methods[POWER_LIMIT_METHOD] = {
            "frontier": [[chosen.time_s, chosen.energy_j]],
            "metrics": composed.metrics[POWER_LIMIT_METHOD],
            "chosen_power_limit_w": chosen.power_limit_w,
            "power_limits": [[p.power_limit_w, p.time_s, p.energy_j] for p in composed.power_limits],
        }
    if composed.kareus_power_limits:
        methods["kareus"]["power_limits"] = [
            [p.power_limit_w, p.time_s, p.energy_j] for p in composed.kareus_power_limits
        ]
        methods["kareus"]["locked_power_limits"] = [
            [p.power_limit_w, p.time_s, p.energy_j] for p in composed.kareus_locked_power_limits
        ]
    tail = composed.step_tail
    step_tail_record = (
        None
        if tail is None
        else {
            "time_s": tail.time_s,
            "energy_j": tail.energy_j * composed.energy_scale,
            "parts_s": dict(tail.parts_s),
            "parameters_per_gpu": list(tail.parameters_per_gpu),
        }
    )
    live = req.model == LIVE_GRAPH_MODEL
    layers = req.layers if live else _model_layers(req)
    stage_layers = None if live else _stage_layer_counts(req)
    return {
        "format": PLAN_FORMAT,
        "schema_version": PLAN_SCHEMA_VERSION,
        "kareus_fx_version": __version__,
        "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "workload": {
            "model": req.model,
            "tp": req.tp,
            "cp": req.cp,
            "pp": req.pp,
            "virtual_stages": req.virtual_stages,
            "microbatches": req.microbatches,
            "mbs": req.mbs,
            "seq": req.seq,
            "layers": layers,
            "stage_layers": stage_layers,
            "world_size": req.world_size,
            "dp": req.dp,
            "preset": req.preset,
            "dtype": req.dtype,
            "recompute": req.recompute,
            "compile_unit": req.compile_unit,
        },
        "gpu": canonical_gpu_name(req.gpu),
        "profiler": profiler_kind,
        "simulated": req.profiler == "simulated",
        "measurement": _measurement_provenance(req, device),
        "energy_scope": (
            f"one pipeline: {req.world_size} GPUs (tp x cp x pp); every rank of a stage "
            f"assumed to cost what the traced rank costs"
            if req.dp == 1
            else f"the job: {req.dp} data-parallel replicas x {req.world_size} GPUs (tp x cp x pp) = "
            f"{req.dp * req.world_size} GPUs; every rank assumed to cost what the traced rank of its stage "
            f"costs; their gradient all-reduce is in step_tail where the plan records it"
        ),
        "baselines": list(BASELINES),
        "max_clock_only": req.max_clock_only,
        "stages": stages,
        "partition_types": {pid: _type_record(p, tuned[pid], max_count) for pid, p in ptypes.items()},
        "microbatch_options": options,
        "iteration_frontier": frontier,
        "methods": methods,
        **({} if step_tail_record is None else {"step_tail": step_tail_record}),
        "wall_s": dict(wall),
    }
