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
