"""The schema of ``plan.json`` (version 1): every field any reader of a plan touches.

Two layers: pydantic models for the shape and range of every field (:class:`PlanFile`), then
:func:`cross_check` for what relates fields to each other (a frontier point's option index
within its option list, a config's partition type among the plan's types, a launch slot
within its type's slots, one stage record per pipeline stage). :mod:`plan_format` runs both and
hands readers only the validated data (unknown keys are dropped). A reader that needs a new
field adds it here first.

Bounds are "far beyond any real plan" (counts below 2**53, numbers of at most 1e30): they keep
arithmetic finite, not workloads small. Clocks and SM counts are held to the plan's GPU (its
clock range, fewer SMs than it has), which is what the simulator and the runtime accept.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal, NoReturn

from pydantic import StrictBool, StrictInt, StrictStr, field_validator

from kareus_fx.capture.dump_schema import SmallCount, TypeCollective
from kareus_fx.capture.validated_input import (
    MAX_MAGNITUDE,
    Count,
    Fail,
    Number,
    PositiveCount,
    SchemaModel,
    finite,
    int_range,
)
from kareus_fx.cost_models.hardware import canonical_gpu_name, gpu_spec
from kareus_fx.errors import UnknownGPUError
from kareus_fx.workload import GraphName

__all__ = ["BUCKET_FIELDS", "INSTRUCTIONS", "Bucket", "PlanFile", "comm_library_of", "cross_check", "instruction_key"]

INSTRUCTIONS: tuple[GraphName, ...] = ("forward", "backward")
Clock = Annotated[StrictInt, int_range(1, 100_000)]
"""MHz."""
SMs = Annotated[StrictInt, int_range(1, 100_000)]
Slot = Annotated[StrictInt, int_range(0, 100_000)]
Seconds = Number
Joules = Number
SignedNumber = Annotated[int | float, finite(-MAX_MAGNITUDE)]
Bound = Literal["compute", "memory"]
Library = Literal["nccl", "mscclpp"]
"""``kareus_fx.workload.CommLibrary``. A plan older than the field reads with its old meaning: the
version that wrote it priced every partition configuration's collective as Kareus's tuned kernel,
so its configurations read as "mscclpp". (On a GPU both run on CTA-limited NCCL communicators
today: ``kareus_fx.runtime.collectives``; the field says which library the plan priced.)"""
OLD_LIBRARY: Library = "mscclpp"
"""The library of a configuration in a plan older than the field."""


def comm_library_of(record: Mapping[str, Any]) -> Library:
    """The collective library of a validated frontier point or type configuration; a plan older
    than the field: ``"mscclpp"``, what the version that wrote it priced every partition's collective as."""
    library: Library = record.get("comm_library", OLD_LIBRARY)
    return library


def instruction_key(stage: int, instruction: str) -> str:
    """The key of one (stage, instruction) in ``microbatch_options`` and ``choices``."""
    return f"{stage}/{instruction}"


