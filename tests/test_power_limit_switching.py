"""Switching between clock points and Kareus power-limit points at run time.

The plan is :mod:`test_point_switching`'s (a real fp32 tiny-llama TP2 plan given a frontier of
four clock points, each on options of its own) with a Kareus power-limit curve of three rows
(``methods.kareus.power_limits``: 400, 350 and 300 W; time and energy in the shape of a curve).
Candidates: the four clock points (frontier indices 0-3) and rows 1 and 2 of the curve
(candidate indices 5 and 6). A power-limit point runs the max-throughput point's variants (point
0: both microbatches un-split), requests the maximum clock for every instruction and sets its
limit; a clock point runs under the curve's first (unlimited) limit.

What can fail: a power-limit point dispatches the previous point's variants or clocks; the
dry-run power-limit controller does not get exactly the limit of each switch (and nothing when
the limit stays); the clock controller does not get exactly each candidate's clock schedule;
anything compiles after the first iteration; loss or a gradient differs from eager (fp32,
rtol=1e-5, atol=1e-6); bad candidates or a missing controller or curve are not refused by name.
"""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_TP2_WORKLOAD as WORKLOAD
from dist_harness import run_distributed
from test_point_switching import _batches, _check_parity, _expected_launches, _tiny_model, switching_plan

from kareus_fx.cost_models.hardware import gpu_spec
from kareus_fx.plan.plan_format import write_plan

CURVE = ((400, 1.00, 1.45), (350, 1.06, 1.20), (300, 1.18, 1.10))
"""Rows of the power-limit curve: (limit_w, time and energy relative to the plan's base point)."""
LIMIT_ROWS = (1, 2)
ORDER = (0, 5, 2, 6, 5, 3, 0)
"""The candidate of each of 7 iterations: clock, limit, clock, limit, limit, clock, clock."""
LIMITS_SET_W = [350, 400, 300, 350, 400]
"""What the power-limit controller gets over ORDER: each change of limit, once."""


def _plan(tiny_tp2_plan_data, path):
    data = switching_plan(tiny_tp2_plan_data, path)
    base_t, base_e = (
        tiny_tp2_plan_data["iteration_frontier"][0]["time_s"],
        tiny_tp2_plan_data["iteration_frontier"][0]["energy_j"],
    )
    data["methods"]["kareus"]["power_limits"] = [[w, base_t * t, base_e * e] for w, t, e in CURVE]
    write_plan(path, data)
    return data


def test_limit_candidates_set_their_limit_and_run_the_fastest_points_variants(tiny_tp2_plan_data, tmp_path):
    from kareus_fx.deploy.plan_clocks import clock_schedule
    from kareus_fx.deploy.switching import PointSwitcher
    from kareus_fx.plan.plan_format import load_plan
    from kareus_fx.runtime.power_limit_controller import PowerLimitController

    path = tmp_path / "plan.json"
    _plan(tiny_tp2_plan_data, path)
    plan = load_plan(path)
    controller = PowerLimitController.open("dry-run")
    switcher = PointSwitcher(plan, candidates=[0, 1, 2, 3], limit_candidates=LIMIT_ROWS, power_limit=controller)
    assert switcher.candidate_indices == (0, 5, 1, 6, 2, 3)  # by predicted time
    assert switcher.compiled_points == (0, 1, 2, 3)
    assert switcher.variant_point(5) == switcher.variant_point(6) == plan.point_index("max-throughput") == 0
    max_mhz = gpu_spec(plan.gpu).clock_max_mhz
    limited = switcher.clock_schedule(6)
    planned = clock_schedule(plan, 2)
    for node in ((0, "forward", 0), (0, "backward", 1)):
        from kareus_fx.compose.pipeline_schedule import PipelineNode

        assert limited.clock_mhz(PipelineNode(*node)) == max_mhz
        assert switcher.clock_schedule(2).clock_mhz(PipelineNode(*node)) == planned.clock_mhz(PipelineNode(*node))
    for index in ORDER[1:]:
        switcher.switch_to(index)
    assert controller.requests_w == LIMITS_SET_W
    assert [switcher.limit_w(i) for i in (0, 5, 6)] == [400, 350, 300]


