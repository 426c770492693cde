"""Could host-side launch gaps make the testbed's eager Megatron-LM slower than our iteration?

    python bench/launch_gaps.py [--presets NAME ...] [--host-us 5 10 25 90] [--json]

Megatron-LM runs eager (no CUDA graphs by default): the CPU issues every kernel, and the GPU idles
wherever the CPU falls behind it. That only happens where kernels are shorter than the host's
per-kernel issue time. This prices it on the paper's shapes: each preset's stage 0 is traced (two
decoder layers, full recompute, its TP/CP and microbatch), and its forward and backward kernels get
their simulated times at 1,410 MHz on all SMs (``KernelModel``; collectives left out, which only
lengthens the GPU's queue). A CPU that issues one kernel every ``h`` microseconds from a
synchronisation (Megatron-LM's pipeline send/recv synchronises once per microbatch and
direction) starts kernel ``i`` no earlier than ``i x h``; the GPU's idle time is the queue's end
less the kernels' sum.

Two counts bracket eager Megatron-LM's kernels: the fused kernels of our trace (Inductor-style
fusion; Megatron-LM with Transformer Engine fuses norms, RoPE, SwiGLU and attention alike) and
every aten op that moves bytes or does FLOPs as its own kernel (an op's share of its fused
kernel's work: shorter kernels than unfused eager ones, so an upper bound on the gaps).

``h``: 5-25 us of CPU per op for PyTorch eager (Python, pybind11, autograd and ATen dispatch, the
backend's choice, the driver's ``cudaLaunchKernel``: the breakdown in "From PyTorch op to kernel
launch", jiahuanglin.xyz/all_lessons/gpu_kernel_serving/18_pytorch_to_kernel.html); 90 us is the slowest seen here, the on-device
profiler's op-by-op Python replay on an H200 (``bench/results/gpu_h200/gpu_checks_run4.json``:
3.7-4.0 ms for 40-41 ops). Nothing is fitted; the Qwen rows are validation data.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

from kareus_fx.capture.dump import load_dump
from kareus_fx.capture.tracing import TraceSpec, trace_full_size
from kareus_fx.cost_models.hardware import gpu_spec
from kareus_fx.cost_models.kernel_model import KernelModel
from kareus_fx.cost_models.sim_params import gpu_params
from kareus_fx.plan.graph_workload import sequential_graphs
from kareus_fx.plan.request import plan_request_from_preset
from kareus_fx.workload import OpCost, fused_kernels

DEFAULT_PRESETS = ("qwen3-1.7b-cp2tp4-mbs16-seq4k", "qwen3-1.7b-tp8-mbs8-seq4k", "qwen3-1.7b-tp8-mbs20-seq4k")


def host_bound_idle_s(durations_s: list[float], host_s: float) -> float:
    """GPU idle time of kernels ``durations_s`` issued one every ``host_s`` from a synchronisation."""
    end = 0.0
    for i, d in enumerate(durations_s):
        end = max(end, i * host_s) + d
    return end - sum(durations_s)


def _durations(ops: list[OpCost], model: KernelModel, clock_mhz: float) -> list[float]:
    sms = model.spec.sm_count
    return [model.kernel(op.flops, op.bytes, sms, clock_mhz).time_s for op in ops if op.flops > 0 or op.bytes > 0]


def check(preset: str, host_us: list[float]) -> list[dict]:
    req = plan_request_from_preset(preset)
    spec = gpu_spec(req.gpu)
    model = KernelModel(spec, gpu_params(spec.name).params)
    trace = TraceSpec(
        model=req.model,
        tp=req.tp,
        cp=req.cp,
        mbs=req.mbs,
        seq=req.seq,
        layers=4,
        pp=2,
        stage=0,
        recompute=req.recompute,
    )
    with tempfile.TemporaryDirectory() as dump_dir:
        (path,) = trace_full_size(
            trace, options={"dump_dir": dump_dir, "nanobatch": False, "gpu": spec.name}
        ).dump_paths
        dump = load_dump(path)
    rows = []
    for name, graph in sequential_graphs(dump).items():
        for counting, ops in (("fused kernels", list(fused_kernels(graph.ops))), ("aten ops", list(graph.ops))):
            d = _durations(ops, model, spec.clock_max_mhz)
            gpu_s = sum(d)
            rows.append(
                {
                    "preset": preset,
                    "graph": name,
                    "counting": counting,
                    "kernels": len(d),
                    "gpu_ms": 1e3 * gpu_s,
                    "median_us": 1e6 * statistics.median(d),
                    "share_under_10us": sum(x < 10e-6 for x in d) / len(d),
                    "share_under_25us": sum(x < 25e-6 for x in d) / len(d),
                    "idle_share_by_host_us": {str(h): host_bound_idle_s(d, h * 1e-6) / gpu_s for h in host_us},
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=list(DEFAULT_PRESETS))
    parser.add_argument("--host-us", type=float, nargs="+", default=[5.0, 10.0, 25.0, 90.0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = [r for p in args.presets for r in check(p, args.host_us)]
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    for r in rows:
        idle = ", ".join(f"{h} us: {100 * v:.1f} %" for h, v in r["idle_share_by_host_us"].items())
        print(
            f"{r['preset']} stage 0 {r['graph']} ({r['counting']}): {r['kernels']} kernels, {r['gpu_ms']:.1f} ms, "
            f"median {r['median_us']:.0f} us, {100 * r['share_under_25us']:.0f} % under 25 us; GPU idle if the host "
            f"issues one every {idle}"
        )


if __name__ == "__main__":
    main()
