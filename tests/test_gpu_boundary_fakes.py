"""The GPU-only runtime paths on CPU, against recording fakes at the library boundary.

The boundary is pynvml (nvidia-ml-py): the installed Zeus runs unchanged on top of
:class:`FakeNvml`, so the clock backend, the frequency controller, the energy monitor and the
device profiler's measurement window go through Zeus's real device and monitor code down to the
NVML functions. The fake records each call and converts integer arguments the way pynvml does
(``ctypes.c_uint``), so a wrong argument type fails here as it would on a GPU. Its functions'
signatures are checked against the installed pynvml (and the CUDA synchronisation fake against
Zeus's), so a fake cannot drift from the library; any other NVML function fails the test if called.

Units at this boundary (NVML's): clocks in MHz, the energy counter in mJ (cumulative), power in
mW, temperature in C; ours: MHz, J, W.
"""

from __future__ import annotations

import ctypes
import inspect
import os
import signal
import sys
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pynvml
import pytest
import zeus.device.gpu as zeus_gpu
import zeus.device.gpu.nvidia as zeus_nvidia
import zeus.monitor.energy as zeus_energy
import zeus.utils.framework as zeus_framework
from zeus.device.gpu.common import GPUs
from zeus.monitor.energy import ZeusMonitor

from kareus_fx.runtime.clock_backends import ClockControlError, ClockPermissionError, open_clock_backend
from kareus_fx.runtime.clock_controller import ClockController
from kareus_fx.runtime.clock_guardian import _reset_function
from kareus_fx.runtime.device_profiler import DeviceProfiler
from kareus_fx.runtime.energy import EnergyMeasurementError, IterationEnergyMonitor
from kareus_fx.runtime.partition_replay import PartitionReplay

MEMORY_CLOCKS_MHZ = [2619, 1593]
GRAPHICS_CLOCKS_MHZ = [1980, 1755, 1410, 1005, 210]


@dataclass(frozen=True)
class FakeHandle:
    """An NVML device handle."""

    index: int


def _c_uint(value: Any) -> int:
    """pynvml's conversion of an integer argument (TypeError for None, a float, ...)."""
    return ctypes.c_uint(value).value