class Workload(SchemaModel):
    model: StrictStr
    tp: PositiveCount
    cp: PositiveCount
    pp: Annotated[StrictInt, int_range(1, 100_000)]
    virtual_stages: Annotated[StrictInt, int_range(1, 1_000)] = 1
    """Model chunks per GPU (interleaved 1F1B above 1); plans older than the field read as 1. The
    stage-indexed fields (``stages``, ``stage_layers``, the instruction keys) count the
    ``pp x virtual_stages`` global stages."""
    microbatches: SmallCount
    mbs: PositiveCount
    seq: PositiveCount
    layers: PositiveCount | None
    """None: a plan of a live graph (no reference model, layer count unknown)."""
    stage_layers: list[PositiveCount] | None = None
    """Decoder layers of each pipeline stage (None: a live graph's plan, or a plan older than the field)."""
    world_size: PositiveCount
    """GPUs of one pipeline (tp x cp x pp)."""
    dp: PositiveCount = 1
    """Data-parallel replicas the energies count (plans older than the field: 1)."""
    preset: StrictStr | None = None
    dtype: StrictStr | None = None
    recompute: Literal["none", "full", "selective", "checkpointed"] | None = None
    """Activation checkpointing the plan was traced with (``kareus_fx.models.recompute``); None: a
    plan older than the field; "checkpointed": a live graph's plan whose graph has checkpointed regions."""
    compile_unit: Literal["stage", "block"] = "stage"
    """What the job compiles as one graph: the whole stage, or each decoder layer (``kareus plan
    --compile-unit block``: the stage graphs' fingerprints are one block's); plans older than the
    field read as "stage"."""
    ep: PositiveCount = 1
    """Expert-parallel degree (written for mixture-of-experts plans with ``ep > 1``; else 1)."""
    expert_imbalance: Annotated[int | float, finite(1.0, 1_000.0)] = 1.0
    """The busiest expert-parallel rank's token load over the uniform share the plan priced."""


class StageGraph(SchemaModel):
    fingerprint: StrictStr
    sequential_fingerprint: StrictStr | None = None
    partition_types: dict[StrictStr, StrictStr]
    """The graph's local partition type id -> the plan's type id."""


class StageGraphs(SchemaModel):
    forward: StageGraph
    backward: StageGraph


class Stage(SchemaModel):
    stage: Count
    graphs: StageGraphs


class TypeSlot(SchemaModel):
    ops: list[StrictStr]
    flops: Number
    bytes: Number
    bound: Bound | None = None


class TypePoint(SchemaModel):
    """A point of a partition type's tuned frontier."""

    clock_mhz: Clock
    comm_sms: SMs
    launch_slot: Slot | None
    comm_library: Library = OLD_LIBRARY
    time_s: Annotated[int | float, finite(low_inclusive=False)]
    energy_j: Joules
    dynamic_energy_j: Joules | None = None
    static_energy_j: Joules | None = None
    found_by: StrictStr | None = None


class Tuning(SchemaModel):
    space_size: Count
    measured: Count
    fraction_measured: Annotated[int | float, finite(0.0, 1.0)]
    stop_reason: StrictStr
    batches: Count | None = None
    frontier_sources: dict[StrictStr, Number] | None = None


class PartitionTypeRecord(SchemaModel):
    graph: GraphName
    count: SmallCount
    fingerprint: StrictStr
    collective: TypeCollective
    slots: list[TypeSlot]
    launch_slots: list[Slot]
    frontier: list[TypePoint]
    tuning: Tuning | None = None

    @field_validator("slots")
    @classmethod
    def _some_slots(cls, slots: list[TypeSlot]) -> list[TypeSlot]:
        if not slots:
            raise ValueError("a partition type has at least one slot")
        return slots


class TypeConfig(SchemaModel):
    comm_sms: SMs
    launch_slot: Slot | None
    """None: that type runs sequentially."""
    comm_library: Library = OLD_LIBRARY
    """A plan older than the field: :data:`OLD_LIBRARY`."""


class MicrobatchOption(SchemaModel):
    clock_mhz: Clock
    sequential: StrictBool
    configs: dict[StrictStr, TypeConfig] | None
    """None exactly when ``sequential``: the whole microbatch runs un-split."""
    time_s: Seconds
    energy_j: Joules
    dynamic_energy_j: Joules | None = None
    static_energy_j: Joules | None = None


class IterationPoint(SchemaModel):
    time_s: Seconds
    energy_j: Joules
    choices: dict[StrictStr, list[Count]]
    """``"<stage>/<instruction>"`` -> the option index each microbatch runs."""


