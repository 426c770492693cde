"""Power limits restored after any death: the guardian process, as for clocks.

A child process opens a power-limit controller on a simulated GPU (a stand-in for NVML whose
limit lives in a state file), sets 250 W and is killed with SIGKILL; the state file is what the
card's limit would be. What can fail: the limit stays at 250 W after the death (no guardian, or
one that missed it), the restore takes more than 1 s after the death is observable, the guardian
restores something other than the limit found at open, survives its parent, or touches the GPU
after a normal close; a test's Zeus stand-in gets a guardian (it would act on a real card).
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from conftest import wait_gone
from zeus.device.gpu.common import GPUs

from kareus_fx.runtime.clock_locks import process_alive
from kareus_fx.runtime.power_limit_controller import PowerLimitController
from kareus_fx.runtime.power_limit_restore import PowerLimitError, SimulatedPowerLimitGPUs, read_simulated_power_limit

FOUND_MW, SET_W = 350_000, 250

CHILD = textwrap.dedent(
    """
    import sys, time
    from kareus_fx.runtime.power_limit_controller import PowerLimitController

    controller = PowerLimitController.open("simulated", state_path=sys.argv[1])
    controller.set_limit_w(250)
    print(controller.guardian.pid, flush=True)
    time.sleep(120)  # killed long before
    """
)


def _gpu_at(path: Path, limit_mw: int) -> None:
    """A simulated 400 W card whose limit is ``limit_mw`` (set by someone before the job)."""
    SimulatedPowerLimitGPUs(path, default_limit_w=400).set_power_management_limit(0, limit_mw)


@pytest.mark.parametrize(
    "name",
    [
        "get_power_management_limit",
        "get_power_management_limit_constraints",
        "set_power_management_limit",
        "reset_power_management_limit",
    ],
)
def test_the_simulated_gpu_has_zeus_signatures(name):
    assert inspect.signature(getattr(SimulatedPowerLimitGPUs, name)) == inspect.signature(getattr(GPUs, name))


def test_sigkill_of_the_job_restores_the_limit_found_at_open_within_1_s(tmp_path):
    state = tmp_path / "gpu.json"
    _gpu_at(state, FOUND_MW)  # not the card's default: the guardian must put back what it found
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(state)], stdout=subprocess.PIPE, text=True)
    guardian_pid = int(child.stdout.readline())
    assert (read_simulated_power_limit(state)["limit_mw"], read_simulated_power_limit(state)["pid"]) == (
        SET_W * 1000,
        child.pid,
    )
    child.kill()
    child.wait()  # the death is observable from here on
    died = time.monotonic()
    while read_simulated_power_limit(state)["limit_mw"] != FOUND_MW and time.monotonic() - died < 5.0:
        time.sleep(0.005)
    restored_after_s = time.monotonic() - died
    after = read_simulated_power_limit(state)
    assert (after["limit_mw"], after["pid"]) == (FOUND_MW, guardian_pid)
    print(f"power limit restored {restored_after_s * 1000:.1f} ms after the SIGKILLed job was reaped")
    assert restored_after_s < 1.0
    assert wait_gone(guardian_pid)  # the guardian exited with its parent


def test_without_a_guardian_a_sigkill_leaves_the_limit_set(tmp_path):
    """The failure the guardian exists for (so the test above can fail)."""
    state = tmp_path / "gpu.json"
    _gpu_at(state, FOUND_MW)
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            CHILD.replace("state_path=sys.argv[1])", "state_path=sys.argv[1], guard=False)").replace(
                "controller.guardian.pid", "0"
            ),
            str(state),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout.readline().strip() == "0"
    child.kill()
    child.wait()
    time.sleep(0.3)
    assert read_simulated_power_limit(state)["limit_mw"] == SET_W * 1000


def test_normal_close_restores_and_disarms_the_guardian_without_touching_the_gpu(tmp_path):
    state = tmp_path / "gpu.json"
    _gpu_at(state, FOUND_MW)
    with PowerLimitController.open("simulated", state_path=state) as controller:
        guardian = controller.guardian
        assert guardian is not None and process_alive(guardian.pid, None)
        controller.set_limit_w(300)
        controller.restore()  # e.g. between phases: the guardian stays armed
        controller.set_limit_w(275)
        assert read_simulated_power_limit(state)["limit_mw"] == 275_000
    assert guardian.process.returncode == 0 and controller.guardian is None
    after = read_simulated_power_limit(state)
    assert (after["limit_mw"], after["pid"]) == (FOUND_MW, os.getpid())  # restored by us, not the guardian
    assert controller.requests_w == [300, 275]


def test_no_guardian_for_dry_run_or_a_zeus_stand_in_and_simulated_needs_a_file():
    from test_power_limit_controller import RecordingGPUs

    assert PowerLimitController.open("dry-run").guardian is None
    stand_in = PowerLimitController.open("real", zeus_gpus=RecordingGPUs())
    assert stand_in.guardian is None
    stand_in.close()
    with pytest.raises(PowerLimitError, match="needs state_path"):
        PowerLimitController.open("simulated")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the real guardian path needs an NVIDIA GPU")
def test_real_power_limit_guardian_opens_zeus_and_disarms_without_touching_the_limit():
    """Opens this machine's GPU 0 through Zeus, starts its guardian and disarms it: the limit
    read before equals the limit after (the guardian sets it only after an unplanned death)."""
    from zeus.device.gpu import get_gpus

    before_mw = get_gpus().get_power_management_limit(0)
    controller = PowerLimitController.open("real")
    assert controller.guardian is not None
    guardian = controller.guardian
    controller.close()
    assert guardian.process.returncode == 0
    assert get_gpus().get_power_management_limit(0) == before_mw
