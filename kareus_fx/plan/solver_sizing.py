"""The iteration-frontier solve's resolution: the time quantum every method is composed at and the
solver steps per method, bounded by the pipeline's size."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kareus_fx.compose.iteration import DEFAULT_UNIT_TIME_S, choose_unit_time_s, count_solver_steps
from kareus_fx.compose.pipeline_schedule import CompositionError
from kareus_fx.workload import GraphName

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
