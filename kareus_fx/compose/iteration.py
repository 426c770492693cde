"""Microbatch frontiers -> iteration frontier over the 1F1B pipeline, the Perseus way.

Every (stage, instruction, microbatch) node of the 1F1B DAG (``pipeline.py``) picks one of the
options of its (stage, instruction): a clock for Perseus, a :class:`MicrobatchPoint` for Kareus.
Each option has a time and an energy. For every iteration time from the slowest plan down to the
fastest, lowtime's Phillips-Dessouky solver (what Perseus uses; not reimplemented here) finds
the plan of least energy, one time quantum at a time.

Energy accounting (Perseus): each stage's GPU is either running one of its instructions or
blocked waiting on pipeline communication (bubbles, waits) for the rest of the iteration, at the
GPU's communication-blocking power ``blocking_power_w``:

    energy = sum of chosen option energies + blocking_power_w * (S * T - sum of chosen times)

As Perseus does, the solver works on *effective* option costs ``energy - blocking_power_w * time``
(the energy above what blocking would have cost), so the static term is ``S * T * P_block``.

Time quantum: lowtime's solver works on integer time units (``quant_time = floor(time /
unit_time)``) and shortens the iteration by one unit per step, so the frontier has one point per
unit between the slowest and the fastest plan. The default ``unit_time_s = 1 ms`` is Perseus's
(the reference frontiers in ``bench/validate_composer.py`` were made with it): the solve takes
(T_max - T_min) / unit steps, each a max-flow on the critical DAG. A plan's real time can exceed
its quantized time by less than one unit per instruction on the critical path.

Cost model (lowtime fits one per (stage, instruction) over the quantized time; the solver needs
it convex to be exact):

- ``"convex"`` (default): the lower convex hull of the options' (quantized time, effective
  energy), linear between hull vertices. Exact at every hull option; never fails to fit.
- ``"exponential"``: lowtime's ``ExponentialModel`` (``a * exp(b * t) + c``), grid search with
  strategy ``"best"``, as the Perseus artifact fits it. Reproduces the artifact's numbers;
  needs at least 3 options per (stage, instruction) (fewer fall back to ``"convex"``).

Whatever model guides the solver, each frontier point is re-evaluated exactly: ``time_s`` is the
critical path of the chosen options' measured times and ``energy_j`` the accounting above with
their measured energies. ``solver_time_s`` / ``solver_energy_j`` keep lowtime's quantized time and
model energy (what the Perseus artifact reports).
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Hashable, Iterator, Mapping, Sequence
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

from kareus_fx.compose.microbatch import pareto_front
from kareus_fx.compose.pipeline import (
    INSTRUCTIONS,
    CompositionError,
    Instruction,
    PipelineNode,
    build_1f1b_dag,
    iteration_energy_j,
)

__all__ = [
    "ConvexPiecewiseLinearModel",
    "InstructionOption",
    "IterationFrontier",
    "IterationPoint",
    "compose_iteration",
]

logger = logging.getLogger(__name__)

CostModelName = Literal["convex", "exponential"]
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
    """lowtime's quantized iteration time (quant_time x unit_time)."""
    solver_energy_j: float
    """lowtime's model energy plus ``S x solver_time_s x blocking power`` (Perseus's number)."""
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
    """Pareto-optimal plans by measured time and energy, fastest first."""
    trace: tuple[IterationPoint, ...]
    """Every plan in solver order: the slowest plan first, then one per solver step."""

    def plan(self, point: IterationPoint) -> dict[PipelineNode, Any]:
        """The chosen option of every (stage, instruction, microbatch) node at ``point``."""
        return {
            node: self.options[(node.stage, node.instruction)][int(index)]
            for node, index in zip(self.nodes, point.choices)
        }

    def option(
        self, point: IterationPoint, stage: int, instruction: Instruction, microbatch: int
    ) -> Any:
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
    """lowtime logs every sped-up operation at INFO; keep that out of the caller's logs."""
    lt_logger = logging.getLogger("lowtime")
    previous = lt_logger.level
    lt_logger.setLevel(max(previous, logging.WARNING))
    try:
        yield
    finally:
        lt_logger.setLevel(previous)


def _normalize_options(
    options: Mapping[tuple[int, Instruction], Sequence[OptionLike] | Any],
    unit_time_s: float,
) -> tuple[int, dict[tuple[int, Instruction], tuple[Any, ...]]]:
    if not options:
        raise CompositionError("no options given: need forward and backward options per stage")
    normalized: dict[tuple[int, Instruction], tuple[Any, ...]] = {}
    for key, value in options.items():
        if not (isinstance(key, tuple) and len(key) == 2):
            raise CompositionError(f"option keys must be (stage, instruction) pairs, got {key!r}")
        stage, instruction = key
        if instruction not in INSTRUCTIONS:
            raise CompositionError(
                f"unknown instruction {instruction!r} for stage {stage}: use one of {INSTRUCTIONS}"
            )
        if not isinstance(stage, int) or isinstance(stage, bool) or stage < 0:
            raise CompositionError(f"stage must be an integer >= 0, got {stage!r}")
        items = tuple(value.points if hasattr(value, "points") else value)
        if not items:
            raise CompositionError(f"stage {stage} {instruction} has no options")
        for option in items:
            t, e = getattr(option, "time_s", None), getattr(option, "energy_j", None)
            if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in (t, e)):
                raise CompositionError(
                    f"stage {stage} {instruction}: option {option!r} needs a finite time_s "
                    "and energy_j"
                )
            if e < 0:
                raise CompositionError(
                    f"stage {stage} {instruction}: negative energy in {option!r}"
                )
            if t < unit_time_s:
                raise CompositionError(
                    f"stage {stage} {instruction}: option time {t} s is below the time quantum "
                    f"{unit_time_s} s; pass a smaller unit_time_s"
                )
        normalized[(stage, instruction)] = items
    stages = sorted({stage for stage, _ in normalized})
    num_stages = stages[-1] + 1
    missing = [
        f"stage {s} {inst}"
        for s in range(num_stages)
        for inst in INSTRUCTIONS
        if (s, inst) not in normalized
    ]
    if missing:
        raise CompositionError(
            f"missing options for {', '.join(missing)} (stages must be 0..{num_stages - 1}, "
            "each with forward and backward options)"
        )
    return num_stages, normalized


