"""Clocks restored after any death: the guardian process (SIGKILL) and the stale-lock repair.

A child process opens a simulated controller with a state file, locks 900 MHz and is killed with
SIGKILL; the state file is what a GPU's clock would be. What can fail: the clock stays locked
after the death (no guardian, or one that missed it), the restore takes more than 1 s after the
death is observable, the lock record survives, a stale lock is not found, repaired or named.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from conftest import wait_gone

from kareus_fx.cli import main
from kareus_fx.runtime.clock_backends import SimulatedClockBackend, read_simulated_clock_state, visible_device
from kareus_fx.runtime.clock_controller import ClockController, StaleClockLockWarning
from kareus_fx.runtime.clock_guardian import start_guardian
from kareus_fx.runtime.clock_locks import process_alive, read_lock, stale_locks, write_lock

DEFAULT_MHZ, LOCKED_MHZ = 1410, 900

CHILD = textwrap.dedent(
    """
    import sys, time
    from kareus_fx.runtime.clock_controller import ClockController

    state_path, lock_dir = sys.argv[1], sys.argv[2]
    controller = ClockController.open("simulated", default_clock_mhz=1410, state_path=state_path,
                                          lock_dir=lock_dir)
    controller.request(900)
    controller.flush()
    print(controller.guardian.pid, flush=True)
    time.sleep(120)  # killed long before
    """
)


def _locked_child(tmp_path: Path) -> tuple[subprocess.Popen, int]:
    """A child holding the simulated GPU at 900 MHz, and its guardian's pid."""
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path / "clock.json"), str(tmp_path / "locks")],
        stdout=subprocess.PIPE,
        text=True,
    )
    guardian_pid = int(child.stdout.readline())
    state = read_simulated_clock_state(tmp_path / "clock.json")
    assert (state.clock_mhz, state.locked, state.pid) == (LOCKED_MHZ, True, child.pid)
    return child, guardian_pid


def test_sigkill_of_the_lock_holder_restores_the_clock_within_1_s(tmp_path):
    child, guardian_pid = _locked_child(tmp_path)
    (record,) = (tmp_path / "locks").glob("*.json")
    assert (read_lock(record).pid, read_lock(record).clock_mhz) == (child.pid, LOCKED_MHZ)
    child.kill()
    child.wait()  # the death is observable from here on
    died = time.monotonic()
    while read_simulated_clock_state(tmp_path / "clock.json").locked and time.monotonic() - died < 5.0:
        time.sleep(0.005)
    restored_after_s = time.monotonic() - died
    state = read_simulated_clock_state(tmp_path / "clock.json")
    assert (state.clock_mhz, state.locked, state.pid) == (DEFAULT_MHZ, False, guardian_pid)
    print(f"clock restored {restored_after_s * 1000:.1f} ms after the SIGKILLed holder was reaped")
    assert restored_after_s < 1.0
    assert wait_gone(guardian_pid)  # the guardian exited with its parent
    assert not record.exists()  # after removing the dead process's record


def test_normal_close_disarms_the_guardian_without_touching_the_clock(tmp_path):
    controller = ClockController.open(
        "simulated",
        default_clock_mhz=DEFAULT_MHZ,
        state_path=tmp_path / "c.json",
        lock_dir=tmp_path / "locks",
        handle_sigterm=False,
    )
    guardian = controller.guardian
    controller.request(LOCKED_MHZ)
    controller.flush(timeout_s=30)
    assert len(list((tmp_path / "locks").glob("*.json"))) == 1
    controller.close()
    assert guardian.process.returncode == 0
    state = read_simulated_clock_state(tmp_path / "c.json")
    assert (state.locked, state.pid) == (False, os.getpid())  # restored by us, not by the guardian
    assert list((tmp_path / "locks").glob("*.json")) == []


def test_no_guardian_where_nothing_outside_the_process_is_locked():
    assert ClockController.open("dry-run", handle_sigterm=False).guardian is None
    assert ClockController.open("simulated", default_clock_mhz=DEFAULT_MHZ, handle_sigterm=False).guardian is None


