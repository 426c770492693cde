"""Deploying a plan as a job-wide power limit instead of clocks."""

from __future__ import annotations

import pytest
import torch

from kareus_fx.deploy.power_limit_mode import active_power_limit_controller
from kareus_fx.errors import KareusError, OptionsError
from kareus_fx.plan.plan_format import load_plan
from kareus_fx.plan.power_limit_baseline import PowerLimitPoint, curve_of_plan, limit_for_target

CURVE = [PowerLimitPoint(400, 1.00, 1000.0), PowerLimitPoint(375, 1.02, 960.0), PowerLimitPoint(350, 1.06, 940.0)]


@pytest.mark.parametrize(
    ("target", "limit_w"),
    [("max-throughput", 400), ({"deadline_s": 1.03}, 375), ({"deadline_s": 2.0}, 350), ({"energy_budget_j": 970}, 375)],
)
def test_targets_pick_along_the_curve(target, limit_w):
    assert limit_for_target(CURVE, target).power_limit_w == limit_w


@pytest.mark.parametrize(
    ("target", "message"),
    [({"deadline_s": 0.5}, "fastest: 1 s"), ({"energy_budget_j": 10}, "least: 940 J"), ("cheapest", "takes target")],
)
def test_unmeetable_or_unknown_targets_are_refused(target, message):
    with pytest.raises(KareusError, match=message):
        limit_for_target(CURVE, target)


def test_a_plan_without_the_curve_is_refused_naming_why():
    with pytest.raises(KareusError, match="re-run `kareus plan`"):
        curve_of_plan({"methods": {"megatron": {}}}, "old.json")


def test_the_compiled_model_runs_under_the_targets_limit_with_eager_numbers(small_real_plan):
    plan_path = small_real_plan[0]
    curve = curve_of_plan(load_plan(plan_path).data)
    deadline_s = max(p.time_s for p in curve)
    expected = limit_for_target(curve, {"deadline_s": deadline_s})
    assert expected.power_limit_w < curve[0].power_limit_w  # the deadline leaves room to cap
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    x = torch.randn(8, 16)
    options = {"plan": str(plan_path), "power_limit": "dry-run", "target": {"deadline_s": deadline_s}}
    compiled = torch.compile(model, backend="kareus", options=options)
    out = compiled(x)
    torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-6)
    out.sum().backward()
    controller = active_power_limit_controller()
    assert controller is not None and controller.requests_w == [expected.power_limit_w]


@pytest.mark.parametrize(
    ("options", "message"),
    [({"power_limit": "dry-run"}, "give option 'plan'"), ({"power_limit": "yes", "plan": "p.json"}, "'real' or")],
)
def test_bad_power_limit_options_name_the_field(options, message):
    from kareus_fx.config import KareusOptions

    with pytest.raises(OptionsError, match=message):
        KareusOptions.from_user(options)