def _operation_spec(
    items: tuple[Any, ...],
    unit_time_s: float,
    blocking_power_w: float,
    cost_model: CostModelName,
    label: str,
) -> OperationSpec[int]:
    execution_options = [
        ExecutionOption[int](
            real_time=float(o.time_s), unit_time=unit_time_s, cost=float(o.energy_j), knob=i
        )
        for i, o in enumerate(items)
    ]
    # Pareto filter, then one option per quantized time (lowtime keeps the costliest, i.e. the
    # fastest within the quantum): the same candidate set the Perseus planner uses.
    candidates = CandidateExecutionOptions[int](options=execution_options)
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
                    f"{label}: lowtime's exponential cost model did not fit ({e}); "
                    'use cost_model="convex"'
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
) -> IterationFrontier:
    """The iteration time-energy frontier of a 1F1B pipeline.

    Args:
        options: per ``(stage, instruction)`` (stages ``0..S-1``, instructions ``"forward"``
            and ``"backward"``) its options: ``InstructionOption`` or ``MicrobatchPoint``
            objects, or a ``MicrobatchFrontier``. Every microbatch of a stage chooses among the
            same options.
        num_microbatches: microbatches per iteration.
        blocking_power_w: power of a GPU blocked on pipeline communication (idle time).
        unit_time_s: lowtime's time quantum (see the module docstring).
        cost_model: ``"convex"`` or ``"exponential"`` (see the module docstring).
        progress: show a progress bar over the solver steps.

    Raises:
        CompositionError: a missing (stage, instruction), an empty option list, a non-finite,
            negative or sub-quantum option, or a bad parameter.
    """
    if not (
        isinstance(unit_time_s, (int, float)) and math.isfinite(unit_time_s) and unit_time_s > 0
    ):
        raise CompositionError(f"unit_time_s must be a positive number, got {unit_time_s!r}")
    if not (
        isinstance(blocking_power_w, (int, float))
        and math.isfinite(blocking_power_w)
        and blocking_power_w >= 0
    ):
        raise CompositionError(f"blocking_power_w must be a number >= 0, got {blocking_power_w!r}")
    if cost_model not in ("convex", "exponential"):
        raise CompositionError(f'cost_model must be "convex" or "exponential", got {cost_model!r}')
    num_stages, normalized = _normalize_options(options, unit_time_s)
    pipeline = build_1f1b_dag(num_stages, num_microbatches)

    specs = {
        key: _operation_spec(
            items, unit_time_s, blocking_power_w, cost_model, f"stage {key[0]} {key[1]}"
        )
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
    node_options = [normalized[(node.stage, node.instruction)] for node in nodes]
    times = [np.array([float(o.time_s) for o in items]) for items in node_options]
    energies = [np.array([float(o.energy_j) for o in items]) for items in node_options]
    most_options = max(len(items) for items in normalized.values())
    choice_dtype = np.uint16 if most_options <= np.iinfo(np.uint16).max else np.uint32

    def longest_path(durations: Sequence[float]) -> float:
        finish = [0.0] * len(nodes)
        for i, ps in enumerate(preds):
            finish[i] = max((finish[p] for p in ps), default=0.0) + durations[i]
        return max(finish)

    def evaluate(solver_time_s: float, solver_cost: float) -> IterationPoint:
        choices = np.fromiter(
            (op.assigned_knob for op in operations), dtype=choice_dtype, count=len(nodes)
        )
        chosen_t = [float(times[i][c]) for i, c in enumerate(choices)]
        chosen_e = [float(energies[i][c]) for i, c in enumerate(choices)]
        time_s = longest_path(chosen_t)
        energy_j = iteration_energy_j(
            num_stages, time_s, sum(chosen_t), sum(chosen_e), blocking_power_w
        )
        choices.setflags(write=False)
        return IterationPoint(
            time_s=time_s,
            energy_j=energy_j,
            solver_time_s=solver_time_s,
            solver_energy_j=solver_cost + num_stages * solver_time_s * blocking_power_w,
            choices=choices,
        )

    # Slowest plan: lowtime starts from every operation at its longest duration but yields only
    # after its first step, so evaluate the starting plan here.
    max_quant = round(longest_path([op.max_duration for op in operations]))
    min_quant = round(longest_path([op.min_duration for op in operations]))
    trace = [evaluate(max_quant * unit_time_s, sum(op.get_cost() for op in operations))]

    solver = PhillipsDessouky(dag)
    with _quiet_lowtime(), _progress(progress, max_quant - min_quant) as advance:
        for result in solver.run():
            trace.append(evaluate(result.real_time, result.cost))
            advance()

    points = tuple(pareto_front(trace))
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
    )


@contextmanager
def _progress(enabled: bool, total: int) -> Iterator[Any]:
    if not enabled:
        yield lambda: None
        return
    from rich.progress import Progress

    with Progress(transient=True) as bar:
        task = bar.add_task("iteration frontier (lowtime)", total=max(total, 1))
        yield lambda: bar.advance(task)
