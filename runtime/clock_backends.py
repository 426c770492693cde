"""Where a GPU SM clock actually goes: the real GPU (Zeus), a dry run, or a simulated GPU.

A backend applies one clock at a time, synchronously; :mod:`kareus_fx.runtime.clock_controller` calls it
from a worker thread so that the training loop never waits on it. Three backends:

- :class:`ZeusClockBackend` (``"real"``): locks the SM clock with Zeus's GPU management
  (``zeus.device.get_gpus()``, ``set_gpu_locked_clocks`` / ``reset_gpu_locked_clocks``). Zeus
  goes through the Zeus daemon (zeusd) when ``ZEUSD_SOCK_PATH`` or ``ZEUSD_HOST_PORT`` is set,
  and through NVML directly otherwise (which needs the ``SYS_ADMIN`` capability).
- :class:`DryRunClockBackend` (``"dry-run"``): applies nothing; the controller records requests.
- :class:`SimulatedClockBackend` (``"simulated"``): keeps a simulated current clock and, when
  given a path, mirrors it to a small JSON state file that other processes can read (a test can
  kill the process and check that the clock was restored).

"Restoring" a clock means returning to the GPU's default clock management (unlocked), which is
what ``reset_gpu_locked_clocks`` does on a real GPU.

Another process can restore a GPU too: a backend's ``reset_spec()`` is a small JSON-able dict
saying how (:func:`reset_clock_from_spec` applies it). The clock guardian
(:mod:`kareus_fx.runtime.clock_guardian`) and the stale-lock repair
(:mod:`kareus_fx.runtime.clock_locks`) use it. ``gpu_key()`` names the GPU the same way in every
process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, ParamSpec, Protocol, TypeVar

from kareus_fx.errors import KareusError

if TYPE_CHECKING:  # zeus is imported where a real GPU is used, not at import time
    from zeus.device.gpu.common import GPUs

_P = ParamSpec("_P")
_R = TypeVar("_R")

ClockMode = Literal["real", "dry-run", "simulated"]
CLOCK_MODES: tuple[ClockMode, ...] = ("real", "dry-run", "simulated")


class ClockControlError(KareusError, RuntimeError):
    """The GPU clock cannot be controlled as asked (no GPU library, daemon unreachable, ...)."""


class ClockPermissionError(ClockControlError, PermissionError):
    """This process may not lock GPU clocks; the message names the fix."""


class ClockRequestError(KareusError, ValueError):
    """A requested clock that no backend may apply (not a positive integer, outside the range)."""


def parse_clock_mode(name: str) -> ClockMode:
    """``name`` as a :data:`ClockMode`; :class:`ClockRequestError` naming the valid ones otherwise."""
    for mode in CLOCK_MODES:
        if name == mode:
            return mode
    raise ClockRequestError(f"unknown clock mode {name!r}; use one of {', '.join(CLOCK_MODES)}")


class ClockBackend(Protocol):
    """Applies SM clocks to one GPU. Calls may block; the controller calls them off-thread."""

    mode: ClockMode
    # Inclusive range of clocks the GPU accepts, when known.
    clock_range_mhz: tuple[int, int] | None

    def set_clock(self, clock_mhz: int) -> None:
        """Lock the SM clock at ``clock_mhz``."""

    def reset_clock(self) -> None:
        """Return the SM clock to the GPU's default management (unlocked)."""

    def reset_spec(self) -> ResetSpec | None:
        """How another process resets this GPU; None when nothing outside this process is locked."""

    def gpu_key(self) -> str:
        """The GPU's name in lock records (the same for every process on this machine)."""


ResetSpec = dict[str, Any]
"""``{"kind": "simulated", "state_path": ..., "default_clock_mhz": ...}`` or
``{"kind": "zeus", "device": <CUDA_VISIBLE_DEVICES entry of the GPU>}``."""


class DryRunClockBackend:
    """Never touches a GPU: every call is a no-op (the controller keeps the request log)."""

    mode: ClockMode = "dry-run"

    def __init__(self, clock_range_mhz: tuple[int, int] | None = None) -> None:
        self.clock_range_mhz = clock_range_mhz

    def set_clock(self, clock_mhz: int) -> None:
        """Apply nothing."""

    def reset_clock(self) -> None:
        """Apply nothing."""

    def reset_spec(self) -> ResetSpec | None:
        """None: a dry run locks nothing."""
        return None

    def gpu_key(self) -> str:
        return "dry-run"


