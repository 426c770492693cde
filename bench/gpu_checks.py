"""What only a GPU can show, measured on this machine's CUDA device 0 with its clocks, power limit
and modes left exactly as found (nothing here sets them; NVML is only read).

Sections, each independent (a failure is recorded with its error and the next one runs):

- ``device``: name, SMs, torch and Triton versions; NVML readings: SM and memory clocks, the
  supported graphics clocks (min, max, step), the power limit and its range, board power and
  temperature sampled before any work (an idle reading, to set beside the spec's static power).
- ``sm_limited_reduce``: the on-device profiler's collective proxy (Triton ``dst += src``, bf16,
  ``runtime/collective_stand_in.py``) launched with 1..132 programs, against ``torch.add``: median
  time (CUDA events) and bandwidth (3 bytes moved per element byte: two reads, one write). The
  sum is checked against torch's. Whether the SM limit holds shows as bandwidth growing with
  the program count.
- ``two_streams``: bf16 matmuls on the ``"compute"`` stream and the proxy on the ``"comm"``
  stream of the deployment's stream table (:class:`CudaStreamTable`): each alone, one after the
  other on one stream, and overlapped, per comm SM count. ``overlap`` = (back-to-back time -
  overlapped time) / the shorter of the two alone (1: fully hidden; 0: serialised).
- ``replay_profiler``: :class:`DeviceProfiler` (recorded aten ops replayed, CUDA-event time, Zeus
  energy over windows of ``--window-s``; no frequency controller, so at the card's own clock) on
  the partition types of a traced Qwen3-1.7B TP8 stage (2 layers), sequential and overlapped at
  several comm SM counts, beside the simulator's prediction for the same partition and
  configuration on the H200 spec at the clock NVML read during the run (``sim_*``: a cost model).
- ``deployed_step``: one process, torch's ``fake`` process group of world 2 (TP2 shards, the
  collectives do nothing, so overlap has nothing to hide), a bf16 decoder on CUDA: eager,
  Inductor, kareus (split off) and kareus nanobatched; median step time (CUDA-synchronised) and
  energy per step (one Zeus window per version), with loss and gradient relative errors against
  eager.

    python bench/gpu_checks.py --out bench/results/gpu_checks.json
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

ELEMENTS = 2**28  # 512 MiB of bf16 per buffer: far past L2 (50-60 MB)
PROGRAM_COUNTS = (1, 2, 4, 8, 16, 32, 64, 132)


def _median_ms(run: Callable[[], object], warmup: int = 3, repeats: int = 10) -> float:
    from kareus_fx.runtime.partition_replay import timed_runs

    return statistics.median(timed_runs(run, torch.device("cuda"), warmup=warmup, repeats=repeats)) * 1e3


@functools.cache
def _nvml() -> Any:
    """pynvml, initialised once, and GPU 0's handle."""
    import pynvml

    pynvml.nvmlInit()
    return pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)


def _sm_clock_mhz() -> int:
    nvml, handle = _nvml()
    return int(nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM))


def device_section(args: argparse.Namespace) -> dict[str, Any]:
    nvml, handle = _nvml()
    power_w = []
    for _ in range(10):
        power_w.append(nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0)
        time.sleep(0.1)
    memory_clocks = nvml.nvmlDeviceGetSupportedMemoryClocks(handle)
    graphics = sorted(nvml.nvmlDeviceGetSupportedGraphicsClocks(handle, memory_clocks[0]))
    steps = sorted({b - a for a, b in itertools.pairwise(graphics)})
    low_mw, high_mw = nvml.nvmlDeviceGetPowerManagementLimitConstraints(handle)
    props = torch.cuda.get_device_properties(0)
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "name": props.name,
        "sm_count": props.multi_processor_count,
        "torch": torch.__version__,
        "triton": triton_version,
        "driver": nvml.nvmlSystemGetDriverVersion(),
        "sm_clock_mhz_idle": int(nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM)),
        "memory_clock_mhz": int(nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_MEM)),
        "max_sm_clock_mhz": int(nvml.nvmlDeviceGetMaxClockInfo(handle, nvml.NVML_CLOCK_SM)),
        "supported_memory_clocks_mhz": [int(c) for c in memory_clocks],
        "supported_graphics_clocks_mhz": {"min": graphics[0], "max": graphics[-1], "count": len(graphics)},
        "graphics_clock_steps_mhz": steps[:5],
        "power_limit_w": nvml.nvmlDeviceGetPowerManagementLimit(handle) / 1000.0,
        "power_limit_range_w": [low_mw / 1000.0, high_mw / 1000.0],
        "idle_power_w_median": statistics.median(power_w),
        "temperature_c": int(nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)),
    }