def test_bad_limit_candidates_are_refused_naming_the_fix(tiny_tp2_plan_data, tmp_path):
    from kareus_fx.deploy.switching import PointSwitcher, PointSwitchError
    from kareus_fx.errors import OptionsError
    from kareus_fx.plan.plan_format import load_plan
    from kareus_fx.runtime.power_limit_controller import PowerLimitController

    path = tmp_path / "plan.json"
    data = _plan(tiny_tp2_plan_data, path)
    controller = PowerLimitController.open("dry-run")
    with pytest.raises(PointSwitchError, match=r"rows of the plan's Kareus power-limit curve \(0\.\.2"):
        PointSwitcher(path, candidates=[0], limit_candidates=[3], power_limit=controller)
    with pytest.raises(OptionsError, match=r"power_limit=PowerLimitController\.open"):
        PointSwitcher(path, candidates=[0], limit_candidates=[1])
    del data["methods"]["kareus"]["power_limits"]
    write_plan(path, data)
    with pytest.raises(OptionsError, match="re-run `kareus plan`"):
        PointSwitcher(load_plan(path), candidates=[0], limit_candidates=[1], power_limit=controller)


def _union_worker(rank, world_size, plan_path):
    from kareus_fx.deploy.hook_ops import recording_hooks
    from kareus_fx.deploy.switching import PointSwitcher
    from kareus_fx.deploy.variants import deployed_graphs
    from kareus_fx.runtime.clock_controller import ClockController
    from kareus_fx.runtime.power_limit_controller import PowerLimitController

    model, layout = _tiny_model()
    limits = PowerLimitController.open("dry-run", guard=False)
    switcher = PointSwitcher(plan_path, candidates=[0, 1, 2, 3], limit_candidates=LIMIT_ROWS, power_limit=limits)
    switcher.prepare_collectives([layout.tp_group])
    controller = ClockController.open("dry-run", handle_sigterm=False)
    compiled = torch.compile(
        model,
        backend="kareus",
        fullgraph=True,
        options={"switching": switcher, "clock_controller": controller, "inductor": False},
    )
    per_iteration = []
    for iteration, point in enumerate(ORDER):
        if iteration:
            assert switcher.switch_to(point) == point
        before, limits_before = len(controller.requests), len(limits.requests_w)
        with recording_hooks() as log:
            _check_parity(model, compiled, _batches(model, iteration))
        if iteration == 0:
            compiled_after_first = len(deployed_graphs())
        per_iteration.append(
            {
                "point": switcher.current_index,
                "requests": [(r.clock_mhz, r.instruction) for r in controller.requests[before:]],
                "launches": sorted({(entry[2], entry[3]) for entry in log if entry[0] == "comm_launch"}),
                "limits_during": limits.requests_w[limits_before:],
            }
        )
    controller.close()
    limits.close()
    return {
        "iterations": per_iteration,
        "limits_w": list(limits.requests_w),
        "compiled_after_first": compiled_after_first,
        "compiled_at_end": len(deployed_graphs()),
    }


@pytest.mark.slow  # gloo TP2 with compiles (about 90 s loaded); fast siblings: the two tests above
def test_switching_clock_and_power_limit_points_keeps_parity_and_gets_each_schedule(tiny_tp2_plan_data, tmp_path):
    from kareus_fx.compose.pipeline_schedule import PipelineNode
    from kareus_fx.deploy.plan_clocks import clock_schedule
    from kareus_fx.plan.plan_format import load_plan

    plan_path = tmp_path / "plan.json"
    data = _plan(tiny_tp2_plan_data, plan_path)
    plan = load_plan(plan_path)
    max_mhz = gpu_spec(plan.gpu).clock_max_mhz
    nodes = [PipelineNode(0, g, mb) for mb in range(WORKLOAD["microbatches"]) for g in ("forward", "backward")]
    results = run_distributed(_union_worker, 2, str(plan_path), timeout_s=900)
    for result in results:
        for iteration, (point, got) in enumerate(zip(ORDER, result["iterations"])):
            assert got["point"] == point
            if point >= len(plan.frontier):  # a power-limit point: point 0's variants, every clock the maximum
                expected = [(max_mhz, str(n)) for n in nodes]
                launches = _expected_launches(data, 0)
            else:
                schedule = clock_schedule(plan, point)
                expected = [(schedule.clock_mhz(n), str(n)) for n in nodes]
                launches = _expected_launches(data, point)
            assert got["requests"] == expected, f"iteration {iteration} (point {point})"
            assert got["launches"] == launches, f"iteration {iteration} (point {point})"
            assert got["limits_during"] == [], "a limit changed inside an iteration"
        assert result["limits_w"] == LIMITS_SET_W
        assert result["compiled_at_end"] == result["compiled_after_first"]
