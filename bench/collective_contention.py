"""Measure what no calibration file holds: a tensor-parallel all-reduce alone and beside the kernels it overlaps.

    torchrun --standalone --nproc-per-node 8 bench/collective_contention.py --out contention.csv
        [--sizes-mb 64,128,170] [--tokens 16384,40960] [--repeats 20]

The remaining fidelity misses (docs/fidelity.md, "What the misses are made of") rest on
one coefficient: how much an NCCL all-reduce over 8 NVLink GPUs slows beside the GEMMs and the
memory-bound kernels of the nanobatch it overlaps (``comm_contention_compute`` and
``comm_contention`` in ``cost_models/sim_params.py``). The calibration data fit the first
equally well from 2.4 to 8.2 (NanoFlow's interference file does not say which GEMM ran beside
the collective), and our model puts the testbed's collective at 1.92x its standalone time where
the testbed's reductions imply about 1.0x. This script measures it on the machine it runs on:

- ``alone``: the all-reduce of ``--sizes-mb`` on NCCL's default channels, nothing beside it;
- ``gemm``: the same all-reduce launched first on its own stream (as Transformer Engine launches
  its asynchronous dgrad all-reduce), then back-to-back GEMMs of a nanobatch's shapes
  (``tokens x 2,048 x 768`` and ``x 512``: Qwen3-1.7B's TP8 gate/up and qkv projections) on the
  default stream for at least twice the all-reduce's standalone time;
- ``norm``: the same with back-to-back RMSNorms of ``tokens x 2,048`` (memory-bound) beside it;
- each kernel loop alone, so the kernels' own slowdown is in the file too.

Every rank times its own stream with CUDA events (median of ``--repeats``); rank 0 writes one CSV
row per (case, size, shape) with the slowest rank's median (a collective ends when its slowest
rank does), the SM clock NVML reports (read only: this script never sets a clock or a limit) and
``NCCL_MIN_NCHANNELS`` / ``NCCL_MAX_NCHANNELS`` as set. Run it on the testbed's kind of machine
(8 x A100-SXM4 on NVLink, as the paper's p4d nodes) for the number the model needs; on a single
GPU it cannot run (an all-reduce needs a group). Without CUDA it runs on gloo with wall-clock
timing, which checks the script, not the hardware: such rows say ``backend gloo`` and are no
measurement of contention.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

HIDDEN = 2048
"""Qwen3-1.7B's hidden size: the width of the all-reduced activation and the GEMMs' K."""
GEMM_WIDTHS = (768, 512)
"""Per-GPU output widths of Qwen3-1.7B's TP8 projections: gate or up (6,144 / 8) and qkv
((16 + 2 x 8) heads x 128 / 8)."""
FIELDS = (
    "backend",
    "world_size",
    "case",
    "bytes",
    "tokens",
    "width",
    "collective_s",
    "kernels_s",
    "collective_alone_s",
    "kernels_alone_s",
    "slowdown",
    "sm_clock_mhz",
    "nccl_channels",
)


def _timer(device: torch.device) -> Callable[[], Callable[[], float]]:
    """``start()`` returns ``stop()``, which returns the seconds since ``start`` on the current
    stream: CUDA events on a GPU, the wall clock after the work completes on CPU."""
    if device.type == "cuda":

        def start_cuda() -> Callable[[], float]:
            begin = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            begin.record()

            def stop() -> float:
                end.record()
                end.synchronize()
                return begin.elapsed_time(end) / 1e3

            return stop

        return start_cuda

    def start_wall() -> Callable[[], float]:
        t0 = time.perf_counter()
        return lambda: time.perf_counter() - t0

    return start_wall


def _sm_clock_mhz(device: torch.device) -> float | None:
    """The SM clock NVML reports now (read only), or None without NVML or a GPU."""
    if device.type != "cuda":
        return None
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
        return float(pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM))
    except pynvml.NVMLError:  # not permitted or no such device: the row's clock stays empty
        return None


def _dtype(device: torch.device) -> torch.dtype:
    """The training's bf16 on a GPU; fp32 on CPU, where gloo and the CPU kernels run it."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _kernel_loop(kind: str, tokens: int, width: int, device: torch.device) -> Callable[[int], None]:
    """``run(n)`` launches ``n`` back-to-back kernels of ``kind`` (``gemm`` or ``norm``)."""
    dtype = _dtype(device)
    x = torch.randn(tokens, HIDDEN, device=device, dtype=dtype)
    if kind == "gemm":
        w = torch.randn(HIDDEN, width, device=device, dtype=dtype)
        out = torch.empty(tokens, width, device=device, dtype=dtype)

        def run_gemm(n: int) -> None:
            for _ in range(n):
                torch.mm(x, w, out=out)

        return run_gemm
    weight = torch.ones(HIDDEN, device=device, dtype=dtype)

    def run_norm(n: int) -> None:
        for _ in range(n):
            torch.nn.functional.rms_norm(x, (HIDDEN,), weight, 1e-6)

    return run_norm