class Method(SchemaModel):
    frontier: list[list[Number]]
    """``[time_s, energy_j]`` points."""
    metrics: dict[StrictStr, SignedNumber | None]
    """Metric name -> a relative reduction (a fraction; negative: worse), None when undefined."""
    chosen_power_limit_w: Number | None = None
    """Megatron-LM + power limit only: the job-wide limit Zeus's selector picks (its frontier)."""
    power_limits: list[list[Number]] | None = None
    """``[power_limit_w, time_s, energy_j]`` at every limit tried: Megatron-LM + power limit's curve,
    or on ``kareus`` its max-throughput schedule with clocks unlocked under each limit."""
    locked_power_limits: list[list[Number]] | None = None
    """``kareus`` only: its max-throughput point, clocks locked as planned, under each limit."""

    @field_validator("frontier")
    @classmethod
    def _pairs(cls, frontier: list[list[float]]) -> list[list[float]]:
        if not frontier:
            raise ValueError("a method's frontier has at least one point")
        for point in frontier:
            if len(point) != 2:
                raise ValueError(f"expected [time_s, energy_j] pairs, got {len(point)} numbers")
        return frontier


class Bucket(SchemaModel):
    """One sequence-length bucket of a bucketed plan (``kareus plan --seq 2048,4096,8192``):
    the plan of ``seq`` tokens, for calls of at most ``seq`` tokens longer than the bucket below."""

    seq: PositiveCount
    stages: list[Stage]
    partition_types: dict[StrictStr, PartitionTypeRecord]
    microbatch_options: dict[StrictStr, list[MicrobatchOption]]
    iteration_frontier: list[IterationPoint]
    methods: dict[StrictStr, Method]


BUCKET_FIELDS = ("stages", "partition_types", "microbatch_options", "iteration_frontier", "methods")
"""The fields a bucket holds; the plan's own are those of its largest bucket."""


class Profiling(SchemaModel):
    """What the plan's measurements cost or would cost on the device (``plan/profiling_cost.py``)."""

    measurements: Count
    duplicates: Count
    groups: PositiveCount
    gpus_per_group: PositiveCount | None = None
    window_s: Number | None = None
    cooldown_s: Number | None = None
    wall_s_on_device: Number
    gpu_hours: Number
    device: StrictStr | None = None
    by_purpose: dict[StrictStr, Count] | None = None


class StepTailRecord(SchemaModel):
    """The work after the last microbatch of every iteration (gradient sync, optimizer step;
    ``frameworks/step_tail.py``), included in every frontier's times and energies."""

    time_s: Seconds
    energy_j: Joules
    """Over all the job's GPUs."""
    parts_s: dict[StrictStr, Number]
    parameters_per_gpu: list[Number]


class RunSourceRecord(SchemaModel):
    """One run log a recalibration read, with its SHA-256."""

    path: StrictStr
    sha256: StrictStr
    iterations: PositiveCount


class RunCalibrationRecord(SchemaModel):
    """The scales ``kareus plan --calibrate-from`` applied to every price (``cost_models/run_calibration.py``)."""

    gpu: StrictStr
    time_scale: Number
    energy_scale: Number
    warmup: Count
    sources: list[RunSourceRecord]


