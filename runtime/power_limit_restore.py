"""What sets a GPU power limit back, shared by the controller and the guardian process.

:mod:`kareus_fx.runtime.power_limit_controller` sets a job's limit; the clock guardian's sidecar process
(:mod:`kareus_fx.runtime.clock_guardian`) puts the limit found at open back when the job dies. Both
need the restore specs, the simulated GPU (a JSON state file other processes read and write) and
:func:`power_limit_restorer`, so they live here, below both: neither imports the other for them.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kareus_fx.errors import KareusError
from kareus_fx.runtime.clock_backends import ResetSpec

__all__ = [
    "SIMULATED_SPEC_KIND",
    "ZEUS_SPEC_KIND",
    "PowerLimitError",
    "SimulatedPowerLimitGPUs",
    "power_limit_restorer",
    "read_simulated_power_limit",
]

SIMULATED_SPEC_KIND = "simulated-power-limit"
ZEUS_SPEC_KIND = "zeus-power-limit"
"""Restore specs (``{"kind": ..., "limit_mw": ...}`` plus ``state_path`` or ``device``) that the
guardian applies with :func:`power_limit_restorer`."""


class PowerLimitError(KareusError, RuntimeError):
    """A power limit that cannot be set: outside the GPU's range, or no permission."""


class SimulatedPowerLimitGPUs:
    """One simulated GPU's power limit, with Zeus's ``GPUs`` method signatures (``gpu_index`` 0).

    The state (``limit_mw``, ``default_mw``, ``min_mw``, ``max_mw``, and the ``pid`` that wrote it
    last) is a JSON file replaced atomically, so a reader in another process sees a whole state.
    Opening an existing file keeps its limit (as a real GPU keeps a limit a dead job left)."""

    def __init__(self, state_path: str | Path, default_limit_w: int = 400, min_limit_w: int = 100) -> None:
        self.state_path = Path(state_path)
        if self.state_path.exists():
            self._state = read_simulated_power_limit(self.state_path)
        else:
            mw = int(default_limit_w) * 1000
            self._state = {"limit_mw": mw, "default_mw": mw, "min_mw": int(min_limit_w) * 1000, "max_mw": mw}
            self._write()

    def get_power_management_limit(self, gpu_index: int) -> int:
        return int(self._state["limit_mw"])

    def get_power_management_limit_constraints(self, gpu_index: int) -> tuple[int, int]:
        return int(self._state["min_mw"]), int(self._state["max_mw"])

    def set_power_management_limit(self, gpu_index: int, power_limit_mw: int, block: bool = True) -> None:
        if gpu_index != 0:
            raise PowerLimitError(f"the simulated GPU is index 0, got {gpu_index}")
        if not self._state["min_mw"] <= power_limit_mw <= self._state["max_mw"]:
            raise PowerLimitError(f"{power_limit_mw} mW is outside [{self._state['min_mw']}, {self._state['max_mw']}]")
        self._state["limit_mw"] = int(power_limit_mw)
        self._write()

    def reset_power_management_limit(self, gpu_index: int, block: bool = True) -> None:
        self.set_power_management_limit(gpu_index, int(self._state["default_mw"]), block)

    def _write(self) -> None:
        self._state["pid"] = os.getpid()
        self._state["updated_unix_s"] = time.time()
        temporary = self.state_path.with_name(f".{self.state_path.name}.{os.getpid()}.tmp")
        temporary.write_text(json.dumps(self._state))
        os.replace(temporary, self.state_path)


def read_simulated_power_limit(path: str | Path) -> dict[str, Any]:
    """The state a :class:`SimulatedPowerLimitGPUs` wrote at ``path``."""
    try:
        state: dict[str, Any] = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise PowerLimitError(f"{path} is not a readable simulated power-limit state file ({err})") from err
    return state


def power_limit_restorer(spec: ResetSpec) -> Callable[[], None] | None:
    """For the guardian: a function that sets the limit ``spec`` names back (None: ``spec`` is not
    a power-limit spec). A real GPU's Zeus is opened here, before the guardian reports ready, so a
    missing permission shows at start; the guardian's ``CUDA_VISIBLE_DEVICES`` is the GPU's entry."""
    limit_mw = int(spec.get("limit_mw", 0))
    if spec.get("kind") == SIMULATED_SPEC_KIND:
        path = Path(spec["state_path"])
        return lambda: SimulatedPowerLimitGPUs(path).set_power_management_limit(0, limit_mw)
    if spec.get("kind") == ZEUS_SPEC_KIND:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(spec["device"])  # before Zeus reads it
        from zeus.device.gpu import get_gpus

        gpus = get_gpus()
        if len(gpus) != 1:
            raise PowerLimitError(f"Zeus sees {len(gpus)} GPUs with CUDA_VISIBLE_DEVICES={spec['device']}")
        return lambda: gpus.set_power_management_limit(0, limit_mw, block=True)
    return None
