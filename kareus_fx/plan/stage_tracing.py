"""Step 1 of ``kareus plan``: trace every distinct pipeline stage (:func:`trace_plan_stages`).

A stage of more than 5 layers is traced as two slices of its layers and extended to its layer count
(``layer_slice.py``); the traces are independent and run at once, one process per core
(``capture.trace_pool``). ``"balanced"`` stage splits are resolved here (``stage_balance.py``)."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kareus_fx.capture.dump import load_dump
from kareus_fx.capture.trace_pool import run_calls
from kareus_fx.capture.tracing import TraceSpec, distinct_stages, trace_both_splits
from kareus_fx.cost_models.hardware import canonical_gpu_name
from kareus_fx.cost_models.simulated_profiler import SimulatedProfiler
from kareus_fx.cost_models.simulator import Simulator
from kareus_fx.errors import UnsupportedGraphError
from kareus_fx.frameworks.base import BackwardReprice
from kareus_fx.frameworks.pipeline_sends import boundary_bytes
from kareus_fx.frameworks.registry import framework_for
from kareus_fx.frameworks.traced_order import model_layers
from kareus_fx.models.configs import get_config
from kareus_fx.models.stage_layers import StageRole, even_layer_counts, stage_role
from kareus_fx.plan.graph_workload import (
    PartitionedGraph,
    SequentialGraph,
    graph_fingerprint,
    partitioned_graphs,
    sequential_graphs,
    with_extra_ops,
)
from kareus_fx.plan.layer_slice import (
    SLICE_LAYERS,
    SPARSE_SLICE_LAYERS,
    SliceNotRepresentativeError,
    block_dump,
    extend_dump,
    slice_pays,
)
from kareus_fx.plan.profiler_capabilities import profiler_capabilities
from kareus_fx.plan.request import LIVE_GRAPH_MODEL, PlanRequest
from kareus_fx.plan.stage_balance import StageCost, balanced_layer_counts, cost_from_slices
from kareus_fx.workload import GraphName, Measurement


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
    """Bytes of the activation the stage sends on to the next (``pipeline_sends.boundary_bytes``)."""


def trace_plan_stages(
    req: PlanRequest, dump_root: Path, load: LoadedDumps | None = None
) -> tuple[PlanRequest, list[StageGraphs]]:
    """``req`` with its stage split resolved, and every distinct stage's graphs (:func:`trace_stages`).

    ``"balanced"`` traces each stage role's slices first (:func:`slice_layers`), prices
    them as the request's training framework runs them on the simulated GPU at its maximum clock
    and takes the split that evens out the stages (``stage_balance.py``); the stages' graphs then extend the same
    slices (or trace the stages in full, where slicing does not apply). ``load`` reads each dump
    once (:class:`LoadedDumps`); pass the planner's, and later steps read the same dumps from it."""
    load = load or LoadedDumps()
    if req.stage_layers != "balanced":
        return req, with_framework_work(req, trace_stages(req, dump_root, None, load))
    if req.num_stages == 1:
        req = dataclasses.replace(req, stage_layers="even")
        return req, with_framework_work(req, trace_stages(req, dump_root, None, load))
    first_stage_of_role = {stage_role(i, req.num_stages): i for i in reversed(range(req.num_stages))}
    dumps = _run_traces(
        {
            stage: [_slice_trace(req, stage, layers, dump_root) for layers in slice_layers(req.model)]
            for stage in first_stage_of_role.values()
        }
    )
    role_slices = {role: dumps[stage] for role, stage in first_stage_of_role.items()}
    req = dataclasses.replace(req, stage_layers=_balanced_stage_layers(req, role_slices, load))
    return req, with_framework_work(req, trace_stages(req, dump_root, role_slices, load))


def slice_layers(model: str) -> tuple[int, int]:
    """The layer counts of ``model``'s slice traces (``layer_slice.py``): ``SPARSE_SLICE_LAYERS`` for a
    mixture of experts, else ``SLICE_LAYERS``."""
    return SLICE_LAYERS if get_config(model).moe is None else SPARSE_SLICE_LAYERS


def layers_alike(model: str) -> bool:
    """Whether every decoder layer of ``model`` has one structure, as slices assume (``layer_slice.py``):
    not a mixture of experts whose first layers are dense, whose slice models (a few layers per stage)
    would put the dense layers elsewhere than the model does."""
    moe = get_config(model).moe
    return moe is None or moe.dense_layers == 0


def prices_framework_work(req: PlanRequest) -> bool:
    """Whether the plan adds the framework's work the traced model does not run
    (``TrainingFramework.extra_work``): where the profiler can price it and the stages are a
    reference model's (not a live graph, whose config is unknown, nor a block plan, priced as its
    blocks alone)."""
    return (
        profiler_capabilities(req.profiler).prices_untraced_work
        and req.model != LIVE_GRAPH_MODEL
        and req.compile_unit != "block"
    )


def with_framework_work(req: PlanRequest, traced: list[StageGraphs]) -> list[StageGraphs]:
    """``traced`` with the work the request's training framework runs that the traced model does
    not (``TrainingFramework.extra_work``), where :func:`prices_framework_work`."""
    if not prices_framework_work(req):
        return traced
    framework = framework_for(req)
    extras = [framework.extra_work(req, graphs.stages[0]) for graphs in traced]
    if not any(extras):
        return traced
    priced = []
    for graphs, extra in zip(traced, extras, strict=True):
        sequential, partitioned = with_extra_ops(graphs.sequential, graphs.partitioned, extra)
        priced.append(dataclasses.replace(graphs, sequential=sequential, partitioned=partitioned))
    return priced


