"""What holds nanobatching's overlap back: its partitions on the simulated GPU, under parameter what-ifs.

    python bench/overlap_holdback.py PRESET [--clock 1200] [--json]

Traces the preset's first pipeline stage (meta device) and runs every partition type the way
nanobatching does (the collective launched first, on NCCL's ``default_comm_sms``), summed over the
stage's forward and backward partitions (times their counts):

- ``compute``: the partitions' kernels alone on every SM; ``collective``: the collectives alone;
  ``sequential``: one after the other; ``overlapped``: nanobatching's schedule;
- ``hidden``: share of the standalone collective the overlap removes, ``(sequential - overlapped)
  / collective``; ``overlap cost``: ``overlapped - compute`` (the SMs the collective takes from the
  kernels beside it, and the collective's time past them);
- the whole microbatch (forward + backward) un-split as Megatron-LM runs it and nanobatched, at the
  clock asked for and at 1,410 MHz (where the power cap may throttle both), and nanobatching's saving;
- where the overlapped collective spends its wall time: beside compute-bound kernels (memory share
  at most 0.5) and memory-bound ones, with their mean HBM utilisation and the collective's mean
  slowdown there (``1 + contention x utilisation``, ``cost_models/simulator.py``), and beside no
  kernel (launch gaps, exposed).

Each variant replaces calibrated parameters (the same names as ``KAREUS_SIM_PARAM_OVERRIDES``);
they are diagnostics, not fits. Every number is a cost-model prediction.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from kareus_fx.cost_models.sim_params import gpu_params
from kareus_fx.cost_models.simulator import Simulator
from kareus_fx.frameworks.megatron_async_dgrad import predict_unsplit
from kareus_fx.plan.graph_workload import PartitionedGraph
from kareus_fx.plan.request import plan_request_from_preset
from kareus_fx.plan.stage_tracing import StageGraphs, backward_repricing, trace_plan_stages
from kareus_fx.workload import PartitionConfig, fused_kernels

VARIANTS: dict[str, dict[str, float]] = {
    "calibrated": {},
    "no contention": {"comm_contention": 0.0, "comm_contention_compute": 0.0},
    "memory-bound contention = compute-bound": {},  # filled from the calibrated compute-bound value
    "compute-bound contention 2.4": {"comm_contention_compute": 2.4},
    "no collective latency": {"comm_latency_s": 0.0},
    "16 NCCL SMs": {"default_comm_sms": 16},
    "32 NCCL SMs": {"default_comm_sms": 32},
}
"""``compute-bound contention 2.4``: the NanoFlow fit (calibration step 2b) with a 512-token GEMM
assumed instead of 2,048 tokens (the data do not record the GEMM; every assumed shape fits alike)."""


def holdback(graphs: list[PartitionedGraph], sim: Simulator, clock_mhz: int) -> dict[str, Any]:
    """Nanobatching's partitions of ``graphs`` summed (see the module docstring)."""
    sms = sim.params.default_comm_sms
    free_sms = sim.spec.sm_count - sms
    saturation = sim.kernels.hbm_saturation_bytes_per_s
    total = {"compute_ms": 0.0, "collective_ms": 0.0, "sequential_ms": 0.0, "overlapped_ms": 0.0}
    beside = {k: {"ms": 0.0, "util_ms": 0.0, "slowdown_ms": 0.0} for k in ("compute-bound", "memory-bound")}
    idle_ms = 0.0
    for graph in graphs:
        for ptype in graph.ptypes:
            if ptype.collective is None:
                continue
            n = ptype.count
            sequential = sim.predict(ptype, PartitionConfig(clock_mhz, sms, None, "nccl")).terms.time_s
            overlapped = sim.predict(ptype, PartitionConfig(clock_mhz, sms, 0, "nccl"), timeline=True)
            collective = sim.kernels.collective_time(ptype.collective, sms, clock_mhz, "nccl")
            total["sequential_ms"] += sequential * n * 1e3
            total["overlapped_ms"] += overlapped.terms.time_s * n * 1e3
            total["collective_ms"] += collective * n * 1e3
            total["compute_ms"] += (sequential - collective) * n * 1e3
            kernels = {k.name: k for slot in ptype.slots for k in fused_kernels(slot.ops)}
            for seg in overlapped.timeline:
                if not seg.comm:
                    continue
                ms = (seg.end_s - seg.start_s) * n * 1e3
                if seg.compute is None or seg.compute == "gap":
                    idle_ms += ms
                    continue
                k = kernels[seg.compute]
                rates = sim.kernels.kernel(k.flops, k.bytes, free_sms, clock_mhz)
                util = rates.hbm_bytes_per_s / saturation
                b = beside["memory-bound" if rates.memory_share > 0.5 else "compute-bound"]
                b["ms"] += ms
                b["util_ms"] += util * ms
                b["slowdown_ms"] += (1.0 + sim.kernels.comm_contention(rates.memory_share) * util) * ms
    return {
        **total,
        "hidden": (total["sequential_ms"] - total["overlapped_ms"]) / total["collective_ms"],
        "overlap_cost_ms": total["overlapped_ms"] - total["compute_ms"],
        "collective_beside": {
            name: {
                "ms": b["ms"],
                "mean_hbm_util": b["util_ms"] / b["ms"] if b["ms"] > 0 else 0.0,
                "mean_slowdown": b["slowdown_ms"] / b["ms"] if b["ms"] > 0 else 0.0,
            }
            for name, b in beside.items()
        }
        | {"no kernel": {"ms": idle_ms}},
    }


