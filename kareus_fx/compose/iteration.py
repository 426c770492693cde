"""Microbatch frontiers -> iteration frontier over the 1F1B pipeline, the Perseus way.

Every (stage, instruction, microbatch) node of the 1F1B DAG (``pipeline_schedule.py``) picks one of the
options of its (stage, instruction): a clock for Perseus, a :class:`MicrobatchPoint` for Kareus.
Each option has a time and an energy. For every iteration time from the slowest plan down to the
fastest, lowtime's Phillips-Dessouky solver (what Perseus uses; not reimplemented here) finds
the plan of least energy, one time quantum at a time.

Energy accounting (Perseus): each stage's GPU is either running one of its instructions or
blocked waiting on pipeline communication (bubbles, waits) for the rest of the iteration, at the
GPU's communication-blocking power ``blocking_power_w``:

    energy = sum of chosen option energies + blocking_power_w * (G * T - sum of chosen times)

As Perseus does, the solver works on *effective* option costs ``energy - blocking_power_w * time``
(the energy above what blocking would have cost), so the static term is ``G * T * P_block`` with ``G``
the GPUs (stages / virtual stages per GPU).

Time quantum: lowtime's solver works on integer time units (``quant_time = floor(time /
unit_time)``) and shortens the iteration by one unit per step, so the frontier has one point per
unit between the slowest and the fastest plan. The default ``unit_time_s = 1 ms`` is Perseus's
(the reference frontiers in ``bench/validate_composer.py`` were made with it): the solve takes
(T_max - T_min) / unit steps, each a max-flow on the critical DAG. A plan's real time can exceed
its quantized time by less than one unit per instruction on the critical path.

Adaptive quantum (``max_solver_steps``): the number of steps grows with the pipeline (about
``(N + S) x (slowest - fastest instruction time) / unit``: ~10^4 at 1 ms for 10 stages x 128
microbatches of 0.1 / 0.2 s instructions), so a caller with a time budget can bound it instead:
:func:`choose_unit_time_s` picks the smallest quantum ``>= unit_time_s`` for which the solve takes
at most ``max_solver_steps`` steps (the quantized span of the slowest and fastest plans, counted
on lowtime's own candidate options). What a coarser quantum ``u`` costs:

- every frontier point is still a real plan, re-evaluated exactly (measured time and energy);
- a plan's measured time exceeds its quantized time by less than ``u`` per instruction on its
  critical path (``floor`` quantization), so the solver's ranking of plans near the same time
  is only that precise;
- options closer than ``u`` collapse to one (lowtime keeps the fastest per quantum), so fewer
  clock choices per instruction remain and the frontier can lose energy it would have found
  with a finer quantum. ``bench/compose_scaling.py`` measures that loss against the 1 ms solve
  (synthetic clock sweeps: about 1% more energy at a given deadline with a 2-3x coarser
  quantum, 2-4% at 5-10x);
- the solver's last plan (least quantized time) can be slower than the fastest possible plan by
  up to ``u`` per critical instruction. With a coarsened quantum the composer therefore walks
  on from that plan: each walk step moves every instruction on the measured critical path to
  its next faster option, until the critical path runs only fastest options (the least
  iteration time). Those plans join the frontier candidates (not the ``trace``; their
  ``solver_*`` fields are NaN).

Cost model (lowtime fits one per (stage, instruction) over the quantized time; the solver needs
it convex to be exact):

- ``"convex"`` (default): the lower convex hull of the options' (quantized time, effective
  energy), linear between hull vertices. Exact at every hull option; never fails to fit.
- ``"exponential"``: lowtime's ``ExponentialModel`` (``a * exp(b * t) + c``), grid search with
  strategy ``"best"``, as the Perseus artifact fits it. Reproduces the artifact's numbers;
  needs at least 3 options per (stage, instruction) (fewer fall back to ``"convex"``).

Solver loop: ``solver_loop="fast"`` (default) runs lowtime's iteration through
``solver_loop.py``, which keeps lowtime's flow-bound rule, Rust min-cut and duration changes but
builds no graph per step (critical edges, bounds and min-cut input over precomputed index lists;
on 10 stages x 128 microbatches the Rust min-cut is then most of a step; the same plans step by
step);
``solver_loop="lowtime"`` runs ``PhillipsDessouky.run`` itself.

Whatever model guides the solver, each frontier point is re-evaluated exactly: ``time_s`` is the
critical path of the chosen options' measured times and ``energy_j`` the accounting above with
their measured energies. ``solver_time_s`` / ``solver_energy_j`` keep lowtime's quantized time and
model energy (what the Perseus artifact reports).
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal, Protocol

import networkx as nx
import numpy as np
from lowtime.cost_model import CostModel, ExponentialModel
from lowtime.graph_utils import add_sink_node, add_source_node
from lowtime.operation import CandidateExecutionOptions, ExecutionOption, OperationSpec
from lowtime.perseus.instruction import Backward, Forward
from lowtime.perseus.instruction import Instruction as LowtimeInstruction
from lowtime.solver import PhillipsDessouky

from kareus_fx.capture.gc_freeze import heap_frozen
from kareus_fx.compose.critical_path import NodeWeightedDag
from kareus_fx.compose.microbatch import pareto_front
from kareus_fx.compose.pipeline_schedule import (
    INSTRUCTIONS,
    CompositionError,
    Instruction,
    PipelineNode,
    iteration_energy_j,
    pipeline_dag,
    pipeline_makespan_s,
)
from kareus_fx.compose.solver_loop import MIN_CUTS, MinCut, run_phillips_dessouky

__all__ = [
    "ConvexPiecewiseLinearModel",
    "InstructionOption",
    "IterationFrontier",
    "IterationPoint",
    "choose_unit_time_s",
    "compose_iteration",
    "count_solver_steps",
]

logger = logging.getLogger(__name__)

CostModelName = Literal["convex", "exponential"]
SolverLoop = Literal["fast", "lowtime"]
DEFAULT_UNIT_TIME_S = 1e-3
"""Perseus's time quantum (its planner's ``unit_time`` default)."""


class OptionLike(Protocol):
    """Anything with a time and an energy: :class:`InstructionOption`, ``MicrobatchPoint``."""

    time_s: float
    energy_j: float


@dataclass(frozen=True)
class InstructionOption:
    """One way to run one instruction (a forward or backward microbatch) of one stage."""

    time_s: float
    energy_j: float
    knob: Hashable = None
    """What to run: a clock in MHz for a Perseus profile, anything hashable otherwise."""


@dataclass(frozen=True)
class IterationPoint:
    """One plan on the iteration frontier."""

    time_s: float
    """Critical path of the chosen options' measured times."""
    energy_j: float
    """Chosen options' measured energies plus blocking power times idle GPU time."""
    solver_time_s: float
    """lowtime's quantized iteration time (quant_time x unit_time); NaN for a plan of the
    fast-end walk after a coarsened solve (module docstring)."""
    solver_energy_j: float
    """lowtime's model energy plus ``G x solver_time_s x blocking power`` (Perseus's number);
    NaN where ``solver_time_s`` is."""
    choices: np.ndarray = field(compare=False, repr=False)
    """Index of the chosen option per node, in :attr:`IterationFrontier.nodes` order."""