class FakeNvml:
    """The pynvml functions Zeus calls on the runtime's paths, recording ``(name, args)``.

    ``fail`` maps a function name to an NVML error code it raises (pynvml's own ``NVMLError``,
    so Zeus's error mapping applies). The energy counter starts at ``energy_mj`` and grows by
    ``energy_step_mj`` at each read.
    """

    FAKED = (
        "nvmlInit",
        "nvmlShutdown",
        "nvmlDeviceGetCount",
        "nvmlDeviceGetHandleByIndex",
        "nvmlDeviceGetC2cModeInfoV",
        "nvmlDeviceGetName",
        "nvmlDeviceGetSupportedMemoryClocks",
        "nvmlDeviceGetSupportedGraphicsClocks",
        "nvmlDeviceSetGpuLockedClocks",
        "nvmlDeviceResetGpuLockedClocks",
        "nvmlDeviceGetArchitecture",
        "nvmlDeviceGetTotalEnergyConsumption",
        "nvmlDeviceGetTemperatureV",
    )

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.fail: dict[str, int] = {}
        self.locked_mhz: tuple[int, int] | None = None
        self.energy_mj = 5_000_000
        self.energy_step_mj = 0
        self.temperature_c = 41

    def _enter(self, name: str, *args: Any) -> None:
        self.calls.append((name, args))
        code = self.fail.get(name)
        if code is not None:
            raise pynvml.NVMLError(code)

    def nvmlInit(self):
        self._enter("nvmlInit")

    def nvmlShutdown(self):
        self._enter("nvmlShutdown")

    def nvmlDeviceGetCount(self):
        self._enter("nvmlDeviceGetCount")
        return 1

    def nvmlDeviceGetHandleByIndex(self, index):
        self._enter("nvmlDeviceGetHandleByIndex", _c_uint(index))
        return FakeHandle(index)

    def nvmlDeviceGetC2cModeInfoV(self, handle):
        self._enter("nvmlDeviceGetC2cModeInfoV", handle)
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)  # not a Grace Hopper

    def nvmlDeviceGetName(self, handle):
        self._enter("nvmlDeviceGetName", handle)
        return "NVIDIA H100 80GB HBM3"

    def nvmlDeviceGetSupportedMemoryClocks(self, handle):
        self._enter("nvmlDeviceGetSupportedMemoryClocks", handle)
        return list(MEMORY_CLOCKS_MHZ)

    def nvmlDeviceGetSupportedGraphicsClocks(self, handle, memoryClockMHz):
        self._enter("nvmlDeviceGetSupportedGraphicsClocks", handle, _c_uint(memoryClockMHz))
        if memoryClockMHz not in MEMORY_CLOCKS_MHZ:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return list(GRAPHICS_CLOCKS_MHZ)

    def nvmlDeviceSetGpuLockedClocks(self, handle, minGpuClockMHz, maxGpuClockMHz):
        self._enter("nvmlDeviceSetGpuLockedClocks", handle, _c_uint(minGpuClockMHz), _c_uint(maxGpuClockMHz))
        self.locked_mhz = (minGpuClockMHz, maxGpuClockMHz)

    def nvmlDeviceResetGpuLockedClocks(self, handle):
        self._enter("nvmlDeviceResetGpuLockedClocks", handle)
        self.locked_mhz = None

    def nvmlDeviceGetArchitecture(self, device):
        self._enter("nvmlDeviceGetArchitecture", device)
        return pynvml.NVML_DEVICE_ARCH_HOPPER

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        self._enter("nvmlDeviceGetTotalEnergyConsumption", handle)
        self.energy_mj += self.energy_step_mj
        return self.energy_mj

    def nvmlDeviceGetTemperatureV(self, handle, sensor, version=pynvml.nvmlTemperature_v1):
        self._enter("nvmlDeviceGetTemperatureV", handle, sensor)
        return self.temperature_c

    def module(self) -> types.ModuleType:
        """A ``pynvml`` module: the installed one's constants and classes, these functions, and
        every other NVML function failing the test when called."""
        fake = types.ModuleType("pynvml")
        for name, value in vars(pynvml).items():
            if name.startswith("nvml") and inspect.isfunction(value):
                setattr(fake, name, _unexpected(name))
            else:
                setattr(fake, name, value)
        for name in self.FAKED:
            setattr(fake, name, getattr(self, name))
        return fake

    def named(self, *names: str) -> list[tuple[str, tuple[Any, ...]]]:
        """The recorded calls of ``names``, in order."""
        return [call for call in self.calls if call[0] in names]


def _unexpected(name: str) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"unexpected NVML call {name}{args}: add it to FakeNvml (signature-checked)")

    return call


def fake_sync_execution(calls: list[tuple[str, tuple[Any, ...]]]) -> Callable[..., None]:
    """Zeus's CUDA synchronisation (``torch.cuda.synchronize`` per GPU), recorded."""

    def sync_execution(gpu_devices, sync_with="torch"):
        calls.append(("sync_execution", (list(gpu_devices), sync_with)))

    return sync_execution


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeNvml]:
    """Zeus over a fresh :class:`FakeNvml` with one GPU and no daemon."""
    fake = FakeNvml()
    module = fake.module()
    monkeypatch.setitem(sys.modules, "pynvml", module)
    monkeypatch.setattr(zeus_nvidia, "pynvml", module)
    monkeypatch.setattr(zeus_energy, "sync_execution_fn", fake_sync_execution(fake.calls))
    for variable in ("CUDA_VISIBLE_DEVICES", "ZEUSD_SOCK_PATH", "ZEUSD_HOST_PORT"):
        monkeypatch.delenv(variable, raising=False)
    _fresh_zeus(monkeypatch)
    yield fake
    zeus_nvidia.nvml_is_available.cache_clear()


def _fresh_zeus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget Zeus's process-wide GPU singleton and its cached NVML probe."""
    monkeypatch.setattr(zeus_gpu, "_gpus", None)
    zeus_nvidia.nvml_is_available.cache_clear()