@dataclass(frozen=True)
class SimulatedClockState:
    """What a :class:`SimulatedClockBackend` state file holds."""

    clock_mhz: int
    default_clock_mhz: int
    locked: bool
    pid: int
    updated_unix_s: float


def read_simulated_clock_state(path: str | Path) -> SimulatedClockState:
    """Read a state file written by :class:`SimulatedClockBackend`."""
    try:
        fields = json.loads(Path(path).read_text())
        return SimulatedClockState(**fields)
    except (OSError, ValueError, TypeError) as err:
        raise ClockControlError(
            f"{path} is not a readable simulated clock state file ({err}); it is written by "
            "ClockController.open('simulated', state_path=...)"
        ) from err


class SimulatedClockBackend:
    """A simulated GPU clock, optionally mirrored to a JSON state file.

    The file is replaced atomically (write to a temporary file, then rename), so a reader sees
    either the previous or the new state, never a torn write; a process killed between two
    writes leaves the last complete state.
    """

    mode: ClockMode = "simulated"

    def __init__(
        self,
        default_clock_mhz: int,
        state_path: str | Path | None = None,
        clock_range_mhz: tuple[int, int] | None = None,
    ) -> None:
        _check_positive_clock(default_clock_mhz, "default_clock_mhz")
        self.default_clock_mhz = default_clock_mhz
        self.state_path = None if state_path is None else Path(state_path)
        self.clock_range_mhz = clock_range_mhz
        self.current_clock_mhz = default_clock_mhz
        self.locked = False
        self._write_state()

    def set_clock(self, clock_mhz: int) -> None:
        """Make ``clock_mhz`` the simulated current clock."""
        self.current_clock_mhz = clock_mhz
        self.locked = True
        self._write_state()

    def reset_clock(self) -> None:
        """Return the simulated clock to its default."""
        self.current_clock_mhz = self.default_clock_mhz
        self.locked = False
        self._write_state()

    def reset_spec(self) -> ResetSpec | None:
        """Rewrite the state file unlocked; None without a state file (the state dies with us)."""
        if self.state_path is None:
            return None
        return {
            "kind": "simulated",
            "state_path": str(self.state_path.resolve()),
            "default_clock_mhz": self.default_clock_mhz,
        }

    def gpu_key(self) -> str:
        where = "memory" if self.state_path is None else str(self.state_path.resolve())
        return f"simulated:{where}"

    def _write_state(self) -> None:
        if self.state_path is None:
            return
        state = SimulatedClockState(
            clock_mhz=self.current_clock_mhz,
            default_clock_mhz=self.default_clock_mhz,
            locked=self.locked,
            pid=os.getpid(),
            updated_unix_s=time.time(),
        )
        temporary = self.state_path.with_name(f".{self.state_path.name}.{os.getpid()}.tmp")
        temporary.write_text(json.dumps(state.__dict__))
        os.replace(temporary, self.state_path)


_PERMISSION_FIX = (
    "Fix: run the Zeus daemon (zeusd, https://ml.energy/zeus/getting_started/) and set "
    "ZEUSD_SOCK_PATH to its socket, or give this process the SYS_ADMIN capability "
    "(e.g. `docker run --cap-add SYS_ADMIN`) or run it as root. Or pass fallback='dry-run' to "
    "record the planned clocks without applying them."
)


