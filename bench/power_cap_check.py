"""Paper section 6.2.1 beside the simulator: the time-averaged SM clock of a microbatch at 1,410 MHz.

    python bench/power_cap_check.py [--preset qwen3-1.7b-tp8-mbs8-seq4k] [--clock 1410] [--json]

The paper measured on its testbed (Qwen 3 1.7B, TP8, mbs 8, 4K, A100-SXM4-40GB, 400 W): both
baselines run the critical-path microbatch at 1,410 MHz, and with nanobatching overlap at 1,410 MHz
the GPU throttles to about 1,350 MHz on average (``../shared/data/README.md``). For every traced
stage and instruction of the preset this prints the simulator's time-averaged SM clock (the
clock integral over the microbatch's time, the power cap acting per kernel phase:
``cost_models/power_model.py``) and the share of time spent throttled, of

- the un-split microbatch (Megatron-LM), and
- the nanobatched microbatch on the nanobatching schedule (collective first, default SMs; the
  work outside partitions op after op);
- the schedule Kareus ran on the testbed for its MLP all-reduce partitions (paper section 6.2.1,
  Figure 10: overlap from the start, 6 communication SMs, 1,350 MHz), on our MLP partition types
  (those without an attention kernel). The testbed ran them at 1,350 MHz, not throttled; where
  the simulator throttles them, its power there is above what the testbed drew.

These are cost-model predictions. The Qwen rows are validation data: this comparison is reported,
nothing is fitted to it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

from kareus_fx.cost_models.hardware import canonical_gpu_name, gpu_spec
from kareus_fx.cost_models.power_model import ZERO_TERMS
from kareus_fx.cost_models.sim_params import gpu_params
from kareus_fx.cost_models.simulator import Prediction, Simulator
from kareus_fx.plan.graph_workload import PartitionedGraph
from kareus_fx.plan.methods import nanobatching_config
from kareus_fx.plan.request import plan_request_from_preset
from kareus_fx.plan.stage_tracing import trace_plan_stages
from kareus_fx.workload import PartitionConfig, PartitionType

PAPER_NANOBATCHING_CLOCK_MHZ = 1350.0
"""Section 6.2.1: the time-averaged clock of the nanobatched microbatch requested at 1,410 MHz."""
PAPER_KAREUS_MLP_CONFIG = PartitionConfig(clock_mhz=1350, comm_sms=6, launch_slot=0)
"""Section 6.2.1 / Figure 10: Kareus's MLP all-reduce partitions on the testbed (Qwen TP8 mbs8 4K)."""


def _summary(parts: list[tuple[Prediction, int]]) -> dict[str, float]:
    """Time-averaged clock and throttled share of the parts (each prediction ``count`` times)."""
    total = sum((p.terms.scaled(n) for p, n in parts), ZERO_TERMS)
    throttled_s = sum(p.terms.time_s * n for p, n in parts if p.throttled)
    return {
        "time_s": total.time_s,
        "average_clock_mhz": total.average_clock_mhz,
        "throttled_share": throttled_s / total.time_s,
        "average_power_w": sum(p.measurement.energy_j * n for p, n in parts) / total.time_s,
    }


def _nanobatched(sim: Simulator, graph: PartitionedGraph, clock_mhz: int, sms: int) -> list[tuple[Prediction, int]]:
    outside = sim.predict_sequence(graph.outside.ops, graph.outside.collectives, clock_mhz=clock_mhz)
    return [(outside, 1)] + [(sim.predict(t, nanobatching_config(clock_mhz, sms)), t.count) for t in graph.ptypes]


def is_mlp_partition(ptype: PartitionType) -> bool:
    """An MLP all-reduce partition: no slot holds an attention kernel (forward or backward)."""
    return not any("attention" in op.target for slot in ptype.slots for op in slot.ops)


def _kareus_mlp(sim: Simulator, uncapped: Simulator, graph: PartitionedGraph) -> dict[str, float] | None:
    """The MLP partitions on the testbed's Kareus schedule: capped summary plus uncapped power."""
    mlp = [t for t in graph.ptypes if is_mlp_partition(t)]
    if not mlp:
        return None
    summary = _summary([(sim.predict(t, PAPER_KAREUS_MLP_CONFIG), t.count) for t in mlp])
    summary["uncapped_power_w"] = _summary([(uncapped.predict(t, PAPER_KAREUS_MLP_CONFIG), t.count) for t in mlp])[
        "average_power_w"
    ]
    return summary