@dataclass(frozen=True)
class IterationFrontier:
    """The iteration time-energy frontier and every plan the solver walked through."""

    num_stages: int
    num_microbatches: int
    blocking_power_w: float
    unit_time_s: float
    cost_model: CostModelName
    nodes: tuple[PipelineNode, ...]
    options: Mapping[tuple[int, Instruction], tuple[Any, ...]]
    """The options as given, per (stage, instruction); ``choices`` index into these."""
    points: tuple[IterationPoint, ...]
    """Pareto-optimal plans by measured time and energy, fastest first (among the trace and,
    after a coarsened solve, the fast-end walk)."""
    trace: tuple[IterationPoint, ...]
    """Every plan in solver order: the slowest plan first, then one per solver step."""
    virtual_stages: int = 1
    """Stages per GPU (interleaved 1F1B when above 1); ``num_stages`` counts global stages."""

    @property
    def num_gpus(self) -> int:
        """GPUs of the pipeline (one per rank)."""
        return self.num_stages // self.virtual_stages

    def plan(self, point: IterationPoint) -> dict[PipelineNode, Any]:
        """The chosen option of every (stage, instruction, microbatch) node at ``point``."""
        return {
            node: self.options[(node.stage, node.instruction)][int(index)]
            for node, index in zip(self.nodes, point.choices)
        }

    def option(self, point: IterationPoint, stage: int, instruction: Instruction, microbatch: int) -> Any:
        """The chosen option of one node at ``point``."""
        index = self._node_index[PipelineNode(stage, instruction, microbatch)]
        return self.options[(stage, instruction)][int(point.choices[index])]

    @cached_property
    def _node_index(self) -> dict[PipelineNode, int]:
        return {node: i for i, node in enumerate(self.nodes)}