def sm_limited_reduce_section(args: argparse.Namespace) -> dict[str, Any]:
    from kareus_fx.runtime.collective_stand_in import _triton_reduce

    reduce = _triton_reduce()
    if reduce is None:
        return {"error": "Triton does not import"}
    dst = torch.randn(ELEMENTS, device="cuda").to(torch.bfloat16)
    src = torch.randn(ELEMENTS, device="cuda").to(torch.bfloat16)
    expected = dst + src
    reduce(dst, src, 8)
    torch.cuda.synchronize()
    max_abs_err = float((dst.float() - expected.float()).abs().max())
    moved_bytes = 3 * ELEMENTS * dst.element_size()
    rows = []
    for programs in PROGRAM_COUNTS:
        ms = _median_ms(lambda p=programs: reduce(dst, src, p))
        rows.append({"programs": programs, "ms": ms, "gb_per_s": moved_bytes / ms / 1e6})
    torch_ms = _median_ms(lambda: dst.add_(src))
    return {
        "elements": ELEMENTS,
        "sum_max_abs_error_vs_torch": max_abs_err,
        "rows": rows,
        "torch_add": {"ms": torch_ms, "gb_per_s": moved_bytes / torch_ms / 1e6},
    }


def two_streams_section(args: argparse.Namespace) -> dict[str, Any]:
    from kareus_fx.runtime.collective_stand_in import _triton_reduce
    from kareus_fx.runtime.streams import CudaStreamTable, make_stream_table

    reduce = _triton_reduce()
    table = make_stream_table("cuda")
    assert isinstance(table, CudaStreamTable)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(a)
    dst = torch.randn(ELEMENTS // 2, device="cuda").to(torch.bfloat16)
    src = torch.randn(ELEMENTS // 2, device="cuda").to(torch.bfloat16)
    matmuls = 4

    def compute() -> None:
        for _ in range(matmuls):
            torch.mm(a, b, out=out)

    rows = []
    compute_ms = _median_ms(compute)
    for programs in (4, 8, 16, 32, 66, 132):

        def comm(p: int = programs) -> None:
            reduce(dst, src, p)

        def overlapped(p: int = programs) -> None:
            table.record("start", "compute")
            table.wait("start", "comm")
            with table.use("comm"):
                reduce(dst, src, p)
            table.record("comm_done", "comm")
            with table.use("compute"):
                compute()
            table.wait("comm_done", "compute")

        comm_ms = _median_ms(comm)

        def back_to_back(c: Callable[[], None] = comm) -> None:
            compute()
            c()

        serial_ms = _median_ms(back_to_back)
        overlap_ms = _median_ms(overlapped)
        rows.append(
            {
                "comm_programs": programs,
                "compute_ms": compute_ms,
                "comm_ms": comm_ms,
                "back_to_back_ms": serial_ms,
                "overlapped_ms": overlap_ms,
                "overlap": (serial_ms - overlap_ms) / min(compute_ms, comm_ms),
                "overlapped_over_compute": overlap_ms / compute_ms,
            }
        )
    flops = 2 * 8192**3 * matmuls
    return {"matmul_tflops_alone": flops / compute_ms / 1e9, "comm_elements": ELEMENTS // 2, "rows": rows}


def _traced_partitions(args: argparse.Namespace) -> tuple[str, float, list[Any], dict[str, Any]]:
    """The largest ``--replay-types`` partition types of a traced Qwen3-1.7B TP8 stage (2 layers),
    with the trace's description, its seconds and the dump's node tables."""
    import tempfile

    from kareus_fx.capture.dump import load_dump, partition_types_from_dump
    from kareus_fx.capture.tracing import TraceSpec, trace_full_size
    from kareus_fx.runtime.device_profiler import node_tables_from_dump

    spec = TraceSpec(model="qwen3-1.7b", tp=8, mbs=args.replay_mbs, seq=4096, layers=2)
    started_s = time.perf_counter()
    with tempfile.TemporaryDirectory() as dump_dir:
        (path,) = trace_full_size(spec, options={"dump_dir": dump_dir}).dump_paths
        dump = load_dump(path)
    trace_s = time.perf_counter() - started_s
    types = partition_types_from_dump(dump)
    chosen = sorted(types.values(), key=lambda t: -sum(op.flops for s in t.slots for op in s.ops))[: args.replay_types]
    return f"{spec}", trace_s, chosen, node_tables_from_dump(dump)


def replay_profiler_section(args: argparse.Namespace) -> dict[str, Any]:
    from kareus_fx.cost_models.hardware import gpu_name_for_device, gpu_spec
    from kareus_fx.cost_models.simulated_profiler import SimulatedProfiler
    from kareus_fx.runtime.device_profiler import DeviceProfiler
    from kareus_fx.runtime.partition_replay import PartitionReplay
    from kareus_fx.workload import PartitionConfig

    trace, trace_s, chosen, tables = _traced_partitions(args)
    gpu_name = gpu_name_for_device(torch.cuda.get_device_name(0)) or "H200-SXM-141GB"
    gpu = gpu_spec(gpu_name)
    simulator = SimulatedProfiler(gpu_name)
    rows = []
    with DeviceProfiler(
        gpu_name,
        node_tables=tables,
        min_window_s=args.window_s,
        warmup=3,
        repeats=10,
        cooldown_tolerance_c=100.0,
        cooldown_timeout_s=1.0,
        fused_slots=args.replay_fused,
    ) as profiler:
        for ptype in chosen:
            replay = PartitionReplay.build(
                [s.ops for s in ptype.slots], [ptype.collective], "cuda", tables[ptype.graph]
            )
            sources = [k.source for slot in replay.slots for k in slot]
            del replay
            configs = [(16, None)] + [(sms, ptype.launch_slots[0]) for sms in (8, 16, 32)]
            for sms, slot in configs:
                measured = profiler.measure(ptype, PartitionConfig(gpu.clock_max_mhz, sms, slot))
                clock_mhz = _sm_clock_mhz()
                sim_clock = min(max(clock_mhz, gpu.tuning_clock_min_mhz), gpu.clock_max_mhz)
                sim_clock -= (sim_clock - gpu.clock_min_mhz) % gpu.clock_step_mhz
                predicted = simulator.measure(ptype, PartitionConfig(sim_clock, sms, slot))
                rows.append(
                    {
                        "type": ptype.type_id,
                        "graph": ptype.graph,
                        "ops": len(sources),
                        "replayed_ops": sources.count("replay"),
                        "collective": f"{ptype.collective.kind} {ptype.collective.bytes:.3g} B",
                        "comm_sms": sms,
                        "launch_slot": slot,
                        "replay": profiler.kind,
                        "time_ms": measured.time_s * 1e3,
                        "energy_j": measured.energy_j,
                        "window_s": profiler.last_window_s,
                        "sm_clock_mhz_after": clock_mhz,
                        "sim_time_ms": predicted.time_s * 1e3,
                        "sim_energy_j": predicted.energy_j,
                        "time_over_sim": measured.time_s / predicted.time_s,
                        "energy_over_sim": measured.energy_j / predicted.energy_j,
                    }
                )
    return {"trace": trace, "trace_s": trace_s, "gpu_spec": gpu_name, "rows": rows}


def replay_graph_section(args: argparse.Namespace) -> dict[str, Any]:
    """The profiler's replay issued op by op from Python against the same replay captured once in
    a CUDA graph (how the profiler measures since this comparison: ``DeviceProfiler(cuda_graphs=True)``).
    A graph removes the CPU's launch cost, so where the two differ the eager replay was launch-bound."""
    from kareus_fx.runtime.partition_replay import PartitionReplay, timed_runs

    trace, trace_s, chosen, tables = _traced_partitions(args)
    device = torch.device("cuda")
    rows = []
    for ptype in chosen:
        replay = PartitionReplay.build([s.ops for s in ptype.slots], [ptype.collective], device, tables[ptype.graph])
        for sms, slot in [(16, None), (16, ptype.launch_slots[0])]:
            eager_ms = statistics.median(replay.time_s(slot, sms, warmup=3, repeats=20)) * 1e3
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):  # warm-up off the capture stream, as torch.cuda.graph asks
                for _ in range(3):
                    replay.issue(slot, sms)
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                replay.issue(slot, sms)
            graph_ms = statistics.median(timed_runs(graph.replay, device, warmup=3, repeats=20)) * 1e3
            rows.append(
                {
                    "type": ptype.type_id,
                    "ops": sum(len(s.ops) for s in ptype.slots),
                    "comm_sms": sms,
                    "launch_slot": slot,
                    "eager_ms": eager_ms,
                    "graph_ms": graph_ms,
                    "eager_over_graph": eager_ms / graph_ms,
                }
            )
            del graph
        del replay
    return {"trace": trace, "trace_s": trace_s, "rows": rows}


def deployed_step_section(args: argparse.Namespace) -> dict[str, Any]:
    import torch.distributed as dist

    from kareus_fx.capture.tracing import fake_process_group
    from kareus_fx.models import ModelConfig, ParallelLayout, build_model
    from kareus_fx.runtime.energy import open_zeus_monitor

    config = ModelConfig(
        name="gpu-check-decoder",
        hidden_size=2048,
        num_layers=args.step_layers,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        ffn_size=8192,
        vocab_size=32000,
        norm_eps=1e-5,
        rope_theta=10000.0,
        tie_embeddings=False,
    )
    results: dict[str, Any] = {
        "model": f"{config}",
        "mbs": 4,
        "seq": 2048,
        "world": "fake process group of 2",
        "recompute": args.step_recompute,
    }
    with fake_process_group(2):
        torch.manual_seed(0)
        with torch.device("cuda"):
            layout = ParallelLayout.from_default_group(tp=2)
            model = build_model(config, layout, dtype=torch.bfloat16, recompute=args.step_recompute)
            model.init_weights(seed=0)
        batch = model.example_batch(mbs=4, seq=2048, device="cuda")
        versions: dict[str, Callable[..., torch.Tensor]] = {
            "eager": model,
            "inductor": torch.compile(model, fullgraph=True),
            "kareus": torch.compile(model, backend="kareus", fullgraph=True, options={"nanobatch": False}),
            "kareus_nanobatched": torch.compile(model, backend="kareus", fullgraph=True, options={"nanobatch": True}),
        }
        grads: dict[str, list[torch.Tensor]] = {}
        losses: dict[str, float] = {}
        compile_s: dict[str, float] = {}

        def step(fn: Callable[..., torch.Tensor]) -> torch.Tensor:
            model.zero_grad(set_to_none=True)
            loss = fn(**batch)
            loss.backward()
            return loss

        for name, fn in versions.items():
            started_s = time.perf_counter()
            loss = step(fn)
            torch.cuda.synchronize()
            compile_s[name] = time.perf_counter() - started_s
            losses[name] = float(loss)
            grads[name] = [p.grad.detach().float().clone() for p in model.parameters() if p.grad is not None]
        monitor = open_zeus_monitor([0])
        timing: dict[str, Any] = {}
        for name, fn in versions.items():
            times_ms = []
            monitor.begin_window(f"step_{name}")
            for _ in range(args.steps):
                torch.cuda.synchronize()
                started_s = time.perf_counter()
                step(fn)
                torch.cuda.synchronize()
                times_ms.append((time.perf_counter() - started_s) * 1e3)
            window = monitor.end_window(f"step_{name}")
            timing[name] = {
                "median_step_ms": statistics.median(times_ms),
                "energy_j_per_step": float(sum(window.gpu_energy.values())) / args.steps,
                "first_step_s": compile_s[name],
            }
        reference = grads["eager"]
        for name in versions:
            num = sum(float((g - r).norm() ** 2) for g, r in zip(grads[name], reference)) ** 0.5
            den = sum(float(r.norm() ** 2) for r in reference) ** 0.5
            timing[name]["loss_rel_err_vs_eager"] = abs(losses[name] - losses["eager"]) / abs(losses["eager"])
            timing[name]["grad_rel_err_vs_eager"] = num / den
        inductor_ms = timing["inductor"]["median_step_ms"]
        for name in versions:
            timing[name]["over_inductor"] = timing[name]["median_step_ms"] / inductor_ms
        results["versions"] = timing
    assert not dist.is_initialized()
    return results


SECTIONS = {
    "device": device_section,
    "sm_limited_reduce": sm_limited_reduce_section,
    "two_streams": two_streams_section,
    "replay_profiler": replay_profiler_section,
    "replay_graph": replay_graph_section,
    "deployed_step": deployed_step_section,
}


def summary_lines(results: dict[str, Any]) -> list[str]:
    """A short table of the results' key numbers (what the device call's output tail shows)."""
    lines = []
    for name, section in results.items():
        if not isinstance(section, dict):
            continue
        if "error" in section:
            lines.append(f"{name}: FAILED {section['error'][:300]}")
            continue
        if name == "device":
            keys = ("name", "torch", "triton", "sm_clock_mhz_idle", "max_sm_clock_mhz", "supported_graphics_clocks_mhz")
            keys += ("graphics_clock_steps_mhz", "power_limit_w", "power_limit_range_w", "idle_power_w_median")
            lines.append("device: " + ", ".join(f"{k}={section.get(k)}" for k in keys))
        elif name == "sm_limited_reduce":
            rows = " ".join(f"{r['programs']}:{r['gb_per_s']:.0f}" for r in section["rows"])
            torch_add = section["torch_add"]["gb_per_s"]
            err = section["sum_max_abs_error_vs_torch"]
            lines.append(f"sm_limited_reduce GB/s by programs {rows} | torch.add {torch_add:.0f} | max err {err}")
        elif name == "two_streams":
            lines.append(f"two_streams: matmul alone {section['matmul_tflops_alone']:.0f} TFLOP/s")
            for r in section["rows"]:
                lines.append(
                    f"  comm {r['comm_programs']:>3} programs: compute {r['compute_ms']:.2f} comm {r['comm_ms']:.2f} "
                    f"b2b {r['back_to_back_ms']:.2f} overlapped {r['overlapped_ms']:.2f} ms, overlap {r['overlap']:.2f}"
                )
        elif name == "replay_profiler":
            lines.append(f"replay_profiler: trace {section['trace_s']:.1f} s, spec {section['gpu_spec']}")
            for r in section["rows"]:
                lines.append(
                    f"  {r['type'][:18]:18} {r['graph'][:8]:8} ops {r['ops']} replayed {r['replayed_ops']} "
                    f"({r.get('replay', 'cuda')}) "
                    f"sms {r['comm_sms']} slot {r['launch_slot']}: {r['time_ms']:.3f} ms {r['energy_j']:.3f} J "
                    f"@{r['sm_clock_mhz_after']} MHz | sim {r['sim_time_ms']:.3f} ms {r['sim_energy_j']:.3f} J "
                    f"(x{r['time_over_sim']:.2f} t, x{r['energy_over_sim']:.2f} e)"
                )
        elif name == "replay_graph":
            for r in section["rows"]:
                lines.append(
                    f"replay_graph {r['type'][:28]:28} ops {r['ops']} slot {r['launch_slot']}: eager {r['eager_ms']:.3f} "
                    f"ms, CUDA graph {r['graph_ms']:.3f} ms (x{r['eager_over_graph']:.2f})"
                )
        elif name == "deployed_step":
            for version, r in section["versions"].items():
                lines.append(
                    f"deployed_step {version:>18}: {r['median_step_ms']:.2f} ms (x{r['over_inductor']:.3f} Inductor) "
                    f"{r['energy_j_per_step']:.2f} J/step, first step {r['first_step_s']:.1f} s, loss err "
                    f"{r['loss_rel_err_vs_eager']:.1e}, grad err {r['grad_rel_err_vs_eager']:.1e}"
                )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="JSON file for the results (written after each section)")
    parser.add_argument("--summary", help="print the summary of an earlier run's JSON file and exit")
    parser.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=list(SECTIONS))
    parser.add_argument("--window-s", type=float, default=1.0, help="the energy window of each replay measurement")
    parser.add_argument("--replay-types", type=int, default=3, help="partition types measured (largest first)")
    parser.add_argument("--replay-mbs", type=int, default=2)
    parser.add_argument(
        "--replay-fused", action="store_true", help="replay_profiler: each slot one Inductor-compiled graph"
    )
    parser.add_argument("--step-layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--step-recompute", default="none", choices=("none", "full", "selective"), help="deployed_step's checkpointing"
    )
    args = parser.parse_args()
    if args.summary:
        with open(args.summary) as f:
            print("\n".join(summary_lines(json.load(f))))
        return
    if args.out is None:
        parser.error("give --out (a results file) or --summary")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (torch.cuda.is_available() is False)")
    results: dict[str, Any] = {"command": "python bench/gpu_checks.py " + " ".join(sys.argv[1:])}
    for name in args.sections:
        started_s = time.perf_counter()
        try:
            results[name] = SECTIONS[name](args)
        except Exception as err:  # noqa: BLE001 -- a section's failure is a result too; the next section still runs
            results[name] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
        results[name]["section_s"] = time.perf_counter() - started_s
        print(json.dumps({name: results[name]}, indent=1, default=str), flush=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1, default=str)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
