"""The simulated GPU's estimate of what ran (kareus_fx/deploy/simulated_energy.py), on a real plan.

The session's tiny-llama TP2 x PP2 plan (``small_real_plan``, 2 microbatches). What can fail: a run
that follows the plan (1F1B order, the planned clocks) must reproduce the plan's predicted
iteration time and energy (rel 1e-9: the same sums); GPipe's order on the same clocks must take
no less time or energy; another clock is priced at that clock's option;
requests that name no instruction, or a clock the plan has no option of, are refused.
"""

from __future__ import annotations

import pytest

from kareus_fx.compose.pipeline_schedule import PipelineNode, one_f_one_b_order
from kareus_fx.deploy.plan_clocks import clock_schedule
from kareus_fx.deploy.simulated_energy import SimulationError, parse_node, simulated_iteration
from kareus_fx.plan.plan_format import load_plan
from kareus_fx.runtime.clock_controller import ClockRequest


def _requests(schedule, order, stage, clock=None):
    return [
        ClockRequest(0.0, clock or schedule.clock_mhz(PipelineNode(stage, i, mb)), str(PipelineNode(stage, i, mb)))
        for i, mb in order
    ]


def test_a_run_that_follows_the_plan_is_priced_as_the_plan(small_real_plan):
    plan = load_plan(small_real_plan[0])
    pp, microbatches = plan.workload["pp"], plan.workload["microbatches"]
    for point_index, point in enumerate(plan.frontier):
        schedule = clock_schedule(plan, point_index)
        ranks = [_requests(schedule, one_f_one_b_order(pp, microbatches, s), s) for s in range(pp)]
        estimate = simulated_iteration(plan, point_index, ranks)
        assert estimate.instructions == 2 * pp * microbatches
        assert estimate.time_s == pytest.approx(point["time_s"], rel=1e-9)
        assert estimate.energy_j == pytest.approx(point["energy_j"], rel=1e-9)
    gpipe = [[("forward", mb) for mb in range(microbatches)] + [("backward", mb) for mb in range(microbatches)]] * pp
    schedule = clock_schedule(plan, 0)
    other = simulated_iteration(plan, 0, [_requests(schedule, gpipe[s], s) for s in range(pp)])
    # GPipe (every forward, then every backward) is never faster than 1F1B on the same clocks
    assert other.time_s >= plan.frontier[0]["time_s"] * (1 - 1e-12)
    assert other.energy_j >= plan.frontier[0]["energy_j"] * (1 - 1e-12)


def test_another_clock_is_priced_at_its_option_and_unknown_requests_are_refused(small_real_plan):
    plan = load_plan(small_real_plan[0])
    pp, microbatches = plan.workload["pp"], plan.workload["microbatches"]
    schedule = clock_schedule(plan, 0)
    ranks = [_requests(schedule, one_f_one_b_order(pp, microbatches, s), s) for s in range(pp)]
    clocks = sorted({o["clock_mhz"] for o in plan.data["microbatch_options"]["0/forward"]})
    lowest = [ClockRequest(0.0, clocks[0], r.instruction) for r in ranks[0]]
    slower = simulated_iteration(plan, 0, [lowest, ranks[1]])
    if clocks[0] != schedule.clock_mhz(PipelineNode(0, "forward", 0)):
        assert slower.time_s != pytest.approx(plan.frontier[0]["time_s"], rel=1e-9)
    with pytest.raises(SimulationError, match=r"no option of"):
        simulated_iteration(plan, 0, [[ClockRequest(0.0, 7, ranks[0][0].instruction)], ranks[1]])
    with pytest.raises(SimulationError, match=r"names no pipeline instruction"):
        parse_node("forward of microbatch 0")
    with pytest.raises(SimulationError, match=r"2 pipeline ranks but requests of 1"):
        simulated_iteration(plan, 0, ranks[:1])
