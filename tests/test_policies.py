"""Run-time policies on hand-made frontiers, in one process (fast).

The gloo tests with real replicas are in tests/test_straggler_policy.py; the Zeus objectives are
checked against the installed Zeus's own selectors and cost function.
"""

from __future__ import annotations

import copy
import warnings

import pytest
from test_plan_format import _hand_plan

from kareus_fx.errors import OptionsError
from kareus_fx.policies.base import FrontierPoint, Observation
from kareus_fx.policies.objectives import MaxSlowdownPolicy, ObjectiveError, ZeusCostPolicy, zeus_cost_j
from kareus_fx.policies.power_cap import PowerBudgetError, PowerBudgetWarning, PowerCapPolicy
from kareus_fx.policies.straggler import ReplicaTimes, StragglerPolicy, StragglerSignalError

# time_s, energy_j: a frontier (faster costs more energy); average power 100, 85.5, 70.4, 61.4 W.
FRONTIER = ((1.00, 100.0), (1.10, 94.0), (1.25, 88.0), (1.40, 86.0))
CANDIDATES = tuple(FrontierPoint(index=i, time_s=t, energy_j=e) for i, (t, e) in enumerate(FRONTIER))


def _seen(current=0, elapsed_s=0.0, **signals):
    return Observation(iteration=1, elapsed_s=elapsed_s, current_index=current, **signals)


def _replicas(own, slowest, fastest):
    return {"replica_time_s": own, "slowest_replica_time_s": slowest, "fastest_replica_time_s": fastest}


# ----- straggler ----------------------------------------------------------------------------------
def test_straggler_policy_matches_the_slowest_replica_and_comes_back():
    policy = StragglerPolicy()
    assert policy.choose(CANDIDATES, _seen(current=2)) == 2  # no signal this iteration: keep the point
    assert policy.choose(CANDIDATES, _seen(current=2, **_replicas(0.5, 0.51, 0.5))) == 0  # 2%: noise
    # The other replica is 27% slower: the least-energy point no slower than it (1.25 <= 1.27 < 1.40).
    assert policy.choose(CANDIDATES, _seen(**_replicas(0.5, 0.635, 0.5))) == 2
    assert policy.choose(CANDIDATES, _seen(**_replicas(0.5, 0.56, 0.5))) == 1  # 12% slower
    assert policy.choose(CANDIDATES, _seen(**_replicas(0.5, 5.0, 0.5))) == 3  # the slowest point is as far as it goes
    # The straggler itself runs the fastest point.
    assert policy.choose(CANDIDATES, _seen(current=0, **_replicas(0.635, 0.635, 0.5))) == 0
    # Slack: may be up to 5% slower than the straggler (1.25 * 1.05 > 1.30).
    assert StragglerPolicy(slack=0.12).choose(CANDIDATES, _seen(**_replicas(0.5, 0.635, 0.5))) == 3
    # Another base point: normalised times count from it.
    assert StragglerPolicy(base_index=1).choose(CANDIDATES, _seen(current=1, **_replicas(0.5, 0.5, 0.5))) == 1
    with pytest.raises(StragglerSignalError, match="base point 9 is not a candidate"):
        StragglerPolicy(base_index=9).choose(CANDIDATES, _seen(**_replicas(0.5, 0.6, 0.5)))


def test_replica_times_normalises_to_the_base_point_and_reports_every_k():
    times = ReplicaTimes(replicas=1, replica=0, every=2)
    assert times.exchange(0.7, CANDIDATES[2], CANDIDATES) == {}
    # Mean of (0.7, 0.55) normalised from points 2 (1.25) and 1 (1.10) to the fastest (1.00).
    signals = times.exchange(0.55, CANDIDATES[1], CANDIDATES)
    assert signals["slowest_replica_time_s"] == pytest.approx((0.7 / 1.25 + 0.55 / 1.10) / 2)
    assert signals["slowest_replica_time_s"] == signals["fastest_replica_time_s"] == signals["replica_time_s"]
    with pytest.raises(StragglerSignalError, match=r"replica must be in 0\.\.1"):
        ReplicaTimes(replicas=2, replica=2)
    with pytest.raises(StragglerSignalError, match="positive number of seconds"):
        ReplicaTimes(replicas=1, replica=0).exchange(float("nan"), CANDIDATES[0], CANDIDATES)
    with pytest.raises(StragglerSignalError, match=r"no iteration time from replica\(s\) \[1\]"):
        ReplicaTimes(replicas=2, replica=0).exchange(0.5, CANDIDATES[0], CANDIDATES)


# ----- power cap ------------------------------------------------------------------------------------
def test_power_cap_runs_the_fastest_point_that_fits_a_time_varying_budget():
    assert PowerCapPolicy().choose(CANDIDATES, _seen()) == 0  # no budget: the fastest
    assert PowerCapPolicy(budget_w=90.0).choose(CANDIDATES, _seen()) == 1
    assert PowerCapPolicy(budget_w=180.0, replicas=2).choose(CANDIDATES, _seen()) == 1  # the job's budget
    evening = PowerCapPolicy(budget_w=lambda elapsed_s: 75.0 if elapsed_s >= 3600 else 120.0)
    assert [evening.choose(CANDIDATES, _seen(elapsed_s=s)) for s in (0, 3599, 3600)] == [0, 0, 2]
    # A demand-response signal in the observation wins over the policy's own budget.
    assert PowerCapPolicy(budget_w=120.0).choose(CANDIDATES, _seen(power_budget_w=65.0)) == 3
    # Composed: the budget narrows the candidates, Zeus's max-slowdown chooses among them.
    capped = PowerCapPolicy(budget_w=90.0, then=MaxSlowdownPolicy(1.15))
    assert capped.choose(CANDIDATES, _seen()) == 2  # fits: 1, 2, 3; within 1.15 x 1.10: 1, 2


