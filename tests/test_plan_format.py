"""Plan file: validation on load, target selection, and the paper's metrics.

The plan here is built by hand (tiny and explicit); ``test_plan.py`` checks plans that
``kareus plan`` makes.
"""

from __future__ import annotations

import copy
import json

import pytest

from kareus_fx.plan.metrics import frontier_metrics, least_energy_within, least_time_within
from kareus_fx.plan.plan_format import PlanFormatError, load_plan, validate_plan, write_plan


def _option(clock_mhz, time_s, energy_j, configs=None):
    return {
        "clock_mhz": clock_mhz,
        "sequential": configs is None,
        "configs": configs,
        "time_s": time_s,
        "energy_j": energy_j,
        "dynamic_energy_j": energy_j / 2,
        "static_energy_j": energy_j / 2,
    }


def _hand_plan() -> dict:
    """One stage, two microbatches, one partition type; two frontier points."""
    config = {"T0": {"comm_sms": 12, "launch_slot": 1}}
    return {
        "format": "kareus-plan",
        "schema_version": 1,
        "workload": {
            "model": "tiny-llama",
            "tp": 2,
            "cp": 1,
            "pp": 1,
            "microbatches": 2,
            "mbs": 4,
            "seq": 64,
            "layers": 2,
            "world_size": 2,
        },
        "gpu": "A100-SXM4-40GB",
        "profiler": "simulated:test",
        "energy_scope": "one pipeline",
        "stages": [
            {
                "stage": 0,
                "graphs": {
                    name: {"fingerprint": "f" + name, "partition_types": {"local0": "T0"}}
                    for name in ("forward", "backward")
                },
            }
        ],
        "partition_types": {
            "T0": {
                "graph": "forward",
                "count": 2,
                "fingerprint": "x",
                "collective": {"kind": "all_reduce", "bytes": 4096, "group_size": 2},
                "slots": [
                    {"ops": ["aten.mm.default"], "flops": 1e6, "bytes": 1e4},
                    {"ops": ["aten.add.Tensor"], "flops": 1e3, "bytes": 1e4},
                ],
                "launch_slots": [0, 1],
                "frontier": [],
            }
        },
        "microbatch_options": {
            "0/forward": [_option(1410, 1.0, 10.0, config), _option(1200, 1.2, 8.0)],
            "0/backward": [_option(1410, 2.0, 20.0, config), _option(1200, 2.4, 16.0)],
        },
        "iteration_frontier": [
            {"time_s": 6.0, "energy_j": 60.0, "choices": {"0/forward": [0, 0], "0/backward": [0, 0]}},
            {"time_s": 7.2, "energy_j": 48.0, "choices": {"0/forward": [1, 1], "0/backward": [1, 0]}},
        ],
        "methods": {"kareus": {"frontier": [[6.0, 60.0], [7.2, 48.0]], "metrics": {}}},
    }


def test_round_trip_and_target_selection(tmp_path):
    path = write_plan(tmp_path / "plan.json", _hand_plan())
    plan = load_plan(path)
    assert plan.point_index("max-throughput") == 0
    assert plan.point_index({"deadline_s": 7.0}) == 0
    assert plan.point_index({"deadline_s": 8.0}) == 1  # least energy within the deadline
    assert plan.point_index({"energy_budget_j": 50.0}) == 1
    assert plan.option(1, 0, "backward", 0)["clock_mhz"] == 1200
    # a plan without the library field reads as the version that wrote it meant it: the tuned kernel
    assert plan.option(1, 0, "backward", 1)["configs"] == {
        "T0": {"comm_sms": 12, "launch_slot": 1, "comm_library": "mscclpp"}
    }
    with pytest.raises(PlanFormatError, match="deadline"):
        plan.point_index({"deadline_s": 1.0})
    with pytest.raises(PlanFormatError, match="energy budget"):
        plan.point_index({"energy_budget_j": 1.0})
    with pytest.raises(PlanFormatError, match="target must be"):
        plan.point_index("fastest")


def test_a_configs_collective_library_round_trips(tmp_path):
    """A plan names each type's library; NCCL (the baselines') and the tuned kernel both read back."""
    data = _hand_plan()
    data["microbatch_options"]["0/forward"][0]["configs"] = {
        "T0": {"comm_sms": 24, "launch_slot": 0, "comm_library": "nccl"}
    }
    plan = load_plan(write_plan(tmp_path / "plan.json", data))
    assert plan.option(0, 0, "forward", 0)["configs"]["T0"]["comm_library"] == "nccl"
    assert plan.option(0, 0, "backward", 0)["configs"]["T0"]["comm_library"] == "mscclpp"