def backward_repricing(
    req: PlanRequest, traced: Sequence[StageGraphs], load: Callable[[Path], Mapping[str, Any]] = load_dump
) -> list[dict[str, BackwardReprice | None]]:
    """Per traced stage group, how the request's framework runs its backward
    (``TrainingFramework.backward_repricing``: by "sequential" and "outside"), from the group's
    dumps, with the framework's extra backward work; empty where the profiler cannot price work
    the traced model does not run (it measures the traced order)."""
    if not profiler_capabilities(req.profiler).prices_untraced_work:
        return [{} for _ in traced]
    framework = framework_for(req)
    repricing = []
    for graphs in traced:
        kinds = ("sequential",) if graphs.partitioned is None else ("sequential", "nanobatched")
        extra = framework.extra_work(req, graphs.stages[0]) if prices_framework_work(req) else {}
        repricing.append(
            framework.backward_repricing(
                req, {kind: graphs.dump_paths[kind] for kind in kinds}, load, extra.get("backward", ())
            )
        )
    return repricing


def repriced(
    measured: Mapping[int, Measurement], graph: SequentialGraph, reprice: BackwardReprice | None, gpu: str
) -> dict[int, Measurement]:
    """``measured`` as ``reprice`` prices ``graph`` on the simulated ``gpu`` (None: unchanged)."""
    if reprice is None:
        return dict(measured)
    return reprice.reprice(measured, graph, _reprice_simulator(canonical_gpu_name(gpu)))


@functools.cache
def _reprice_simulator(gpu: str) -> Simulator:
    """One simulator per GPU for the backward repricing (its caches serve every stage and clock)."""
    return SimulatedProfiler(gpu).simulator


def _balanced_stage_layers(
    req: PlanRequest,
    role_slices: Mapping[StageRole, Sequence[Mapping[str, Path]]],
    load: LoadedDumps,
) -> tuple[int, ...]:
    """The balanced split (``stage_balance.py``): each role's cost priced from its un-split slice
    dumps, each stage's plus the pipeline sends it ends with (``pipeline_sends.py``)."""
    profiler = SimulatedProfiler(canonical_gpu_name(req.gpu))
    spec = profiler.simulator.spec
    framework = framework_for(req)
    reprices = profiler_capabilities(req.profiler).prices_untraced_work
    paths = {role: [kinds["sequential"] for kinds in slices] for role, slices in role_slices.items()}

    def step_s(path: Path) -> float:
        total_s = 0.0
        for name, g in sequential_graphs(load(path)).items():
            m = {spec.clock_max_mhz: profiler.measure_sequence(g.ops, g.collectives, spec.clock_max_mhz)}
            if name == "backward" and reprices:
                reprice = framework.backward_repricing(req, {"sequential": path}, load).get("sequential")
                m = repriced(m, g, reprice, req.gpu)
            total_s += m[spec.clock_max_mhz].time_s
        return total_s

    role_costs = {
        role: cost_from_slices(step_s(short), step_s(long), slice_layers(req.model)[0])
        for role, (short, long) in paths.items()
    }
    roles = [stage_role(s, req.num_stages) for s in range(req.num_stages)]
    sends = framework.pipeline_sends(req, [boundary_bytes(load(paths[role][0])) for role in roles], spec)
    return balanced_layer_counts(
        model_layers(req),
        [
            StageCost(
                role_costs[role].fixed_s + sends[(s, "forward")] + sends[(s, "backward")], role_costs[role].per_layer_s
            )
            for s, role in enumerate(roles)
        ],
    )


def trace_stages(
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
        if not req.full_trace
        and profiler_capabilities(req.profiler).prices_untraced_work
        and layers_alike(req.model)
        and slice_pays(group.num_layers, slice_layers(req.model))
    }
    slice_at: dict[StageRole, int] = {}
    for group in groups:
        if group.stages[0] in sliced and group.role not in role_slices:
            slice_at.setdefault(group.role, group.stages[0])
    traces = {
        stage: [_slice_trace(req, stage, layers, dump_root) for layers in slice_layers(req.model)]
        for stage in slice_at.values()
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
            paths[stage] = _extend_slices(
                stage, group.num_layers, slice_layers(req.model)[1], (short, long), dump_root, load
            )
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
    order = pool_order([trace_cost(call.args[0]) for call in calls], processes)
    by_call = dict(zip(order, run_calls([calls[i] for i in order], processes), strict=True))
    results = iter(by_call[i] for i in range(len(calls)))
    return {
        stage: [dict(zip(("nanobatched", "sequential"), next(results), strict=True)) for _ in stage_traces]
        for stage, stage_traces in traces.items()
    }


def trace_cost(spec: TraceSpec) -> float:
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
    stage: int,
    num_layers: int,
    long_layers: int,
    slices: tuple[Mapping[str, Path], Mapping[str, Path]],
    dump_root: Path,
    load: LoadedDumps,
) -> dict[str, Path]:
    """Dumps of stage ``stage`` at ``num_layers`` layers, extended from the dumps of its slices of
    ``long_layers - 1`` and ``long_layers`` layers (``layer_slice.py``), nanobatched and sequential."""
    short, long = slices
    paths = {}
    dump_root.mkdir(parents=True, exist_ok=True)
    for kind in ("nanobatched", "sequential"):
        paths[kind] = dump_root / f"stage{stage}-{kind}-extended.json"
        extended = extend_dump(load(short[kind]), load(long[kind]), long_layers, num_layers, f"stage {stage} {kind}")
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
    sent_bytes = (
        None if boundary is None else boundary_bytes(sequential_dump if boundary == sequential else load(boundary))
    )
    return StageGraphs(
        stages=stages,
        sequential=sequential_by_name,
        partitioned=partitioned,
        dump_paths={"nanobatched": nanobatched, "sequential": sequential},
        sent_bytes=sent_bytes,
    )
