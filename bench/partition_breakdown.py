"""Where a Kareus plan's microbatch saves time and energy, partition type by partition type.

    python bench/partition_breakdown.py DIR/plan.json [--clocks 1410,1080] [--json]

For every (stage, instruction) of a plan made by ``kareus plan --preset NAME --out DIR`` and each
clock asked for, it takes the plan's fastest non-sequential microbatch option at that clock (one
configuration per partition type) and prints, on the simulated GPU the plan was made for:

- the un-split microbatch (Megatron-LM: every op, then every collective alone on NCCL's default SMs,
  but, where the preset's engine is Transformer Engine (the testbed presets), the backward's
  column-parallel input-gradient all-reduces beside their wgrad GEMMs: ``kareus_fx/frameworks/megatron_async_dgrad.py``;
  the same for the work outside partitions);
- the nanobatched microbatch run sequentially (each partition's collective alone after its compute,
  NCCL's default SMs) and on the plan's configurations, with the work outside partitions;
- per partition type (times its count): what the plan's configuration saves against running that
  partition sequentially, in time and energy, and the collective's exposed time both ways.

The preset is read from the plan (``workload.preset``), traced again on the meta device. Every
number is a cost-model prediction of the current simulator (a plan made with another parameter set
is re-simulated with the current one).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from kareus_fx.cost_models.sim_params import gpu_params
from kareus_fx.cost_models.simulator import Simulator
from kareus_fx.frameworks.megatron_async_dgrad import predict_unsplit
from kareus_fx.plan.request import plan_request_from_preset
from kareus_fx.plan.stage_tracing import backward_repricing, trace_plan_stages
from kareus_fx.workload import PartitionConfig


def breakdown(plan: dict, clocks_mhz: list[int]) -> list[dict]:
    """One entry per (stage, instruction, clock) that the plan has a partitioned option for."""
    preset = plan["workload"].get("preset")
    if not preset:
        raise SystemExit("the plan names no preset (workload.preset): make it with kareus plan --preset NAME")
    req = plan_request_from_preset(preset)
    sim = Simulator(plan["gpu"])
    sms = gpu_params(plan["gpu"]).params.default_comm_sms
    with tempfile.TemporaryDirectory(prefix="breakdown-") as tmp:
        _, traced = trace_plan_stages(req, Path(tmp))
        repricing = backward_repricing(req, traced)
    out = []
    for stage, reprices in zip(traced, repricing, strict=True):
        if stage.partitioned is None:
            continue
        for name in ("forward", "backward"):
            key = f"{stage.stages[0]}/{name}"
            graph, seq = stage.partitioned[name], stage.sequential[name]
            names = plan["stages"][stage.stages[0]]["graphs"][name]["partition_types"]
            for clock in clocks_mhz:
                options = [
                    o for o in plan["microbatch_options"][key] if o["clock_mhz"] == clock and not o["sequential"]
                ]
                if not options:
                    continue
                configs = min(options, key=lambda o: o["time_s"])["configs"]
                asynchronous = reprices if name == "backward" else {}
                unsplit = predict_unsplit(sim, seq, asynchronous.get("sequential"), clock)
                outside = predict_unsplit(sim, graph.outside, asynchronous.get("outside"), clock)
                planned_s = sequential_s = outside.terms.time_s
                planned_j = sequential_j = outside.measurement.energy_j
                types = []
                for ptype in graph.ptypes:
                    c = configs[names[ptype.type_id]]
                    mine = sim.predict(
                        ptype,
                        PartitionConfig(clock, c["comm_sms"], c["launch_slot"], c["comm_library"]),
                    )
                    alone = sim.predict(ptype, PartitionConfig(clock, sms, None, "nccl"))
                    n = ptype.count
                    planned_s += mine.terms.time_s * n
                    planned_j += mine.measurement.energy_j * n
                    sequential_s += alone.terms.time_s * n
                    sequential_j += alone.measurement.energy_j * n
                    types.append(
                        {
                            "type": names[ptype.type_id],
                            "count": n,
                            "collective": f"{ptype.collective.kind} x{ptype.collective.group_size}",
                            "config": c,
                            "saves_ms": (alone.terms.time_s - mine.terms.time_s) * n * 1e3,
                            "saves_j": (alone.measurement.energy_j - mine.measurement.energy_j) * n,
                            "exposed_sequential_ms": alone.exposed_comm_s * n * 1e3,
                            "exposed_planned_ms": mine.exposed_comm_s * n * 1e3,
                        }
                    )
                out.append(
                    {
                        "microbatch": key,
                        "clock_mhz": clock,
                        "unsplit": {"ms": unsplit.terms.time_s * 1e3, "j": unsplit.measurement.energy_j},
                        "nanobatched_sequential": {"ms": sequential_s * 1e3, "j": sequential_j},
                        "planned": {"ms": planned_s * 1e3, "j": planned_j},
                        "outside_ms": outside.terms.time_s * 1e3,
                        "types": types,
                    }
                )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plan", type=Path, help="plan.json written by kareus plan --preset NAME --out DIR")
    parser.add_argument("--clocks", default="1410,1080", help="comma-separated SM clocks in MHz")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rows = breakdown(json.loads(args.plan.read_text()), [int(c) for c in args.clocks.split(",")])
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    for r in rows:
        u, s, p = r["unsplit"], r["nanobatched_sequential"], r["planned"]
        print(
            f"{r['microbatch']} @{r['clock_mhz']} MHz: un-split {u['ms']:.1f} ms {u['j']:.1f} J | nanobatched "
            f"sequential {s['ms']:.1f} ms {s['j']:.1f} J | planned {p['ms']:.1f} ms {p['j']:.1f} J | outside "
            f"partitions {r['outside_ms']:.1f} ms"
        )
        for t in r["types"]:
            c = t["config"]
            print(
                f"   {t['type']} x{t['count']} {t['collective']} {c['comm_sms']} SMs {c['comm_library']} slot "
                f"{c['launch_slot']}: saves {t['saves_ms']:.2f} ms {t['saves_j']:.2f} J (exposed "
                f"{t['exposed_sequential_ms']:.2f} -> {t['exposed_planned_ms']:.2f} ms)"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