class ZeusClockBackend:
    """Locks one GPU's SM clock through Zeus (zeusd when configured, NVML otherwise).

    Construction checks that clocks can be controlled by resetting the GPU's locked clocks (the
    state the controller restores to anyway): missing permission fails here, in the caller's
    thread, with :class:`ClockPermissionError`, rather than later in the worker thread.

    ``gpu_index`` is Zeus's index, which respects ``CUDA_VISIBLE_DEVICES`` (the same index as
    ``torch.cuda``'s device). ``zeus_gpus`` is a Zeus ``GPUs`` object; default
    ``zeus.device.get_gpus()``.
    """

    mode: ClockMode = "real"

    def __init__(self, gpu_index: int = 0, zeus_gpus: GPUs | None = None) -> None:
        self._own_zeus = zeus_gpus is None
        if zeus_gpus is None:
            zeus_gpus = _zeus_gpus()
        if not 0 <= gpu_index < len(zeus_gpus):
            raise ClockControlError(
                f"gpu_index {gpu_index} is outside the {len(zeus_gpus)} GPU(s) Zeus sees "
                "(CUDA_VISIBLE_DEVICES applies); pass the index of this process's GPU"
            )
        self.gpu_index = gpu_index
        self._gpus = zeus_gpus
        # NVML lists the graphics clocks per memory clock (a memory clock is a required argument of
        # nvmlDeviceGetSupportedGraphicsClocks; Zeus's default None fails in pynvml): those at the
        # highest memory clock, the one the GPU runs at by default.
        memory_mhz = self._call("read the supported memory clocks", zeus_gpus.get_supported_memory_clocks, gpu_index)
        supported_mhz = (
            self._call("read the supported clocks", zeus_gpus.get_supported_graphics_clocks, gpu_index, max(memory_mhz))
            if memory_mhz
            else []
        )
        self.clock_range_mhz = (min(supported_mhz), max(supported_mhz)) if supported_mhz else None
        self.reset_clock()

    def set_clock(self, clock_mhz: int) -> None:
        """Lock the SM clock at exactly ``clock_mhz`` (min = max)."""
        self._call(
            f"lock the SM clock at {clock_mhz} MHz",
            self._gpus.set_gpu_locked_clocks,
            self.gpu_index,
            clock_mhz,
            clock_mhz,
        )

    def reset_clock(self) -> None:
        """Unlock the SM clock (the driver's default management)."""
        self._call("reset the locked SM clock", self._gpus.reset_gpu_locked_clocks, self.gpu_index)

    def reset_spec(self) -> ResetSpec | None:
        """The GPU as another process reaches it: its ``CUDA_VISIBLE_DEVICES`` entry (index or
        UUID). None when the Zeus object was passed in (a test's stand-in: never a real card)."""
        if not self._own_zeus:
            return None
        return {"kind": "zeus", "device": visible_device(self.gpu_index)}

    def gpu_key(self) -> str:
        return f"nvidia:{visible_device(self.gpu_index)}"

    def _call(self, what: str, method: Callable[_P, _R], *args: _P.args, **kwargs: _P.kwargs) -> _R:
        from zeus.exception import ZeusBaseError

        try:
            return method(*args, **kwargs)
        except ZeusBaseError as err:
            raise _clock_error(f"GPU {self.gpu_index}", what, err) from err


def _clock_error(gpu: str, what: str, err: Exception) -> ClockControlError:
    """A Zeus error (Zeus maps each NVML error code to one) as ours: a permission error names the fix."""
    from zeus.device.gpu.common import ZeusGPUNoPermissionError
    from zeus.utils.zeusd import ZeusdAuthError

    if isinstance(err, (ZeusGPUNoPermissionError, ZeusdAuthError)):
        return ClockPermissionError(
            f"{gpu}: this process may not {what} ({type(err).__name__}: {err}). " + _PERMISSION_FIX
        )
    return ClockControlError(
        f"{gpu}: could not {what} ({type(err).__name__}: {err}). If the "
        "Zeus daemon is configured (ZEUSD_SOCK_PATH / ZEUSD_HOST_PORT), check that it runs."
    )