def _leave_stale_lock(tmp_path: Path) -> int:
    """Kill the guardian, then its parent: the clock stays locked with a record of a dead pid."""
    child, guardian_pid = _locked_child(tmp_path)
    os.kill(guardian_pid, signal.SIGKILL)
    assert wait_gone(guardian_pid)
    child.kill()
    child.wait()
    assert read_simulated_clock_state(tmp_path / "clock.json").locked  # nothing restored it
    return child.pid


def test_stale_lock_from_a_dead_pid_is_repaired_at_the_next_start(tmp_path):
    dead_pid = _leave_stale_lock(tmp_path)
    ((_, lock),) = stale_locks(tmp_path / "locks")
    assert (lock.pid, lock.clock_mhz) == (dead_pid, LOCKED_MHZ)
    with pytest.warns(StaleClockLockWarning, match=rf"left locked at 900 MHz by process {dead_pid} .*clock restored"):
        controller = ClockController.open(
            "simulated",
            default_clock_mhz=DEFAULT_MHZ,
            state_path=tmp_path / "clock.json",
            lock_dir=tmp_path / "locks",
            handle_sigterm=False,
            guard=False,
        )
    controller.close()
    assert stale_locks(tmp_path / "locks") == [] and list((tmp_path / "locks").glob("*.json")) == []


def test_kareus_clocks_lists_and_resets_stale_locks(tmp_path, capsys):
    dead_pid = _leave_stale_lock(tmp_path)
    assert main(["clocks", "--lock-dir", str(tmp_path / "locks")]) == 0
    out = capsys.readouterr().out
    assert f"locked at 900 MHz by process {dead_pid}" in out and "1 stale lock(s)" in out
    assert read_simulated_clock_state(tmp_path / "clock.json").locked  # listing changes nothing
    assert main(["clocks", "--reset-stale", "--lock-dir", str(tmp_path / "locks")]) == 0
    assert f"by process {dead_pid} " in capsys.readouterr().out
    state = read_simulated_clock_state(tmp_path / "clock.json")
    assert (state.clock_mhz, state.locked) == (DEFAULT_MHZ, False)
    assert stale_locks(tmp_path / "locks") == []


def test_a_live_locker_is_not_stale_and_a_reused_pid_is(tmp_path):
    backend = SimulatedClockBackend(DEFAULT_MHZ, tmp_path / "c.json")
    path = write_lock(tmp_path, backend.gpu_key(), LOCKED_MHZ, backend.reset_spec())
    assert stale_locks(tmp_path) == []  # this process holds it
    record = json.loads(path.read_text())
    assert process_alive(record["pid"], record["pid_start"])
    if record["pid_start"] is not None:  # /proc: the same pid with another start time is another process
        path.write_text(json.dumps({**record, "pid_start": str(int(record["pid_start"]) + 1)}))
        assert [lock.pid for _, lock in stale_locks(tmp_path)] == [os.getpid()]


def test_a_zeus_stand_in_gets_no_guardian():
    """A test's stand-in for Zeus never yields a reset spec, so no guardian touches a real card."""
    from test_runtime import FakeZeusGPUs

    controller = ClockController.open("real", zeus_gpus=FakeZeusGPUs(permitted=True), handle_sigterm=False)
    assert controller.backend.reset_spec() is None and controller.guardian is None
    controller.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the real guardian path needs an NVIDIA GPU")
def test_real_guardian_opens_zeus_and_disarms_without_touching_the_clock():
    """Starts the guardian of GPU 0 through Zeus (NVML or zeusd) and disarms it: it never resets
    or sets the clock of the card it runs on (its reset runs only after an unplanned death)."""
    pytest.importorskip("zeus")
    guardian = start_guardian({"kind": "zeus", "device": visible_device(0)}, None)
    guardian.disarm()
    assert guardian.process.returncode == 0