def measure(
    sizes_bytes: list[int], tokens_list: list[int], repeats: int, device: torch.device
) -> list[dict[str, object]]:
    """Every rank measures; the slowest rank's medians are returned on rank 0 (empty elsewhere)."""
    start = _timer(device)
    side = torch.cuda.Stream() if device.type == "cuda" else None
    rows: list[dict[str, object]] = []

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()

    def slowest(value_s: float) -> float:
        t = torch.tensor([value_s], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    for size in sizes_bytes:
        buf = torch.zeros(size // _dtype(device).itemsize, device=device, dtype=_dtype(device))
        alone = []
        for _ in range(repeats + 1):  # the first call warms NCCL's channels up
            sync()
            stop = start()
            dist.all_reduce(buf)
            alone.append(stop())
        collective_alone_s = slowest(statistics.median(alone[1:]))
        rows.append(_row(device, "alone", size, 0, 0, collective_alone_s, 0.0, collective_alone_s, 0.0))
        for kind, widths in (("gemm", GEMM_WIDTHS), ("norm", (HIDDEN,))):
            for tokens in tokens_list:
                for width in widths:
                    run = _kernel_loop(kind, tokens, width, device)
                    run(2)  # warm-up
                    sync()
                    stop = start()
                    run(10)
                    per_kernel_s = slowest(stop() / 10)
                    n = max(2, int(2 * collective_alone_s / max(per_kernel_s, 1e-9)) + 1)
                    kernels_alone, beside_coll, beside_kernels = [], [], []
                    for _ in range(repeats):
                        sync()
                        stop = start()
                        run(n)
                        kernels_alone.append(stop())
                        sync()
                        coll_s, kern_s = _overlapped(buf, run, n, side)
                        beside_coll.append(coll_s)
                        beside_kernels.append(kern_s)
                    rows.append(
                        _row(
                            device,
                            kind,
                            size,
                            tokens,
                            width,
                            slowest(statistics.median(beside_coll)),
                            slowest(statistics.median(beside_kernels)),
                            collective_alone_s,
                            slowest(statistics.median(kernels_alone)),
                        )
                    )
    return rows if dist.get_rank() == 0 else []


def _overlapped(
    buf: torch.Tensor, run: Callable[[int], None], n: int, side: torch.cuda.Stream | None
) -> tuple[float, float]:
    """The all-reduce launched first on its own stream, then ``n`` kernels on the default stream:
    each one's own duration (seconds). On CPU the collective's end is when gloo reports it
    complete between two kernels (the wall clock)."""
    if side is not None:
        coll_begin, coll_end, kern_begin, kern_end = (torch.cuda.Event(enable_timing=True) for _ in range(4))
        with torch.cuda.stream(side):
            coll_begin.record()
            dist.all_reduce(buf)
            coll_end.record()
        kern_begin.record()
        run(n)
        kern_end.record()
        torch.cuda.synchronize()
        return coll_begin.elapsed_time(coll_end) / 1e3, kern_begin.elapsed_time(kern_end) / 1e3
    t0 = time.perf_counter()
    work = dist.all_reduce(buf, async_op=True)
    assert work is not None
    coll_s = None
    for _ in range(n):
        run(1)
        if coll_s is None and work.is_completed():
            coll_s = time.perf_counter() - t0
    kernels_s = time.perf_counter() - t0
    work.wait()
    return (coll_s if coll_s is not None else time.perf_counter() - t0), kernels_s


def _row(
    device: torch.device,
    case: str,
    size: int,
    tokens: int,
    width: int,
    collective_s: float,
    kernels_s: float,
    collective_alone_s: float,
    kernels_alone_s: float,
) -> dict[str, object]:
    channels = "/".join(os.environ.get(k, "") for k in ("NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS"))
    return {
        "backend": dist.get_backend(),
        "world_size": dist.get_world_size(),
        "case": case,
        "bytes": size,
        "tokens": tokens,
        "width": width,
        "collective_s": f"{collective_s:.6e}",
        "kernels_s": f"{kernels_s:.6e}",
        "collective_alone_s": f"{collective_alone_s:.6e}",
        "kernels_alone_s": f"{kernels_alone_s:.6e}",
        "slowdown": f"{collective_s / collective_alone_s:.4f}",
        "sm_clock_mhz": "" if (clock := _sm_clock_mhz(device)) is None else f"{clock:.0f}",
        "nccl_channels": channels if channels != "/" else "",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="CSV written by rank 0")
    parser.add_argument("--sizes-mb", default="64,128,170", help="all-reduce sizes (MiB, comma-separated)")
    parser.add_argument("--tokens", default="16384,40960", help="nanobatch tokens per GPU (comma-separated)")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    if "RANK" not in os.environ:
        parser.error("run it under torchrun (an all-reduce needs a group): torchrun --nproc-per-node 8 ...")
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        if dist.get_world_size() < 2:
            parser.error("an all-reduce needs at least 2 ranks (--nproc-per-node 8 for the testbed's TP8)")
        sizes = [int(float(mb) * 2**20) for mb in args.sizes_mb.split(",")]
        tokens = [int(t) for t in args.tokens.split(",")]
        rows = measure(sizes, tokens, args.repeats, device)
        if rows:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            with args.out.open("w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=FIELDS)
                writer.writeheader()
                writer.writerows(rows)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