def microbatch(stage: StageGraphs, reprices: Mapping[str, Any], sim: Simulator, clock_mhz: int) -> dict[str, float]:
    """The stage's forward + backward microbatch un-split (Megatron-LM, with Transformer Engine's
    asynchronous dgrad all-reduces where the framework runs them: ``reprices``, ``backward_repricing``) and nanobatched (partitions on nanobatching's schedule plus the
    work outside them), as ``bench/partition_breakdown.py`` prices them."""
    sms = sim.params.default_comm_sms
    unsplit_s = nanobatched_s = 0.0
    assert stage.partitioned is not None
    for name in ("forward", "backward"):
        split = reprices if name == "backward" else {}
        unsplit_s += predict_unsplit(sim, stage.sequential[name], split.get("sequential"), clock_mhz).terms.time_s
        graph = stage.partitioned[name]
        nanobatched_s += predict_unsplit(sim, graph.outside, split.get("outside"), clock_mhz).terms.time_s
        for ptype in graph.ptypes:
            nanobatched_s += sim.predict(ptype, PartitionConfig(clock_mhz, sms, 0, "nccl")).terms.time_s * ptype.count
    return {
        "unsplit_ms": unsplit_s * 1e3,
        "nanobatched_ms": nanobatched_s * 1e3,
        "saving": 1.0 - nanobatched_s / unsplit_s,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("preset", help="a kareus plan preset, e.g. qwen3-1.7b-tp8-mbs8-seq4k")
    parser.add_argument("--clock", type=int, default=1200, help="requested SM clock in MHz")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    req = plan_request_from_preset(args.preset)
    base = gpu_params(req.gpu).params
    with tempfile.TemporaryDirectory(prefix="holdback-") as tmp:
        _, traced = trace_plan_stages(req, Path(tmp))
        repricing = backward_repricing(req, traced)
    g, stage = next((g, s) for g, s in enumerate(traced) if s.partitioned is not None)
    graphs = [stage.partitioned[name] for name in ("forward", "backward")]
    rows = {}
    for name, overrides in VARIANTS.items():
        values = {"comm_contention": base.comm_contention_compute} if name.startswith("memory-bound") else overrides
        sim = Simulator(req.gpu, replace(base, **values))
        rows[name] = holdback(graphs, sim, args.clock) | {
            f"microbatch_{c}_mhz": microbatch(stage, repricing[g], sim, c) for c in (args.clock, 1410)
        }
    if args.json:
        print(json.dumps({"preset": args.preset, "stage": stage.stages[0], "clock_mhz": args.clock, "variants": rows}))
        return 0
    print(f"{args.preset} stage {stage.stages[0]} at {args.clock} MHz, nanobatching's partitions (forward + backward)")
    for name, r in rows.items():
        cmp_, mem = r["collective_beside"]["compute-bound"], r["collective_beside"]["memory-bound"]
        print(
            f"  {name:42s} compute {r['compute_ms']:6.1f} collective {r['collective_ms']:5.1f} sequential "
            f"{r['sequential_ms']:6.1f} overlapped {r['overlapped_ms']:6.1f} ms | hidden {100 * r['hidden']:4.1f} % | "
            f"overlap cost {r['overlap_cost_ms']:5.1f} ms | collective beside compute-bound {cmp_['ms']:5.1f} ms "
            f"(u {cmp_['mean_hbm_util']:.2f}, x{cmp_['mean_slowdown']:.2f}), memory-bound {mem['ms']:5.1f} ms "
            f"(u {mem['mean_hbm_util']:.2f}, x{mem['mean_slowdown']:.1f}), none {r['collective_beside']['no kernel']['ms']:4.1f} ms"
        )
        for c in (args.clock, 1410):
            m = r[f"microbatch_{c}_mhz"]
            print(
                f"  {'':42s} microbatch at {c} MHz: un-split {m['unsplit_ms']:6.1f} ms, nanobatched "
                f"{m['nanobatched_ms']:6.1f} ms, saves {100 * m['saving']:4.1f} %"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