class ConvexPiecewiseLinearModel(CostModel):
    """Lower convex hull of the candidate options' (quant_time, cost), linear in between.

    Exact at hull options; outside the options' range it extends the end segments (the solver
    only asks within it). A single option gives a constant.
    """

    def __init__(self, options: CandidateExecutionOptions) -> None:
        points = sorted((o.quant_time, o.cost) for o in options.options)
        hull: list[tuple[float, float]] = []
        for q, c in points:
            while len(hull) >= 2:
                (q0, c0), (q1, c1) = hull[-2], hull[-1]
                # Drop the middle point unless it lies strictly below the chord.
                if (q1 - q0) * (c - c0) - (c1 - c0) * (q - q0) <= 0:
                    hull.pop()
                else:
                    break
            hull.append((q, c))
        self.quant_times = np.array([q for q, _ in hull], dtype=float)
        self.costs = np.array([c for _, c in hull], dtype=float)
        self._cache: dict[int, float] = {}

    def __call__(self, quant_time: int) -> float:
        # The solver asks for the same few integer times over and over: memoize.
        try:
            return self._cache[quant_time]
        except KeyError:
            value = self._cache[quant_time] = self._evaluate(quant_time)
            return value

    def _evaluate(self, quant_time: int) -> float:
        q, c = self.quant_times, self.costs
        if len(q) == 1:
            return float(c[0])
        if quant_time <= q[0]:
            return float(c[0] + (c[1] - c[0]) / (q[1] - q[0]) * (quant_time - q[0]))
        if quant_time >= q[-1]:
            return float(c[-1] + (c[-1] - c[-2]) / (q[-1] - q[-2]) * (quant_time - q[-1]))
        return float(np.interp(quant_time, q, c))


@contextmanager
def _quiet_lowtime() -> Iterator[None]:
    """lowtime logs every sped-up operation at INFO (its Rust min-cut under ``_lowtime_rs``);
    keep that out of the caller's logs (and skip formatting records nobody reads)."""
    loggers = [logging.getLogger(name) for name in ("lowtime", "_lowtime_rs")]
    previous = [lt_logger.level for lt_logger in loggers]
    for lt_logger, level in zip(loggers, previous):
        lt_logger.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        for lt_logger, level in zip(loggers, previous):
            lt_logger.setLevel(level)


def _finite_or_none(value: object) -> int | float | None:
    """``value`` when it is a finite int or float, else None."""
    return value if isinstance(value, (int, float)) and math.isfinite(value) else None