class PlanFile(SchemaModel):
    """A schema-1 plan. ``format`` and ``schema_version`` are checked before this model runs."""

    format: Literal["kareus-plan"]
    schema_version: Literal[1]
    kareus_fx_version: StrictStr | None = None
    created_utc: StrictStr | None = None
    workload: Workload
    gpu: StrictStr
    profiler: StrictStr
    simulated: StrictBool = False
    measurement: StrictStr | None = None
    energy_scope: StrictStr
    baselines: list[StrictStr] | None = None
    max_clock_only: StrictBool = False
    """Kareus without frequency scaling (``kareus plan --max-clock-only``): every microbatch option
    runs at the GPU's maximum clock and deployment requests no clock. Absent: False."""
    stages: list[Stage]
    partition_types: dict[StrictStr, PartitionTypeRecord]
    microbatch_options: dict[StrictStr, list[MicrobatchOption]]
    iteration_frontier: list[IterationPoint]
    methods: dict[StrictStr, Method]
    buckets: list[Bucket] | None = None
    """None: a plan of one sequence length (``workload.seq``)."""
    profiling: Profiling | None = None
    """Absent in plans made before the profiling cost was recorded."""
    step_tail: StepTailRecord | None = None
    """Absent where the profiler does not price it (a measured plan) and in plans made before it."""
    run_calibration: RunCalibrationRecord | None = None
    """Absent: the simulator's own prices (no ``--calibrate-from``)."""

    @field_validator("gpu")
    @classmethod
    def _known_gpu(cls, gpu: str) -> str:
        try:
            canonical = canonical_gpu_name(gpu)
        except UnknownGPUError as err:
            raise ValueError(str(err)) from None
        if canonical != gpu:
            raise ValueError(f"expected the canonical GPU name {canonical!r}")
        return gpu

    @field_validator("iteration_frontier")
    @classmethod
    def _some_points(cls, points: list[IterationPoint]) -> list[IterationPoint]:
        if not points:
            raise ValueError("the iteration frontier has at least one point")
        return points


def cross_check(plan: PlanFile, fail: Fail) -> None:
    """Call ``fail(field, what is wrong)`` (which raises) unless the plan's parts agree (each
    bucket of a bucketed plan as a plan of its own)."""
    _cross_check_one(plan, fail)
    if plan.buckets is None:
        return
    seqs = [bucket.seq for bucket in plan.buckets]
    if not seqs or seqs != sorted(set(seqs)):
        fail("buckets", f"expected at least one bucket, in increasing distinct seq, got {seqs}")
    if seqs[-1] != plan.workload.seq:
        fail("buckets", f"the largest bucket ({seqs[-1]}) must be workload.seq ({plan.workload.seq})")
    for i, bucket in enumerate(plan.buckets):
        view = plan.model_copy(update={name: getattr(bucket, name) for name in BUCKET_FIELDS})
        _cross_check_one(view, _within(f"buckets[{i}]", fail))


def _within(prefix: str, fail: Fail) -> Fail:
    """``fail`` with every field named below ``prefix``."""

    def fail_within(where: str, what: str) -> NoReturn:
        fail(f"{prefix}.{where}", what)

    return fail_within