def check(preset: str, clock_mhz: int) -> dict:
    """Per traced stage and instruction, the un-split and the nanobatched microbatch at ``clock_mhz``
    (and the nanobatched one without the cap, at ``clock_mhz`` and at the paper's average clock), and
    the MLP partitions on Kareus's testbed schedule (``PAPER_KAREUS_MLP_CONFIG``, whatever ``clock_mhz``)."""
    req = plan_request_from_preset(preset)
    gpu = canonical_gpu_name(req.gpu)
    spec, params = gpu_spec(gpu), gpu_params(gpu).params
    sim = Simulator(gpu)
    uncapped = Simulator(dataclasses.replace(spec, tdp_w=float("inf")), params)
    sms = params.default_comm_sms
    rows = []
    with tempfile.TemporaryDirectory(prefix="power-cap-") as tmp:
        _, traced = trace_plan_stages(req, Path(tmp))
    for stage in traced:
        for name in ("forward", "backward"):
            seq = stage.sequential[name]
            row = {
                "stages": list(stage.stages),
                "instruction": name,
                "megatron": _summary([(sim.predict_sequence(seq.ops, seq.collectives, clock_mhz=clock_mhz), 1)]),
            }
            if stage.partitioned is not None:
                graph = stage.partitioned[name]
                row["nanobatching"] = _summary(_nanobatched(sim, graph, clock_mhz, sms))
                row["nanobatching"]["uncapped_power_w"] = _summary(_nanobatched(uncapped, graph, clock_mhz, sms))[
                    "average_power_w"
                ]
                row["nanobatching"]["uncapped_power_at_paper_clock_w"] = _summary(
                    _nanobatched(uncapped, graph, int(PAPER_NANOBATCHING_CLOCK_MHZ), sms)
                )["average_power_w"]
                kareus_mlp = _kareus_mlp(sim, uncapped, graph)
                if kareus_mlp is not None:
                    row["kareus_mlp_testbed_schedule"] = kareus_mlp
            rows.append(row)
    return {
        "preset": preset,
        "gpu": gpu,
        "tdp_w": gpu_spec(gpu).tdp_w,
        "requested_clock_mhz": clock_mhz,
        "paper_nanobatching_average_clock_mhz": PAPER_NANOBATCHING_CLOCK_MHZ,
        "paper_kareus_mlp_config": dataclasses.asdict(PAPER_KAREUS_MLP_CONFIG),
        "rows": rows,
        "note": "simulated (cost-model predictions); the paper's value is a measurement",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-1.7b-tp8-mbs8-seq4k")
    parser.add_argument("--clock", type=int, default=1410, help="requested SM clock in MHz")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    report = check(args.preset, args.clock)
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"{report['preset']} on {report['gpu']} (TDP {report['tdp_w']:.0f} W) at {args.clock} MHz; {report['note']}")
    print(f"paper (measured): nanobatching throttles to about {PAPER_NANOBATCHING_CLOCK_MHZ:.0f} MHz on average")
    for row in report["rows"]:
        for method in ("megatron", "nanobatching"):
            if method in row:
                s = row[method]
                print(
                    f"  stages {row['stages']} {row['instruction']:8s} {method:12s} avg clock {s['average_clock_mhz']:7.1f} MHz"
                    f"  throttled {100 * s['throttled_share']:5.1f} % of {1e3 * s['time_s']:.1f} ms"
                    f"  avg power {s['average_power_w']:.0f} W"
                    + (
                        f" (uncapped: {s['uncapped_power_w']:.0f} W; at {PAPER_NANOBATCHING_CLOCK_MHZ:.0f} MHz "
                        f"{s['uncapped_power_at_paper_clock_w']:.0f} W)"
                        if "uncapped_power_w" in s
                        else ""
                    )
                )
        if "kareus_mlp_testbed_schedule" in row:
            s = row["kareus_mlp_testbed_schedule"]
            print(
                f"  stages {row['stages']} {row['instruction']:8s} Kareus MLP partitions on the testbed's schedule "
                f"(section 6.2.1, Qwen TP8 mbs8 4K: 1,350 MHz, 6 SMs, overlap from the start, not throttled there): avg clock "
                f"{s['average_clock_mhz']:7.1f} MHz  throttled {100 * s['throttled_share']:5.1f} %  "
                f"uncapped power {s['uncapped_power_w']:.0f} W"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