def test_corrupt_json_is_a_validation_error_naming_the_file(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(_hand_plan())[:-40])
    with pytest.raises(PlanFormatError, match=r"plan.json is not a kareus plan: invalid JSON at line 1"):
        load_plan(path)
    with pytest.raises(PlanFormatError, match=r"cannot read kareus plan .*missing.json: No such file"):
        load_plan(tmp_path / "missing.json")


def _broken(edit):
    data = copy.deepcopy(_hand_plan())
    edit(data)
    return data


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(format="other"), "not a kareus plan"),
        (lambda d: d.update(schema_version=99), "reads version 1"),
        (lambda d: d["workload"].pop("tp"), r"plan.json: workload: missing tp;"),
        (lambda d: d["workload"].update(pp=2), "expected 2 stages"),
        (
            lambda d: d["workload"].update(stage_layers=[1, 1]),
            r"workload.stage_layers: expected one layer count per stage \(1\)",
        ),
        (lambda d: d["workload"].update(stage_layers=[3]), r"counts \[3\] add up to 3, not the model's 2 layers"),
        (lambda d: d["workload"].update(stage_layers=[0]), "stage_layers"),
        (
            lambda d: d["microbatch_options"].pop("0/backward"),
            r"microbatch_options: expected exactly the keys \['0/forward', '0/backward'\]",
        ),
        (lambda d: d["iteration_frontier"][0]["choices"]["0/forward"].__setitem__(1, 5), "option 5 out of range"),
        (lambda d: d["iteration_frontier"][0]["choices"]["0/forward"].pop(), "expected 2 entries"),
        (
            lambda d: d["microbatch_options"]["0/forward"][0]["configs"].update(T9={"comm_sms": 1, "launch_slot": 0}),
            "unknown partition type 'T9'",
        ),
        (lambda d: d["microbatch_options"]["0/forward"][1].update(time_s=float("nan")), "finite number"),
        (lambda d: d["partition_types"]["T0"].update(launch_slots=[3]), "outside the type's 2 slots"),
        (
            lambda d: d["stages"][0]["graphs"]["forward"]["partition_types"].update(x="T7"),
            "unknown partition type 'T7'",
        ),
        (lambda d: d["microbatch_options"]["0/forward"][1].update(sequential=False), "configs must be null exactly"),
        (
            lambda d: d["microbatch_options"]["0/forward"][0]["configs"]["T0"].update(comm_library="rccl"),
            r"configs.T0.comm_library",
        ),
    ],
)
def test_validation_names_the_broken_field(edit, message):
    with pytest.raises(PlanFormatError, match=message):
        validate_plan(_broken(edit), "plan.json")


def test_metrics_follow_the_paper_definitions():
    megatron = (10.0, 100.0)
    mp = [(10.0, 95.0), (11.0, 85.0), (13.0, 80.0)]
    method = [(9.0, 90.0), (10.0, 80.0), (12.0, 70.0)]
    m = frontier_metrics(method, megatron, mp)
    assert m["max_throughput_time_reduction"] == pytest.approx(0.1)
    assert m["max_throughput_energy_reduction"] == pytest.approx(0.1)
    # deadline = M+P's fastest time 10 s: method's least energy within it is 80 vs M+P's 95
    assert m["iso_time_energy_reduction"] == pytest.approx(1 - 80 / 95)
    # budget = M+P's least energy 80 J (at 13 s): method's fastest point within it is 10 s
    assert m["iso_energy_time_reduction"] == pytest.approx(1 - 10 / 13)
    own = frontier_metrics(mp, megatron, mp)
    assert own["iso_time_energy_reduction"] == 0 and own["iso_energy_time_reduction"] == 0
    slow = frontier_metrics([(20.0, 200.0)], megatron, mp)
    assert slow["iso_time_energy_reduction"] is None and slow["iso_energy_time_reduction"] is None
    assert least_energy_within(method, 9.5) == 90.0 and least_time_within(method, 60.0) is None


def test_a_400_digit_integer_is_refused_not_a_crash():
    """Regression (found fuzzing, tests/test_fuzz_readers.py): the number check called
    math.isfinite on an int of 400 digits, which raises OverflowError."""
    data = _hand_plan()
    data["microbatch_options"]["0/forward"][0]["time_s"] = 10**400
    with pytest.raises(
        PlanFormatError, match=r"microbatch_options.0/forward\[0\].time_s: expected a number >= 0 and <= 1e\+30"
    ):
        validate_plan(data, "plan.json")