# -- the fakes against the installed packages ------------------------------------------------


@pytest.mark.parametrize("name", FakeNvml.FAKED)
def test_fake_nvml_functions_have_the_installed_signatures(name):
    assert inspect.signature(getattr(FakeNvml(), name)) == inspect.signature(getattr(pynvml, name))


def test_fake_sync_has_zeus_signature():
    assert inspect.signature(fake_sync_execution([])) == _unannotated(inspect.signature(zeus_framework.sync_execution))


def _unannotated(signature: inspect.Signature) -> inspect.Signature:
    return signature.replace(
        parameters=[p.replace(annotation=inspect.Parameter.empty) for p in signature.parameters.values()],
        return_annotation=inspect.Signature.empty,
    )


def _fits(fake: Callable[..., Any], real: Callable[..., Any]) -> bool:
    """Every parameter of ``fake`` is ``real``'s (name, kind, default), and ``real``'s others have defaults."""
    fake_params = {p.name: p for p in inspect.signature(fake).parameters.values()}
    real_params = {p.name: p for p in inspect.signature(real).parameters.values()}
    for name, param in fake_params.items():
        other = real_params.get(name)
        if other is None or other.kind != param.kind or other.default != param.default:
            return False
    return all(p.default is not inspect.Parameter.empty for n, p in real_params.items() if n not in fake_params)


def test_zeus_stand_ins_of_other_tests_fit_the_installed_zeus():
    """The hand-written Zeus stand-ins (test_runtime, test_device_profiler) accept only what the
    installed Zeus accepts."""
    from test_device_profiler import FakeZeus
    from test_runtime import FakeZeusGPUs, FakeZeusMonitor

    for fake_class, real_class in ((FakeZeusGPUs, GPUs), (FakeZeusMonitor, ZeusMonitor), (FakeZeus, ZeusMonitor)):
        methods = [n for n, _ in inspect.getmembers(fake_class, inspect.isfunction) if not n.startswith("_")]
        assert methods, fake_class
        for name in methods:
            assert _fits(getattr(fake_class, name), getattr(real_class, name)), f"{fake_class.__name__}.{name}"


# -- clocks: order, units, restore on every exit ---------------------------------------------

CLOCK_FUNCTIONS = (
    "nvmlDeviceGetSupportedMemoryClocks",
    "nvmlDeviceGetSupportedGraphicsClocks",
    "nvmlDeviceSetGpuLockedClocks",
    "nvmlDeviceResetGpuLockedClocks",
)
GPU0 = FakeHandle(0)


def _open(tmp_path, **kwargs: Any) -> ClockController:
    # guard=False: the guardian is another process, which would load the real NVML
    return ClockController.open("real", guard=False, lock_dir=tmp_path, **kwargs)


def test_clock_is_locked_in_mhz_and_restored(nvml, tmp_path):
    with _open(tmp_path, handle_sigterm=False) as controller:
        assert controller.backend.clock_range_mhz == (210, 1980)
        controller.request(1410)
        controller.flush(timeout_s=30)
        assert nvml.locked_mhz == (1410, 1410)
        assert len(list(tmp_path.glob("*.json"))) == 1  # the lock record
    assert nvml.locked_mhz is None
    assert list(tmp_path.glob("*.json")) == []
    assert nvml.named(*CLOCK_FUNCTIONS) == [
        ("nvmlDeviceGetSupportedMemoryClocks", (GPU0,)),
        ("nvmlDeviceGetSupportedGraphicsClocks", (GPU0, 2619)),  # at the highest memory clock
        ("nvmlDeviceResetGpuLockedClocks", (GPU0,)),  # at start: the state restored to
        ("nvmlDeviceSetGpuLockedClocks", (GPU0, 1410, 1410)),  # min = max
        ("nvmlDeviceResetGpuLockedClocks", (GPU0,)),
    ]


