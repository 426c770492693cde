"""A sidecar process that restores a GPU's clock when the process that locked it dies, SIGKILL included.

The same process guards a GPU power limit (:mod:`kareus_fx.runtime.power_limit_controller`): its spec then
names the limit to set back (``power_limit_restore.power_limit_restorer``), and there is no lock record.

Python cannot run anything after SIGKILL (the OOM killer, a scheduler's preemption after its grace
period, ``kill -9``), so the restore must happen in another process. :func:`start_guardian`
starts ``python -m kareus_fx.runtime.clock_guardian`` with the reset spec of one GPU (see
:func:`~kareus_fx.runtime.clock_backends.reset_clock_from_spec`) and its lock record. The guardian:

- opens a pidfd on its parent (Linux 5.3+: ``os.pidfd_open``; elsewhere it polls its parent pid
  every 0.1 s) and checks that the parent is still its parent after opening it, so a parent that
  died during the start is not missed;
- for a real GPU, opens Zeus before reporting ready (a missing permission shows at start, not
  after the death); Zeus goes through zeusd when ``ZEUSD_SOCK_PATH`` / ``ZEUSD_HOST_PORT`` are
  set. zeusd has no lease that undoes a client's settings when the client goes away, so the
  guardian calls the daemon's reset itself. It holds nothing but that reset: it never sets a
  clock;
- reports ``ready`` on stdout, then sleeps in ``poll`` on the pidfd and its stdin;
- when the parent dies (the pidfd becomes readable, or stdin reaches end of file without a
  ``disarm``): resets the clock, removes the lock record if the dead parent wrote it, says so on
  stderr and exits. On ``disarm`` (the controller restored the clock itself) it exits at once.

It runs in its own session, so a signal to the job's process group (Ctrl-C, ``kill -- -PGID``)
does not take it down before its parent; it ignores SIGINT and SIGTERM and exits with its parent.
What it cannot survive: being killed itself together with its parent (a cgroup kill of the whole
job), which leaves a stale lock record that the next controller on that GPU (or
``kareus clocks --reset-stale``) repairs, and power loss, after which the driver starts unlocked.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from kareus_fx.runtime.clock_backends import ClockControlError, ResetSpec, reset_clock_from_spec
from kareus_fx.runtime.clock_locks import remove_lock
from kareus_fx.runtime.power_limit_restore import power_limit_restorer

READY = "ready"
DISARM = "disarm"
_PARENT_POLL_S = 0.1


class ClockGuardian:
    """The controller's handle on a running guardian process."""

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self.process = process

    @property
    def pid(self) -> int:
        return self.process.pid

    def disarm(self, timeout_s: float = 5.0) -> None:
        """Tell the guardian the clock is restored; it exits without touching the GPU."""
        stdin = self.process.stdin
        try:
            if stdin is not None:  # started with stdin=PIPE, so always a pipe
                stdin.write(f"{DISARM}\n".encode())
                stdin.close()
        except (BrokenPipeError, ValueError, OSError):
            pass  # it is gone already
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_guardian(spec: ResetSpec, lock_file: Path | None, timeout_s: float = 60.0) -> ClockGuardian:
    """Start a guardian of the GPU ``spec`` names for this process; returns once it is ready.

    Raises :class:`ClockControlError` (with the guardian's own message) if it cannot start.
    """
    argv = [
        sys.executable,
        "-m",
        "kareus_fx.runtime.clock_guardian",
        str(os.getpid()),
        json.dumps(spec),
        "" if lock_file is None else str(lock_file),
    ]
    # stderr is the job's: the guardian's messages (a start error, a restore) land in its log.
    process = subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True, close_fds=True
    )
    stdout = process.stdout
    assert stdout is not None, "started with stdout=PIPE"
    ready, _, _ = select.select([stdout], [], [], timeout_s)
    line = stdout.readline().decode().strip() if ready else ""
    stdout.close()
    if line != READY:
        process.kill()
        process.wait()
        raise ClockControlError(
            f"the clock guardian did not start within {timeout_s:.0f} s (exit status {process.returncode}; "
            "its error, if any, is on stderr above); fix that, or pass guard=False to ClockController.open "
            "to run without one (a SIGKILL then leaves the clock locked until the next start repairs it)"
        )
    return ClockGuardian(process)


def _parent_death(parent_pid: int) -> Callable[[float | None], bool]:
    """A wait(timeout) that returns True once ``parent_pid`` has died (or stdin says why not)."""
    try:
        pidfd = os.pidfd_open(parent_pid)
    except (AttributeError, OSError):
        pidfd = None
    if os.getppid() != parent_pid:  # died before the pidfd was open (we were re-parented)
        return lambda timeout_s: True
    poller = select.poll()
    if pidfd is not None:
        poller.register(pidfd, select.POLLIN)
    poller.register(sys.stdin.fileno(), select.POLLIN | select.POLLHUP)

    def wait(timeout_s: float | None) -> bool:
        timeout_ms = None if timeout_s is None else int(timeout_s * 1000)
        if pidfd is None:
            timeout_ms = int(_PARENT_POLL_S * 1000)
        for fd, _ in poller.poll(timeout_ms):
            if fd == pidfd:
                return True
            line = sys.stdin.readline()
            if line.strip() == DISARM:
                raise SystemExit(0)
            if not line:  # end of file: the parent's end of the pipe closed
                return True
        return pidfd is None and os.getppid() != parent_pid

    return wait


def _reset_function(spec: ResetSpec) -> Callable[[], None]:
    """The reset, prepared now (a real GPU: Zeus opened, so its errors show at start)."""
    restore_limit = power_limit_restorer(spec)
    if restore_limit is not None:
        return restore_limit
    if spec.get("kind") != "zeus":
        return lambda: reset_clock_from_spec(spec)
    os.environ["CUDA_VISIBLE_DEVICES"] = str(spec["device"])  # before Zeus reads it
    from zeus.device.gpu import get_gpus

    gpus = get_gpus()
    if len(gpus) != 1:
        raise ClockControlError(f"Zeus sees {len(gpus)} GPUs with CUDA_VISIBLE_DEVICES={spec['device']}")
    return lambda: gpus.reset_gpu_locked_clocks(0)


def main(argv: list[str]) -> int:
    """``python -m kareus_fx.runtime.clock_guardian PARENT_PID SPEC_JSON LOCK_FILE``."""
    parent_pid, spec, lock_file = int(argv[0]), json.loads(argv[1]), argv[2]
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    reset = _reset_function(spec)
    what = "power limit" if str(spec.get("kind", "")).endswith("power-limit") else "clock"
    died = _parent_death(parent_pid)
    print(READY, flush=True)
    while not died(None):
        pass
    start = time.monotonic()
    try:
        reset()
    except Exception as err:  # noqa: BLE001 - nothing to return to; the lock record stays for repair
        _say(
            f"kareus guardian: process {parent_pid} died with its GPU {what} set and the restore failed "
            f"({type(err).__name__}: {err}); "
            + ("run `kareus clocks --reset-stale`" if what == "clock" else "set it back with `nvidia-smi -pl`")
        )
        return 1
    if lock_file:
        remove_lock(Path(lock_file), parent_pid)
    _say(
        f"kareus guardian: process {parent_pid} died; GPU {what} restored ({(time.monotonic() - start) * 1000:.0f} ms)"
    )
    return 0


def _say(message: str) -> None:
    try:
        print(message, file=sys.stderr, flush=True)
    except OSError:
        pass  # the job's log is gone with it


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