def test_power_budget_below_every_point_warns_once_and_runs_the_lowest_power_point():
    policy = PowerCapPolicy(budget_w=50.0)
    with pytest.warns(PowerBudgetWarning, match=r"no candidate point fits the power budget of 50.0 W .* point 3"):
        assert policy.choose(CANDIDATES, _seen()) == 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert policy.choose(CANDIDATES, _seen()) == 3  # the same budget again: no second warning
    for bad in (0.0, -5.0, float("nan"), True):
        with pytest.raises(PowerBudgetError, match="positive number of watts"):
            PowerCapPolicy(budget_w=bad).choose(CANDIDATES, _seen())


# ----- Zeus objectives --------------------------------------------------------------------------------
def test_zeus_cost_matches_zeus_metric_and_selector():
    from zeus.optimizer.power_limit import PowerLimitMeasurement, ZeusCost
    from zeus.utils.metric import zeus_cost

    max_power_w = 400.0 * 2
    for point in CANDIDATES:
        assert zeus_cost_j(point, 0.3, max_power_w) == pytest.approx(
            zeus_cost(point.energy_j, point.time_s, 0.3, max_power_w)
        )
    # Zeus's selector over the same (time, energy) pairs, each labelled with a distinct power limit.
    limits = (400, 300, 250, 200)
    measurements = [
        PowerLimitMeasurement(power_limit=w, time=p.time_s, energy=p.energy_j) for w, p in zip(limits, CANDIDATES)
    ]
    for eta in (0.0, 0.3, 0.5, 0.9, 0.95, 1.0):
        chosen = ZeusCostPolicy(eta, max_power_w).choose(CANDIDATES, _seen())
        # ZeusCost scales the largest limit by world_size: 400 W x 2 GPUs = max_power_w.
        assert limits[chosen] == ZeusCost(eta, world_size=2).select(measurements), eta
    with pytest.raises(ObjectiveError, match=r"eta_knob must be a number in \[0, 1\]"):
        ZeusCostPolicy(1.5, max_power_w).choose(CANDIDATES, _seen())


def test_max_slowdown_matches_zeus_selector():
    from zeus.optimizer.power_limit import MaxSlowdownConstraint, PowerLimitMeasurement

    limits = (400, 300, 250, 200)  # a lower limit: slower and less energy, as on the frontier
    measurements = [
        PowerLimitMeasurement(power_limit=w, time=p.time_s, energy=p.energy_j) for w, p in zip(limits, CANDIDATES)
    ]
    for factor in (1.0, 1.05, 1.1, 1.3, 1.4, 2.0):
        chosen = MaxSlowdownPolicy(factor).choose(CANDIDATES, _seen())
        assert limits[chosen] == MaxSlowdownConstraint(factor).select(measurements), factor
    with pytest.raises(ObjectiveError, match="factor must be a number >= 1"):
        MaxSlowdownPolicy(0.9).choose(CANDIDATES, _seen())


def test_zeus_targets_select_plan_points_and_are_validated(tmp_path):
    from kareus_fx.config import KareusOptions
    from kareus_fx.cost_models.hardware import gpu_spec
    from kareus_fx.plan.plan_format import PlanFormatError, load_plan, write_plan

    data = copy.deepcopy(_hand_plan())
    choices = data["iteration_frontier"][0]["choices"]
    data["iteration_frontier"] = [{"time_s": t, "energy_j": e, "choices": choices} for t, e in FRONTIER]
    plan = load_plan(write_plan(tmp_path / "plan.json", data))
    assert plan.point_index({"max_slowdown": 1.0}) == 0
    assert plan.point_index({"max_slowdown": 1.3}) == 2
    assert plan.point_index({"zeus_cost": 0.0}) == 0  # pure time
    assert plan.point_index({"zeus_cost": 1.0}) == 3  # pure energy
    max_power_w = gpu_spec(plan.gpu).tdp_w * plan.workload["world_size"]
    costs = [zeus_cost_j(p, 0.99, max_power_w) for p in CANDIDATES]
    assert plan.point_index({"zeus_cost": 0.99}) == costs.index(min(costs))
    with pytest.raises(PlanFormatError, match="max_slowdown's factor must be a number >= 1"):
        plan.point_index({"max_slowdown": 0.5})
    assert KareusOptions.from_user({"target": {"zeus_cost": 0}}).target == {"zeus_cost": 0.0}
    assert KareusOptions.from_user({"target": {"max_slowdown": 1}}).target == {"max_slowdown": 1.0}
    for bad in ({"zeus_cost": 1.2}, {"max_slowdown": 0.99}, {"deadline_s": 0}, {"zeus_cost": float("inf")}):
        with pytest.raises(OptionsError, match=r"'zeus_cost': eta\} with 0 <= eta <= 1"):
            KareusOptions.from_user({"target": bad})