def _cross_check_one(plan: PlanFile, fail: Fail) -> None:
    workload, types = plan.workload, plan.partition_types
    gpu = gpu_spec(plan.gpu)

    def check_knobs(where: str, clock_mhz: int | None, comm_sms: int | None) -> None:
        """A clock and an SM count the plan's GPU has (what the simulator and the runtime accept)."""
        if clock_mhz is not None and not gpu.clock_min_mhz <= clock_mhz <= gpu.clock_max_mhz:
            fail(
                f"{where}.clock_mhz",
                f"{clock_mhz} MHz outside the {plan.gpu}'s clock range {gpu.clock_min_mhz}-{gpu.clock_max_mhz} MHz",
            )
        if comm_sms is not None and not 1 <= comm_sms < gpu.sm_count:
            fail(
                f"{where}.comm_sms", f"{comm_sms} outside 1-{gpu.sm_count - 1} (the {plan.gpu} has {gpu.sm_count} SMs)"
            )

    num_stages = workload.pp * workload.virtual_stages
    keys = [instruction_key(s, name) for s in range(num_stages) for name in INSTRUCTIONS]
    for tid, record in types.items():
        for i, slot in enumerate(record.launch_slots):
            if slot >= len(record.slots):
                fail(
                    f"partition_types.{tid}.launch_slots[{i}]",
                    f"slot {slot} outside the type's {len(record.slots)} slots",
                )
        for i, point in enumerate(record.frontier):
            check_knobs(f"partition_types.{tid}.frontier[{i}]", point.clock_mhz, point.comm_sms)
            if point.launch_slot is not None and point.launch_slot >= len(record.slots):
                fail(
                    f"partition_types.{tid}.frontier[{i}].launch_slot",
                    f"slot {point.launch_slot} outside the type's {len(record.slots)} slots",
                )

    if len(plan.stages) != num_stages:
        fail("stages", f"expected {num_stages} stages (workload.pp x workload.virtual_stages), got {len(plan.stages)}")
    if workload.stage_layers is not None:
        if len(workload.stage_layers) != num_stages:
            fail(
                "workload.stage_layers",
                f"expected one layer count per stage ({num_stages}), got {len(workload.stage_layers)}",
            )
        if workload.layers is not None and sum(workload.stage_layers) != workload.layers:
            fail(
                "workload.stage_layers",
                f"counts {workload.stage_layers} add up to {sum(workload.stage_layers)}, "
                f"not the model's {workload.layers} layers (workload.layers)",
            )
    for s, stage in enumerate(plan.stages):
        if stage.stage != s:
            fail(f"stages[{s}].stage", f"expected {s} (stages in order), got {stage.stage}")
        for name in INSTRUCTIONS:
            for local, tid in getattr(stage.graphs, name).partition_types.items():
                if tid not in types:
                    fail(f"stages[{s}].graphs.{name}.partition_types.{local}", f"unknown partition type {tid!r}")

    if sorted(plan.microbatch_options) != sorted(keys):
        fail(
            "microbatch_options",
            f"expected exactly the keys {keys} (one per stage and instruction), got {sorted(plan.microbatch_options)}",
        )
    for key, options in plan.microbatch_options.items():
        if not options:
            fail(f"microbatch_options.{key}", "must not be empty")
        for i, option in enumerate(options):
            where = f"microbatch_options.{key}[{i}]"
            check_knobs(where, option.clock_mhz, None)
            if plan.max_clock_only and option.clock_mhz != gpu.clock_max_mhz:
                fail(
                    f"{where}.clock_mhz",
                    f"a max_clock_only plan runs every microbatch at the {plan.gpu}'s "
                    f"maximum clock {gpu.clock_max_mhz} MHz, got {option.clock_mhz}",
                )
            if option.sequential != (option.configs is None):
                fail(where, "configs must be null exactly when sequential is true")
            for tid, config in (option.configs or {}).items():
                if tid not in types:
                    fail(f"{where}.configs", f"unknown partition type {tid!r}")
                check_knobs(f"{where}.configs.{tid}", None, config.comm_sms)
                n_slots = len(types[tid].slots)
                if config.launch_slot is not None and config.launch_slot >= n_slots:
                    fail(
                        f"{where}.configs.{tid}.launch_slot",
                        f"slot {config.launch_slot} outside type {tid}'s {n_slots} slots",
                    )
            stage_index, instruction = key.split("/")
            graph_types = set(getattr(plan.stages[int(stage_index)].graphs, instruction).partition_types.values())
            if option.configs is not None and set(option.configs) != graph_types:
                fail(
                    f"{where}.configs",
                    f"expected one config per partition type of the {key} graph "
                    f"{sorted(graph_types)}, got {sorted(option.configs)}",
                )

    for p, iteration_point in enumerate(plan.iteration_frontier):
        where = f"iteration_frontier[{p}].choices"
        if sorted(iteration_point.choices) != sorted(keys):
            fail(where, f"expected exactly the keys {keys}, got {sorted(iteration_point.choices)}")
        for key, indices in iteration_point.choices.items():
            if len(indices) != workload.microbatches:
                fail(
                    f"{where}.{key}",
                    f"expected {workload.microbatches} entries (one per microbatch), got {len(indices)}",
                )
            for m, index in enumerate(indices):
                if index >= len(plan.microbatch_options[key]):
                    fail(
                        f"{where}.{key}[{m}]",
                        f"option {index} out of range ({len(plan.microbatch_options[key])} options)",
                    )
