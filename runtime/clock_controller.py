"""Asynchronous GPU clock controller that always restores the clock.

:class:`ClockController` takes clock requests from the training loop (one per pipeline
instruction, paper section 5.1) and applies them on a worker thread through a
:class:`~kareus_fx.runtime.clock_backends.ClockBackend`, so a switch never stalls the caller:

- ``request()`` only validates the clock and stores it; the worker applies the newest request
  and skips older ones that it has not reached yet (only the latest clock matters), and skips
  a clock equal to the one already applied.
- In ``"dry-run"`` mode every request is also recorded, with its time and instruction, in the
  caller's thread (so the record does not depend on the worker's timing).
- The clock is restored (unlocked) by ``restore()`` / ``close()``, on leaving a ``with`` block
  (also on an exception), at interpreter exit (``atexit``) and on SIGTERM. The SIGTERM handler
  restores, then hands the signal to the handler installed before it, or, if that was the
  default, terminates the process by SIGTERM as the default would. A handler can only be
  installed from the main thread; Python runs it between bytecodes of the main thread, so a
  main thread blocked in a long C call delays it.
- SIGKILL cannot be caught, so a backend that locks something outside this process (a real GPU,
  a simulated GPU with a state file) gets a guardian process at construction
  (:mod:`kareus_fx.runtime.clock_guardian`): it restores the clock when this process dies by any
  means, and exits with it. Each applied clock is also recorded in a lock record
  (:mod:`kareus_fx.runtime.clock_locks`), removed on restore. A controller starting on a GPU
  first repairs a stale record (a dead locker whose guardian died too) and warns
  (:class:`StaleClockLockWarning`) naming the process, clock and time.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any, Literal

from kareus_fx.runtime.clock_backends import (
    ClockBackend,
    ClockControlError,
    ClockMode,
    ResetSpec,
    check_clock_request,
    open_clock_backend,
)
from kareus_fx.runtime.clock_guardian import ClockGuardian, start_guardian
from kareus_fx.runtime.clock_locks import default_lock_dir, lock_path, remove_lock, repair_stale_locks, write_lock

if TYPE_CHECKING:
    from zeus.device.gpu.common import GPUs

logger = logging.getLogger(__name__)

_SignalHandler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None
"""What ``signal.getsignal`` returns."""


class StaleClockLockWarning(RuntimeWarning):
    """A GPU was left locked by a process that is gone; the controller restored it (the message says which)."""


@dataclass(frozen=True)
class ClockRequest:
    """One requested clock: when (``time.monotonic()``), which clock, for which instruction."""

    time_s: float
    clock_mhz: int
    instruction: str | None


class ClockController:
    """Applies requested SM clocks off-thread through ``backend``; restores them on every exit.

    ``record_requests`` (default: only in dry-run mode) keeps every request in
    :attr:`requests`. ``handle_sigterm`` installs the SIGTERM handler when constructed in the
    main thread. ``guard`` starts the guardian process (module docstring) when the backend has a
    ``reset_spec``; ``lock_dir`` holds the lock records (default
    :func:`~kareus_fx.runtime.clock_locks.default_lock_dir`).
    """

    def __init__(
        self,
        backend: ClockBackend,
        *,
        record_requests: bool | None = None,
        handle_sigterm: bool = True,
        guard: bool = True,
        lock_dir: str | Path | None = None,
    ) -> None:
        self.backend = backend
        if record_requests is None:
            record_requests = backend.mode == "dry-run"
        self._record_requests = record_requests
        self._requests: list[ClockRequest] = []
        # _cond guards the request slot and the closing flag; _apply_lock serialises backend
        # calls. Both are re-entrant because the SIGTERM handler may run restore() in the main
        # thread while that thread is inside request() or restore().
        self._cond = threading.Condition(threading.RLock())
        self._apply_lock = threading.RLock()
        self._pending_clock_mhz: int | None = None
        self._requested_seq = 0
        self._applied_seq = 0
        self._applied_clock_mhz: int | None = None
        self._worker_error: BaseException | None = None
        self._closing = False
        self._restored = False
        self._worker: threading.Thread | None = None
        self._previous_sigterm: _SignalHandler = None
        self._sigterm_installed = False
        self._reset_spec: ResetSpec | None = getattr(backend, "reset_spec", lambda: None)()
        self._lock_file: Path | None = None
        self.guardian: ClockGuardian | None = None
        """The guardian process, when one runs."""
        if self._reset_spec is not None:
            self._lock_file = self._repair_stale_lock(Path(lock_dir) if lock_dir else default_lock_dir())
            if guard:
                self.guardian = start_guardian(self._reset_spec, self._lock_file)
        atexit.register(self._restore_at_exit)
        if handle_sigterm:
            self._install_sigterm()

    def _repair_stale_lock(self, lock_dir: Path) -> Path:
        """Repair a lock a dead process left on this GPU (warning once per repair); the GPU's record file."""
        gpu = self.backend.gpu_key()
        for repaired in repair_stale_locks(lock_dir, gpu):
            message = repaired.describe()
            logger.warning(message)
            warnings.warn(message, StaleClockLockWarning, stacklevel=3)
            if repaired.error is not None:
                raise ClockControlError(f"{message}; reset it by hand (nvidia-smi --reset-gpu-clocks) first")
        return lock_path(lock_dir, gpu)

    @classmethod
    def open(
        cls,
        mode: ClockMode,
        *,
        gpu_index: int = 0,
        default_clock_mhz: int | None = None,
        state_path: str | Path | None = None,
        clock_range_mhz: tuple[int, int] | None = None,
        fallback: Literal["error", "dry-run"] = "error",
        zeus_gpus: GPUs | None = None,
        handle_sigterm: bool = True,
        guard: bool = True,
        lock_dir: str | Path | None = None,
    ) -> ClockController:
        """A controller over the backend for ``mode`` (see ``open_clock_backend``).

        ``gpu_index`` is this process's GPU as Zeus and ``torch.cuda`` number it (under
        ``CUDA_VISIBLE_DEVICES``), usually the local rank.
        """
        backend = open_clock_backend(
            mode,
            gpu_index=gpu_index,
            default_clock_mhz=default_clock_mhz,
            state_path=state_path,
            clock_range_mhz=clock_range_mhz,
            fallback=fallback,
            zeus_gpus=zeus_gpus,
        )
        return cls(backend, handle_sigterm=handle_sigterm, guard=guard, lock_dir=lock_dir)

    @property
    def mode(self) -> ClockMode:
        """The backend's mode (``"dry-run"`` after a permission fallback)."""
        return self.backend.mode

    @property
    def requests(self) -> tuple[ClockRequest, ...]:
        """Every request so far, in order (empty unless requests are recorded)."""
        with self._cond:
            return tuple(self._requests)

    @property
    def applied_clock_mhz(self) -> int | None:
        """The clock the backend last applied; None while the GPU runs at its default."""
        return self._applied_clock_mhz

    def request(self, clock_mhz: int, instruction: str | None = None) -> None:
        """Ask for ``clock_mhz`` from now on; returns without waiting for the switch."""
        check_clock_request(clock_mhz, self.backend.clock_range_mhz)
        with self._cond:
            self._raise_worker_error()
            if self._closing:
                raise ClockControlError("this ClockController was closed (its clock restored); open a new one")
            if self._record_requests:
                self._requests.append(ClockRequest(time.monotonic(), clock_mhz, instruction))
            self._pending_clock_mhz = clock_mhz
            self._requested_seq += 1
            if self._worker is None:
                self._worker = threading.Thread(target=self._apply_requests, name="kareus-clock", daemon=True)
                self._worker.start()
            self._cond.notify_all()

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait until the latest request has been applied (or skipped as already current)."""
        with self._cond:
            done = self._cond.wait_for(lambda: self._applied_seq >= self._requested_seq or self._closing, timeout_s)
            self._raise_worker_error()
            if not done:
                raise TimeoutError(f"clock request not applied within {timeout_s} s")

    def restore(self) -> None:
        """Stop applying requests and return the GPU to its default clock (idempotent)."""
        with self._cond:
            if self._restored:
                return
            self._closing = True
            self._pending_clock_mhz = None
            self._cond.notify_all()
        with self._apply_lock:  # waits for a switch in progress, then no switch follows
            if not self._restored:
                self.backend.reset_clock()
                self._applied_clock_mhz = None
                self._restored = True
                if self._lock_file is not None:
                    remove_lock(self._lock_file, os.getpid())
                if self.guardian is not None:
                    self.guardian.disarm()
        worker = self._worker
        if worker is not None and worker is not threading.current_thread():
            worker.join(timeout=5.0)
        self._uninstall_sigterm()
        atexit.unregister(self._restore_at_exit)

    close = restore

    def __enter__(self) -> ClockController:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.restore()
        if exc_type is None:
            self._raise_worker_error()

    def _apply_requests(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending_clock_mhz is not None or self._closing)
                if self._closing:
                    return
                clock_mhz, seq = self._pending_clock_mhz, self._requested_seq
                if clock_mhz is None:  # unreachable: the wait returns on a request or on closing
                    return
                self._pending_clock_mhz = None
            with self._apply_lock:
                if self._closing:
                    return
                if self._worker_error is None and clock_mhz != self._applied_clock_mhz:
                    try:
                        if self._lock_file is not None and self._reset_spec is not None:  # no lock without a record
                            write_lock(self._lock_file.parent, self.backend.gpu_key(), clock_mhz, self._reset_spec)
                        self.backend.set_clock(clock_mhz)
                        self._applied_clock_mhz = clock_mhz
                    except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
                        self._worker_error = err
            with self._cond:
                self._applied_seq = seq
                self._cond.notify_all()

    def _raise_worker_error(self) -> None:
        if self._worker_error is not None:
            raise ClockControlError(
                f"switching the clock failed in the worker thread: {self._worker_error}"
            ) from self._worker_error

    def _restore_at_exit(self) -> None:
        try:
            self.restore()
        except Exception:
            logger.exception("restoring the GPU clock at exit failed")

    def _install_sigterm(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            logger.warning(
                "ClockController created outside the main thread: no SIGTERM handler; "
                "the clock is restored by close(), the with block and atexit only"
            )
            return
        previous = signal.getsignal(signal.SIGTERM)
        if previous is signal.SIG_IGN:
            return  # the process ignores SIGTERM: it keeps running, and so does the controller
        # None: installed from outside Python; SIG_DFL is what re-raising it should then do.
        self._previous_sigterm = signal.SIG_DFL if previous is None else previous
        signal.signal(signal.SIGTERM, self._on_sigterm)
        self._sigterm_installed = True

    def _uninstall_sigterm(self) -> None:
        if not self._sigterm_installed or threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
        self._sigterm_installed = False

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        previous = self._previous_sigterm
        try:
            self.restore()
        except Exception:
            logger.exception("restoring the GPU clock on SIGTERM failed")
        if callable(previous):
            previous(signum, frame)
            return
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        os._exit(128 + signum)  # only reached if the re-raised signal was not delivered