def _normalize_options(
    options: Mapping[tuple[int, Instruction], Sequence[OptionLike] | Any],
    unit_time_s: float,
    virtual_stages: int = 1,
) -> tuple[int, dict[tuple[int, Instruction], tuple[Any, ...]]]:
    if not options:
        raise CompositionError("no options given: need forward and backward options per stage")
    normalized: dict[tuple[int, Instruction], tuple[Any, ...]] = {}
    for key, value in options.items():
        if not (isinstance(key, tuple) and len(key) == 2):
            raise CompositionError(f"option keys must be (stage, instruction) pairs, got {key!r}")
        stage, instruction = key
        if instruction not in INSTRUCTIONS:
            raise CompositionError(f"unknown instruction {instruction!r} for stage {stage}: use one of {INSTRUCTIONS}")
        if not isinstance(stage, int) or isinstance(stage, bool) or stage < 0:
            raise CompositionError(f"stage must be an integer >= 0, got {stage!r}")
        items = tuple(value.points if hasattr(value, "points") else value)
        if not items:
            raise CompositionError(f"stage {stage} {instruction} has no options")
        for option in items:
            t, e = _finite_or_none(getattr(option, "time_s", None)), _finite_or_none(getattr(option, "energy_j", None))
            if t is None or e is None:
                raise CompositionError(
                    f"stage {stage} {instruction}: option {option!r} needs a finite time_s and energy_j"
                )
            if e < 0:
                raise CompositionError(f"stage {stage} {instruction}: negative energy in {option!r}")
            if t < unit_time_s:
                raise CompositionError(
                    f"stage {stage} {instruction}: option time {t} s is below the time quantum "
                    f"{unit_time_s} s; pass a smaller unit_time_s"
                )
        normalized[(stage, instruction)] = items
    stages = sorted({stage for stage, _ in normalized})
    num_stages = stages[-1] + 1
    missing = [f"stage {s} {inst}" for s in range(num_stages) for inst in INSTRUCTIONS if (s, inst) not in normalized]
    if missing:
        raise CompositionError(
            f"missing options for {', '.join(missing)} (stages must be 0..{num_stages - 1}, "
            "each with forward and backward options)"
        )
    if not isinstance(virtual_stages, int) or isinstance(virtual_stages, bool) or virtual_stages < 1:
        raise CompositionError(f"virtual_stages must be a positive integer, got {virtual_stages!r}")
    if num_stages % virtual_stages:
        raise CompositionError(
            f"{num_stages} stages do not divide into {virtual_stages} virtual stages per GPU: give options "
            f"for pp x virtual_stages global stages"
        )
    return num_stages, normalized


def _candidates(items: tuple[Any, ...], unit_time_s: float) -> CandidateExecutionOptions[int]:
    """Pareto filter, then one option per quantized time (lowtime keeps the costliest, i.e. the
    fastest within the quantum): the same candidate set the Perseus planner uses."""
    return CandidateExecutionOptions[int](
        options=[
            ExecutionOption[int](real_time=float(o.time_s), unit_time=unit_time_s, cost=float(o.energy_j), knob=i)
            for i, o in enumerate(items)
        ]
    )


def _quantized_span(
    pipeline: tuple[int, int, int], options: Mapping[tuple[int, Instruction], tuple[Any, ...]], unit: float
) -> int:
    """Solver steps at quantum ``unit`` (an upper bound: lowtime may stop earlier): quantized
    critical path of the slowest plan minus that of the fastest, over the pipeline of
    ``pipeline`` = (ranks, microbatches, virtual stages)."""
    ranges = {}
    for key, items in options.items():
        quant_times = [o.quant_time for o in _candidates(items, unit).options]
        ranges[key] = (min(quant_times), max(quant_times))
    slowest = pipeline_makespan_s(*pipeline, lambda n: ranges[(n.stage, n.instruction)][1])
    fastest = pipeline_makespan_s(*pipeline, lambda n: ranges[(n.stage, n.instruction)][0])
    return int(slowest - fastest)


