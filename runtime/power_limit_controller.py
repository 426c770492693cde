"""A job-wide GPU power limit, set through Zeus and always put back, SIGKILL included.

For clusters that forbid locking clocks but allow power limits: a deployment in power-
limit mode sets one limit on this process's GPU (the plan's ``megatron+power-limit`` curve gives
the limit for a target) instead of requesting clocks. Three modes:

- ``"real"`` goes through ``zeus.device.get_gpus()`` (``set_power_management_limit`` in mW, as
  NVML takes it; zeusd when ``ZEUSD_SOCK_PATH`` / ``ZEUSD_HOST_PORT`` are set);
- ``"simulated"``: :class:`SimulatedPowerLimitGPUs`, a stand-in for NVML whose limit lives in a
  JSON state file that other processes read and write (a test can kill the job and see the limit);
- ``"dry-run"`` only records.

The limit found at open is restored by ``restore()`` / ``close()``, on leaving a ``with`` block and
at interpreter exit. A SIGKILL runs none of those, and NVML keeps a limit until it is set again
or the machine reboots, so a controller on a real GPU (or a simulated one with a state file) also
starts the clock guardian's sidecar process (:mod:`kareus_fx.runtime.clock_guardian`) with a
restore spec: when this process dies without disarming it, the guardian sets the limit found at
open again. A limit passed in as ``zeus_gpus`` (a test's stand-in) gets no guardian, as for clocks.
What it cannot survive is the guardian's own death together with the job (a cgroup kill of both):
the limit then stays until ``nvidia-smi -pl`` or a reboot.
"""

from __future__ import annotations

import atexit
from pathlib import Path
from types import TracebackType
from typing import Literal, Protocol

from kareus_fx.runtime.clock_backends import ClockControlError, ResetSpec, visible_device
from kareus_fx.runtime.clock_guardian import ClockGuardian, start_guardian
from kareus_fx.runtime.power_limit_restore import (
    SIMULATED_SPEC_KIND,
    ZEUS_SPEC_KIND,
    PowerLimitError,
    SimulatedPowerLimitGPUs,
)

PowerLimitMode = Literal["real", "simulated", "dry-run"]
POWER_LIMIT_MODES: tuple[PowerLimitMode, ...] = ("real", "simulated", "dry-run")


class _ZeusGPUs(Protocol):
    def get_power_management_limit(self, gpu_index: int) -> int: ...

    def get_power_management_limit_constraints(self, gpu_index: int) -> tuple[int, int]: ...

    def set_power_management_limit(self, gpu_index: int, power_limit_mw: int, block: bool = True) -> None: ...


class PowerLimitController:
    """Sets this process's GPU power limit (watts in, milliwatts to Zeus) and restores the one
    found at open on every exit path above; ``restore_spec`` (how another process restores it)
    starts a guardian unless ``guard`` is False."""

    def __init__(
        self,
        mode: PowerLimitMode,
        gpus: _ZeusGPUs | None,
        gpu_index: int = 0,
        *,
        restore_spec: ResetSpec | None = None,
        guard: bool = True,
    ) -> None:
        self.mode = mode
        self._gpus = gpus
        self._gpu_index = gpu_index
        self.requests_w: list[int] = []
        """Every limit set, in order (every mode)."""
        self._original_mw: int | None = None
        self._range_mw: tuple[int, int] | None = None
        if gpus is not None:
            self._original_mw = int(gpus.get_power_management_limit(gpu_index))
            low, high = gpus.get_power_management_limit_constraints(gpu_index)
            self._range_mw = (int(low), int(high))
        self._restored = True
        self.guardian: ClockGuardian | None = None
        """The guardian process, when one runs."""
        if guard and restore_spec is not None and self._original_mw is not None:
            try:
                self.guardian = start_guardian({**restore_spec, "limit_mw": self._original_mw}, None)
            except ClockControlError as err:
                raise PowerLimitError(
                    f"the power-limit guardian did not start ({err}); fix that, or pass guard=False to "
                    f"PowerLimitController.open (a SIGKILL then leaves the limit set until `nvidia-smi -pl`)"
                ) from err
        atexit.register(self.close)

    @classmethod
    def open(
        cls,
        mode: PowerLimitMode,
        gpu_index: int = 0,
        zeus_gpus: _ZeusGPUs | None = None,
        *,
        state_path: str | Path | None = None,
        default_limit_w: int = 400,
        guard: bool = True,
    ) -> PowerLimitController:
        """``"dry-run"`` records only; ``"simulated"`` drives a :class:`SimulatedPowerLimitGPUs`
        (``state_path``: its file, shared with other processes; ``default_limit_w``: its limit
        when the file is new); ``"real"`` needs a GPU Zeus can drive (``zeus_gpus``: a
        ``zeus.device`` GPUs object, default ``get_gpus()``). ``guard``: start the guardian
        process where the limit outlives this process (a real GPU opened here, a state file)."""
        if mode == "dry-run":
            return cls(mode, None, gpu_index)
        if mode == "simulated":
            if state_path is None:
                raise PowerLimitError("mode 'simulated' needs state_path (the simulated GPU's limit file)")
            gpus = SimulatedPowerLimitGPUs(state_path, default_limit_w)
            simulated = {"kind": SIMULATED_SPEC_KIND, "state_path": str(Path(state_path).resolve())}
            return cls(mode, gpus, 0, restore_spec=simulated, guard=guard)
        if mode != "real":
            raise PowerLimitError(f"power-limit mode must be one of {', '.join(POWER_LIMIT_MODES)}, got {mode!r}")
        spec: ResetSpec | None = None
        if zeus_gpus is None:  # a GPU of this machine: its guardian reaches it by CUDA_VISIBLE_DEVICES
            from zeus.device.gpu import get_gpus

            zeus_gpus = get_gpus()
            spec = {"kind": ZEUS_SPEC_KIND, "device": visible_device(gpu_index)}
        return cls(mode, zeus_gpus, gpu_index, restore_spec=spec, guard=guard)

    def set_limit_w(self, limit_w: int) -> None:
        """Set the limit (watts); refused outside the GPU's range with the range in the message."""
        if self._range_mw is not None and not self._range_mw[0] <= limit_w * 1000 <= self._range_mw[1]:
            low, high = (v // 1000 for v in self._range_mw)
            raise PowerLimitError(f"power limit {limit_w} W is outside this GPU's range [{low}, {high}] W")
        if self._gpus is not None:
            try:
                self._gpus.set_power_management_limit(self._gpu_index, int(limit_w) * 1000, block=True)
            except Exception as err:  # Zeus raises its own error types per vendor (NVML, AMDSMI)
                raise PowerLimitError(
                    f"cannot set the power limit to {limit_w} W ({err}); setting it needs root or a zeusd "
                    f"daemon (zeus.ml/en/latest/getting_started/#system-privileges), or deploy in clock mode"
                ) from err
        self.requests_w.append(int(limit_w))
        self._restored = False

    def restore(self) -> None:
        """Put back the limit found at open (idempotent); the guardian stays until :meth:`close`."""
        if self._restored:
            return
        if self._gpus is not None and self._original_mw is not None:
            self._gpus.set_power_management_limit(self._gpu_index, self._original_mw, block=True)
        self._restored = True

    def close(self) -> None:
        """Restore, then dismiss the guardian (it exits without touching the GPU)."""
        self.restore()
        if self.guardian is not None:
            self.guardian.disarm()
            self.guardian = None
        atexit.unregister(self.close)

    def __enter__(self) -> PowerLimitController:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()