def visible_device(gpu_index: int) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` entry of this process's GPU ``gpu_index`` (the index itself
    when the variable is unset): with it as the whole variable, the GPU is index 0 anywhere."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return str(gpu_index)
    entries = [entry.strip() for entry in visible.split(",") if entry.strip()]
    if not 0 <= gpu_index < len(entries):
        raise ClockControlError(f"gpu_index {gpu_index} is outside CUDA_VISIBLE_DEVICES={visible!r}")
    return entries[gpu_index]


def reset_clock_from_spec(spec: ResetSpec) -> None:
    """Restore the GPU that ``spec`` names (from any process; see the module docstring).

    A ``"zeus"`` spec is applied by a child process whose ``CUDA_VISIBLE_DEVICES`` is the GPU's
    entry (Zeus reads the variable once per process), through zeusd when this process's
    environment names it, else NVML.
    """
    kind = spec.get("kind")
    if kind == "simulated":
        SimulatedClockBackend(int(spec["default_clock_mhz"]), spec["state_path"]).reset_clock()
    elif kind == "zeus":
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(spec["device"])}
        done = subprocess.run(
            [sys.executable, "-c", _ZEUS_RESET], env=env, capture_output=True, text=True, timeout=120, check=False
        )
        if done.returncode != 0:
            raise ClockControlError(
                f"could not reset the locked clock of GPU {spec['device']}: {done.stderr.strip()[-500:]}"
            )
    else:
        raise ClockControlError(f"unknown reset spec {spec!r}: written by another kareus-fx version?")


_ZEUS_RESET = "from zeus.device import get_gpus; get_gpus().reset_gpu_locked_clocks(0)"


def _zeus_gpus() -> GPUs:
    from zeus.device.gpu import get_gpus
    from zeus.device.gpu.common import ZeusGPUInitError
    from zeus.exception import ZeusBaseError

    try:
        return get_gpus()
    except ZeusGPUInitError as err:
        raise ClockControlError(
            f"no GPU management library could start ({err}). Real clock control needs an "
            "NVIDIA (NVML) or AMD (amdsmi) GPU driver; use mode='dry-run' or 'simulated' without one"
        ) from err
    except ZeusBaseError as err:  # NVML started but listing the GPUs failed
        raise _clock_error("the GPUs", "open the GPUs' handles", err) from err
    except ValueError as err:  # Zeus reads CUDA_VISIBLE_DEVICES as integers
        raise ClockControlError(
            f"Zeus cannot read CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r} ({err}): it "
            "takes GPU indices only (no UUIDs); set CUDA_VISIBLE_DEVICES to indices for real clock control"
        ) from err


def _check_positive_clock(clock_mhz: Any, name: str) -> None:
    if isinstance(clock_mhz, bool) or not isinstance(clock_mhz, int) or clock_mhz <= 0:
        raise ClockRequestError(f"{name} must be a positive integer number of MHz, got {clock_mhz!r}")


def check_clock_request(clock_mhz: Any, clock_range_mhz: tuple[int, int] | None) -> None:
    """Raise :class:`ClockRequestError` unless ``clock_mhz`` is a clock the GPU accepts."""
    _check_positive_clock(clock_mhz, "clock_mhz")
    if clock_range_mhz is not None and not clock_range_mhz[0] <= clock_mhz <= clock_range_mhz[1]:
        raise ClockRequestError(
            f"clock {clock_mhz} MHz is outside the GPU's supported range "
            f"{clock_range_mhz[0]}..{clock_range_mhz[1]} MHz; the plan was made for another GPU?"
        )


def open_clock_backend(
    mode: ClockMode,
    *,
    gpu_index: int = 0,
    default_clock_mhz: int | None = None,
    state_path: str | Path | None = None,
    clock_range_mhz: tuple[int, int] | None = None,
    fallback: Literal["error", "dry-run"] = "error",
    zeus_gpus: GPUs | None = None,
) -> ClockBackend:
    """The backend for ``mode``.

    ``"real"`` uses ``gpu_index`` and ``zeus_gpus``; if clocks cannot be controlled it raises
    (``fallback="error"``) or warns once and returns a dry-run backend (``fallback="dry-run"``).
    ``"simulated"`` needs ``default_clock_mhz`` and mirrors its state to ``state_path`` if given.
    ``clock_range_mhz`` bounds the requests of the dry-run and simulated backends.
    """
    if fallback not in ("error", "dry-run"):
        raise ClockRequestError(f"fallback must be 'error' or 'dry-run', got {fallback!r}")
    if mode == "dry-run":
        return DryRunClockBackend(clock_range_mhz)
    if mode == "simulated":
        if default_clock_mhz is None:
            raise ClockRequestError(
                "mode='simulated' needs default_clock_mhz (the clock the GPU runs at unlocked, "
                "e.g. the spec's clock_max_mhz)"
            )
        return SimulatedClockBackend(default_clock_mhz, state_path, clock_range_mhz)
    if mode == "real":
        try:
            return ZeusClockBackend(gpu_index, zeus_gpus)
        except ClockControlError as err:
            if fallback == "error":
                raise
            warnings.warn(
                f"GPU clock control unavailable, running the clock plan in dry-run: {err}",
                RuntimeWarning,
                stacklevel=2,
            )
            return DryRunClockBackend(clock_range_mhz)
    raise ClockRequestError(f"unknown clock mode {mode!r}; use one of {', '.join(CLOCK_MODES)}")
