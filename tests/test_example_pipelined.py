"""examples/train_pipelined.py run as the README says: `kareus plan ...`, then torchrun with 4 CPU ranks.

Slow (a minute of planning and a compile per stage on 2 cores); its fast sibling is
tests/test_torch_pipelining.py, which runs the same path (kareus_stage, follow_plan, Schedule1F1B
over TP2 x PP2) in-process. What can fail: the plan command or the script; each iteration must
print the plan's clock of every instruction of each stage in 1F1B order, a finite loss, and the
plan's prediction beside the simulated GPU's price of what ran (equal: the run followed the
plan); the summary must close the run.
"""

from __future__ import annotations

import ast
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kareus_fx.compose.pipeline_schedule import one_f_one_b_order
from kareus_fx.deploy.plan_clocks import clock_schedule
from kareus_fx.plan.plan_format import load_plan
from kareus_fx.runtime.step_context import PipelineNode

ROOT = Path(__file__).resolve().parents[1]
PLAN_ARGS = (
    "--model tiny-llama --tp 2 --pp 2 --microbatches 3 --mbs 2 --seq 256 --layers 2 --dtype float32 --clock-stride 120"
)
ITERATIONS = 3


def _plan_and_train(tmp_path: Path, plan_args: str, nproc: int) -> tuple[Path, subprocess.CompletedProcess]:
    """``kareus plan`` with ``plan_args``, then the example under torchrun on ``nproc`` CPU ranks."""
    kareus = Path(sys.executable).with_name("kareus")
    subprocess.run([str(kareus), "plan", *plan_args.split(), "--out", str(tmp_path)], check=True, timeout=900)
    plan_path = tmp_path / "plan.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(nproc),
            str(ROOT / "examples" / "train_pipelined.py"),
            "--plan",
            str(plan_path),
            "--iterations",
            str(ITERATIONS),
        ],
        capture_output=True,
        text=True,
        timeout=1500,
        check=False,
        cwd=tmp_path,
    )
    return plan_path, run


@pytest.mark.slow
def test_example_trains_a_single_stage_plan(tmp_path):
    """--pp 1: the one stage takes the inputs and the labels (this failed before 2026-11-26)."""
    plan_path, run = _plan_and_train(
        tmp_path, "--model tiny-llama --tp 1 --pp 1 --microbatches 2 --mbs 2 --seq 128 --layers 2", nproc=1
    )
    assert run.returncode == 0, run.stderr[-4000:]
    plan = load_plan(plan_path)
    schedule = clock_schedule(plan, plan.point_index("max-throughput"))
    lines = [line for line in run.stdout.splitlines() if line.startswith("iter ")]
    assert len(lines) == ITERATIONS, run.stdout
    for line in lines:
        clocks = ast.literal_eval(re.search(r"stage 0 clocks (\[[^\]]*\])", line).group(1))
        assert clocks == [schedule.clock_mhz(PipelineNode(0, i, mb)) for i, mb in one_f_one_b_order(1, 2, 0)]
        assert math.isfinite(float(re.search(r"loss (\S+)", line).group(1)))


@pytest.mark.slow
def test_example_trains_through_torch_pipelining_on_the_plan(tmp_path):
    plan_path, run = _plan_and_train(tmp_path, PLAN_ARGS, nproc=4)
    assert run.returncode == 0, run.stderr[-4000:]
    plan = load_plan(plan_path)
    point = plan.point_index("max-throughput")
    schedule = clock_schedule(plan, point)
    lines = [line for line in run.stdout.splitlines() if line.startswith("iter ")]
    assert len(lines) == ITERATIONS, run.stdout
    for line in lines:
        for stage in range(2):
            clocks = ast.literal_eval(re.search(rf"stage {stage} clocks (\[[^\]]*\])", line).group(1))
            assert clocks == [
                schedule.clock_mhz(PipelineNode(stage, i, mb)) for i, mb in one_f_one_b_order(2, 3, stage)
            ]
        assert math.isfinite(float(re.search(r"loss (\S+)", line).group(1)))
        predicted = plan.frontier[point]
        # on CPU the energy column is the simulated GPU's price of what ran: the plan's, when it was followed
        energy = f"{predicted['energy_j']:.2f} J"
        assert f"plan {predicted['time_s'] * 1e3:.2f} ms {energy}, measured energy {energy} (simulated)" in line
    assert re.search(rf"summary over iterations 1-{ITERATIONS - 1} .* mean \S+ ms per iteration", run.stdout)
    assert f"energy {predicted['energy_j']:.2f} J simulated" in run.stdout