def test_clock_is_restored_when_the_block_raises(nvml, tmp_path):
    with pytest.raises(RuntimeError, match="training step failed"), _open(tmp_path, handle_sigterm=False) as c:
        c.request(1005)
        c.flush(timeout_s=30)
        raise RuntimeError("training step failed")
    assert nvml.locked_mhz is None
    assert nvml.named(*CLOCK_FUNCTIONS)[-2:] == [
        ("nvmlDeviceSetGpuLockedClocks", (GPU0, 1005, 1005)),
        ("nvmlDeviceResetGpuLockedClocks", (GPU0,)),
    ]


def test_clock_is_restored_on_sigterm_before_the_previous_handler_runs(nvml, tmp_path):
    seen_locked: list[tuple[int, int] | None] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen_locked.append(nvml.locked_mhz))
    try:
        controller = _open(tmp_path)
        controller.request(1755)
        controller.flush(timeout_s=30)
        assert nvml.locked_mhz == (1755, 1755)
        os.kill(os.getpid(), signal.SIGTERM)
        deadline_s = time.monotonic() + 10
        while not seen_locked and time.monotonic() < deadline_s:
            time.sleep(0.01)
        assert seen_locked == [None]  # restored first, then handed on
        assert nvml.named("nvmlDeviceResetGpuLockedClocks")[-1] == ("nvmlDeviceResetGpuLockedClocks", (GPU0,))
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_failed_switch_is_typed_and_the_clock_still_restored(nvml, tmp_path):
    nvml.fail["nvmlDeviceSetGpuLockedClocks"] = pynvml.NVML_ERROR_NO_PERMISSION
    controller = _open(tmp_path, handle_sigterm=False)
    controller.request(1410)
    with pytest.raises(ClockControlError, match="switching the clock failed") as info:
        controller.flush(timeout_s=30)
    assert isinstance(info.value.__cause__, ClockPermissionError)
    assert "zeusd" in str(info.value.__cause__)
    controller.close()
    assert nvml.named("nvmlDeviceResetGpuLockedClocks")[-1] == ("nvmlDeviceResetGpuLockedClocks", (GPU0,))


