"""Deploy a plan as one job-wide power limit instead of clocks (``options={"power_limit": ...}``).

For clusters that forbid locking clocks but allow power limits: the plan's
``megatron+power-limit`` curve (Megatron-LM's un-split step under each limit, ``plan/power_limit_baseline.py``)
gives the limit for the target; the graph compiles un-split (what that curve priced: no nanobatch
split, no clock hooks) and this process's GPU runs under the limit. One
:class:`~kareus_fx.runtime.power_limit_controller.PowerLimitController` per process (a process drives one
GPU: ``LOCAL_RANK``'s), opened at the first compiled graph and restored at exit.
"""

from __future__ import annotations

import os

from kareus_fx.config import KareusOptions
from kareus_fx.errors import OptionsError
from kareus_fx.plan.plan_format import load_plan
from kareus_fx.plan.power_limit_baseline import PowerLimitPoint, curve_of_plan, limit_for_target
from kareus_fx.runtime.power_limit_controller import PowerLimitController

_controller: PowerLimitController | None = None


def active_power_limit_controller() -> PowerLimitController | None:
    """The controller this process's power-limit deployment opened, if any."""
    return _controller


def deploy_power_limit(opts: KareusOptions) -> PowerLimitPoint:
    """Set the limit ``opts.target`` selects on the plan's curve (once per process and limit)."""
    global _controller
    if opts.plan is None or opts.power_limit is None:
        raise OptionsError("option 'power_limit' deploys a plan: give option 'plan' too")
    plan = load_plan(opts.plan)
    point = limit_for_target(curve_of_plan(plan.data, str(opts.plan)), opts.target)
    if _controller is None or _controller.mode != opts.power_limit:
        _controller = PowerLimitController.open(opts.power_limit, gpu_index=int(os.environ.get("LOCAL_RANK", "0")))
    if _controller.requests_w[-1:] != [point.power_limit_w]:
        _controller.set_limit_w(point.power_limit_w)
    return point