def choose_unit_time_s(
    options: Mapping[tuple[int, Instruction], Sequence[OptionLike] | Any],
    num_microbatches: int,
    max_steps: int,
    *,
    min_unit_time_s: float = DEFAULT_UNIT_TIME_S,
    virtual_stages: int = 1,
) -> float:
    """The smallest time quantum ``>= min_unit_time_s`` whose solve takes ``<= max_steps`` steps.

    Counts steps the way lowtime does (the quantized critical path of the slowest plan minus
    that of the fastest, on lowtime's candidate options); see the module docstring for what a
    coarser quantum costs.

    Raises:
        CompositionError: ``max_steps`` is not a positive integer, or so few steps would need a
            quantum above the shortest option time (the fix: allow more steps).
    """
    if not isinstance(max_steps, int) or isinstance(max_steps, bool) or max_steps < 1:
        raise CompositionError(f"max_solver_steps must be an integer >= 1, got {max_steps!r}")
    _check_unit_time(min_unit_time_s)
    num_stages, normalized = _normalize_options(options, min_unit_time_s, virtual_stages)
    pipeline = (num_stages // virtual_stages, num_microbatches, virtual_stages)
    shortest_s = min(float(o.time_s) for items in normalized.values() for o in items)
    fine_steps = _quantized_span(pipeline, normalized, min_unit_time_s)
    unit = min_unit_time_s * max(1.0, fine_steps / max_steps)
    while unit <= shortest_s:
        steps = _quantized_span(pipeline, normalized, unit)
        if steps <= max_steps:
            return unit
        # Floor quantization adds up to one unit per critical instruction: grow by the excess.
        unit *= max(steps / max_steps, 1.01)
    raise CompositionError(
        f"max_solver_steps={max_steps} is too few for {num_stages} stages x "
        f"{num_microbatches} microbatches: the time quantum would exceed the shortest "
        f"option time ({shortest_s:.4g} s); pass a larger max_solver_steps (a quantum of half the "
        f"shortest option time takes {_quantized_span(pipeline, normalized, shortest_s / 2)} steps)"
    )


def count_solver_steps(
    options: Mapping[tuple[int, Instruction], Sequence[OptionLike] | Any],
    num_microbatches: int,
    unit_time_s: float = DEFAULT_UNIT_TIME_S,
    *,
    virtual_stages: int = 1,
) -> int:
    """At most how many solver steps :func:`compose_iteration` takes at quantum ``unit_time_s``."""
    _check_unit_time(unit_time_s)
    num_stages, normalized = _normalize_options(options, unit_time_s, virtual_stages)
    return _quantized_span((num_stages // virtual_stages, num_microbatches, virtual_stages), normalized, unit_time_s)


def _check_unit_time(unit_time_s: Any) -> None:
    if not (isinstance(unit_time_s, (int, float)) and math.isfinite(unit_time_s) and unit_time_s > 0):
        raise CompositionError(f"unit_time_s must be a positive number, got {unit_time_s!r}")


def _operation_spec(
    items: tuple[Any, ...],
    unit_time_s: float,
    blocking_power_w: float,
    cost_model: CostModelName,
    label: str,
) -> OperationSpec[int]:
    candidates = _candidates(items, unit_time_s)
    for option in candidates.options:
        option.cost -= blocking_power_w * option.quant_time * option.unit_time
    model: CostModel
    if cost_model == "exponential" and len(candidates.options) >= 3:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # scipy's fit warnings on rejected initial guesses
            try:
                model = ExponentialModel(candidates, search_strategy="best")
            except (ValueError, RuntimeError) as e:
                raise CompositionError(
                    f'{label}: lowtime\'s exponential cost model did not fit ({e}); use cost_model="convex"'
                ) from e
    else:
        if cost_model == "exponential":
            logger.info(
                "%s: %d candidate options, too few to fit an exponential; using the convex model",
                label,
                len(candidates.options),
            )
        model = ConvexPiecewiseLinearModel(candidates)
    return OperationSpec[int](options=candidates, cost_model=model)


def compose_iteration(
    options: Mapping[tuple[int, Instruction], Sequence[OptionLike] | Any],
    num_microbatches: int,
    *,
    blocking_power_w: float,
    unit_time_s: float = DEFAULT_UNIT_TIME_S,
    cost_model: CostModelName = "convex",
    progress: bool = False,
    max_solver_steps: int | None = None,
    solver_loop: SolverLoop = "fast",
    virtual_stages: int = 1,
    min_cut: MinCut = "dinic",
    fast_end_walk: bool | None = None,
) -> IterationFrontier:
    """The iteration time-energy frontier of a 1F1B or interleaved 1F1B pipeline.

    Args:
        options: per ``(stage, instruction)`` (stages ``0..S-1``, instructions ``"forward"``
            and ``"backward"``) its options: ``InstructionOption`` or ``MicrobatchPoint``
            objects, or a ``MicrobatchFrontier``. Every microbatch of a stage chooses among the
            same options.
        num_microbatches: microbatches per iteration.
        blocking_power_w: power of a GPU blocked on pipeline communication (idle time).
        unit_time_s: lowtime's time quantum (see the module docstring); with
            ``max_solver_steps``, the finest quantum allowed.
        cost_model: ``"convex"`` or ``"exponential"`` (see the module docstring).
        progress: show a progress bar over the solver steps.
        max_solver_steps: ``None``: solve at ``unit_time_s``. An integer: coarsen the quantum
            (:func:`choose_unit_time_s`) so the solve takes at most this many steps; the
            quantum used is the frontier's ``unit_time_s``.
        solver_loop: ``"fast"`` or ``"lowtime"`` (same plans; see the module docstring).
        min_cut: the fast loop's min-cut: ``"dinic"`` (SciPy) or ``"lowtime"`` (lowtime's Rust
            min-cut, the exact reference; ``solver_loop.py``).
        virtual_stages: model chunks per GPU: 1 is 1F1B; above 1 interleaved 1F1B, with
            ``options`` keyed by global stage (``pipeline_schedule.py``: GPU ``r`` holds stages ``r,
            r + pp, ...``) and energy counted per GPU.
        fast_end_walk: walk from the solver's last plan to the least iteration time (module
            docstring): ``None`` only after a coarsened quantum (Perseus's frontier otherwise);
            ``True`` always (at any quantum the last plan can be up to a quantum per critical
            instruction slower than the fastest plan).

    Raises:
        CompositionError: a missing (stage, instruction), an empty option list, a non-finite,
            negative or sub-quantum option, or a bad parameter.
    """
    _check_unit_time(unit_time_s)
    if not (isinstance(blocking_power_w, (int, float)) and math.isfinite(blocking_power_w) and blocking_power_w >= 0):
        raise CompositionError(f"blocking_power_w must be a number >= 0, got {blocking_power_w!r}")
    if cost_model not in ("convex", "exponential"):
        raise CompositionError(f'cost_model must be "convex" or "exponential", got {cost_model!r}')
    if solver_loop not in ("fast", "lowtime"):
        raise CompositionError(f'solver_loop must be "fast" or "lowtime", got {solver_loop!r}')
    if min_cut not in MIN_CUTS:
        raise CompositionError(f"min_cut must be one of {MIN_CUTS}, got {min_cut!r}")
    coarsened = False
    if max_solver_steps is not None:
        fine_unit_time_s = unit_time_s
        unit_time_s = choose_unit_time_s(
            options, num_microbatches, max_solver_steps, min_unit_time_s=unit_time_s, virtual_stages=virtual_stages
        )
        # A caller may pass an already-coarse floor (one quantum for several frontiers).
        coarsened = unit_time_s > min(fine_unit_time_s, DEFAULT_UNIT_TIME_S)
    num_stages, normalized = _normalize_options(options, unit_time_s, virtual_stages)
    num_gpus = num_stages // virtual_stages
    pipeline = pipeline_dag(num_gpus, num_microbatches, virtual_stages)

    specs = {
        key: _operation_spec(items, unit_time_s, blocking_power_w, cost_model, f"stage {key[0]} {key[1]}")
        for key, items in sorted(normalized.items())
    }

    # The lowtime DAG: operations on nodes 2.., dummy source 0 and sink 1 (as Perseus builds it).
    nodes: tuple[PipelineNode, ...] = tuple(nx.topological_sort(pipeline))
    node_id = {node: i + 2 for i, node in enumerate(nodes)}
    operations: list[LowtimeInstruction] = []
    dag = nx.DiGraph()
    for node in nodes:
        cls = Forward if node.instruction == "forward" else Backward
        op = cls(
            spec=specs[(node.stage, node.instruction)],
            stage_id=node.stage,
            micro_batch_id=node.microbatch,
        )
        operations.append(op)
        dag.add_node(node_id[node], op=op)
    dag.add_edges_from((node_id[u], node_id[v]) for u, v in pipeline.edges)
    add_source_node(dag, 0)
    add_sink_node(dag, 1)
    dag.graph["source_node"] = 0
    dag.graph["sink_node"] = 1

    # Exact evaluation of a plan: longest path over measured times, in topological order.
    index = {node: i for i, node in enumerate(nodes)}
    preds = [tuple(index[p] for p in pipeline.predecessors(node)) for node in nodes]
    plan_dag = NodeWeightedDag(preds)
    keys = sorted(normalized)
    key_offset = dict(zip(keys, np.cumsum([0] + [len(normalized[k]) for k in keys]).tolist()))
    node_offset = np.array([key_offset[(n.stage, n.instruction)] for n in nodes], dtype=np.int64)
    option_times_s = np.array([float(o.time_s) for k in keys for o in normalized[k]])
    option_energies_j = np.array([float(o.energy_j) for k in keys for o in normalized[k]])
    most_options = max(len(items) for items in normalized.values())
    choice_dtype = np.uint16 if most_options <= np.iinfo(np.uint16).max else np.uint32

    def evaluate_choices(choices: np.ndarray, solver_time_s: float, solver_energy_j: float) -> IterationPoint:
        flat = node_offset + choices
        chosen_t, chosen_e = option_times_s[flat], option_energies_j[flat]
        time_s = plan_dag.longest_path(chosen_t)
        energy_j = iteration_energy_j(num_gpus, time_s, float(chosen_t.sum()), float(chosen_e.sum()), blocking_power_w)
        choices.setflags(write=False)
        return IterationPoint(time_s, energy_j, solver_time_s, solver_energy_j, choices)

    def evaluate(solver_time_s: float, solver_cost: float) -> IterationPoint:
        choices = np.fromiter((op.assigned_knob for op in operations), dtype=choice_dtype, count=len(nodes))
        solver_energy_j = solver_cost + num_gpus * solver_time_s * blocking_power_w
        return evaluate_choices(choices, solver_time_s, solver_energy_j)

    # Slowest plan: lowtime starts from every operation at its longest duration but yields only
    # after its first step, so evaluate the starting plan here.
    max_quant = round(_longest_path(preds, [op.max_duration for op in operations])[0])
    min_quant = round(_longest_path(preds, [op.min_duration for op in operations])[0])
    trace = [evaluate(max_quant * unit_time_s, sum(op.get_cost() for op in operations))]

    steps: Iterator[tuple[float, float]]
    if solver_loop == "fast":
        steps = ((r.quant_time * unit_time_s, r.cost) for r in run_phillips_dessouky(dag, min_cut=min_cut))
    else:
        steps = ((r.real_time, r.cost) for r in PhillipsDessouky(dag).run())
    with _quiet_lowtime(), heap_frozen(), _progress(progress, max_quant - min_quant) as advance:
        for solver_time_s, solver_cost in steps:
            trace.append(evaluate(solver_time_s, solver_cost))
            advance()

    candidates = list(trace)
    if coarsened if fast_end_walk is None else fast_end_walk:
        # The solver's last plan can be up to a quantum per critical instruction slower than
        # the fastest plan: walk from it to the fastest plan (see _sprint_to_fastest).
        faster_by_key = {key: _next_faster_options(items) for key, items in normalized.items()}
        faster = [faster_by_key[(n.stage, n.instruction)] for n in nodes]

        def durations_s(choices: np.ndarray) -> list[float]:
            return option_times_s[node_offset + choices].tolist()

        for choices in _sprint_to_fastest(trace[-1].choices, faster, preds, durations_s):
            candidates.append(evaluate_choices(choices, math.nan, math.nan))
    points = tuple(pareto_front(candidates))
    return IterationFrontier(
        num_stages=num_stages,
        num_microbatches=num_microbatches,
        blocking_power_w=float(blocking_power_w),
        unit_time_s=float(unit_time_s),
        cost_model=cost_model,
        nodes=nodes,
        options=normalized,
        points=points,
        trace=tuple(trace),
        virtual_stages=virtual_stages,
    )


def _longest_path(preds: Sequence[tuple[int, ...]], durations: Sequence[float]) -> tuple[float, list[int]]:
    """Length of the longest path (nodes in topological order, ``preds`` their predecessors)
    and one longest path, last node first."""
    finish = [0.0] * len(preds)
    via = [-1] * len(preds)
    for i, ps in enumerate(preds):
        start = 0.0
        for p in ps:
            if finish[p] > start:
                start, via[i] = finish[p], p
        finish[i] = start + durations[i]
    node = max(range(len(finish)), key=finish.__getitem__)
    path = []
    while node >= 0:
        path.append(node)
        node = via[node]
    return finish[path[0]], path


def _next_faster_options(items: tuple[Any, ...]) -> list[int]:
    """Per option, the index of the next faster option on the (time, energy) Pareto front (the
    option itself for the fastest)."""
    front = sorted(
        pareto_front(range(len(items)), key=lambda i: (items[i].time_s, items[i].energy_j)),
        key=lambda i: items[i].time_s,
    )
    faster = []
    for option in items:
        quicker = [i for i in front if items[i].time_s < option.time_s]
        faster.append(quicker[-1] if quicker else front[0])
    return faster


def _sprint_to_fastest(
    start: np.ndarray,
    faster: Sequence[Sequence[int]],
    preds: Sequence[tuple[int, ...]],
    durations_s: Callable[[np.ndarray], list[float]],
) -> list[np.ndarray]:
    """Plans from ``start`` to the fastest plan: repeatedly move every instruction on the
    measured critical path that has a faster option to its next faster option
    (``faster[node][choice]``), keeping the others as they are.

    Each plan is a real plan (evaluated exactly by the caller); the walk ends when the critical
    path runs only fastest options, i.e. at the least possible iteration time.
    """
    plans: list[np.ndarray] = []
    current = start
    while True:
        _, path = _longest_path(preds, durations_s(current))
        moved = current.copy()
        for i in path:
            moved[i] = faster[i][current[i]]
        if np.array_equal(moved, current):
            return plans
        current = moved
        plans.append(current)


@contextmanager
def _progress(enabled: bool, total: int) -> Iterator[Any]:
    if not enabled:
        yield lambda: None
        return
    from rich.progress import Progress

    with Progress(transient=True) as bar:
        task = bar.add_task("iteration frontier (lowtime)", total=max(total, 1))
        yield lambda: bar.advance(task)
