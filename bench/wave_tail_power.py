"""Does a GEMM's partial last wave draw less power? A sweep on a real GPU.

    python bench/wave_tail_power.py [--k 4096] [--n 1024] [--rows-from 8 --rows-to 48] [--window-s 1.5] [--json]

The simulator charges SM-active power for the SMs that hold CTAs averaged over a kernel's time
(``mean_resident_sms``): when a GEMM's tiles fill one wave and spill a few into the next, its time
grows by a wave while its occupied SM-seconds grow by a few tiles, so its average power drops. If
instead every SM the kernel may use drew power for its whole time, the power would stay flat
across the wave boundary. This sweeps ``M = 128 x rows`` of a bf16 ``[M, K] @ [K, N]`` matmul
(cuBLAS picks its own tiles) and prints, per M, the time per matmul (CUDA events), the energy per
matmul (NVML's total-energy counter, mJ, over a window of ``--window-s`` seconds) and the average
power and SM clock. A time step up with a power dip after it is the partial wave's signature.

Needs a CUDA GPU and the driver's NVML (``libnvidia-ml.so.1``); not part of the test suite. Not yet
run on a GPU: a prepared check for the next GPU session.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import time

import torch


class _Nvml:
    """The three NVML calls this needs, through ctypes (no Python binding required)."""

    def __init__(self, index: int = 0) -> None:
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        if self.lib.nvmlInit_v2() != 0:
            raise RuntimeError("nvmlInit_v2 failed")
        self.handle = ctypes.c_void_p()
        if self.lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(self.handle)) != 0:
            raise RuntimeError("nvmlDeviceGetHandleByIndex_v2 failed")

    def energy_mj(self) -> int:
        value = ctypes.c_ulonglong()
        if self.lib.nvmlDeviceGetTotalEnergyConsumption(self.handle, ctypes.byref(value)) != 0:
            raise RuntimeError("nvmlDeviceGetTotalEnergyConsumption failed")
        return int(value.value)

    def sm_clock_mhz(self) -> int:
        value = ctypes.c_uint()
        if self.lib.nvmlDeviceGetClockInfo(self.handle, 1, ctypes.byref(value)) != 0:  # NVML_CLOCK_SM
            raise RuntimeError("nvmlDeviceGetClockInfo failed")
        return int(value.value)


def measure(nvml: _Nvml, m: int, k: int, n: int, window_s: float) -> dict[str, float]:
    """Time, energy and power of one ``[m, k] @ [k, n]`` bf16 matmul, repeated for ``window_s``."""
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(20):
        torch.matmul(a, b, out=out)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(50):
        torch.matmul(a, b, out=out)
    end.record()
    torch.cuda.synchronize()
    per_s = start.elapsed_time(end) / 1e3 / 50
    reps = max(50, int(window_s / per_s))
    clocks = []
    e0, t0 = nvml.energy_mj(), time.perf_counter()
    start.record()
    for i in range(reps):
        torch.matmul(a, b, out=out)
        if i % max(1, reps // 5) == 0:
            clocks.append(nvml.sm_clock_mhz())
    end.record()
    torch.cuda.synchronize()
    e1, t1 = nvml.energy_mj(), time.perf_counter()
    time_s = start.elapsed_time(end) / 1e3 / reps
    energy_j = (e1 - e0) / 1e3 / reps
    return {
        "m": m,
        "time_us": time_s * 1e6,
        "energy_mj": energy_j * 1e3,
        "power_w": (e1 - e0) / 1e3 / (t1 - t0),
        "sm_clock_mhz": sum(clocks) / len(clocks),
        "tflops": 2.0 * m * k * n / time_s / 1e12,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--n", type=int, default=1024)
    parser.add_argument("--rows-from", type=int, default=8, help="first M / 128")
    parser.add_argument("--rows-to", type=int, default=48, help="last M / 128")
    parser.add_argument("--window-s", type=float, default=1.5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    nvml = _Nvml()
    props = torch.cuda.get_device_properties(0)
    rows = [measure(nvml, 128 * r, args.k, args.n, args.window_s) for r in range(args.rows_from, args.rows_to + 1)]
    report = {"gpu": props.name, "sms": props.multi_processor_count, "k": args.k, "n": args.n, "rows": rows}
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"{props.name} ({props.multi_processor_count} SMs), bf16 [M, {args.k}] @ [{args.k}, {args.n}]")
    for r in rows:
        print(
            f"  M {r['m']:6d}  {r['time_us']:8.1f} us  {r['energy_mj']:8.3f} mJ  {r['power_w']:6.1f} W"
            f"  {r['sm_clock_mhz']:6.0f} MHz  {r['tflops']:6.1f} TFLOPS"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
