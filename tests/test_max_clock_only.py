"""``kareus plan --max-clock-only``: Kareus without frequency scaling (paper section 6.4, Table 8).

A real plan of tiny-llama (TP2 x PP2, simulated A100) made with the flag: every Kareus option and
every tuned partition point runs at the GPU's maximum clock, the kernel schedule is still tuned,
plan.json says so, and deploying it requests no clock from a (dry-run) clock controller, where
the same steps with an ordinary plan request one clock per instruction. Bad combinations and a
plan.json that claims the flag but holds a lower clock are refused with a clear error.
"""

from __future__ import annotations

import copy
import json

import pytest
from conftest import SMALL_REAL_WORKLOAD, sharing_traces

from kareus_fx import cli
from kareus_fx.cost_models.hardware import gpu_spec
from kareus_fx.deploy.deployment import clock_binding
from kareus_fx.deploy.plan_clocks import clock_schedule
from kareus_fx.errors import OptionsError
from kareus_fx.plan.plan_format import PlanFormatError, instruction_key, load_plan, validate_plan
from kareus_fx.plan.request import PlanRequest, validate_plan_request
from kareus_fx.runtime.clock_controller import ClockController
from kareus_fx.runtime.step_context import StepContext

# small_real_plan's workload (conftest), as ``kareus plan`` arguments.
ARGV = [arg for key, value in SMALL_REAL_WORKLOAD.items() for arg in (f"--{key}", str(value))]


@pytest.fixture(scope="module")
def max_clock_plan(tmp_path_factory, small_real_plan, session_traces):
    """``kareus plan`` with the flag on ``small_real_plan``'s workload (ARGV): the command tunes,
    composes and writes its plan; the stage graphs are that plan's, traced once per session
    (the tracer reads neither the flag nor the clock stride; conftest ``sharing_traces``)."""
    out = tmp_path_factory.mktemp("max-clock-plan")
    with sharing_traces(session_traces):
        assert cli.main(["plan", *ARGV, "--max-clock-only", "--out", str(out), "--json"]) == 0
    return load_plan(out / "plan.json")


def test_max_clock_plan_runs_every_microbatch_at_the_maximum_clock_with_a_tuned_schedule(max_clock_plan):
    data = max_clock_plan.data
    top = gpu_spec(data["gpu"]).clock_max_mhz
    assert data["max_clock_only"] is True and not max_clock_plan.locks_clocks
    clocks = {o["clock_mhz"] for options in data["microbatch_options"].values() for o in options}
    assert clocks == {top}
    tuned = [p for record in data["partition_types"].values() for p in record["frontier"]]
    assert tuned and {p["clock_mhz"] for p in tuned} == {top}
    # The kernel schedule is still searched: the tuned frontiers hold more than the nanobatching
    # schedule (launch slot 0), and the plan's options other SM counts or slots.
    assert {(p["comm_sms"], p["launch_slot"]) for p in tuned} != {(tuned[0]["comm_sms"], 0)}
    # The baselines stay the comparison; Kareus's fastest plan is no slower than nanobatching's.
    methods = data["methods"]
    assert min(t for t, _ in methods["kareus"]["frontier"]) <= min(
        t for t, _ in methods["nanobatching"]["frontier"]
    ) * (1 + 1e-6)
    assert methods["megatron+perseus"]["metrics"]["max_throughput_energy_reduction"] is not None


def test_deploying_a_max_clock_plan_requests_no_clock(max_clock_plan, small_real_plan):
    ordinary = load_plan(small_real_plan[0])
    assert ordinary.locks_clocks
    for plan, expected in ((max_clock_plan, 0), (ordinary, 4)):
        point = plan.point_index("max-throughput")
        controller = ClockController.open("dry-run", handle_sigterm=False)
        try:
            with StepContext(clock_schedule(plan, point), controller, stage=0) as steps:
                for mb in range(2):
                    for instruction in ("forward", "backward"):
                        with steps.step(instruction, mb):
                            pass
            assert len(controller.requests) == expected
            assert (clock_binding(plan, point, controller) is None) == (expected == 0)
        finally:
            controller.close()


def test_max_clock_only_with_a_clock_stride_is_refused(no_tracing, tmp_path, capsys):
    request = PlanRequest(
        model="tiny-llama",
        tp=2,
        cp=1,
        pp=1,
        microbatches=1,
        mbs=2,
        seq=256,
        layers=1,
        clock_stride_mhz=60,
        max_clock_only=True,
    )
    with pytest.raises(OptionsError, match="--max-clock-only tunes at the maximum clock only"):
        validate_plan_request(request)
    assert cli.main(["plan", *ARGV, "--max-clock-only", "--clock-stride", "60", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "drop --clock-stride (got 60) or --max-clock-only" in err and "Traceback" not in err


def test_a_max_clock_plan_holding_a_lower_clock_is_refused(max_clock_plan):
    data = copy.deepcopy(json.loads(json.dumps(max_clock_plan.data)))
    key = instruction_key(1, "backward")
    data["microbatch_options"][key][0]["clock_mhz"] = 1200
    with pytest.raises(PlanFormatError, match=r"max_clock_only plan runs every microbatch at .* maximum clock"):
        validate_plan(data)
