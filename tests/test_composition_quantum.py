"""The planner's solver resolution (``solver_sizing.composition_quantum``): small pipelines solve at the
0.5 ms floor, large ones keep the 500-step cap; the planner's fast-end walk at any quantum."""

from __future__ import annotations

import pytest

from kareus_fx.compose import (
    InstructionOption,
    build_1f1b_dag,
    choose_unit_time_s,
    compose_iteration,
    count_solver_steps,
)
from kareus_fx.compose.pipeline_schedule import makespan_s
from kareus_fx.plan.solver_sizing import (
    FINE_SOLVER_STEPS,
    FINE_UNIT_TIME_S,
    MAX_SOLVER_STEPS,
    composition_quantum,
    solver_step_cap,
)


def _sweep(num_stages: int, forward_s: float) -> dict:
    """Per (stage, instruction) 8 clocks: time ~ 1/clock^0.9, energy convex in the clock."""
    options = {}
    for stage in range(num_stages):
        for inst, base_s in (("forward", forward_s), ("backward", 2 * forward_s)):
            opts = []
            for k in range(8):
                clock = 1410 - k * (510 / 7)
                time_s = base_s * (1 + 0.01 * stage) * (1410 / clock) ** 0.9
                opts.append(InstructionOption(time_s, time_s * (150 + 320 * (clock / 1410) ** 3), clock))
            options[(stage, inst)] = opts
    return options


def test_step_cap_bounds_the_solves_work():
    assert solver_step_cap(32) == FINE_SOLVER_STEPS  # the testbed presets: 2 stages x 8 microbatches
    assert solver_step_cap(320) == MAX_SOLVER_STEPS  # Llama 3.3 70B PP10 x 16 microbatches
    assert solver_step_cap(16384) == MAX_SOLVER_STEPS
    assert solver_step_cap(64) == 2500  # 160,000 node-steps / 64 nodes


def test_small_pipeline_solves_at_the_floor_quantum():
    # 2 stages x 8 microbatches: more than 500 steps at 1 ms, which the old cap coarsened.
    options = _sweep(2, 0.08)
    assert MAX_SOLVER_STEPS < count_solver_steps(options, 8)
    assert count_solver_steps(options, 8, FINE_UNIT_TIME_S) <= FINE_SOLVER_STEPS
    assert choose_unit_time_s(options, 8, MAX_SOLVER_STEPS) > 1.3e-3
    by_method = {"a": options, "b": _sweep(2, 0.07)}
    unit_s, max_steps = composition_quantum(by_method, 2, 8, 1)
    assert unit_s == pytest.approx(FINE_UNIT_TIME_S)
    assert max_steps == FINE_SOLVER_STEPS


def test_large_pipeline_keeps_the_500_step_cap():
    # 10 stages x 128 microbatches (2560 nodes): coarsened to fit 500 steps, as before.
    options = _sweep(10, 0.08)
    unit_s, max_steps = composition_quantum({"a": options}, 10, 128, 1)
    assert max_steps == MAX_SOLVER_STEPS
    assert unit_s > 1e-3
    assert count_solver_steps(options, 128, unit_s) <= MAX_SOLVER_STEPS


def test_fast_end_walk_reaches_the_least_iteration_time_at_any_quantum():
    # At Perseus's 1 ms (no coarsening) the solver's last plan stops short of the fastest plan
    # here (measured 1.3 % slower); with fast_end_walk=True (the planner's) the frontier reaches it.
    options = _sweep(2, 0.013)
    dag = build_1f1b_dag(2, 6)
    fastest_s = makespan_s(dag, {n: options[(n.stage, n.instruction)][0].time_s for n in dag})
    walked = compose_iteration(options, 6, blocking_power_w=80.0, fast_end_walk=True)
    plain = compose_iteration(options, 6, blocking_power_w=80.0)
    assert plain.points[0].time_s > 1.005 * fastest_s
    assert walked.points[0].time_s == pytest.approx(fastest_s, rel=1e-12)
    # The walk only adds candidates: every plain point is matched or beaten.
    for p in plain.points:
        assert min(q.energy_j for q in walked.points if q.time_s <= p.time_s + 1e-12) <= p.energy_j + 1e-9
