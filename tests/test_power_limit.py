"""The sixth method, Megatron-LM + power limit: priced by the simulated GPU's power cap, chosen
by Zeus's own selector (issue 31)."""

from __future__ import annotations

import json

import pytest

from kareus_fx.cost_models.hardware import gpu_spec
from kareus_fx.cost_models.simulated_profiler import SimulatedProfiler
from kareus_fx.plan.metrics import frontier_metrics
from kareus_fx.plan.plan_format import load_plan
from kareus_fx.plan.power_limit import POWER_LIMIT_METHOD, ZEUS_POWER_LIMIT_STEP_W


@pytest.fixture(scope="module")
def plan(small_real_plan):
    return load_plan(small_real_plan[0])


def test_the_unlimited_step_is_megatron_and_limits_step_down_as_zeus_does(plan):
    method = plan.data["methods"][POWER_LIMIT_METHOD]
    limits = method["power_limits"]
    tdp_w = gpu_spec(plan.gpu).tdp_w
    assert [row[0] for row in limits] == [int(tdp_w) - ZEUS_POWER_LIMIT_STEP_W * i for i in range(len(limits))]
    assert len(limits) >= 3
    # At the TDP no limit binds beyond the card's own: the same iteration as Megatron-LM's, composed
    # here by a direct 1F1B longest path rather than the lowtime composer.
    ((megatron_t, megatron_e),) = plan.data["methods"]["megatron"]["frontier"]
    assert limits[0][1] == pytest.approx(megatron_t, rel=1e-9)
    assert limits[0][2] == pytest.approx(megatron_e, rel=1e-9)
    times = [row[1] for row in limits]
    assert times == sorted(times) and times[-1] > times[0]  # a lower limit never runs faster


def test_the_chosen_limit_is_zeus_cost_with_eta_half_over_the_job(plan):
    method = plan.data["methods"][POWER_LIMIT_METHOD]
    w = plan.workload
    gpus = w["tp"] * w["cp"] * w["pp"]
    by_hand = min(
        method["power_limits"],
        key=lambda row: 0.5 * row[2] + 0.5 * max(r[0] for r in method["power_limits"]) * gpus * row[1],
    )
    assert method["chosen_power_limit_w"] == by_hand[0]
    assert method["frontier"] == [[by_hand[1], by_hand[2]]]
    mp = plan.data["methods"]["megatron+perseus"]["frontier"]
    expected = frontier_metrics(
        [tuple(method["frontier"][0])], tuple(plan.data["methods"]["megatron"]["frontier"][0]), mp
    )
    assert method["metrics"] == pytest.approx(expected)


def test_the_plan_file_round_trips_with_the_curve(plan, tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan.data))
    assert load_plan(path).data["methods"][POWER_LIMIT_METHOD] == plan.data["methods"][POWER_LIMIT_METHOD]


def test_a_power_limit_slows_the_simulated_gpu_and_keys_its_own_cache():
    spec = gpu_spec("a100")
    free, capped = SimulatedProfiler("a100"), SimulatedProfiler("a100", power_limit_w=spec.tdp_w / 2)
    assert free.kind != capped.kind
    from kareus_fx.workload import OpCost

    ops = [OpCost(name="mm", target="aten.mm", flops=4e12, bytes=3e8)]
    assert (
        capped.measure_sequence(ops, [], spec.clock_max_mhz).time_s
        > free.measure_sequence(ops, [], spec.clock_max_mhz).time_s
    )
    with pytest.raises(ValueError, match="power_limit_w"):
        SimulatedProfiler("a100", power_limit_w=spec.tdp_w + 1)