def test_guardian_reset_unlocks_the_named_gpu_and_never_sets_a_clock(nvml, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # restored after the test; the guardian sets it
    reset = _reset_function({"kind": "zeus", "device": "3"})
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3"
    assert nvml.named("nvmlDeviceGetHandleByIndex") == [("nvmlDeviceGetHandleByIndex", (3,))]
    assert nvml.named(*CLOCK_FUNCTIONS) == []  # prepared at start: nothing touched before the death
    reset()
    assert nvml.named(*CLOCK_FUNCTIONS) == [("nvmlDeviceResetGpuLockedClocks", (FakeHandle(3),))]


def test_gpu_uuids_in_cuda_visible_devices_are_a_typed_error(nvml, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-5b8d2e8c-0a1f-4c1e-9d2a-3f6b7c8d9e0f")
    with pytest.raises(ClockControlError, match="GPU indices only"):
        open_clock_backend("real")


# -- every NVML error code on these paths maps to a typed error -------------------------------

NVML_ERROR_CODES = sorted({value for name, value in vars(pynvml).items() if name.startswith("NVML_ERROR_")})
CLOCK_OPEN_CALLS = (
    "nvmlInit",
    "nvmlDeviceGetCount",
    "nvmlDeviceGetHandleByIndex",
    "nvmlDeviceGetSupportedMemoryClocks",
    "nvmlDeviceGetSupportedGraphicsClocks",
    "nvmlDeviceResetGpuLockedClocks",
)
ENERGY_OPEN_CALLS = ("nvmlInit", "nvmlDeviceGetCount", "nvmlDeviceGetHandleByIndex", "nvmlDeviceGetArchitecture")


def test_every_nvml_error_code_of_the_clock_path_is_typed(nvml, monkeypatch):
    for code in NVML_ERROR_CODES:
        for call in (*CLOCK_OPEN_CALLS, "nvmlDeviceSetGpuLockedClocks"):
            _fresh_zeus(monkeypatch)
            nvml.fail = {call: code}
            with pytest.raises(ClockControlError) as info:
                open_clock_backend("real").set_clock(1410)
            permission = code == pynvml.NVML_ERROR_NO_PERMISSION and call != "nvmlInit"
            assert isinstance(info.value, ClockPermissionError) == permission, (call, code, info.value)


def test_every_nvml_error_code_of_the_energy_path_is_typed(nvml, monkeypatch):
    for code in NVML_ERROR_CODES:
        for call in (*ENERGY_OPEN_CALLS, "nvmlDeviceGetTotalEnergyConsumption"):
            _fresh_zeus(monkeypatch)
            nvml.fail = {call: code}
            with pytest.raises(EnergyMeasurementError):
                IterationEnergyMonitor(gpu_indices=[0]).begin_iteration()
        _fresh_zeus(monkeypatch)
        nvml.fail = {}
        monitor = IterationEnergyMonitor(gpu_indices=[0])
        monitor.begin_iteration()
        nvml.fail = {"nvmlDeviceGetTotalEnergyConsumption": code}
        with pytest.raises(EnergyMeasurementError, match="iteration's end"):
            monitor.end_iteration()


# -- energy: mJ counter in, joules out, synchronised reads ------------------------------------


def test_iteration_energy_is_the_mj_counter_difference_in_joules(nvml):
    monitor = IterationEnergyMonitor(gpu_indices=[0])
    nvml.calls.clear()
    monitor.begin_iteration()
    nvml.energy_mj += 123_456  # mJ used by the iteration
    measurement = monitor.end_iteration()
    assert measurement.energy_j == pytest.approx(123.456)
    reads = [("sync_execution", ([0], "torch")), ("nvmlDeviceGetTotalEnergyConsumption", (GPU0,))]
    assert nvml.named("sync_execution", "nvmlDeviceGetTotalEnergyConsumption") == reads + reads


def test_profiler_window_sets_the_clock_then_reads_energy_per_run_in_joules(nvml, tmp_path, monkeypatch):
    from test_device_profiler import small_ptype

    monkeypatch.setattr(DeviceProfiler, "_check_cuda", lambda self: None)  # the replay runs on CPU
    window_runs: list[int] = []
    fill_window = DeviceProfiler._fill_window

    def counting_fill_window(self: DeviceProfiler, *args: Any) -> int:
        window_runs.append(fill_window(self, *args))
        return window_runs[-1]

    monkeypatch.setattr(DeviceProfiler, "_fill_window", counting_fill_window)
    nvml.energy_step_mj = 40_000  # each read: the window spans one step, 40 J
    controller = _open(tmp_path, handle_sigterm=False)
    profiler = DeviceProfiler("H100-SXM5-80GB", frequency=controller, min_window_s=0.05, warmup=0, repeats=2)
    ptype = small_ptype()
    replay = PartitionReplay.build([s.ops for s in ptype.slots], [ptype.collective], "cpu")
    with profiler:
        measurement = profiler._measure(replay, 1410, 1, 8)
    assert measurement.energy_j == pytest.approx(40.0 / window_runs[0])
    order = [
        name
        for name, _ in nvml.named(
            "nvmlDeviceGetTemperatureV",
            "nvmlDeviceSetGpuLockedClocks",
            "sync_execution",
            "nvmlDeviceGetTotalEnergyConsumption",
            "nvmlDeviceResetGpuLockedClocks",
        )
    ]
    assert order[-7:] == [
        "nvmlDeviceGetTemperatureV",  # idle temperature, then the cooldown check
        "nvmlDeviceSetGpuLockedClocks",
        "sync_execution",
        "nvmlDeviceGetTotalEnergyConsumption",
        "sync_execution",
        "nvmlDeviceGetTotalEnergyConsumption",
        "nvmlDeviceResetGpuLockedClocks",  # close() restores
    ]
    assert nvml.named("nvmlDeviceGetTemperatureV")[0] == (
        "nvmlDeviceGetTemperatureV",
        (GPU0, pynvml.NVML_TEMPERATURE_GPU),
    )
    assert nvml.named("nvmlDeviceSetGpuLockedClocks")[-1][1] == (GPU0, 1410, 1410)
