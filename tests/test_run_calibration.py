"""Recalibration from a user's runs on the committed H200 example (``bench/results/gpu_h200/``).

The example plan (qwen3-1.7b, 2 layers, TP1 PP1, 4 microbatches of 2 x 4096, simulated H200)
predicted 178.05 ms and 124.63 J per iteration; two runs on the card measured about 221 ms and
145 J (``example_run1.log``, ``example_run4.log``, converted to the run format by
``bench/h200_example_to_run.py``). Fitted on run 1 alone, the same plan must predict run 4 within
10 % in time and in energy (median of its iterations after the compiling one); CPU runs, another
GPU and an empty fit are refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kareus_fx.cost_models.run_calibration import RunCalibrationError, apply_run_calibration, fit_run_calibration
from kareus_fx.deploy.run_record import read_run_log
from kareus_fx.plan.plan_format import Plan, load_plan, validate_plan
from kareus_fx.report.run_vs_plan import compare_run

H200 = Path(__file__).resolve().parent.parent / "bench" / "results" / "gpu_h200"


def test_recalibrated_on_run1_the_plan_predicts_run4_within_ten_percent():
    plan = load_plan(H200 / "example_plan.json")
    run4 = read_run_log(H200 / "example_run4.jsonl")
    before = compare_run(run4, plan)
    assert before.time.median > 1.2 and before.energy.median > 1.08  # the simulator is fast and low here
    calibration = fit_run_calibration([H200 / "example_run1.jsonl"])
    assert calibration.time_scale == pytest.approx(220.0 / 178.046, rel=1e-3)
    data = apply_run_calibration(plan.data, calibration)
    validate_plan(data)
    after = compare_run(run4, Plan(data))
    assert abs(after.time.median - 1) < 0.10 and abs(after.energy.median - 1) < 0.10
    recorded = data["run_calibration"]
    assert recorded["time_scale"] == calibration.time_scale and len(recorded["sources"][0]["sha256"]) == 64
    assert data["methods"]["kareus"]["metrics"] == plan.data["methods"]["kareus"]["metrics"]


def test_cpu_runs_another_gpu_and_no_iteration_are_refused(tmp_path):
    record = json.loads((H200 / "example_run1.jsonl").read_text().splitlines()[1])
    cpu = tmp_path / "cpu.jsonl"
    cpu.write_text(json.dumps({**record, "energy_source": "simulated"}) + "\n")
    with pytest.raises(RunCalibrationError, match="no measured energy"):
        fit_run_calibration([cpu])
    with pytest.raises(RunCalibrationError, match="no iteration after the 9 warm-up"):
        fit_run_calibration([H200 / "example_run1.jsonl"], warmup=9)
    calibration = fit_run_calibration([H200 / "example_run1.jsonl"])
    other = {**load_plan(H200 / "example_plan.json").data, "gpu": "A100-SXM4-40GB"}
    with pytest.raises(RunCalibrationError, match="plan with --gpu H200-SXM-141GB"):
        apply_run_calibration(other, calibration)


def test_kareus_plan_calibrate_from_scales_the_plan_and_records_its_runs(tmp_path, small_real_plan, session_traces):
    """``kareus plan --calibrate-from`` on small_real_plan's workload with a run measuring 2x the
    time and 1.5x the energy: the same plan, every price scaled, the scales and the run's hash recorded."""
    from conftest import SMALL_REAL_WORKLOAD, sharing_traces

    from kareus_fx import cli

    plain = load_plan(small_real_plan[0]).data
    record = json.loads((H200 / "example_run1.jsonl").read_text().splitlines()[1])
    point = plain["iteration_frontier"][0]
    run = {
        **record,
        "gpu": plain["gpu"],
        "predicted_time_s": point["time_s"],
        "predicted_energy_j": point["energy_j"],
        "time_s": 2.0 * point["time_s"],
        "energy_j": 1.5 * point["energy_j"],  # one GPU measured, one predicted (gpus fields of the record)
    }
    run_path = tmp_path / "run.jsonl"
    run_path.write_text("".join(json.dumps({**run, "iteration": i}) + "\n" for i in range(3)))
    argv = [arg for key, value in SMALL_REAL_WORKLOAD.items() for arg in (f"--{key}", str(value))]
    out = tmp_path / "plan"
    with sharing_traces(session_traces):
        assert (
            cli.main(
                ["plan", *argv, "--clock-stride", "120", "--calibrate-from", str(run_path), "--out", str(out), "--json"]
            )
            == 0
        )
    data = load_plan(out / "plan.json").data
    assert data["run_calibration"]["time_scale"] == pytest.approx(2.0)
    assert data["run_calibration"]["energy_scale"] == pytest.approx(1.5)
    assert len(data["iteration_frontier"]) == len(plain["iteration_frontier"])
    for scaled, base in zip(data["iteration_frontier"], plain["iteration_frontier"]):
        assert scaled["time_s"] == pytest.approx(2.0 * base["time_s"])
        assert scaled["energy_j"] == pytest.approx(1.5 * base["energy_j"])
    assert len(data["run_calibration"]["sources"][0]["sha256"]) == 64
