"""The power-limit controller: watts in, milliwatts to Zeus, the original limit always restored."""

from __future__ import annotations

import inspect

import pytest
from zeus.device.gpu.common import GPUs

from kareus_fx.runtime.power_limit_controller import PowerLimitController, PowerLimitError


class RecordingGPUs:
    """Zeus's GPUs methods the controller calls, recording each call (signatures checked below)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.limit_mw = 400_000

    def get_power_management_limit(self, gpu_index: int) -> int:
        return self.limit_mw

    def get_power_management_limit_constraints(self, gpu_index: int) -> tuple[int, int]:
        return (100_000, 400_000)

    def set_power_management_limit(self, gpu_index: int, power_limit_mw: int, block: bool = True) -> None:
        self.calls.append(("set", gpu_index, power_limit_mw, block))
        self.limit_mw = power_limit_mw


@pytest.mark.parametrize(
    "name", ["get_power_management_limit", "get_power_management_limit_constraints", "set_power_management_limit"]
)
def test_the_fake_has_zeus_signatures(name):
    assert inspect.signature(getattr(RecordingGPUs, name)) == inspect.signature(getattr(GPUs, name))


def test_limits_go_to_zeus_in_milliwatts_and_the_original_comes_back():
    gpus = RecordingGPUs()
    with PowerLimitController.open("real", gpu_index=3, zeus_gpus=gpus) as controller:
        controller.set_limit_w(275)
        assert gpus.calls == [("set", 3, 275_000, True)]
    assert gpus.calls[-1] == ("set", 3, 400_000, True) and controller.requests_w == [275]


def test_an_exception_still_restores_and_out_of_range_is_refused():
    gpus = RecordingGPUs()
    with pytest.raises(RuntimeError, match="boom"), PowerLimitController.open("real", zeus_gpus=gpus) as controller:
        with pytest.raises(PowerLimitError, match=r"\[100, 400\] W"):
            controller.set_limit_w(450)
        controller.set_limit_w(300)
        raise RuntimeError("boom")
    assert gpus.limit_mw == 400_000


def test_dry_run_records_only():
    with PowerLimitController.open("dry-run") as controller:
        controller.set_limit_w(250)
        controller.set_limit_w(300)
    assert controller.requests_w == [250, 300]
    with pytest.raises(PowerLimitError, match="one of real, simulated, dry-run"):
        PowerLimitController.open("maybe")  # type: ignore[arg-type]
