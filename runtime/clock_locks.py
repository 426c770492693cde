"""Records of locked GPU clocks, so a lock left by a dead process is found and repaired.

While a :class:`~kareus_fx.runtime.clock_controller.ClockController` holds a GPU's clock locked it
keeps one small JSON record per GPU in a lock directory: the locking process (pid and its start
time, so a reused pid is not taken for the locker), the GPU (``gpu_key``), the clock, when it was
locked, and how another process resets that GPU (the backend's ``reset_spec``). Restoring the
clock removes the record. A record whose process is gone is *stale*: the process died with the
clock locked and nothing restored it (its guardian was killed too, or the machine lost power).
:func:`repair_stale_locks` resets such GPUs and removes their records; the next controller to
start on the GPU calls it, and so does ``kareus clocks --reset-stale`` for every GPU.

The lock directory is ``$KAREUS_CLOCK_LOCK_DIR`` when set, else ``kareus-clock-locks-<uid>`` in
the system's temporary directory (one per user; the records hold no secrets). Assumes one
controller per GPU at a time, as the runtime does (one process drives one GPU).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from hashlib import sha256
from pathlib import Path
from typing import Any

from kareus_fx.runtime.clock_backends import ClockControlError, ResetSpec, reset_clock_from_spec

LOCK_DIR_ENV = "KAREUS_CLOCK_LOCK_DIR"


@dataclass(frozen=True)
class ClockLock:
    """One lock record (see the module docstring)."""

    gpu: str
    pid: int
    pid_start: str | None
    clock_mhz: int
    locked_unix_s: float
    reset: ResetSpec


@dataclass(frozen=True)
class RepairedLock:
    """A stale lock that :func:`repair_stale_locks` handled: ``error`` is None when the clock was reset."""

    lock: ClockLock
    error: str | None

    def describe(self) -> str:
        """One line saying what was found and done."""
        lock = self.lock
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(lock.locked_unix_s))
        found = (
            f"GPU {lock.gpu} was left locked at {lock.clock_mhz} MHz by process {lock.pid} "
            f"(locked {when}), which is gone"
        )
        return f"{found}: clock restored" if self.error is None else f"{found}: reset FAILED ({self.error})"


def default_lock_dir() -> Path:
    """``$KAREUS_CLOCK_LOCK_DIR``, else ``<tmp>/kareus-clock-locks-<uid>``."""
    configured = os.environ.get(LOCK_DIR_ENV)
    if configured:
        return Path(configured)
    return Path(tempfile.gettempdir()) / f"kareus-clock-locks-{os.getuid()}"


def lock_path(lock_dir: Path, gpu: str) -> Path:
    """The record file of ``gpu`` in ``lock_dir``."""
    return lock_dir / f"{sha256(gpu.encode()).hexdigest()[:20]}.json"


def _proc_stat(pid: int) -> list[str] | None:
    """Fields 3 onwards of ``/proc/PID/stat`` (after the name, which may hold spaces); None where unknown."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def process_start(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot, field 22 of ``/proc/PID/stat``)."""
    fields = _proc_stat(pid)
    return None if fields is None else fields[19]


def process_alive(pid: int, start: str | None) -> bool:
    """Whether process ``pid`` runs (a zombie has died) and, when ``start`` is known, is the one
    that started then (not a reused pid)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by another user
    fields = _proc_stat(pid)
    if fields is None:
        return True
    return fields[0] != "Z" and (start is None or fields[19] == start)


def write_lock(lock_dir: Path, gpu: str, clock_mhz: int, reset: ResetSpec) -> Path:
    """Record that this process holds ``gpu`` at ``clock_mhz`` (atomic replace); returns the file."""
    lock_dir.mkdir(parents=True, exist_ok=True)
    pid = os.getpid()
    record = ClockLock(gpu, pid, process_start(pid), clock_mhz, time.time(), reset)
    path = lock_path(lock_dir, gpu)
    temporary = path.with_name(f".{path.name}.{pid}.tmp")
    temporary.write_text(json.dumps(asdict(record)))
    os.replace(temporary, path)
    return path


def remove_lock(path: Path, pid: int | None = None) -> None:
    """Delete the record at ``path`` (if ``pid`` is given, only when that process wrote it)."""
    if pid is not None:
        lock = read_lock(path)
        if lock is None or lock.pid != pid:
            return
    path.unlink(missing_ok=True)


def read_lock(path: Path) -> ClockLock | None:
    """The record at ``path``; None when it is missing or unreadable (a partly written temporary)."""
    try:
        fields: dict[str, Any] = json.loads(path.read_text())
        return ClockLock(**fields)
    except (OSError, ValueError, TypeError):
        return None


def stale_locks(lock_dir: Path | None = None, gpu: str | None = None) -> list[tuple[Path, ClockLock]]:
    """Records (of ``gpu``, or all) whose locking process is gone."""
    lock_dir = default_lock_dir() if lock_dir is None else lock_dir
    paths = [lock_path(lock_dir, gpu)] if gpu is not None else sorted(lock_dir.glob("*.json"))
    found = []
    for path in paths:
        lock = read_lock(path)
        if lock is not None and not process_alive(lock.pid, lock.pid_start):
            found.append((path, lock))
    return found


def repair_stale_locks(lock_dir: Path | None = None, gpu: str | None = None) -> list[RepairedLock]:
    """Reset every GPU (or ``gpu``) whose locking process is gone and remove its record; a GPU
    whose reset fails keeps its record (the next repair tries again) and reports the error."""
    repaired = []
    for path, lock in stale_locks(lock_dir, gpu):
        try:
            reset_clock_from_spec(lock.reset)
        except (ClockControlError, OSError, KeyError, ValueError) as err:
            repaired.append(RepairedLock(lock, f"{type(err).__name__}: {err}"))
            continue
        remove_lock(path, lock.pid)
        repaired.append(RepairedLock(lock, None))
    return repaired
