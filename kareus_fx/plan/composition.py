"""Step 3 of ``kareus plan``: measure the baselines' microbatches, lengthen each instruction by the
pipeline send it ends with (``pipeline_sends.py``), compose every method's iteration frontier
over the pipeline (lowtime), add the step tail and price the power-limit curves."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kareus_fx.capture.trace_pool import run_calls, start_method
from kareus_fx.compose.iteration import IterationFrontier
from kareus_fx.compose.microbatch import MicrobatchFrontier, MicrobatchPoint, pareto_front
from kareus_fx.compose.pipeline_schedule import INSTRUCTIONS, PipelineNode
from kareus_fx.compose.slack import with_reclaimed_fastest
from kareus_fx.compose.solve_pool import compose_iterations
from kareus_fx.cost_models.hardware import GPUSpec, canonical_gpu_name, gpu_spec
from kareus_fx.cost_models.sim_params import gpu_params
from kareus_fx.cost_models.simulated_profiler import SimulatedProfiler
from kareus_fx.errors import OptionsError
from kareus_fx.frameworks.base import BackwardReprice
from kareus_fx.frameworks.registry import framework_for
from kareus_fx.frameworks.step_tail import StepTail, with_step_tail
from kareus_fx.plan.graph_workload import PartitionedGraph
from kareus_fx.plan.kareus_power_limit_curves import NodeWork, kareus_power_limit_curves
from kareus_fx.plan.methods import (
    METHODS,
    as_options,
    kareus_microbatch_frontier,
    nanobatching_config,
    nanobatching_measurements,
    sequential_measurements,
)
from kareus_fx.plan.metrics import frontier_metrics
from kareus_fx.plan.power_limit_baseline import (
    POWER_LIMIT_METHOD,
    PowerLimitPoint,
    iteration_of,
    power_limit_curve,
    zeus_choice,
)
from kareus_fx.plan.profiler_capabilities import profiler_capabilities
from kareus_fx.plan.profilers import LocalKey, simulated_profiler
from kareus_fx.plan.request import LIVE_GRAPH_MODEL, PlanRequest
from kareus_fx.plan.solver_sizing import composition_quantum
from kareus_fx.plan.stage_tracing import (
    StageGraphs,
    parallel_processes,
    repriced,
)
from kareus_fx.tuner.space import clock_grid_mhz
from kareus_fx.workload import GraphName, Measurement

PARALLEL_COMPOSE_MIN_NODES = 1000
"""Pipelines of at least this many (stage, instruction, microbatch) nodes compose the methods'
frontiers in parallel processes (``compose.solve_pool``; PP10 x 128 microbatches has 2560): a
solve there takes seconds to minutes per method, against about a second to start a process."""


@dataclass
class Composed:
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


def compose_methods(req, traced, repricing, ptypes, local_to_plan, tuned, profiler, progress) -> Composed:
    """Every method's iteration frontier over the pipeline (module docstring); ``repricing``: per
    traced stage group, how the framework runs its backward (``stage_tracing.backward_repricing``)."""
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
                sequential = repriced(sequential, stage.sequential[name], repricing[g].get("sequential"), req.gpu)
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
                    outside = repriced(outside, graph.outside, repricing[g].get("outside"), req.gpu)
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
            (s, name): with_link_wait(
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
        curve.extend(
            _power_limit_curve(req, traced, repricing, stage_group, waits_s, spec, spec.tuning_clock_min_mhz, scale)
        )

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
    tail = planned_step_tail(req, spec)
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
        repricing,
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
    return Composed(
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
    repricing: Sequence[Mapping[str, BackwardReprice | None]],
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
    if not profiler_capabilities(req.profiler).prices_power_limits:
        return {False: [], True: []}
    gpu = canonical_gpu_name(req.gpu)
    fastest = min(kareus.points, key=lambda p: (p.time_s, p.energy_j))

    def work(node: PipelineNode, option: MicrobatchPoint) -> NodeWork:
        stage = traced[stage_group[node.stage]]
        reprices = repricing[stage_group[node.stage]]
        partitioned = stage.partitioned and stage.partitioned.get(node.instruction)
        return NodeWork(
            option=option,
            sequential=stage.sequential[node.instruction],
            partitioned=None
            if not partitioned
            else _with_plan_ids(partitioned, stage_group[node.stage], local_to_plan),
            wait_s=waits_s[(node.stage, node.instruction)],
            sequential_reprice=reprices.get("sequential") if node.instruction == "backward" else None,
            outside_reprice=reprices.get("outside") if node.instruction == "backward" else None,
        )

    curves = functools.partial(
        kareus_power_limit_curves,
        {node: work(node, option) for node, option in kareus.plan(fastest).items()},
        functools.partial(simulated_profiler, gpu),
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


def _power_limit_curve(
    req: PlanRequest,
    traced: Sequence[StageGraphs],
    repricing: Sequence[Mapping[str, BackwardReprice | None]],
    stage_group: Mapping[int, int],
    waits_s: Mapping[tuple[int, GraphName], float],
    spec: GPUSpec,
    lowest_clock_mhz: int,
    energy_scale: float,
) -> list[PowerLimitPoint]:
    """Megatron-LM's iteration under each job-wide power limit (``power_limit_baseline.py``); empty for
    a profiler that cannot price a power limit (the on-device one never sets it)."""
    if not profiler_capabilities(req.profiler).prices_power_limits:
        return []
    gpu = canonical_gpu_name(req.gpu)

    def measure_at(limit_w: int | None, clock_mhz: int = spec.clock_max_mhz) -> dict[tuple[int, str], Measurement]:
        profiler = SimulatedProfiler(gpu, power_limit_w=limit_w)
        # once per distinct stage (its stages run the same graphs), deterministic
        by_group = {}
        for g, graphs in enumerate(traced):
            for instruction in INSTRUCTIONS:
                graph = graphs.sequential[instruction]
                measured = {clock_mhz: profiler.measure_sequence(graph.ops, graph.collectives, clock_mhz)}
                reprice = repricing[g].get("sequential") if instruction == "backward" else None
                if reprice is not None:
                    measured = reprice.reprice(measured, graph, profiler.simulator)
                by_group[(g, instruction)] = measured[clock_mhz]
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


def planned_step_tail(req: PlanRequest, spec: GPUSpec) -> StepTail | None:
    """The work after the last microbatch (``TrainingFramework.step_tail``) on the simulated GPU;
    None for a profiler that cannot price work the traced model does not run (it measures the
    microbatches' graphs, not the optimizer) or a live graph (no model config to count parameters)."""
    if not profiler_capabilities(req.profiler).prices_untraced_work or req.model == LIVE_GRAPH_MODEL:
        return None
    return framework_for(req).step_tail(req, SimulatedProfiler(spec.name).simulator)


def _with_tail_points(points: Sequence[PowerLimitPoint], tail: StepTail, scale: float) -> list[PowerLimitPoint]:
    """Power-limit curve points lengthened by ``tail`` (energies over all GPUs: ``scale`` x one pipeline's)."""
    return [
        dataclasses.replace(p, time_s=p.time_s + tail.time_s, energy_j=p.energy_j + tail.energy_j * scale)
        for p in points
    ]


def _send_recv_s(
    req: PlanRequest, traced: Sequence[StageGraphs], stage_group: Mapping[int, int], spec: GPUSpec
) -> dict[tuple[int, GraphName], float]:
    """Per (stage, instruction), the blocking pipeline send it ends with (``pipeline_sends.py``)."""
    if req.num_stages == 1:
        return {(0, "forward"): 0.0, (0, "backward"): 0.0}
    sent_bytes = {g: stage.sent_bytes for g, stage in enumerate(traced) if stage.sent_bytes is not None}
    missing = [g for g in range(len(traced)) if g not in sent_bytes]
    if missing:
        raise OptionsError(
            f"a {req.num_stages}-stage pipeline needs the activation each stage sends on, but the traced "
            f"stage group(s) {missing} hold none: build them with stage_graphs_from_dumps(boundary=...)"
        )
    return framework_for(req).pipeline_sends(req, [sent_bytes[stage_group[s]] for s in range(req.num_stages)], spec)


def with_link_wait(options: Sequence[Any], wait_s: float, power_w: float) -> list[Any]:
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
