"""A job-wide GPU power limit, set through Zeus and always put back.

For clusters that forbid locking clocks but allow power limits (issue 31): a deployment in power-
limit mode sets one limit on this process's GPU (the plan's ``megatron+power-limit`` curve gives
the limit for a target) instead of requesting clocks. ``"real"`` goes through
``zeus.device.get_gpus()`` (``set_power_management_limit`` in mW, as NVML takes it); ``"dry-run"``
only records. The limit found at open is restored by ``restore()`` / ``close()``, on leaving a
``with`` block and at interpreter exit. Unlike the clock controller there is no guardian process:
a SIGKILLed job leaves the limit set (NVML keeps it until reset or reboot); the README says so.
"""

from __future__ import annotations

import atexit
from types import TracebackType
from typing import Literal, Protocol

from kareus_fx.errors import KareusError

PowerLimitMode = Literal["real", "dry-run"]


class PowerLimitError(KareusError, RuntimeError):
    """A power limit that cannot be set: outside the GPU's range, or no permission."""


class _ZeusGPUs(Protocol):
    def get_power_management_limit(self, gpu_index: int) -> int: ...

    def get_power_management_limit_constraints(self, gpu_index: int) -> tuple[int, int]: ...

    def set_power_management_limit(self, gpu_index: int, power_limit_mw: int, block: bool = True) -> None: ...


class PowerLimitController:
    """Sets this process's GPU power limit (watts in, milliwatts to Zeus) and restores the one
    found at open on every exit path above."""

    def __init__(self, mode: PowerLimitMode, gpus: _ZeusGPUs | None, gpu_index: int = 0) -> None:
        self.mode = mode
        self._gpus = gpus
        self._gpu_index = gpu_index
        self.requests_w: list[int] = []
        """Every limit set, in order (dry-run and real)."""
        self._original_mw: int | None = None
        self._range_mw: tuple[int, int] | None = None
        if gpus is not None:
            self._original_mw = int(gpus.get_power_management_limit(gpu_index))
            low, high = gpus.get_power_management_limit_constraints(gpu_index)
            self._range_mw = (int(low), int(high))
        self._restored = True
        atexit.register(self.restore)

    @classmethod
    def open(cls, mode: PowerLimitMode, gpu_index: int = 0, zeus_gpus: _ZeusGPUs | None = None) -> PowerLimitController:
        """``"dry-run"`` records only; ``"real"`` needs a GPU Zeus can drive (``zeus_gpus``:
        a ``zeus.device`` GPUs object, default ``get_gpus()``)."""
        if mode == "dry-run":
            return cls(mode, None, gpu_index)
        if mode != "real":
            raise PowerLimitError(f"power-limit mode must be 'real' or 'dry-run', got {mode!r}")
        if zeus_gpus is None:
            from zeus.device.gpu import get_gpus

            zeus_gpus = get_gpus()
        return cls(mode, zeus_gpus, gpu_index)

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
        """Put back the limit found at open (idempotent)."""
        if self._restored:
            return
        if self._gpus is not None and self._original_mw is not None:
            self._gpus.set_power_management_limit(self._gpu_index, self._original_mw, block=True)
        self._restored = True

    def close(self) -> None:
        self.restore()
        atexit.unregister(self.restore)

    def __enter__(self) -> PowerLimitController:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()
